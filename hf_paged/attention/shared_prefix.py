"""Decode attention over a prefix that every row holds in the same blocks, then each row's own tail.

`num_return_sequences=n` and `num_beams=n` expand one prompt into n rows that `PagedCache` stores once (the rows
share the prompt's blocks). Handing SDPA `[B, kv_heads, kv_len, head_dim]` K/V would copy that prompt n times into a
workspace of one layer of all rows; here the prefix is read once, `[1, kv_heads, prefix_len, head_dim]` (a view of
the pool when its blocks are consecutive), against every row's query at once, and only the rows' own tails are
gathered. The logits of both parts go through one softmax, as eager attention computes them (model dtype logits,
float32 softmax): identical tokens to SDPA on the models tested, logits equal to float rounding.
"""

from __future__ import annotations

import torch


def shared_prefix_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    tail_keys: torch.Tensor | None,
    tail_values: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over a shared prefix and per-row tails.

    Args:
        query: `[B, heads, 1, head_dim]`.
        prefix_keys, prefix_values: `[1, kv_heads, prefix_len, head_dim]` (values may have their own head_dim):
            keys every row sees first.
        tail_keys, tail_values: `[B, kv_heads, tail_len, head_dim]`, each row's keys after the prefix, or None.
        attention_mask: None (every key visible), or a boolean (True = attend) or additive
            `[B, 1, 1, >= prefix_len + tail_len]` mask over the prefix's then the tail's keys.
        scaling: the logits' scale (default `head_dim ** -0.5`); softcap: logits capped at `softcap`.

    Returns:
        `[B, 1, heads, v_head_dim]`, as transformers' attention functions return it.
    """
    batch, num_heads, q_len, head_dim = query.shape
    if q_len != 1:
        raise ValueError(f"shared_prefix_attention takes one query token per row, got q_len={q_len}")
    num_kv_heads, prefix_len = prefix_keys.shape[1], prefix_keys.shape[2]
    groups = num_heads // num_kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    # [B, kv_heads, groups, D]: the query heads that read one kv head (repeat_kv's order)
    grouped = query.reshape(batch, num_kv_heads, groups, head_dim)
    # Every row's queries of one kv head against the prefix in one product: [kv_heads, B * groups, prefix_len].
    stacked = grouped.transpose(0, 1).reshape(num_kv_heads, batch * groups, head_dim)
    logits = torch.matmul(stacked, prefix_keys[0].transpose(1, 2))
    logits = logits.view(num_kv_heads, batch, groups, prefix_len).transpose(0, 1)  # [B, kv_heads, groups, P]
    # Tails gathered head-major (each kv head's rows together underneath, as the Engine's decode runner gathers
    # them) are multiplied in that order: batched over (kv_heads, B) they need no copy before the product.
    head_major = tail_keys is not None and tail_keys.stride(0) < tail_keys.stride(1)
    if tail_keys is not None:
        logits = torch.cat([logits, _tail_product(grouped, tail_keys.transpose(2, 3), head_major)], dim=-1)
    logits = logits * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : logits.shape[-1]]  # [B, 1, 1, kv_len]: the same for every head
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + mask
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    prefix_weights = weights[..., :prefix_len].transpose(0, 1).reshape(num_kv_heads, batch * groups, prefix_len)
    out = torch.matmul(prefix_weights, prefix_values[0])  # [kv_heads, B * groups, v_head_dim]
    out = out.view(num_kv_heads, batch, groups, -1).transpose(0, 1)  # [B, kv_heads, groups, v_head_dim]
    if tail_keys is not None:
        out = out + _tail_product(weights[..., prefix_len:], tail_values, head_major)
    return out.reshape(batch, 1, num_heads, -1)


def _tail_product(left: torch.Tensor, right: torch.Tensor, head_major: bool) -> torch.Tensor:
    """`left @ right` of `[B, kv_heads, ...]` operands, batched over (kv_heads, B) when the tails are head-major."""
    if head_major:
        return torch.matmul(left.transpose(0, 1), right.transpose(0, 1)).transpose(0, 1)
    return torch.matmul(left, right)


def per_row_mask(attention_mask: torch.Tensor | None) -> bool:
    """Whether `attention_mask` is one `[B, 1, 1, kv_len]` mask shared by every head (or None), which
    `shared_prefix_attention` takes; other masks (per head, several query positions) go to the gather path."""
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
