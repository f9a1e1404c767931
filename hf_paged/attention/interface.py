"""The `hf_paged` attention implementation: decode reads K/V straight from the pool.

Registered with transformers under `PAGED_ATTENTION` ("hf_paged"; "paged" already means transformers' own
continuous batching), together with a mask function: without one, a custom attention name gets
`attention_mask=None` and a left-padded batch is silently wrong.

How it meets the cache: when the model runs this implementation, `PagedCache.update` on a decode step (one new
token per row) stores the token and returns an empty `[B, kv_heads, 0, head_dim]` tensor carrying a `DecodePlan`
instead of gathering the whole context (plan.py). The plan holds the block tables of the layer's layer group (a
Gemma-style pool keeps one per group; a sliding group's tables start at its first unreleased block,
`position_offset`), so the same code serves every group. This function finds the plan on `key` and calls its
`attend`. Prefill steps, and any other cache (DynamicCache, StaticCache), get plain SDPA: with no plan on `key`,
this is exactly `sdpa_attention_forward`.

The backend comes from `enable(model, backend=...)`, else `HF_PAGED_ATTENTION_BACKEND`, else "auto".
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels.dispatch import resolve_backend
from .plan import BACKEND_ATTR, PAGED_ATTENTION, plan_of


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, heads, q_len, head_dim], key/value [B, kv_heads, kv_len, head_dim] or a placeholder carrying a plan
    -> ([B, q_len, heads, head_dim], None), like every transformers attention function."""
    plan = plan_of(key)
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )
    return plan.attend(
        module,
        query,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        **kwargs,
    )


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent; done on `import hf_paged`)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    # The decode plan describes the same key range as the sdpa mask, so the sdpa mask is the right one.
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


def enable(model, backend: str | None = None):
    """Switch a loaded model to the paged attention implementation; returns the model.

    Args:
        model: a transformers `PreTrainedModel`.
        backend (`str`, *optional*): "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch". Default: the
            environment variable `HF_PAGED_ATTENTION_BACKEND`, else "auto".
    """
    if backend is not None:
        resolve_backend(backend, model.device)  # validate now: a bad value names the allowed ones
    register()
    model.set_attn_implementation(PAGED_ATTENTION)
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            setattr(module, BACKEND_ATTR, backend)
    return model
