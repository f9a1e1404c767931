"""PrefillPlan: a step of several new tokens per row over cached ones (a prompt chunk, a prompt after a prefix-cache
hit, the second turn of a chat) reading a layer's K/V straight from the pool.

`PagedCache.update` returns it attached to an empty placeholder (plan.py) when the model runs the `hf_paged`
attention implementation and a Triton backend could run. `attend` runs the paged prefill kernel when the module's
backend resolves to "triton" and the model's mask is exactly what the kernel applies (causal, each row's left
padding, the sliding window), checked once per mask and step; otherwise it gathers the K/V once and runs SDPA (or
the torch attention for a softcap or sinks) with the model's mask, as a cache without a plan would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kernels import paged_prefill_attention
from .kernels.launch_config import INDEX_DTYPE
from .plan import memoized_backend
from .torch_attention import sdpa_or_torch_attention


@dataclass
class PrefillPlan:
    """What a multi-token step's attention needs to read one layer's K/V from the pool without gathering it (the
    step's rows all add `q_len` tokens, as in `generate()`)."""

    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] view of the head-major pool
    value_cache: torch.Tensor  # same, of V
    block_tables: torch.Tensor  # [B, num_table_blocks] int64
    seq_lens: torch.Tensor  # [B] int64: tokens per row from the first held block, the new ones included
    kv_offset: int  # absolute position of the first key the attention mask describes
    position_offset: int  # absolute position of block_tables[:, 0]'s first token (blocks released before it)
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the K/V an sdpa step would get: [B, H, kv_len, D]
    _kv_starts: dict = field(default_factory=dict)  # (id(mask), window) -> (mask, kv_start); shared by the layers
    _backends: dict = field(default_factory=dict)  # a module's backend setting -> resolved; shared likewise

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
        """query [B, heads, q_len, head_dim], the step's mask -> ([B, q_len, heads, head_dim], None)."""
        kv_start = None
        if self.kernel_runs(module, query.device, dropout, **kwargs):
            kv_start = self.kv_start(attention_mask, query.shape[2], sliding_window)
        if kv_start is None:
            key, value = self.gather()
            return sdpa_or_torch_attention(
                module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs
            )
        batch, num_heads, q_len, head_dim = query.shape
        cu_seqlens_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=query.device)
        out = paged_prefill_attention(
            query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim),
            self.key_cache,
            self.value_cache,
            self.block_tables,
            cu_seqlens_q,
            self.seq_lens,
            scale=scaling if scaling is not None else head_dim**-0.5,
            kv_start=kv_start,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=kwargs.get("s_aux"),
            backend="triton",
        )
        return out.view(batch, q_len, num_heads, head_dim), None

    def kernel_runs(self, module: torch.nn.Module, device: torch.device, dropout: float = 0.0, **kwargs) -> bool:
        """Whether the kernel can compute this call: the Triton backend for `module`, K and V of one shape, no dropout
        and no additive position bias (Inkling's relative logits, which the kernel does not add)."""
        if dropout or kwargs.get("position_bias") is not None or self.key_cache.shape != self.value_cache.shape:
            return False
        return memoized_backend(self._backends, module, device) == "triton"

    def kv_start(self, attention_mask: torch.Tensor | None, q_len: int, sliding_window: int | None):
        """[B] int64: each row's first key (counted from the first held block) when `attention_mask` ([B, 1, q_len,
        kv_len] bool, or None: causal, no padding) is exactly causal attention from that key on (and within the
        window); None for any other mask, which the caller then applies itself through SDPA. One device read per
        mask and window, shared by the step's layers."""
        batch = self.seq_lens.shape[0]
        if attention_mask is None:
            return torch.zeros(batch, dtype=INDEX_DTYPE, device=self.seq_lens.device)
        key = (id(attention_mask), sliding_window)
        memo = self._kv_starts.get(key)
        if memo is not None and memo[0] is attention_mask:
            return memo[1]
        kv_start = None
        if attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
            kv_len = attention_mask.shape[-1]
            keys = torch.arange(kv_len, device=attention_mask.device)  # relative to kv_offset
            queries = torch.arange(kv_len - q_len, kv_len, device=attention_mask.device)[:, None]
            # The first query row's first visible key: the row's padding ends there, or it is hidden by the window
            # (then no query sees the keys before it either).
            first = attention_mask[:, 0, 0, :].int().argmax(dim=-1)  # [B]
            expected = (keys[None, :] <= queries)[None] & (keys[None, None, :] >= first[:, None, None])
            if sliding_window is not None:
                expected &= (queries - keys[None, :] < sliding_window)[None]
            if attention_mask.shape[0] == batch and torch.equal(attention_mask[:, 0], expected):
                kv_start = (first + self.kv_offset - self.position_offset).to(INDEX_DTYPE)
        self._kv_starts[key] = (attention_mask, kv_start)
        return kv_start
