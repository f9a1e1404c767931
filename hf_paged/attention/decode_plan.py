"""DecodePlan: what one decode step's attention needs to read a layer's K/V straight from the pool.

`PagedCache.update` returns it attached to an empty placeholder tensor (see plan.py) when the model runs the
`hf_paged` attention implementation; the engine's step cache builds one for its decode rows on the Triton path.
Block tables and lengths are built once per step (per layer group) and shared by the step's layers. `attend` runs
- the Triton paged-decode kernel on the pool (backend "triton"; "auto" on CUDA), or, on backend "torch" ("auto"
  elsewhere):
- when the rows share a prefix of blocks (`split_gather`: the prompt of `num_return_sequences` / `num_beams`), the
  prefix once and each row's tail (shared_prefix.py), so the transient K/V stay far below one layer of all rows;
- else one gather of the K/V and SDPA, bit-identical to plain sdpa.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kernels.dispatch import decode_launch
from .kernels.launch_config import INDEX_DTYPE
from .plan import memoized_backend
from .shared_prefix import per_row_mask, shared_prefix_attention
from .torch_attention import sdpa_or_torch_attention


@dataclass
class DecodePlan:
    """What a decode step's attention needs to read one layer's K/V from the pool without gathering it.

    `PagedCache.update` returns it attached to an empty `[B, kv_heads, 0, head_dim]` tensor (`plan_placeholders`) when
    the model runs the `hf_paged` attention implementation. `block_tables`, `seq_lens` and the kv_start memo are
    built once per step and shared by every layer.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] view of the head-major pool
    value_cache: torch.Tensor  # same, of V (whose heads and head_dim may differ: then attend takes the torch path)
    block_tables: torch.Tensor  # [B, num_table_blocks] int64
    seq_lens: torch.Tensor  # [B] int64: tokens per row from the first held block, the new one included
    kv_offset: int  # absolute position of the first key that the attention mask describes
    position_offset: int  # absolute position of block_tables[:, 0]'s first token (blocks released before it)
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the K/V an sdpa step would get: [B, H, kv_len, D]
    # Rows of different lengths (the engine's batches): `seq_lens` alone says which keys each row sees, the
    # attention mask is ignored, and `gather` pads every row to the longest (mask with `length_mask`).
    ragged: bool = False
    # Rows that share their first blocks: () -> (prefix keys, prefix values [1, kv_heads, P, D], tail keys, tail values
    # [B, kv_heads, T, D] or None), the same keys `gather` returns split at the end of the shared blocks.
    split_gather: Callable[[], tuple] | None = None
    length_masks: dict = field(default_factory=dict)  # sliding window -> length_mask(window)
    _kv_starts: dict = field(default_factory=dict)  # id(mask) -> (mask, kv_start); shared by the step's layers
    _backends: dict = field(default_factory=dict)  # a module's backend setting -> resolved; shared likewise
    # (id(kv_start), query shape, dtype, cache shape) -> the Triton kernel's `DecodeLaunch` for these rows; shared
    # likewise
    _launches: dict = field(default_factory=dict)

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
        out: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [B, heads, 1, head_dim], the step's decode mask -> ([B, 1, heads, head_dim], None). `out` ([B, heads,
        head_dim]): where the kernel writes, when it runs (the torch path returns a tensor of its own)."""
        backend = self.backend(module, query.device)
        sinks = kwargs.get("s_aux")
        # The paged kernels read K and V of one shape and apply no attention sinks: gather for the torch path.
        if not self.uniform_kv or sinks is not None:
            backend = "torch"
        kv_start = self.kv_start(attention_mask) if backend == "triton" else None
        if backend == "torch" or kv_start is None or kwargs.get("position_bias") is not None:
            if sinks is None and self.shares_prefix(attention_mask, dropout, **kwargs):
                return self.attend_shared_prefix(query, attention_mask, scaling=scaling, softcap=softcap), None
            # The torch path, masks that are not "left padding then causal", and an additive position bias (Inkling's
            # relative logits, which SDPA adds and the kernel does not): gather once, plain SDPA (the torch attention
            # for a softcap or sinks, which SDPA has not).
            key, value = self.gather()
            if self.ragged:
                attention_mask = self.length_mask(sliding_window)
            return sdpa_or_torch_attention(
                module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs
            )
        rows = query[:, :, 0]  # [B, heads, head_dim]
        key = (id(kv_start), rows.shape, rows.dtype, self.key_cache.shape)  # a group's layers may differ in kv heads
        launch = self._launches.get(key)
        if launch is None or launch.kv_start is not kv_start:  # made by the step's first layer, called by each
            launch = self._launches[key] = decode_launch(
                rows, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, kv_start=kv_start
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = launch(
            rows, self.key_cache, self.value_cache, scale=scale, sliding_window=sliding_window, softcap=softcap, out=out
        )
        return out.unsqueeze(1), None  # [B, 1, heads, head_dim]

    @property
    def uniform_kv(self) -> bool:
        """Whether K and V have one shape (kv heads and head_dim), as the paged kernels need; a layer whose V differs
        (MiMo-V2-Flash's `v_head_dim`) takes the torch path."""
        return self.key_cache.shape == self.value_cache.shape

    def shares_prefix(self, attention_mask: torch.Tensor | None, dropout: float = 0.0, **kwargs) -> bool:
        """Whether the torch path reads the rows' shared prefix once (`attend_shared_prefix`) instead of gathering
        every row's whole context: the rows share blocks, the mask is one per row, no dropout, and no other term
        in the attention function's `kwargs` (a position bias)."""
        return (
            self.split_gather is not None
            and not self.ragged
            and not dropout
            and kwargs.get("position_bias") is None
            and per_row_mask(attention_mask)
        )

    def attend_shared_prefix(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query [B, heads, 1, head_dim] -> [B, 1, heads, head_dim]: the shared prefix once, then each row's tail."""
        prefix_keys, prefix_values, tail_keys, tail_values = self.split_gather()
        return shared_prefix_attention(
            query, prefix_keys, prefix_values, tail_keys, tail_values, attention_mask, scaling=scaling, softcap=softcap
        )

    def backend(self, module: torch.nn.Module, device: torch.device) -> str:
        """`module_backend(module, device)`, resolved once per step for every module with the same setting."""
        return memoized_backend(self._backends, module, device)

    def kv_start(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[B] int64: the first visible key of each row, from a decode mask ([B, 1, 1, kv_len] bool, or None).

        None when the mask is not "hidden prefix, then every key visible" (left padding, sliding window): such a
        mask cannot be described by one start per row, and the caller falls back to gather + SDPA.
        """
        if attention_mask is None or self.ragged:
            # Every key visible from the first: zeros like the lengths, made once for the step's layers that read
            # these lengths (a pool over several devices has lengths on each).
            memo = self._kv_starts.get(id(self.seq_lens))
            if memo is None or memo[0] is not self.seq_lens:
                memo = self._kv_starts[id(self.seq_lens)] = (self.seq_lens, torch.zeros_like(self.seq_lens))
            return memo[1]
        memo = self._kv_starts.get(id(attention_mask))
        if memo is not None and memo[0] is attention_mask:
            return memo[1]
        kv_start = None
        if attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1:
            visible = attention_mask[:, 0, -1, :]  # [B, kv_len]
            first = visible.int().argmax(dim=-1)
            if bool((visible.sum(dim=-1) == visible.shape[-1] - first).all()):
                kv_start = (first + self.kv_offset - self.position_offset).to(INDEX_DTYPE)
        self._kv_starts[id(attention_mask)] = (attention_mask, kv_start)
        return kv_start

    def length_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[B, 1, 1, max_len] bool for a ragged `gather` (the module-level `length_mask`), memoized per window in
        `length_masks`, which plans of one step over the same rows may share."""
        return length_mask(self.seq_lens, sliding_window, self.length_masks)


def length_mask(
    seq_lens: torch.Tensor, sliding_window: int | None, memo: dict, *, max_len: int | None = None
) -> torch.Tensor:
    """[B, 1, 1, max_len] bool for rows of `seq_lens` ([B] int) keys padded to the longest: key j is visible to row b
    when j < seq_lens[b] (and, with a sliding window, j > seq_lens[b] - 1 - sliding_window). `memo`: window -> mask,
    filled on first use. `max_len`: the longest row, when the caller knows it on the host (no device read)."""
    mask = memo.get(sliding_window)
    if mask is not None:
        return mask
    max_len = int(seq_lens.max()) if max_len is None else max_len
    positions = torch.arange(max_len, device=seq_lens.device)[None, :]
    lengths = seq_lens[:, None]
    visible = positions < lengths
    if sliding_window is not None:
        visible &= positions > lengths - 1 - sliding_window
    mask = memo[sliding_window] = visible[:, None, None, :]
    return mask
