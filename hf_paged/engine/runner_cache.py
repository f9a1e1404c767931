"""RunnerCache: the cache a decode runner's forward writes and reads (engine/decode_runner.py runs the forward).

Every tensor it touches is one of the runner's persistent buffers or the pool, so a captured CUDA graph replays any
step. Per layer, `update` stores the new K/V at the step's slots and hands attention a `FixedDecodePlan`; what the
layers would otherwise each make again is made once:

    RunnerLayer   per pool layer, for the Engine's life: its group, views of its K/V (kernel, slot, per-head blocks) and
                  its `RunnerPlan`
    GroupStep     per forward and layer group: the rows' tables, lengths and slots, the gather indices and the
                  buffers' views, and the shared-prefix split (`DecodeRunner.shared_blocks`)
    RunnerPlan    per layer: its decode plan, bound to the forward's GroupStep by `update` and unbound when the forward
                  ends, carried by the layer's reused placeholders (the empty K/V `update` returns)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from transformers.cache_utils import Cache

from ..attention import plan_placeholders, store_kv_rows
from ..attention.fixed_plan import FixedDecodePlan
from ..attention.plan import backend_of
from ..attention.torch_attention import decode_sdpa, decode_sdpa_applies
from ..cache.gather import head_major
from ..errors import UnsupportedModel
from ..storage import BlockPool
from .step_cache import StepLayer


class RunnerStep(Protocol):
    """What a `RunnerCache` reads of its runner (`DecodeRunner`): the pool, the step's shape, and per layer group the
    persistent buffers the forward reads (views `[rows]`, `[rows, W]`)."""

    pool: BlockPool
    model_type: str | None
    store: str  # "triton" or "torch": where new K/V rows are written
    backends: Mapping  # a backend setting -> "triton" / "torch", or the error (`kernels.dispatch.resolve_backends`)
    num_rows: int  # the step's rows, padding included
    compiled: bool  # the forward runs compiled (torch.compile traces what the cache does)
    table_width: int  # block table entries the step's attention spans (eager steps; compiled: the tables' width)
    kv_width: int  # keys the step's attention spans (eager steps; compiled: the tables' width x block size)
    tables: list[torch.Tensor]  # per layer group: [max_rows, W] block ids
    seq_lens: list[torch.Tensor]  # per layer group: [max_rows] keys from the row's first held block
    slots: list[torch.Tensor]  # per layer group: [max_rows] the new token's slot
    full_rows: list[bool]  # per layer group: every row spans all `kv_width` keys
    split_rows: list | None  # the step's rows when enough run to read a shared prefix once, else None
    chunk_bytes: int  # a chunk's keys and values when a layer's rows are gathered and attended a few at a time
    chunk_min_bytes: int  # ... which happens above this many bytes of one layer's keys and values (CPU only)

    def shared_blocks(self, group: int) -> int:
        """Leading blocks of `group` every row holds alike, worth reading once (0: none)."""

    def gather_buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """A reused buffer of `numel` values like `like` (None inside a CUDA-graph capture)."""


class RunnerLayer:
    """One pool layer's tensors as the runner's eager steps read and write them, made once (the Engine's pool keeps
    its tensors): its layer group, K and V as the kernels view them (`[num_blocks, block_size, kv_heads, head_dim]`),
    slot-indexed (`[num_slots, kv_heads, head_dim]`, where the torch store copies new rows) and per head as rows of
    one block (`[kv_heads, num_blocks, block_size * head_dim]`, what a gather selects)."""

    def __init__(self, pool: BlockPool, layer_idx: int, shape_ids: dict):
        self.group = pool.group_of_layer[layer_idx]
        self.key_cache, self.value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
        # One small int per distinct (K shape, V shape, dtype): what a step's gathers are made once for and keyed by.
        shapes = (self.key_cache.shape, self.value_cache.shape, self.key_cache.dtype)
        self.shape_id = shape_ids.setdefault(shapes, len(shape_ids))
        self.key_nhd, self.value_nhd = pool.nhd_view(self.key_cache), pool.nhd_view(self.value_cache)
        # Slot-major (`[num_slots, kv_heads, head_dim]`): a row's new token, `[kv_heads, head_dim]`, copies in as is.
        self.slot_views = [cache.view(cache.shape[0], -1, cache.shape[3]).transpose(0, 1) for cache in self.caches]
        self.head_blocks = [cache.view(cache.shape[0], cache.shape[1], -1) for cache in self.caches]
        self.head_dims = (self.key_cache.shape[3], self.value_cache.shape[3])
        self.plan = RunnerPlan(self.key_nhd, self.value_nhd)

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_cache, self.value_cache

    def current(self, pool: BlockPool, layer_idx: int) -> bool:
        """Whether the pool still holds the tensors this view was made of."""
        return pool.key_cache[layer_idx] is self.key_cache and pool.value_cache[layer_idx] is self.value_cache


class GroupStep:
    """One layer group's share of a runner forward, made at the group's first layer and read by the others: its
    rows' tables, lengths and slots (views of the runner's buffers), the gather indices per pool shape, and the
    length masks."""

    def __init__(self, runner: RunnerStep, group: int, num_rows: int):
        # `num_rows`: the states' rows, `runner.num_rows` (a size of the traced graph's inputs where the forward is
        # compiled, not a number the graph is specialized on)
        self.runner = runner
        if runner.compiled:
            # Full width, W a size of the traced graph's inputs (marked dynamic in the runner's `_run_model`) rather
            # than a number it is specialized on: a row that doubles W compiles nothing again.
            self.tables = runner.tables[group][:num_rows]  # [B, W]
            self.width = self.tables.shape[1] * runner.pool.block_size
        else:
            self.tables = runner.tables[group][:num_rows, : runner.table_width]  # [B, table_width]
            self.width = runner.kv_width
        self.seq_lens = runner.seq_lens[group][:num_rows]
        self.slots = runner.slots[group][:num_rows]
        self.full_rows = runner.full_rows[group]
        self.group = group
        self.length_masks: dict = {}
        self.gathers: dict[tuple, tuple] = {}  # (part, layer shape id) -> what `_gather` made for them
        self.chunks: dict[int, int] = {}  # layer shape id -> `chunk_rows`
        # Not in a traced forward: its gathers are its own outputs (no buffer to chunk into), and a chunk count would be
        # a size it compiles for.
        self.chunking = runner.chunk_bytes > 0 and runner.pool.device.type == "cpu" and not runner.compiled

    def _gather(self, part: str, tables: torch.Tensor, width: int, layer: RunnerLayer) -> tuple[torch.Tensor, ...]:
        """K and V of `tables`' blocks, `[rows, kv_heads, width, head_dim]` each (views of `[kv_heads, rows, ...]`
        copies: each head's blocks read in one pass over the pool's head). What does not depend on the layer (the
        index, the buffers' views) is made once per step and pool shape: a layer then costs two index_selects."""
        index, outs, results = self._made(part, tables, width, layer)
        if outs is None:  # inside a capture: outputs of the graph's own memory
            return tuple(
                head_major(rows.index_select(1, index), len(tables), width, head_dim)
                for rows, head_dim in zip(layer.head_blocks, layer.head_dims)
            )
        for rows, out in zip(layer.head_blocks, outs):
            torch.index_select(rows, 1, index, out=out)
        return results

    def _made(self, part: str, tables: torch.Tensor, width: int, layer: RunnerLayer) -> tuple:
        """`_make_gather`'s result for `part` and the layer's pool shapes, made at the first layer that asks."""
        key = (part, layer.shape_id)
        made = self.gathers.get(key)
        if made is None:
            made = self.gathers[key] = self._make_gather(part, tables, width, layer)
        return made

    def _make_gather(self, part: str, tables: torch.Tensor, width: int, layer: RunnerLayer) -> tuple:
        """(the block ids, K's and V's `[kv_heads, rows * W, block_size * head_dim]` outputs or None, their
        `[rows, kv_heads, width, head_dim]` views)."""
        index = tables.flatten()
        outs, results = [], []
        for name, cache, rows in zip(("key", "value"), layer.caches, layer.head_blocks):
            out = self.runner.gather_buffer(f"{part} {name}", rows.shape[0] * index.numel() * rows.shape[2], cache)
            if out is not None:
                outs.append(out.view(rows.shape[0], index.numel(), rows.shape[2]))
                results.append(head_major(outs[-1], len(tables), width, cache.shape[3]))
        return index, (outs or None), tuple(results)

    def gather(self, layer: RunnerLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values, `[B, kv_heads, width, head_dim]`, into the runner's two reused buffers."""
        key, value = self._gather("all", self.tables, self.width, layer)
        return key, value

    def chunk_rows(self, layer: RunnerLayer) -> int:
        """Rows per chunk when a layer's gather and attention run a few rows at a time (`gather_rows`), 0 for all at
        once: on CPU, when the step's keys and values of one layer exceed `DecodeRunner.chunk_min_bytes`, chunks of
        about `chunk_bytes` stay in the core's caches between their gather and their attention."""
        if not self.chunking:
            return 0
        rows = self.chunks.get(layer.shape_id)
        if rows is None:
            row_bytes = sum(cache.shape[0] * cache.shape[3] * cache.element_size() for cache in layer.caches)
            row_bytes *= self.width
            too_few = len(self.tables) * row_bytes <= self.runner.chunk_min_bytes
            rows = self.chunks[layer.shape_id] = 0 if too_few else max(1, self.runner.chunk_bytes // row_bytes)
        return rows

    def gather_rows(self, layer: RunnerLayer, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [first, end)'s keys and values, `[end - first, kv_heads, width, head_dim]`, into the start of the
        runner's two buffers (what `gather` fills whole), so one chunk's copy is read while still in cache."""
        index, outs, _ = self._made("all", self.tables, self.width, layer)
        table_width = index.numel() // len(self.tables)
        chunk_index = index[first * table_width : end * table_width]
        gathered = []
        for rows, out, head_dim in zip(layer.head_blocks, outs, layer.head_dims):
            numel = rows.shape[0] * chunk_index.numel() * rows.shape[2]
            chunk = out.view(-1)[:numel].view(rows.shape[0], -1, rows.shape[2])
            torch.index_select(rows, 1, chunk_index, out=chunk)
            gathered.append(head_major(chunk, end - first, self.width, head_dim))
        return gathered[0], gathered[1]

    def split_gather(self, layer: RunnerLayer):
        """The shared blocks' keys and values once (from row 0's table), `[1, kv_heads, prefix, head_dim]`, then
        every row's after them, `[B, kv_heads, width - prefix, head_dim]` (None when empty); None when the rows share
        too little to split (`DecodeRunner.shared_blocks`)."""
        shared = self.runner.shared_blocks(self.group)
        if not shared:
            return None
        prefix_len = min(shared * self.runner.pool.block_size, self.width)
        prefix = self._gather("prefix", self.tables[:1, :shared], prefix_len, layer)
        if prefix_len == self.width:
            return prefix[0], prefix[1], None, None
        tail = self._gather("tail", self.tables[:, shared:], self.width - prefix_len, layer)
        return prefix[0], prefix[1], tail[0], tail[1]


class RunnerPlan(FixedDecodePlan):
    """A layer's decode plan for the runner's steps, made once with its `RunnerLayer`: a forward's `update` binds it
    to the layer and the forward's `GroupStep` (its tables, lengths, masks and gathers), `unbind` lets go of them
    when the forward ends. A forward then makes no plan per layer, and no plan keeps a step's gather buffers (nor a
    layer a pool that grew has replaced) after its forward. `attend` takes the torch path's usual step directly and
    leaves every other one to `FixedDecodePlan.attend`, over ragged rows."""

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor):
        # `gather` and `gather_rows` are this class's methods, not fields holding bound methods: a plan refers to no
        # layer or step of its own between forwards, so nothing here outlives what it reads.
        self.key_cache, self.value_cache = key_cache, value_cache
        self.block_tables = self.seq_lens = self.length_masks = self.split_gather = None
        self.backends, self.ragged, self.full_rows, self.chunk_rows = {}, True, False, 0
        self.layer: RunnerLayer | None = None
        self.step: GroupStep | None = None

    def bind(self, step: GroupStep, layer: RunnerLayer) -> None:
        """Read `step`'s rows (a forward's, of `layer`'s group) at the next `attend`."""
        self.step, self.layer = step, layer
        self.block_tables, self.seq_lens, self.backends = step.tables, step.seq_lens, step.runner.backends
        self.length_masks, self.full_rows = step.length_masks, step.full_rows
        self.split_gather = self._split_gather if step.runner.split_rows else None
        self.chunk_rows = step.chunk_rows(layer)

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, attention_mask, **kwargs
    ) -> tuple[torch.Tensor, None]:
        """`FixedDecodePlan.attend`, with the torch path's usual step taken directly: every row's keys gathered at
        once (no shared prefix read once, no row chunks), none hidden (rows of one length, no window), and SDPA
        called as transformers' `sdpa_attention_forward` calls it there (`decode_sdpa`). A step pays this once per
        layer, where every call and check shows."""
        step = self._bound_step()
        if (
            kwargs.get("softcap") is None
            and not self.chunk_rows
            and backend_of(self.backends, module, query.device) == "torch"
            and (self.split_gather is None or not step.runner.shared_blocks(step.group))  # never on the kernel path
            and self._length_mask(step.width, kwargs.get("sliding_window")) is None
            and decode_sdpa_applies(module, query, *self.layer.head_dims, kwargs)
        ):
            key, value = step.gather(self.layer)
            return decode_sdpa(module, query, key, value, kwargs.get("dropout", 0.0), kwargs.get("scaling")), None
        return super().attend(module, query, attention_mask, **kwargs)

    def unbind(self) -> None:
        """Let go of the forward's step and layer; an `attend` before the next `bind` raises."""
        self.step = self.layer = self.block_tables = self.seq_lens = self.length_masks = self.split_gather = None

    def _bound_step(self) -> GroupStep:
        if self.step is None:
            raise RuntimeError("a runner's decode plan was used after its forward ended")
        return self.step

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._bound_step().gather(self.layer)

    def gather_rows(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._bound_step().gather_rows(self.layer, first, end)

    def _split_gather(self):
        return self._bound_step().split_gather(self.layer)


class RunnerCache(Cache):
    """The cache a runner's forward writes: store at the step's slots, hand attention a `FixedDecodePlan`. Every
    tensor it reads is one of the runner's persistent buffers, so a captured graph replays any step."""

    def __init__(self, runner: RunnerStep):
        self.runner = runner
        self.num_updates = 0
        self.inference_mode = False  # the forward's (`start_forward`), part of the placeholders' key
        self.layer_views: list[RunnerLayer | None] = [None] * runner.pool.layout.num_layers
        self.shape_ids: dict[tuple, int] = {}  # (K shape, V shape, dtype) -> `RunnerLayer.shape_id`
        # Per forward: layer group -> its GroupStep (what every layer of the group would make again).
        self.groups: dict[int, GroupStep] = {}
        # Per layer: (what its states were, its two placeholders carrying its `RunnerPlan`), or None.
        self.placeholders: list[tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(self.layer_views)
        super().__init__(layers=[StepLayer(self) for _ in range(runner.pool.layout.num_layers)])

    def start_forward(self) -> None:
        self.num_updates = 0
        self.groups.clear()
        # Read here, not in `update`: a traced forward (torch.compile) cannot read it.
        self.inference_mode = torch.is_inference_mode_enabled()

    def end_forward(self) -> None:
        """Unbind the layers' plans and drop the group steps: nothing keeps a gather buffer the workspace let go of."""
        self.groups.clear()
        for layer in self.layer_views:
            if layer is not None:
                layer.plan.unbind()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # the mask sizes describe a plain causal block of the new tokens (StepLayer); positions are given

    def _layer(self, layer_idx: int) -> RunnerLayer:
        """The layer's `RunnerLayer`, made at its first use and again when the pool grew."""
        layer = self.layer_views[layer_idx]
        if layer is None or not layer.current(self.runner.pool, layer_idx):
            layer = self.layer_views[layer_idx] = RunnerLayer(self.runner.pool, layer_idx, self.shape_ids)
            self.placeholders[layer_idx] = None  # they carry the old layer's plan
        return layer

    def make_layers(self) -> None:
        """Every layer's `RunnerLayer` now, before a compiled forward: made inside one, they would be state the traced
        graph guards on, and the next forward would compile again."""
        for layer_idx in range(len(self.layer_views)):
            self._layer(layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, kv_heads, 1, head_dim] -> empty placeholders carrying the layer's decode plan."""
        runner, views = self.runner, self.layer_views
        if not 0 <= layer_idx < len(views):
            raise UnsupportedModel(
                runner.model_type,
                f"it writes cache layer {layer_idx}, while the pool holds its {len(views)} layers",
                "Engine",
            )
        self.num_updates += 1
        layer = views[layer_idx]
        if layer is None or not layer.current(runner.pool, layer_idx):  # first used, or the pool grew
            layer = self._layer(layer_idx)
        step = self.groups.get(layer.group)
        if step is None:
            step = self.groups[layer.group] = GroupStep(runner, layer.group, key_states.shape[0])
        if runner.store == "torch":
            # `store_kv_rows`' torch path on the layer's slot views: one index_copy_ per K and V.
            for view, states in zip(layer.slot_views, (key_states, value_states)):
                view.index_copy_(0, step.slots, states.squeeze(2))  # [B, kv_heads, head_dim]
        else:
            store_kv_rows(
                *layer.caches,
                key_states,
                value_states,
                step.slots,
                backend=runner.store,
                nhd_views=(layer.key_nhd, layer.value_nhd),
            )
        layer.plan.bind(step, layer)
        if runner.compiled and torch.compiler.is_compiling():  # a traced forward's own (the memo would guard sizes)
            return plan_placeholders(key_states, value_states, layer.plan)
        # A layer's placeholders are made again only when its states change shape, dtype or device (or the
        # inference mode); they carry the layer's plan, bound to each forward in turn.
        key = (
            key_states.shape,
            value_states.shape,
            key_states.dtype,
            key_states.device,
            self.inference_mode,
        )
        made = self.placeholders[layer_idx]
        if made is None or made[0] != key:
            made = self.placeholders[layer_idx] = (key, plan_placeholders(key_states, value_states, layer.plan))
        return made[1]
