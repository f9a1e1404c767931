"""FixedWidthSteps: the device-side inputs of a compileable `PagedCache` (one built with `max_cache_len`).

A compiled (and CUDA-graph replayed) forward cannot take blocks from the allocator: that is host bookkeeping. So a
step is split in two, as vLLM splits its scheduler from its model runner:

    host, before the forward (`reserve`)            device, inside the forward (`store` / `gather`)
    ------------------------------------            -----------------------------------------------
    take blocks for [length, length + n),           write K/V to `slot_mapping`
    copy-on-write what rows shared,                 read K/V through `block_tables`, padded to
    fill the persistent buffers below               max_cache_len (the mask hides the rest)

The buffers keep their addresses for the cache's life (and are marked static for dynamo), so a captured graph reads
each step's values. Every tensor has a shape fixed by the batch and `max_cache_len`:

    block_tables[g]  [B, W] int64    W = ceil(max_cache_len / block_size); entries past a row's blocks name block 0,
                                     whose keys the causal mask hides
    slot_mapping[g]  [B * n] int64   the slots of the step's n new tokens of every row, row by row
    seq_lens         [B] int64       tokens per row after the step (the decode kernel's lengths)
    past_length      [] int64        tokens per row before the step (`get_seq_length` inside a compiled forward)

`g` is the layer group (a Gemma-style pool keeps one table per group); every row writes its own slots, so rows that
shared a prompt's blocks get their own copy of the block they write next.

`ReservedSteps` is the host side: `reserve` before a forward, the forward's `update` of each layer, and `settle`,
which counts in the layers' lengths what a reserved forward wrote once the host looks again.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch

from ..attention import plan_placeholders
from ..attention.fixed_plan import FixedDecodePlan
from ..attention.kernels.dispatch import resolve_backends, triton_possible
from ..attention.kernels.launch_config import INDEX_DTYPE
from ..errors import UnsupportedModel
from ..storage import BlockPool, KVLayout, group_of_layer
from ..storage.pool import check_positive_int
from ..storage.transfer import aligned_flat
from .block_tables import head_major_index
from .store import heads_first
from .visible import runs_paged_attention

if TYPE_CHECKING:
    from .group_tables import GroupTables
    from .layer import PagedLayer


class FixedWidthSteps:
    """The persistent step buffers of a compileable cache (see the module docstring), refilled by `fill` before
    each forward: a step's per-row values in one host-to-device copy, a layer group's tables in one more when they
    changed (from pinned memory on CUDA, without a wait)."""

    def __init__(self, max_cache_len: int, block_size: int, num_groups: int):
        self.max_cache_len = max_cache_len
        self.block_size = block_size
        self.width = -(-max_cache_len // block_size)  # W: block table entries per row
        self.num_groups = num_groups
        self.block_tables: list[torch.Tensor] = []
        self.slot_mapping: list[torch.Tensor] = []  # the step's, one of `_values`
        self.seq_lens: torch.Tensor | None = None  # the step's, one of `_values`
        self.past_length: torch.Tensor | None = None  # the step's, one of `_values`
        self._values: dict[int, StepValues] = {}  # new tokens of a step -> its values' buffers
        self._rows: tuple[int, torch.device] | None = None  # (rows, device) the buffers are made for
        self._versions: list[int] = [-1] * num_groups  # the BlockTables version each table buffer holds
        self._marked_pool: weakref.ref | None = None  # the first K tensor of the pool whose tensors are marked static

    def fill(self, groups: list, past_length: int, num_new_tokens: int, device: torch.device) -> None:
        """Write one step's inputs: `groups` (one `BlockTables` per layer group, every row its own writer and holding
        blocks up to `past_length + num_new_tokens`)."""
        self._mark_pool_static(groups[0].pool)
        num_rows = groups[0].num_rows
        values = self._allocate(num_rows, num_new_tokens, device)
        block_size, end = self.block_size, past_length + num_new_tokens
        staged = []
        for group, tables in enumerate(groups):
            assert tables.base == 0, "a compileable PagedCache keeps every block from position 0"
            if self._versions[group] != tables.version:
                padded = [entry for table in tables.tables for entry in table + [0] * (self.width - len(table))]
                copy_from_host(self.block_tables[group], padded)
                self._versions[group] = tables.version
            staged.append(
                [
                    table[position // block_size] * block_size + position % block_size
                    for table in tables.tables
                    for position in range(past_length, end)
                ]
            )
        staged += [[end] * num_rows, [past_length]]
        values.write(staged)

    def _allocate(self, num_rows: int, num_new_tokens: int, device: torch.device) -> StepValues:
        """(Re)make the buffers when the batch or the device changed, and a step's values when its token count did.

        The decode step's values are kept while the batch stays (a prompt's between two decode turns does not
        replace them): a compiled step's CUDA graphs read static buffers in place, and one at a new address records
        the graphs again."""
        if self._rows != (num_rows, device):
            with torch.inference_mode(False):  # normal tensors: a step outside inference mode writes them too
                self.block_tables = [
                    _static(torch.zeros(num_rows, self.width, dtype=INDEX_DTYPE, device=device))
                    for _ in range(self.num_groups)
                ]
            self._versions = [-1] * self.num_groups
            self._values = {}
            self._rows = (num_rows, device)
        values = self._values.get(num_new_tokens)
        if values is None:
            if num_new_tokens != 1:  # the decode step's and the last other step's
                self._values = {n: kept for n, kept in self._values.items() if n == 1}
            shapes = [(num_rows * num_new_tokens,)] * self.num_groups + [(num_rows,), ()]
            values = self._values[num_new_tokens] = StepValues(shapes, device)
        *self.slot_mapping, self.seq_lens, self.past_length = values.views
        return values

    def _mark_pool_static(self, pool) -> None:
        """A compiled step writes the pool in place: its tensors must be static inputs, or CUDA graphs would copy them
        in (and write the copy) or be skipped. Marked again only when they changed: a growable pool's grow replaces
        every tensor, the first one included."""
        first = pool.key_cache[0]
        if self._marked_pool is not None and self._marked_pool() is first:
            return
        for tensor in (*pool.key_cache, *pool.value_cache):
            _static(tensor)
        self._marked_pool = weakref.ref(first)


class StepValues:
    """Tensors of int64 values a step sends to the device, as static views of one device tensor, written by one copy
    (`write`). Each starts on 16 bytes (`aligned_flat`, the layout of `to_device`'s copy), as a freshly made tensor
    does: the kernels' compiled variants specialize on it.

    Args:
        shapes (`list[tuple[int, ...]]`): the tensors' shapes.
        device (`torch.device`): where they live.
    """

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device):
        sizes = [math.prod(shape) for shape in shapes]
        flat, offsets = aligned_flat([[0] * size for size in sizes], INDEX_DTYPE)
        with torch.inference_mode(False):  # normal tensors: a step outside inference mode writes them too
            self.device = torch.zeros(len(flat), dtype=INDEX_DTYPE, device=device)
            self.views = [
                _static(self.device[offset : offset + size].view(shape))
                for offset, size, shape in zip(offsets, sizes, shapes)
            ]

    def write(self, values: list[list[int]]) -> None:
        """One copy of every tensor's values (flat, in order) into the views."""
        copy_from_host(self.device, aligned_flat(values, INDEX_DTYPE)[0])


def copy_from_host(buffer: torch.Tensor, values: list[int]) -> None:
    """`buffer` (contiguous) := `values`, in one copy; from pinned memory on CUDA, which the host does not wait for
    (PyTorch's pinned allocator keeps that memory until the copy has run)."""
    pinned = buffer.device.type == "cuda"
    buffer.copy_(torch.tensor(values, dtype=buffer.dtype, pin_memory=pinned).view(buffer.shape), non_blocking=pinned)


def gather_fixed(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_cache_len: int,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A head-major pool tensor `[kv_heads, num_blocks, block_size, head_dim]` read through `block_tables` `[B, W]`:
    `[B, kv_heads, max_cache_len, head_dim]` (one index_select, no copy after it). `index`: `head_major_index` of
    the same tables, where the caller keeps it for other layers; `out`: a 1-D buffer of at least
    `B * kv_heads * W * block_size * head_dim` values to gather into (a fresh tensor without it)."""
    num_heads, num_blocks, block_size, head_dim = cache.shape
    batch_size, width = block_tables.shape
    if index is None:
        index = head_major_index(block_tables, num_heads, num_blocks)
    # Blocks as rows of block_size * head_dim values (on CPU, index_select copies 2-D rows ~3x faster than 3-D ones).
    flat = cache.view(num_heads * num_blocks, block_size * head_dim)
    if out is None:
        rows = flat.index_select(0, index)
    else:
        rows = torch.index_select(
            flat, 0, index, out=out[: index.numel() * block_size * head_dim].view(-1, flat.shape[1])
        )
    return rows.view(batch_size, num_heads, width * block_size, head_dim)[:, :, :max_cache_len]


class ReservedSteps:
    """The steps of a compileable `PagedCache` (`max_cache_len`), each reserved on the host before its forward.

    `reserve(n)` takes the blocks the next forward writes and fills the `FixedWidthSteps` buffers; that forward's
    `update` only reads the buffers (it traces into one graph); its last cached layer consumes the reservation
    (`pending`, the one host attribute a compiled step writes: dynamo replays that store after the graph), and
    `settle` counts the written tokens in the layers' lengths when the host next looks.

    Args:
        max_cache_len (`int`): tokens per row the cache holds at most; every step's K/V are that wide.
        block_size (`int`): the pool's.
        tables (`GroupTables`), paged_layers (`list[PagedLayer]`), pool_layers (`list[int | None]`): the cache's
            tables, its layers holding K/V, and the pool layer of each decoder layer.
        last_cached_layer (`int`): the pool layer whose update ends a forward.
        config: the model's text config (whether it runs the "hf_paged" attention).
    """

    def __init__(
        self,
        max_cache_len: int,
        block_size: int,
        tables: GroupTables,
        paged_layers: list[PagedLayer],
        pool_layers: list[int | None],
        *,
        last_cached_layer: int,
        config,
    ):
        self.max_cache_len = max_cache_len
        self.steps = FixedWidthSteps(max_cache_len, block_size, len(tables.groups))
        self.pending: int | None = None  # tokens per row reserved for the next forward, until its last layer
        self.unsettled = 0  # tokens per row a reserved forward wrote that the layers' lengths do not count yet
        self._tables, self._paged_layers, self._pool_layers = tables, paged_layers, pool_layers
        self._last_cached_layer = last_cached_layer
        self._config = config
        self._group_of = group_of_layer(tables.layer_groups)
        self._plans, self._backends = False, None  # set by reserve
        # Whether the "hf_paged" attention's kernel can run on the pool's device (`_kernel_runs`), worked out at the
        # first reservation on that device, as its backends are.
        self._kernel_device: torch.device | None = None
        self._kernel_runs = False
        # The reserved forward's masks and their first visible keys, read once a step (`FixedDecodePlan.kv_starts`).
        self._kv_starts: list = []
        for layer in paged_layers:
            layer.is_compileable = True

    def reserve(self, num_new_tokens: int) -> None:
        """Take the blocks the next forward writes (`num_new_tokens` per row) and fill the step's buffers. Idempotent
        until that forward runs. Every row writes its own blocks from here on (a block rows shared is copied
        first)."""
        check_positive_int("num_new_tokens", num_new_tokens)
        self.settle()
        self._kv_starts.clear()  # the same list (a compiled forward guards on it), emptied for the next forward
        if self.pending is not None:
            if self.pending != num_new_tokens:
                raise ValueError(
                    f"{self.pending} tokens per row are reserved for the next forward, not {num_new_tokens}"
                )
            return
        if not self._tables.num_rows:
            raise ValueError("reserve() continues the cache's rows: the first forward (the prefill) starts them")
        past_length = self._paged_layers[0].cumulative_length
        end = past_length + num_new_tokens
        check_fits(end, self.max_cache_len)
        for tables in self._tables.groups:
            followers = [row for row, leader in enumerate(tables.leaders) if leader != row]
            if followers:
                tables.split(followers)
            tables.prepare_write(tables.writers(), past_length, end)
        device = self._tables.pool.device
        self.steps.fill(self._tables.groups, past_length, num_new_tokens, device)
        # A decode step of the "hf_paged" attention where its kernel can run: placeholders carrying a plan. The
        # attention is asked at every step (`hf_paged.enable` or `set_attn_implementation` may switch it between two);
        # whether the kernel runs on the pool's device, and its backends, once per device.
        if self._kernel_device != device:
            self._kernel_device = device
            self._kernel_runs = triton_possible(device)
            # NOTE: a dict, not the shared read-only mapping: dynamo breaks the graph at a read of a mapping proxy
            # once the traced frame mutated any dict (transformers pops `return_dict` from the forward's kwargs).
            self._backends = dict(resolve_backends(device)) if self._kernel_runs else None
        self._plans = num_new_tokens == 1 and self._kernel_runs and runs_paged_attention(self._config)
        self.pending = self.unsettled = num_new_tokens

    def settle(self) -> None:
        """Count in the layers' lengths what a reserved forward wrote (a compiled forward changes no host state but
        `pending`)."""
        if self.unsettled and self.pending is None:
            for layer in self._paged_layers:
                layer.cumulative_length += self.unsettled
            self.unsettled = 0

    def drop_reservation(self) -> int | None:
        """Forget a reservation no forward used (rows or lengths are about to change); returns its token count."""
        pending = self.pending
        if pending is not None:
            self.pending, self.unsettled = None, 0
        return pending

    def mask_sizes(self, query_length: int) -> tuple[int, int] | None:
        """`Cache.get_mask_sizes` of the next forward: reserves its blocks (outside a compiled region) when the cache
        has rows, and then describes `max_cache_len` keys from position 0; None for a first prefill (the step's own
        K/V, as without `max_cache_len`)."""
        if not torch.compiler.is_compiling():
            self.settle()
            if self.pending is None and self._tables.num_rows:
                self.reserve(query_length)
            if self.pending is None:
                return None
        return self.max_cache_len, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """A reserved step of decoder layer `layer_idx`: store at the step's slots, return `[B, kv_heads,
        max_cache_len, head_dim]` read through the fixed-width tables. Nothing here takes a block or reads a device
        value on the host, so it traces into one graph and replays in a CUDA graph."""
        if self.pending is None:
            raise ValueError(
                "a forward of a compileable PagedCache writes only the blocks reserved before it: generate() reserves "
                "them; before a compiled forward of your own, call cache.reserve(num_new_tokens)"
            )
        if key_states.shape[2] != self.pending:
            raise ValueError(f"the forward writes {key_states.shape[2]} tokens per row, {self.pending} were reserved")
        pool_layer = self._pool_layers[layer_idx]
        steps, group = self.steps, self._group_of[pool_layer]
        key_cache, value_cache = self._tables.pool.key_cache[pool_layer], self._tables.pool.value_cache[pool_layer]
        slots = steps.slot_mapping[group]
        for cache, states in ((key_cache, key_states), (value_cache, value_states)):
            cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(1, slots, heads_first(states))
        if pool_layer == self._last_cached_layer:
            self.pending = None
        table, max_cache_len = steps.block_tables[group], self.max_cache_len

        def gather():
            return gather_fixed(key_cache, table, max_cache_len), gather_fixed(value_cache, table, max_cache_len)

        if not self._plans:
            return gather()
        plan = FixedDecodePlan(
            key_cache=BlockPool.nhd_view(key_cache),
            value_cache=BlockPool.nhd_view(value_cache),
            block_tables=table,
            seq_lens=steps.seq_lens,
            gather=gather,
            backends=self._backends,
            kv_starts=self._kv_starts,
        )
        return plan_placeholders(key_states, value_states, plan)


# Models whose own code sizes or changes what a fixed-width step hands attention: each step's K/V and masks describe
# `max_cache_len` keys (a first prefill: the prompt's own), as StaticCache's do, and these read something else. Found
# by the zoo's "fixed" path (tests/zoo.py), each a raw error or other tokens than DynamicCache's.
FIXED_WIDTH_REFUSALS = {
    "bloom": "it builds its ALiBi bias over cache.get_max_length() keys at every forward, a first prefill's included",
    "cpmant": "it adds prompt tokens of its own and builds its mask inside its forward, not from the cache's sizes",
    "dory": "its recurrent loops attend copies of the cache's layers, which a fixed-width step does not describe",
    "git": "it concatenates image K/V to what cache.update() returns",
    "prophetnet": "its n-gram streams attend the cache's K/V through masks of their own",
    "xlm": "it builds its attention mask without asking the cache's sizes, so no step is reserved before a forward",
}


def check_compileable(model_type: str | None, layout: KVLayout, has_states: bool, kv_sources: frozenset) -> None:
    """Refuse (`UnsupportedModel`) a model whose cache holds what a fixed-width step cannot: `has_states` (linear
    attention / mamba / conv states), latent K/V, indexer keys, or KV-sharing layers (`kv_sources`), and the models
    of `FIXED_WIDTH_REFUSALS`."""
    layer_types = layout.layer_types
    reasons = (
        (has_states, "its linear-attention / mamba / conv states are not paged"),
        (layout.latent, "it expands latent K/V (multi-head latent attention) after cache.update()"),
        ("indexed_attention" in layer_types, "its indexer keys live beside the pool"),
        ("dummy" in layer_types or kv_sources, "its KV-sharing layers attend another layer's K/V"),
    )
    reason = FIXED_WIDTH_REFUSALS.get(model_type) or next((reason for applies, reason in reasons if applies), None)
    if reason is not None:
        raise UnsupportedModel(model_type, reason, "PagedCache(max_cache_len=...)")


def check_fits(num_tokens: int, max_cache_len: int) -> None:
    if num_tokens > max_cache_len:
        raise ValueError(
            f"the forward would hold {num_tokens} tokens per row, over max_cache_len={max_cache_len}: build the cache "
            "with a larger max_cache_len"
        )


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo the tensor keeps its address (CUDA graphs read it in place instead of copying it in)."""
    torch._dynamo.mark_static_address(tensor)
    return tensor
