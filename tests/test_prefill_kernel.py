"""Paged prefill (extend) attention, Triton and PyTorch, against an independent per-query fp64 reference.

The new tokens of several sequences arrive packed (`cu_seqlens_q`), each sequence's last `q_len` tokens of
`seq_len`: a whole prompt (`q_len == seq_len`), a chunk over cached tokens that starts mid-block or on a block
boundary, one token (decode-like), or none. The pool is poisoned as in tests/test_kernels.py (NaN outside every
sequence's tokens, random table entries past its blocks), so a kernel that reads an invisible key fails.
Without a GPU the Triton kernel runs in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from test_kernels import CAN_RUN_TRITON, DEVICE, TOLERANCES, make_batch

import hf_paged.attention.kernels as kernels
from hf_paged.attention.kernels import launch_config, paged_prefill_attention


def prefill_impl(name: str):
    if name == "torch":
        return kernels.paged_prefill_attention_torch
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    return kernels.paged_prefill_attention_triton


IMPLS = pytest.mark.parametrize("impl", ["torch", "triton"])


def make_prefill(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    block_size: int = 16,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """(query [sum(q_lens), H, D], key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens) on DEVICE."""
    batch = make_batch(
        seq_lens,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    return query, batch.key_cache, batch.value_cache, batch.block_tables, cu_seqlens_q, batch.seq_lens


def reference_prefill(args, *, scale, kv_start=None, sliding_window=None, softcap=None, sinks=None):
    """Per query: concatenate its sequence's blocks, keep the keys it sees, fp64 softmax (plus the sink)."""
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens = (t.cpu() for t in args)
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        n, first, last = int(seq_lens[b]), int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if first == last:
            continue
        block_ids = block_tables[b, : math.ceil(n / block_size)].tolist()
        k = torch.cat([key_cache[i] for i in block_ids])[:n].double().repeat_interleave(group, dim=1)
        v = torch.cat([value_cache[i] for i in block_ids])[:n].double().repeat_interleave(group, dim=1)
        for row in range(first, last):
            position = n - (last - first) + (row - first)
            pos = torch.arange(n)
            visible = pos <= position
            if kv_start is not None:
                visible &= pos >= int(kv_start[b])
            if sliding_window is not None:
                visible &= position - pos < sliding_window
            logits = torch.einsum("hd,shd->hs", query[row].double(), k[visible]) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if sinks is not None:
                logits = torch.cat([logits, sinks.cpu().double()[:, None]], dim=1)
            elif not visible.any():
                continue  # no visible key: zeros
            probs = torch.softmax(logits, dim=-1)[:, : int(visible.sum())]
            out[row] = torch.einsum("hs,shd->hd", probs, v[visible])
    return out


def check_prefill(impl_name: str, args, **kwargs) -> torch.Tensor:
    query = args[0]
    scale = query.shape[-1] ** -0.5
    result = prefill_impl(impl_name)(*args, scale=scale, **kwargs)
    assert result.shape == query.shape and result.dtype == query.dtype
    expected = reference_prefill(args, scale=scale, **kwargs)
    torch.testing.assert_close(result.cpu().double(), expected, **TOLERANCES[query.dtype])
    return result


def option_tensors(options: dict) -> dict:
    """A test's options as the kernels take them: `kv_start` a list of ints -> an int32 tensor, `sinks=True` -> one
    sink logit per head of the 4 q heads."""
    kwargs = dict(options)
    if "kv_start" in kwargs:
        kwargs["kv_start"] = torch.tensor(kwargs["kv_start"], dtype=torch.int32, device=DEVICE)
    if kwargs.get("sinks"):
        kwargs["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    return kwargs


def launched_with(monkeypatch, change) -> None:
    """The Triton launcher takes `change(config, args)` of the `launch_config.prefill_config(*args)` it would take."""
    chooser = launch_config.prefill_config
    monkeypatch.setattr(launch_config, "prefill_config", lambda *args: change(chooser(*args), args))


# ------------------------------------------------------------------ lengths, chunks and block boundaries
@IMPLS
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([5], [5]),  # a whole prompt inside one block
        ([37, 64, 20], [6, 16, 20]),  # a chunk starting mid-block, one on a block boundary, a whole prompt
        ([100, 1, 33], [1, 1, 0]),  # decode-like rows and a sequence with no new token
        ([150], [70]),  # a chunk longer than a program's token tile, over a long cached prefix
    ],
    ids=["prompt", "chunks", "decode-and-empty", "long-chunk"],
)
def test_prefill_lengths_and_block_sizes(impl, block_size, seq_lens, q_lens):
    check_prefill(impl, make_prefill(seq_lens, q_lens, block_size=block_size))


@IMPLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 80), (4, 1, 128), (32, 1, 16)],
    ids=["MHA-64", "GQA-80", "MQA-128", "group32-16"],
)
def test_prefill_heads_head_dim_dtype(impl, num_q_heads, num_kv_heads, head_dim, dtype):
    args = make_prefill(
        [40, 23], [9, 23], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    check_prefill(impl, args)


@IMPLS
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(softcap=5.0, sinks=True),
        dict(kv_start=[64, 0]),  # the first kept key on a tile boundary: whole tiles after it
        dict(kv_start=[3, 70]),  # off a boundary: every tile masked
        dict(sliding_window=400),  # a window wider than every row's keys
        dict(sliding_window=81),  # wider than a tile: the first tiles of late rows fall out of it
        dict(sliding_window=64),
    ],
    ids=["plain", "softcap-sinks", "kv-start-on-tile", "kv-start-off-tile", "wide-window", "window-81", "window-64"],
)
def test_prefill_long_chunks_with_unmasked_tiles(impl, options, monkeypatch):
    """The kernel with `unmasked_tiles` (launch_config: on by default for 16-bit caches, set here whatever the
    default): the tiles every row of a program sees whole read without a mask, the diagonal ones with it, on chunks
    long enough for both over 62 and 63 cached keys (the first query's position just before a tile boundary), in
    bf16."""
    launched_with(monkeypatch, lambda config, args: dataclasses.replace(config, unmasked_tiles=True))
    args = make_prefill([132, 191], [70, 128], num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16)
    check_prefill(impl, args, **option_tensors(options))


@pytest.mark.parametrize(
    "options",
    [dict(), dict(sliding_window=81, softcap=30.0, sinks=True), dict(kv_start=[3, 70])],
    ids=["plain", "window-softcap-sinks", "kv-start-off-tile"],
)
@pytest.mark.parametrize("block_size", [16, 12], ids=["slot-rows", "general"])
def test_prefill_with_the_tiles_of_sm_90(options, block_size, monkeypatch):
    """The tiles 16-bit caches of head_dim 64 and 128 take on sm_90 (128 rows: 64 tokens x 2 q heads a program here,
    over one warpgroup, or two with a softcap or the general addressing of a block size not a power of two), run
    here in the interpreter: chunks past a program's tokens over 62 and 63 cached keys, in bf16."""
    wide = launch_config.prefill_config(64, 2, torch.bfloat16, 90)
    assert (wide.block_m, wide.block_q, wide.num_warps, wide.num_stages) == (128, 64, 4, 3)
    assert launch_config.ids_ahead(wide.num_stages)  # 3 stages keep the next tile's K/V in flight with the ids ahead
    capped = launch_config.prefill_config(64, 2, torch.bfloat16, 90, True)  # one warpgroup spills with the softcap
    assert (capped.block_m, capped.num_warps, capped.num_stages) == (128, 8, 3)
    general = launch_config.prefill_config(64, 2, torch.bfloat16, 90, False, False)  # and the general addressing
    assert (general.block_m, general.num_warps) == (128, 8)
    assert launch_config.prefill_config(128, 4, torch.float16, 90).block_m == 128
    assert launch_config.prefill_config(128, 4, torch.bfloat16, 80).block_m == 64  # sm_80: spills with 128 rows
    assert launch_config.prefill_config(128, 4, torch.bfloat16, 120).block_m == 64  # not measured past sm_90
    assert launch_config.prefill_config(256, 4, torch.bfloat16, 90).block_m == 64
    chooser = launch_config.prefill_config  # the chooser itself, before the patch

    def sm_90(args):  # its choice on sm_90 for the arguments of this launch
        return chooser(*args[:3], 90, *args[4:])

    tiles = ("block_m", "block_q", "block_n", "num_warps", "num_stages", "unmasked_tiles")
    launched_with(
        monkeypatch,
        lambda config, args: dataclasses.replace(config, **{name: getattr(sm_90(args), name) for name in tiles}),
    )
    args = make_prefill(
        [132, 191], [70, 128], block_size=block_size, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    check_prefill("triton", args, **option_tensors(options))


@IMPLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "options",
    [
        dict(sliding_window=7),
        dict(sliding_window=1),
        dict(kv_start=[3, 0, 20]),
        dict(softcap=5.0),
        dict(sinks=True),
        dict(sliding_window=9, kv_start=[2, 5, 0], softcap=30.0, sinks=True),
    ],
    ids=["window", "window-1", "kv-start", "softcap", "sinks", "all"],
)
def test_prefill_masking(impl, dtype, options):
    args = make_prefill([37, 30, 12], [12, 30, 4], num_q_heads=4, num_kv_heads=2, dtype=dtype)
    check_prefill(impl, args, **option_tensors(options))


