"""Attention in plain torch, for what SDPA does not do (a softcap, attention sinks): the "hf_paged" attention, its
plans and the Engine's packed step run it where they would run SDPA (`sdpa_or_torch_attention`)."""

from __future__ import annotations

import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_torch_mps_available, is_torch_npu_available, is_torch_xpu_available


def sdpa_or_torch_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention over whole K/V, or `torch_attention_forward` where the step asks for what SDPA
    has not (a softcap, attention sinks `s_aux`). Shapes as in `torch_attention_forward`."""
    sinks = kwargs.get("s_aux")
    if softcap is None and sinks is None:
        if attention_mask is None and decode_sdpa_applies(module, query, key.shape[-1], value.shape[-1], kwargs):
            return decode_sdpa(module, query, key, value, dropout, scaling), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    is_causal = getattr(module, "is_causal", True)
    extra = dict(softcap=softcap, sinks=sinks, is_causal=is_causal)
    return torch_attention_forward(query, key, value, attention_mask, dropout, scaling, **extra)


@functools.cache
def _wrapper_branches_on_host() -> bool:
    """Whether transformers' SDPA attention picks SDPA's arguments by the host's accelerator (XPU, MPS: by their torch
    version; NPU: masks converted) rather than by the shapes alone."""
    return is_torch_xpu_available() or is_torch_mps_available() or is_torch_npu_available()


def decode_sdpa_applies(module, query: torch.Tensor, head_dim: int, value_head_dim: int, kwargs) -> bool:
    """Whether `decode_sdpa` is the call transformers' `sdpa_attention_forward` makes for this query with no mask:
    one new token per row on CPU or CUDA, on a host whose accelerator it does not branch on, without a position bias,
    `output_attentions` or attention sinks (`kwargs`: the attention function's), and head sizes it passes to SDPA's
    GQA rather than packing the query's groups."""
    if query.shape[2] != 1 or query.device.type not in ("cpu", "cuda") or _wrapper_branches_on_host():
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("output_attentions") or kwargs.get("s_aux") is not None:
        return False
    return getattr(module, "num_key_value_groups", 1) == 1 or head_dim == value_head_dim <= 256


def decode_sdpa(module, query, key, value, dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """query [B, heads, 1, head_dim], key/value [B, kv_heads, kv_len, head_dim], every key visible -> [B, 1, heads,
    head_dim]: `torch.nn.functional.scaled_dot_product_attention` with the arguments `sdpa_attention_forward` passes
    it where `decode_sdpa_applies` (GQA through `enable_gqa`, `is_causal=False`), without that function's per-call
    checks, which a decode step pays once per layer. The same call, so the same output bit for bit."""
    groups = getattr(module, "num_key_value_groups", 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
    )
    return out.transpose(1, 2).contiguous()


def torch_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    is_causal: bool = False,
) -> tuple[torch.Tensor, None]:
    """Attention in plain torch, for what SDPA does not do: query [B, heads, q_len, head_dim], key/value
    [B, kv_heads, kv_len, head_dim] -> ([B, q_len, heads, head_dim], None).

    Args:
        attention_mask: a boolean (True = attend) or additive [B, 1, q_len, >= kv_len] mask. None: every key is
            visible, or with `is_causal` (and q_len > 1) query i sees the keys up to position kv_len - q_len + i,
            as SDPA's `is_causal` where transformers skips building the mask.
        softcap: logits capped at `softcap` (`softcap * tanh(logits / softcap)`).
        sinks: [heads] attention sinks (transformers' `s_aux`): one more logit per head joins the softmax, and its
            share of the weight is dropped (GPT-OSS; Granite's sigmoid form is the same).
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    q_len, kv_len = logits.shape[-2], logits.shape[-1]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :kv_len]
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + mask
    elif is_causal and q_len > 1:
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=logits.device).tril(kv_len - q_len)
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(logits.shape[0], -1, q_len, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None
