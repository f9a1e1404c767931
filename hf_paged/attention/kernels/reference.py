"""PyTorch references for the paged kernels: the CPU fallback, and what the Triton kernels are tested against.

Same signatures as the Triton versions in `triton_decode.py` / `triton_store.py`. Correctness over speed: the
decode reference gathers every sequence's K/V into a contiguous `[B, S, H, D]` tensor and does fp32 math.

Pool layout (per layer, vLLM "NHD"): `key_cache`, `value_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token `pos` of sequence `b` lives in block `block_tables[b, pos // block_size]` at offset `pos % block_size`, i.e.
at slot `block_id * block_size + offset` of the flattened `[num_blocks * block_size, num_kv_heads, head_dim]` view.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len_max: int) -> torch.Tensor:
    """Copy positions `0 .. seq_len_max-1` of every sequence out of the paged pool into a contiguous tensor.

    Args:
        cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, a `key_cache` or `value_cache`.
        block_tables: `[B, max_blocks_per_seq]` int32/int64 block ids; needs `max_blocks_per_seq * block_size >=
            seq_len_max`.
        seq_len_max: number of positions to gather.

    Returns:
        `[B, num_kv_heads, seq_len_max, head_dim]` in the cache's dtype. Positions at or past a sequence's own
        length hold whatever its block table points at: mask them.
    """
    block_size = cache.shape[1]
    assert block_tables.shape[1] * block_size >= seq_len_max, "block table too short for seq_len_max"
    pos = torch.arange(seq_len_max, device=cache.device)
    block_ids = block_tables[:, pos // block_size].long()  # [B, S]
    # k: [B, S, H, D] -> [B, H, S, D]
    return cache[block_ids, pos % block_size].transpose(1, 2)


def check_decode_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Raise ValueError, with the shapes, when decode-attention inputs do not fit together (shared by both backends)."""
    _check_heads(query, key_cache, value_cache, "B")
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(seq_lens.shape) != (batch,):
        raise ValueError(
            f"batch {batch} needs block_tables [{batch}, max_blocks_per_seq] and seq_lens [{batch}], got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )


def _check_heads(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, rows: str) -> None:
    """Raise ValueError unless query `[rows, num_q_heads, head_dim]` fits caches `[num_blocks, block_size,
    num_kv_heads, head_dim]` of one shape (`num_q_heads` a multiple of `num_kv_heads`)."""
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"query must be [{rows}, num_q_heads, head_dim] and key_cache [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(query.shape)} and {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def decode_key_mask(
    seq_lens: torch.Tensor, seq_len_max: int, kv_start: torch.Tensor | None, sliding_window: int | None
) -> torch.Tensor:
    """`[B, seq_len_max]` bool: which cached positions the new token (at position `seq_len - 1`) attends to."""
    pos = torch.arange(seq_len_max, device=seq_lens.device)[None, :]
    seq_lens = seq_lens.long()[:, None]
    mask = pos < seq_lens
    if kv_start is not None:
        mask &= pos >= kv_start.long()[:, None]
    if sliding_window is not None:
        # transformers convention: query position p sees key position k iff p - k < sliding_window.
        mask &= pos > seq_lens - 1 - sliding_window
    return mask


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (pure PyTorch, fp32 math).

    Args:
        query: `[B, num_q_heads, head_dim]`; the token's own K/V must already be in the cache.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`; `num_q_heads` is a multiple of
            `num_kv_heads` (q head `h` reads kv head `h // (num_q_heads // num_kv_heads)`).
        block_tables: `[B, max_blocks_per_seq]` int32 or int64 block ids (the library's callers pass int64:
            `launch_config.INDEX_DTYPE`); entries past a sequence's length are ignored.
        seq_lens: `[B]` int32 or int64, tokens in the cache per sequence (>= 1), the new one included.
        scale: logit scale, usually `head_dim ** -0.5`.
        kv_start: `[B]` int32 or int64, optional; positions `< kv_start[b]` are masked out (left padding).
        sliding_window: optional; attend only to the last `sliding_window` positions (the new one included).
        softcap: optional; logits become `softcap * tanh(logits / softcap)` after scaling (Gemma 2).
        out: optional `[B, num_q_heads, head_dim]` tensor to write into.

    Returns:
        `[B, num_q_heads, head_dim]` in `query.dtype` (`out` if given). A sequence with no visible key gets zeros.
    """
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    seq_len_max = int(seq_lens.max())

    # k, v: [B, H_kv, S, D]; q: [B, H_kv, G, D]
    k = gather_kv(key_cache, block_tables, seq_len_max).float()
    v = gather_kv(value_cache, block_tables, seq_len_max).float()
    q = query.float().reshape(batch, num_kv_heads, group, head_dim)

    logits = torch.einsum("bhgd,bhsd->bhgs", q, k) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask = decode_key_mask(seq_lens, seq_len_max, kv_start, sliding_window)  # [B, S]
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    # Slots past a sequence's end hold stale data (possibly inf/NaN); 0 * NaN would leak through the PV product.
    v = v.masked_fill(~mask[:, None, :, None], 0.0)
    # NOTE: a row with every key masked gives NaN from softmax; zero it so callers see a defined value.
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    result = torch.einsum("bhgs,bhsd->bhgd", probs, v).reshape(batch, num_q_heads, head_dim)

    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into the paged pool in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, cast to the cache dtype.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous over the first two dims
            (so the flattened slot view aliases the storage).
        slot_mapping: `[num_tokens]` int64, `block_id * block_size + offset` for each token; every slot must be valid
            and distinct (no sentinel for "skip this token").
    """
    num_kv_heads, head_dim = key_cache.shape[2:]
    # .view, not .reshape: a copy would make the in-place write silently vanish.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def check_prefill_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """Raise ValueError, with the shapes, when prefill-attention inputs do not fit together (shared by both
    backends; nothing here reads a device value)."""
    _check_heads(query, key_cache, value_cache, "num_tokens")
    num_q_heads = query.shape[1]
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(cu_seqlens_q.shape) != (batch + 1,):
        raise ValueError(
            "seq_lens [B] needs block_tables [B, max_blocks_per_seq] and cu_seqlens_q [B + 1], got seq_lens "
            f"{tuple(seq_lens.shape)}, block_tables {tuple(block_tables.shape)}, "
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}"
        )
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads] = [{num_q_heads}], got {tuple(sinks.shape)}")


def paged_prefill_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens of several sequences (packed, varlen) over their paged K/V (pure PyTorch,
    fp32 math): the prefill or extend step of a chunked prompt, a prompt after a prefix-cache hit, or several new
    tokens per sequence.

    Args:
        query: `[num_tokens, num_q_heads, head_dim]`: sequence `b`'s new tokens are rows
            `cu_seqlens_q[b] : cu_seqlens_q[b + 1]`, in order. Their K/V must already be in the cache.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` (q head `h` reads kv head
            `h // (num_q_heads // num_kv_heads)`).
        block_tables: `[B, max_blocks_per_seq]` int32 or int64 block ids (int64 from the library's callers);
            entries past a sequence's length are ignored.
        cu_seqlens_q: `[B + 1]` int32, the cumulative new-token counts (`cu_seqlens_q[0] == 0`).
        seq_lens: `[B]` int32 or int64, tokens in the cache per sequence, its new ones included: new token `i` of
            sequence `b` is at position `seq_lens[b] - q_len_b + i` and sees the keys at positions up to its own.
        scale: logit scale, usually `head_dim ** -0.5`.
        kv_start: `[B]` int32 or int64, optional; positions `< kv_start[b]` are masked out (left padding).
        sliding_window: optional; a query at position `p` sees keys `k` with `p - k < sliding_window`.
        softcap: optional; logits become `softcap * tanh(logits / softcap)` after scaling (Gemma 2).
        sinks: `[num_q_heads]` float, optional; one more logit per head in the softmax denominator that attends to
            nothing (gpt-oss's attention sinks).
        out: optional `[num_tokens, num_q_heads, head_dim]` tensor to write into.

    Returns:
        `[num_tokens, num_q_heads, head_dim]` in `query.dtype` (`out` if given). A query with no visible key gets
        zeros.
    """
    check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, sinks)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    result = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    bounds = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        first, last = bounds[b], bounds[b + 1]
        q_len = last - first
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[b : b + 1], seq_len)[0].float()  # [H_kv, S, D]
        v = gather_kv(value_cache, block_tables[b : b + 1], seq_len)[0].float()
        q = query[first:last].float().transpose(0, 1).reshape(num_kv_heads, group, q_len, head_dim)
        logits = torch.einsum("hgqd,hsd->hgqs", q, k) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = k_pos <= q_pos  # [q_len, S]
        if kv_start is not None:
            mask &= k_pos >= int(kv_start[b])
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.float().reshape(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        probs = probs.nan_to_num(0.0)  # a query with every key masked: zeros
        o = torch.einsum("hgqs,hsd->hgqd", probs, v.masked_fill(~mask.any(0)[None, :, None], 0.0))
        result[first:last] = o.reshape(num_q_heads, q_len, head_dim).transpose(0, 1)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def token_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, kv_heads, q_len, head_dim] K and V states -> [W * q_len, kv_heads, head_dim] rows, row by row, as the store
    kernel takes them. It takes any strides, so one token a row (decode) or one row (the packed step's, a batch-1
    prefill) is a view; only several rows of several tokens are copied."""
    if key_states.shape[2] == 1:
        return key_states[:, :, 0], value_states[:, :, 0]
    if key_states.shape[0] == 1:
        return key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
    return tuple(
        states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3]) for states in (key_states, value_states)
    )