@IMPLS
@pytest.mark.parametrize("options", [dict(), dict(softcap=5.0)], ids=["plain", "softcap"])
def test_prefill_with_a_negative_scale(impl, options):
    """The Triton kernel scales each row's running max of the raw logits, which only a positive scale keeps in order:
    a negative one still gives the reference's attention. Logits hundreds apart (in log2 units) would overflow the
    exponent against a wrong max: bf16 at head_dim 64, chunks over cached keys (tiles read without a mask, where
    the running max is taken that way)."""
    args = make_prefill([132, 191], [70, 128], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    result = prefill_impl(impl)(*args, scale=-8.0, **options)
    expected = reference_prefill(args, scale=-8.0, **options)
    torch.testing.assert_close(result.cpu().double(), expected, **TOLERANCES[torch.bfloat16])


@IMPLS
def test_prefill_query_with_no_visible_key_gives_zeros(impl):
    args = make_prefill([6], [3])
    kv_start = torch.tensor([6], dtype=torch.int32, device=DEVICE)  # every key is padding
    result = prefill_impl(impl)(*args, scale=1.0, kv_start=kv_start)
    assert torch.equal(result.cpu(), torch.zeros_like(result.cpu()))


@IMPLS
def test_prefill_strided_query_and_out(impl):
    """A query as attention hands it over ([1, heads, tokens, D] transposed) and a preallocated output view."""
    query, *rest = make_prefill([20, 9], [7, 9], head_dim=32)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # same values, head-major strides
    assert not strided.is_contiguous()
    out = torch.full((query.shape[1], query.shape[0], 32), float("nan"), device=DEVICE).transpose(0, 1)
    result = prefill_impl(impl)(strided, *rest, scale=32**-0.5, out=out)
    assert result is out
    expected = reference_prefill((query, *rest), scale=32**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[torch.float32])


def test_prefill_equals_decode_for_one_token_per_sequence():
    """One new token per sequence is a decode step: the prefill and decode references agree."""
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens = make_prefill([30, 17, 64], [1, 1, 1])
    prefill = paged_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=0.2, sliding_window=9
    )
    decode = kernels.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale=0.2, sliding_window=9
    )
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


