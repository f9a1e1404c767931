"""FixedDecodePlan: the decode plan of steps with fixed shapes, traceable by torch.compile and CUDA-graph capture.

Two users: a compileable `PagedCache` (`max_cache_len`: every row has the same length, the model's mask says which
keys each row sees) and the Engine's decode runner (`ragged`: rows of different lengths, `seq_lens` alone says which
keys each row sees, the model's mask is ignored).

It differs from `DecodePlan` in what a compiled, CUDA-graph replayed step allows: its tensors are the cache's
persistent step buffers (fixed shapes), the paged kernel is called through its custom op, and nothing reads a device
value on the host. So where `DecodePlan.kv_start` checks on the host that the mask is "hidden prefix, then every key
up to the new token" before it hands the kernel one start per row, this plan checks it on the device
(`torch._assert_async`): a mask of another shape stops the step loudly instead of attending the wrong keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .decode_plan import length_mask
from .kernels.launch_config import INDEX_DTYPE
from .kernels.ops import paged_decode_attention_compiled
from .plan import backend_of
from .shared_prefix import shared_prefix_attention
from .torch_attention import sdpa_or_torch_attention

# The shared prefix's K and V once, then every row's tail K and V (None when empty).
SplitKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class FixedDecodePlan:
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] view of the head-major pool
    value_cache: torch.Tensor  # same, of V
    block_tables: torch.Tensor  # [B, W] int64, the cache's persistent table of this layer's group
    seq_lens: torch.Tensor  # [B] int64, tokens per row with the new one
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # [B, kv_heads, W * block_size, head_dim] K and V
    backends: Mapping  # a module's backend setting (None or one of BACKENDS) -> "triton" / "torch", or the error
    ragged: bool = False  # rows of different lengths: `seq_lens` says which keys each row sees, not the mask
    # window -> the ragged rows' length mask (`length_mask`), shared by the layers of a step whose keys span one width
    length_masks: dict | None = None
    # Ragged rows that all hold exactly as many keys as `gather` returns (known on the host): no length mask then,
    # unless a sliding window hides some.
    full_rows: bool = False
    # Ragged rows whose tables start with the same blocks (a shared system prompt, parallel samples of one prompt):
    # the shared prefix's K and V `[1, kv_heads, prefix_len, head_dim]` once and every row's tail `[B, kv_heads,
    # kv_len - prefix_len, head_dim]` (None when empty), which the torch path reads instead of `gather`'s whole
    # context of every row (`shared_prefix_attention`); it returns None when the rows share too little to split.
    split_gather: Callable[[], SplitKV | None] | None = None
    # Ragged rows attended `chunk_rows` at a time on the torch path (0: all at once): `gather_rows(first, end)` gives
    # rows [first, end)'s K and V `[end - first, kv_heads, width, head_dim]`, each chunk's reusing the same memory.
    gather_rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    chunk_rows: int = 0
    # The forward's (mask, its `_kv_start`) pairs, shared by its layers' plans: the layers of one mask check it and
    # find each row's first key once a step, not once a layer (None: each plan its own).
    kv_starts: list | None = None

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [B, heads, 1, head_dim], the step's [B, 1, 1, max_cache_len] mask -> ([B, 1, heads, head_dim],
        None)."""
        backend = backend_of(self.backends, module, query.device)
        sinks, bias = kwargs.get("s_aux"), kwargs.get("position_bias")
        kernel = backend == "triton" and sinks is None and bias is None and not dropout
        if self.ragged:
            attention_mask = None  # the mask describes no row's keys: each row's length does
        kv_start = None
        if kernel and attention_mask is not None:  # the kernel takes a mask of one first visible key per row only
            kv_start = self._memo_kv_start(attention_mask) if self._bool_mask(attention_mask) else None
            kernel = kv_start is not None
        if not kernel:
            parts = None
            if self.split_gather is not None and self.ragged and sinks is None and bias is None and not dropout:
                parts = self.split_gather()
            if parts is not None:
                prefix_keys, prefix_values, tail_keys, tail_values = parts
                width = prefix_keys.shape[2] + (0 if tail_keys is None else tail_keys.shape[2])
                mask = self._length_mask(width, sliding_window)
                out = shared_prefix_attention(
                    query, prefix_keys, prefix_values, tail_keys, tail_values, mask, scaling=scaling, softcap=softcap
                )
                return out, None
            batch = query.shape[0]
            if self.ragged and 0 < self.chunk_rows < batch and bias is None and self.gather_rows is not None:
                return self._attend_in_row_chunks(module, query, dropout, scaling, sliding_window, softcap, kwargs)
            key, value = self.gather()
            if self.ragged:
                attention_mask = self._length_mask(key.shape[2], sliding_window)
            return sdpa_or_torch_attention(
                module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs
            )
        out = paged_decode_attention_compiled(
            query[:, :, 0],  # [B, heads, head_dim]
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            kv_start=kv_start,
            sliding_window=sliding_window,
            softcap=softcap,
            backend="triton",
        )
        return out.unsqueeze(1), None  # [B, 1, heads, head_dim]

    def _attend_in_row_chunks(self, module, query, dropout, scaling, sliding_window, softcap, kwargs):
        """The torch path `chunk_rows` rows at a time: each chunk's K/V gathered, then attended while in cache. Rows
        are independent in attention, so every row's output is what one call over all rows gives, bit for bit."""
        batch, out = query.shape[0], None
        for first in range(0, batch, self.chunk_rows):
            end = min(batch, first + self.chunk_rows)
            key, value = self.gather_rows(first, end)
            mask = self._length_mask(key.shape[2], sliding_window)
            rows_mask = None if mask is None else mask[first:end]
            chunk, _ = sdpa_or_torch_attention(
                module, query[first:end], key, value, rows_mask, dropout, scaling, softcap, **kwargs
            )
            if out is None:
                out = chunk.new_empty(batch, *chunk.shape[1:])
            out[first:end] = chunk
        return out, None

    def _memo_kv_start(self, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """`_kv_start` of `attention_mask`, made by the first layer of the forward that reads this mask."""
        if self.kv_starts is None:
            return self._kv_start(attention_mask)
        for mask, kv_start in self.kv_starts:
            if mask is attention_mask:
                return kv_start
        kv_start = self._kv_start(attention_mask)
        self.kv_starts.append((attention_mask, kv_start))
        return kv_start

    def _kv_start(self, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """[B] int64: each row's first visible key, when the mask is "hidden prefix, then every key up to the new
        token" (left padding, a window). Eagerly a mask of another shape gives None (the gather path runs); inside a
        compiled step, where the host cannot look, it stops the step with a device-side assert (on CUDA one that ends
        the process's CUDA context: loud, never wrong)."""
        visible = attention_mask[:, 0, -1, :]  # [B, max_cache_len]: the keys the new token sees
        first = visible.int().argmax(dim=-1)
        one_run = (visible.sum(dim=-1) == self.seq_lens - first).all()
        if not torch.compiler.is_compiling():
            return first.to(INDEX_DTYPE) if bool(one_run) else None
        message = "hf_paged: a compiled decode step's mask is not 'hidden prefix, then every key up to the new token'"
        torch._assert_async(one_run, message)
        return first.to(INDEX_DTYPE)

    def _length_mask(self, width: int, sliding_window: int | None) -> torch.Tensor | None:
        if self.full_rows and (sliding_window is None or width <= sliding_window):
            return None
        memo = self.length_masks if self.length_masks is not None else {}
        return length_mask(self.seq_lens, sliding_window, memo, max_len=width)  # width from the host: no device read

    @staticmethod
    def _bool_mask(attention_mask: torch.Tensor) -> bool:
        return attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
