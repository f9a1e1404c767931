"""StepPlan: the attention of the Engine's packed step, one layer at a time.

The packed step (engine/step_cache.py, `StepCache`) stores every new token of a step and returns placeholders
carrying a `StepPlan`; the "hf_paged" attention hands it the whole step's query:

    query [1, heads, num_tokens, head_dim]:  | d0 | d1 | p0: prefill chunk ...... | p1 ... |
      decode rows     one ragged batch: the paged decode kernel on the pool, or one gather and SDPA with a
                      per-row length mask where the rows' lengths differ (`DecodePlan`)
      prefill chunks  the Triton backend: one launch of the paged prefill kernel for all of them, reading the pool
                      in place; otherwise each chunk gathers its row's K/V and runs SDPA with the causal mask
                      `generate()` would build for that row alone (`chunk_mask`)
      chunked layers  (Llama 4) each row against its own chunk of positions

The plan reads the step through `PackedRows`, which `StepCache` implements: the rows' lengths and starts, and per
layer group the block tables, slots and lengths (`GroupStep`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..storage import BlockPool
from .decode_plan import DecodePlan, length_mask
from .kernels import paged_prefill_attention
from .plan import memoized_backend
from .torch_attention import sdpa_or_torch_attention, torch_attention_forward


@dataclass
class GroupStep:
    """One layer group's share of a step: its rows' block tables and where the new tokens go."""

    tables: torch.Tensor  # [B, width] long: row b's held blocks, padded with 0 (never read)
    num_table_blocks: list[int]  # per row: blocks its keys span
    first_positions: list[int]  # per row: position of its table's first key
    slots: torch.Tensor  # [num_tokens] long: pool slot of each new token
    seq_lens: torch.Tensor  # [B] int64: keys per row from its first held block, the new ones included
    host_seq_lens: list[int]  # the same on the host (no device sync to read one)
    length_masks: dict  # window -> the decode rows' length mask, shared by the group's layers this step
    decode_tables: torch.Tensor  # [num_decode, longest row's blocks] int64: the decode rows' (the decode kernel's)
    decode_seq_lens: torch.Tensor  # [num_decode] int64: the decode rows' `seq_lens`
    prefill_tables: torch.Tensor  # [B - num_decode, width]: the prefill rows' `tables`
    # [B - num_decode] int64: the prefill rows' `seq_lens`, a tensor of its own on 16 bytes (the prefill kernel
    # compiles a variant per pointer alignment, and a slice after the decode rows may be off it)
    prefill_seq_lens: torch.Tensor
    plan_memos: dict = field(default_factory=dict)  # the decode plans' memos (kv starts, backends by setting)


class PackedRows(Protocol):
    """What a `StepPlan` reads of a packed step (`StepCache`): rows `b` holding `seq_lens[b]` cached tokens, adding
    `q_lens[b]` new ones that start at `starts[b]` in the packed sequence; decode rows (one new token) first."""

    pool: BlockPool
    num_decode: int
    seq_lens: list[int]
    q_lens: list[int]
    starts: list[int]
    chunk_sizes: list[int | None]

    def group_step(self, layer_idx: int) -> GroupStep:
        """The step's share of the layer group of `layer_idx`."""

    def gather(self, layer_idx: int, first_row: int, end_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [first_row, end_row): `[rows, kv_heads, longest, head_dim]` keys and values read from the pool."""

    def first_position(self, layer_idx: int, row: int) -> int:
        """Position of the first key `row` still holds in layer `layer_idx`."""

    def prefill_cu_seqlens(self) -> torch.Tensor:
        """[chunks + 1] int32: where each prefill chunk starts among the chunks' tokens."""


@dataclass
class StepPlan:
    """What attention needs for one layer of a packed step (attached to the placeholder `update` returns)."""

    cache: PackedRows
    layer_idx: int

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [1, heads, num_tokens, head_dim] -> ([1, num_tokens, heads, value_head_dim], None). `attention_mask`
        is ignored: each row's keys are described by its lengths, and each prefill chunk builds its own causal mask.

        `key` / `value`: the model's expansion of what `update` returned for a latent layout (multi-head latent
        attention): every row's keys padded to the longest, `[rows, heads, longest, head_dim]` (and V's head_dim);
        without them, each row's K/V are read from the pool."""
        cache = self.cache
        expanded = None if key is None else (key, value)
        chunk_size = cache.chunk_sizes[self.layer_idx]
        if chunk_size is not None:
            out = self._attend_chunked(module, query, chunk_size, expanded=expanded, **kwargs)
            return out, None
        num_decode = cache.num_decode
        _, num_heads, num_tokens, _ = query.shape
        out = None
        if num_decode < len(cache.seq_lens):  # prefill chunks too: the whole step's output, decode rows first
            out = query.new_empty(1, num_tokens, num_heads, self.value_head_dim(expanded))
        if num_decode:
            decode_query = query[0, :, :num_decode].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, D]
            decode_out = None if out is None else out[0, :num_decode]  # [n, heads, D]
            decoded = self._attend_decode(
                module, decode_query, sliding_window=sliding_window, expanded=expanded, out=decode_out, **kwargs
            )
            if out is None:  # a decode-only step: the decode rows are the whole output
                return decoded.transpose(0, 1), None
            if decoded.data_ptr() != decode_out.data_ptr():  # the torch path: its own output
                decode_out.copy_(decoded[:, 0])
        if expanded is None and self._prefill_kernel_runs(module, query.device):
            # Every prefill chunk in one launch of the paged prefill kernel, reading the pool in place.
            self._attend_prefill(query, out, sliding_window=sliding_window, **kwargs)
            return out, None
        for row in range(num_decode, len(cache.seq_lens)):
            start, q_len, seq_len = cache.starts[row], cache.q_lens[row], cache.seq_lens[row]
            key, value = self.row_kv(row, expanded)  # [1, kv_heads, seq_len + q_len - first, D]
            first = cache.first_position(self.layer_idx, row)
            chunk_query = query[:, :, start : start + q_len]
            if needs_torch_attention(kwargs):  # SDPA has no softcap or sinks: the torch attention, explicit mask
                mask = chunk_mask(seq_len, q_len, sliding_window, first, query.device, explicit=True)
                chunk, _ = torch_attention(chunk_query, key, value, mask, kwargs)
            else:
                mask = chunk_mask(seq_len, q_len, sliding_window, first, query.device, lazy=query.is_cuda)
                chunk, _ = sdpa_attention_forward(
                    module, chunk_query, key, value, mask, sliding_window=sliding_window, **kwargs
                )
            out[0, start : start + q_len] = chunk[0]  # [q_len, heads, D]
        return out, None

    def _attend_decode(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        expanded: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The decode rows' attention: query [num_decode, heads, 1, head_dim] ->
        [num_decode, 1, heads, value_head_dim]. `kwargs`: the attention function's (scaling, sliding_window, ...).
        `expanded`: every row's expanded K/V of a latent layout (see `StepPlan.attend`), read instead of the pool.
        `out` ([num_decode, heads, value_head_dim]): where the kernel writes (the torch path returns its own).

        With the Triton backend the kernel reads the pool in place (a `DecodePlan`, made only here); with the torch
        backend the rows' keys are gathered once, padded to the longest row, for SDPA with a per-row length mask (none
        when every row holds the longest row's keys and no window hides any: `decode_sdpa` where it applies).
        The backend is the one `enable(model, backend=...)` set on `module`, else `HF_PAGED_ATTENTION_BACKEND`, else
        "auto", resolved for the query's device.
        """
        cache, layer_idx = self.cache, self.layer_idx
        group = cache.group_step(layer_idx)
        # The paged kernels apply no attention sinks: rows with sinks take the torch path too, as do expanded K/V.
        backend = memoized_backend(group.plan_memos.setdefault("backends", {}), module, query.device)
        if backend == "torch" or kwargs.get("s_aux") is not None or expanded is not None:
            lengths = group.host_seq_lens[: cache.num_decode]
            longest, window = max(lengths), kwargs.get("sliding_window")
            if expanded is None:
                key, value = cache.gather(layer_idx, 0, cache.num_decode)
            else:
                key, value = (states[: cache.num_decode, :, :longest] for states in expanded)
            mask = None
            # Rows of one length see every key gathered (a window hides none of them): no mask, as DynamicCache's
            # decode step of one row has none. Else each row's length masks the padding.
            if min(lengths) != longest or (window is not None and longest > window):
                mask = length_mask(group.seq_lens[: cache.num_decode], window, group.length_masks, max_len=longest)
            # SDPA (called directly where the mask is None), or the torch attention for a softcap or sinks.
            return sdpa_or_torch_attention(module, query, key, value, mask, **kwargs)[0]
        key_cache, value_cache = cache.pool.nhd_views(layer_idx)
        plan = DecodePlan(
            key_cache=key_cache,
            value_cache=value_cache,
            block_tables=group.decode_tables,
            seq_lens=group.decode_seq_lens,
            kv_offset=0,
            position_offset=0,
            gather=lambda: cache.gather(layer_idx, 0, cache.num_decode),
            ragged=True,
            length_masks=group.length_masks,
            _kv_starts=group.plan_memos.setdefault("kv_starts", {}),
            _backends=group.plan_memos.setdefault("backends", {}),
            _launches=group.plan_memos.setdefault("launches", {}),  # the kernel's launch, made by the first layer
        )
        return plan.attend(module, query, None, out=out, **kwargs)[0]

    def _prefill_kernel_runs(self, module: torch.nn.Module, device: torch.device) -> bool:
        """Whether the step's prefill chunks go through the paged prefill kernel: the Triton
        backend for `module` (as `attend_decode` resolves it), K and V of one shape (the kernel reads both alike)."""
        pool, layer_idx = self.cache.pool, self.layer_idx
        if pool.key_cache[layer_idx].shape != pool.value_cache[layer_idx].shape:
            return False
        backends = self.cache.group_step(layer_idx).plan_memos.setdefault("backends", {})
        return memoized_backend(backends, module, device) == "triton"

    def _attend_prefill(
        self, query: torch.Tensor, out: torch.Tensor, sliding_window: int | None = None, **kwargs
    ) -> None:
        """The prefill chunks' attention by the paged prefill kernel, in place: query
        [1, heads, num_tokens, head_dim] (the chunks after the decode rows) -> `out` [1, num_tokens, heads, head_dim]
        rows `num_decode:`. Each chunk attends causally to its row's keys from its first held block (positions and
        the window count from there, as the decode rows' do), with the attention function's scaling, softcap and
        sinks (`s_aux`)."""
        cache, layer_idx = self.cache, self.layer_idx
        first = cache.num_decode
        group = cache.group_step(layer_idx)
        scaling = kwargs.get("scaling")
        key_cache, value_cache = cache.pool.nhd_views(layer_idx)
        paged_prefill_attention(
            query[0, :, cache.starts[first] :].transpose(0, 1),  # [chunk tokens, heads, head_dim]
            key_cache,
            value_cache,
            group.prefill_tables,
            cache.prefill_cu_seqlens(),
            group.prefill_seq_lens,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            sliding_window=sliding_window,
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
            out=out[0, cache.starts[first] :],
            backend="triton",
        )

    def _attend_chunked(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        chunk_size: int,
        expanded: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Chunked attention over every row of the step, one row at a time: query [1, heads, num_tokens, head_dim]
        -> [1, num_tokens, heads, value_head_dim]. The query at position q sees the keys at positions p with
        q // chunk_size * chunk_size <= p <= q (the sliding group of these layers keeps at least that much).
        `expanded`: as in `_attend_decode`."""
        cache, layer_idx = self.cache, self.layer_idx
        kwargs.pop("sliding_window", None)
        _, num_heads, num_tokens, _ = query.shape
        out = query.new_empty(1, num_tokens, num_heads, self.value_head_dim(expanded))
        for row, (start, q_len, seq_len) in enumerate(zip(cache.starts, cache.q_lens, cache.seq_lens)):
            key, value = self.row_kv(row, expanded)  # [1, kv_heads, seq_len + q_len - first, D]
            first = cache.first_position(layer_idx, row)
            query_positions = torch.arange(seq_len, seq_len + q_len, device=query.device)[:, None]
            key_positions = torch.arange(first, seq_len + q_len, device=query.device)[None, :]
            visible = (key_positions <= query_positions) & (key_positions >= query_positions // chunk_size * chunk_size)
            row_query = query[:, :, start : start + q_len]
            if needs_torch_attention(kwargs):
                attended, _ = torch_attention(row_query, key, value, visible[None, None], kwargs)
            else:
                attended, _ = sdpa_attention_forward(module, row_query, key, value, visible[None, None], **kwargs)
            out[0, start : start + q_len] = attended[0]  # [q_len, heads, D]
        return out

    def row_kv(
        self, row: int, expanded: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s held keys and values, cached and new (`[1, kv_heads, keys, head_dim]` from its first held
        block to its last new token), or row `row` of a latent layout's expanded K/V (`[rows, heads, longest, D]`, see
        `StepPlan.attend`) cut to its own keys."""
        if expanded is None:
            return self.cache.gather(self.layer_idx, row, row + 1)
        length = self.cache.group_step(self.layer_idx).host_seq_lens[row]
        key, value = expanded
        return key[row : row + 1, :, :length], value[row : row + 1, :, :length]

    def value_head_dim(self, expanded: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """head_dim of the values attention reads (the expanded ones where given)."""
        return expanded[1].shape[-1] if expanded is not None else self.cache.pool.value_cache[self.layer_idx].shape[-1]


def needs_torch_attention(kwargs: dict) -> bool:
    """The attention function's keywords ask for what SDPA does not do: a softcap or attention sinks (`s_aux`)."""
    return kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None


def torch_attention(query, key, value, mask, kwargs: dict) -> tuple[torch.Tensor, None]:
    """`torch_attention_forward` with the attention function's keywords (softcap, s_aux, scaling, dropout)."""
    return torch_attention_forward(
        query,
        key,
        value,
        mask,
        kwargs.get("dropout", 0.0),
        kwargs.get("scaling"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )


def chunk_mask(
    seq_len: int,
    q_len: int,
    sliding_window: int | None,
    first: int,
    device,
    explicit: bool = False,
    lazy: bool = False,
) -> torch.Tensor | CausalBias | None:
    """[1, 1, q_len, seq_len + q_len - first] bool for keys from position `first` on: query i (position seq_len + i)
    sees the key at position p when p <= seq_len + i (and, with a window, p > seq_len + i - sliding_window). None
    where sdpa's own mask would be skipped for plain causal attention (no cached keys, the whole chunk inside the
    window), as `generate()` does for a batch-1 prompt, unless `explicit` (an attention without SDPA's `is_causal`).

    `lazy` (CUDA): a chunk over cached keys that needs no more than causality (every key from position 0, no window)
    gets SDPA's lower-right causal bias instead, which its flash and memory-efficient kernels apply without a mask
    over the whole context."""
    kv_len = seq_len + q_len
    if not explicit and seq_len == 0 and (sliding_window is None or kv_len < sliding_window):
        return None
    if lazy and not explicit and first == 0 and sliding_window is None:
        return causal_lower_right(q_len, kv_len)
    query_positions = torch.arange(seq_len, kv_len, device=device)[:, None]
    key_positions = torch.arange(first, kv_len, device=device)[None, :]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return visible[None, None]