def test_prefill_rejects_inputs_that_do_not_fit():
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens = make_prefill([10, 5], [2, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens_q \[B \+ 1\]"):
        paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q[:2], seq_lens, scale=1.0)
    with pytest.raises(ValueError, match=r"sinks must be \[num_q_heads\] = \[4\]"):
        paged_prefill_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=1.0, sinks=torch.zeros(2)
        )
    with pytest.raises(ValueError, match="query head_dim 16 != cache head_dim 32"):
        paged_prefill_attention(query[..., :16], key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=1)


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs Triton (a GPU or its interpreter)")
@pytest.mark.parametrize("ids_ahead", [True, False], ids=["ids-ahead", "ids-in-tile"])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_prefill_reads_block_ids_ahead_or_in_the_tile_alike(ids_ahead, block_size, monkeypatch):
    """The whole tiles' block ids read one tile ahead (`launch_config.ids_ahead`, with 3 pipeline stages) or within
    the tile: the same keys, the same output bit for bit, right against the reference, on chunks long enough for
    several whole tiles over 62 and 63 cached keys, in bf16."""
    launched_with(monkeypatch, lambda config, args: dataclasses.replace(config, unmasked_tiles=True))
    args = make_prefill(
        [132, 191], [70, 128], block_size=block_size, num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16
    )
    monkeypatch.setattr(launch_config, "ids_ahead", lambda num_stages: not ids_ahead)
    other = kernels.paged_prefill_attention_triton(*args, scale=args[0].shape[-1] ** -0.5)
    monkeypatch.setattr(launch_config, "ids_ahead", lambda num_stages: ids_ahead)
    assert torch.equal(check_prefill("triton", args), other)


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs Triton (a GPU or its interpreter)")
@pytest.mark.parametrize(
    "block_size, storage", [(16, "head-major"), (12, "contiguous"), (16, "block-heads"), (128, "contiguous")]
)
def test_prefill_addresses_rows_by_slot_or_by_block_alike(block_size, storage, monkeypatch):
    """As the decode kernel: a power-of-two block size over consecutive rows reads each row at its slot, blocks of 12
    or stored head by head at block id times block stride plus offset: both right against the reference over whole
    tiles and masked ones (a prompt, a chunk mid-block after a long prefix, a window), the slot path's output the
    general path's bit for bit."""
    from test_kernels import as_strided_cache

    from hf_paged.attention.kernels import triton_prefill

    query, key_cache, value_cache, *rest = make_prefill(
        [140, 37, 200], [140, 6, 40], block_size=block_size, head_dim=64, dtype=torch.bfloat16
    )
    assert launch_config.prefill_config(64, 2, torch.bfloat16, None).unmasked_tiles  # both loops run
    args = (query, as_strided_cache(key_cache, storage), as_strided_cache(value_cache, storage), *rest)
    slots = triton_prefill.slot_rows(args[1].shape, args[1].stride(), args[2].stride())
    assert slots == (block_size != 12 and storage != "block-heads")
    for options in (dict(), dict(sliding_window=40)):
        result = check_prefill("triton", args, **options)
        if slots:
            with monkeypatch.context() as patch:
                patch.setattr(triton_prefill, "slot_rows", lambda *a: False)
                other = kernels.paged_prefill_attention_triton(*args, scale=query.shape[-1] ** -0.5, **options)
            assert torch.equal(other, result)


def test_prefill_grid_order_changes_no_output(monkeypatch):
    """The grid's two orders (`PrefillConfig.heavy_first`, the default: the query tiles in reverse, the kv heads of
    one tile neighbours; or ascending) map the same programs: every output bit for bit the same, and right, over
    ragged sequences (one with no new token, spare tiles of the grid's bound) and a GQA group of 20 q heads, two
    tiles of q heads a kv head."""
    assert launch_config.prefill_config(64, 4, torch.bfloat16, 90).heavy_first
    args = make_prefill([37, 9, 30, 64], [12, 0, 30, 33], num_q_heads=40, num_kv_heads=2, head_dim=16)
    assert launch_config.prefill_config(16, 20, torch.float32, None).heavy_first
    heavy_first = check_prefill("triton", args)
    launched_with(monkeypatch, lambda config, args: dataclasses.replace(config, heavy_first=False))
    ascending = kernels.paged_prefill_attention_triton(*args, scale=args[0].shape[-1] ** -0.5)
    assert torch.equal(ascending, heavy_first)


def test_unmasked_tiles_are_the_default_for_16_bit_caches_and_refused_for_fp32_ones(monkeypatch):
    """16-bit caches of head_dim 64 and 128 (the sizes measured) read the whole tiles without a mask by default; an fp32
    cache, whose variant would spill with the second loop, is refused it by name."""
    for dtype, head_dim, capability in itertools.product((torch.float16, torch.bfloat16), (64, 128), (80, 90, None)):
        assert launch_config.prefill_config(head_dim, 4, dtype, capability).unmasked_tiles
    assert not any(launch_config.prefill_config(d, 4, torch.bfloat16, 90).unmasked_tiles for d in (16, 32, 256))
    assert not launch_config.prefill_config(64, 4, torch.float32, 90).unmasked_tiles
    launched_with(monkeypatch, lambda config, args: dataclasses.replace(config, unmasked_tiles=True))
    args = make_prefill([12, 5], [4, 5], dtype=torch.float32)
    with pytest.raises(ValueError, match="unmasked_tiles is for 16-bit caches .* got a float32 cache"):
        kernels.paged_prefill_attention_triton(*args, scale=1.0)
