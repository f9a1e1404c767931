"""Paged kernels (Triton and PyTorch) against an independent gathered-contiguous fp64 reference.

Without a GPU the Triton kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by conftest.py). The
parameter sets are targeted slices, not a full cartesian product, so the interpreter stays fast.

Every pool is poisoned: blocks no sequence owns and slots past a sequence's end hold NaN, and block-table entries
past a sequence's length point at random blocks. A kernel that reads (and fails to mask) anything outside the
visible range produces NaN and fails `assert_close`.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import pytest
import torch

import hf_paged.attention.kernels as kernels
from hf_paged.attention.kernels import gather_kv, paged_decode_attention, store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
CAN_RUN_TRITON = HAS_TRITON and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def decode_impl(name: str):
    """The implementation under test: "torch" (reference.py) or "triton" (skipped where it cannot run)."""
    if name == "torch":
        return kernels.paged_decode_attention_torch
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    return kernels.paged_decode_attention_triton


@dataclass
class PagedBatch:
    query: torch.Tensor  # [B, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32

    @property
    def args(self):
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens


def make_batch(
    seq_lens: list[int],
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A poisoned pool with random, scattered block tables (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)

    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1  # one extra column: never inside any sequence
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    first = 0
    for b, (n, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_ids = perm[first : first + num_seq_blocks]
        first += num_seq_blocks
        block_tables[b, :num_seq_blocks] = block_ids.int()
        for pos in range(n):  # only positions 0..n-1 get finite data
            block_id, offset = block_ids[pos // block_size], pos % block_size
            key_cache[block_id, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            value_cache[block_id, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query.to(DEVICE),
        key_cache.to(DEVICE),
        value_cache.to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def reference_decode(batch: PagedBatch, *, scale, kv_start=None, sliding_window=None, softcap=None) -> torch.Tensor:
    """Independent reference: per sequence, concatenate its blocks, keep the visible positions, fp64 softmax."""
    query, key_cache, value_cache, block_tables, seq_lens = (t.cpu() for t in batch.args)
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        block_ids = block_tables[b, : math.ceil(n / block_size)].tolist()
        # k, v: [n, num_kv_heads, head_dim] -> [n', num_q_heads, head_dim] (GQA: each kv head serves a group)
        k = torch.cat([key_cache[i] for i in block_ids])[:n].double()
        v = torch.cat([value_cache[i] for i in block_ids])[:n].double()
        pos = torch.arange(n)
        visible = pos >= (int(kv_start[b]) if kv_start is not None else 0)
        if sliding_window is not None:
            visible &= (n - 1) - pos < sliding_window
        if not visible.any():
            continue  # no visible key: zeros
        group = num_q_heads // num_kv_heads
        k = k[visible].repeat_interleave(group, dim=1)
        v = v[visible].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,shd->hs", query[b].double(), k) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(logits, dim=-1), v)
    return out


def check_decode(impl_name: str, batch: PagedBatch, **kwargs) -> None:
    scale = batch.query.shape[-1] ** -0.5
    result = decode_impl(impl_name)(*batch.args, scale=scale, **kwargs)
    assert result.shape == batch.query.shape and result.dtype == batch.query.dtype
    expected = reference_decode(batch, scale=scale, **{k: v for k, v in kwargs.items() if k != "num_splits"})
    torch.testing.assert_close(result.cpu().double(), expected, **TOLERANCES[batch.query.dtype])


IMPLS = pytest.mark.parametrize("impl", ["torch", "triton"])


# ------------------------------------------------------------------ lengths x block size
@IMPLS
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param(lambda bs: [1], id="one-token"),
        pytest.param(lambda bs: [3 * bs + 5], id="long"),
        pytest.param(lambda bs: [bs, 1, 2 * bs], id="block-aligned"),
        pytest.param(lambda bs: [bs + 1, 3 * bs + 5, 7], id="block-plus-one"),
    ],
)
def test_decode_lengths_and_block_sizes(impl, block_size, lengths):
    batch = make_batch(
        lengths(block_size), block_size=block_size, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    check_decode(impl, batch)


# ------------------------------------------------------------------ heads x head_dim x dtype
@IMPLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_decode_heads_head_dim_dtype(impl, num_q_heads, num_kv_heads, head_dim, dtype):
    batch = make_batch(
        [1, 17, 53],
        block_size=16,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
    )
    check_decode(impl, batch)


@IMPLS
def test_decode_head_dim_256_bf16(impl):
    batch = make_batch([40, 9], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    check_decode(impl, batch)


@pytest.mark.parametrize("impl,num_splits", [("torch", None), ("triton", None), ("triton", 3)])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,block_size",
    [
        pytest.param(40, 2, 40, 12, id="group-20-head_dim-40-block-12"),  # two programs per kv head, odd sizes
        pytest.param(34, 2, 8, 5, id="group-17-head_dim-8-block-5"),  # a 16-wide tile for an 8-wide head
    ],
)
def test_decode_large_groups_and_odd_sizes(impl, num_q_heads, num_kv_heads, head_dim, block_size, num_splits):
    """GQA groups past 16 q heads (more than one program per kv head), head dims that are not a power of two or
    under 16, and block sizes that are not powers of two: all runtime arguments of the kernel."""
    batch = make_batch(
        [1, 23, 61],
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float16,
        seed=block_size,
    )
    check_decode(impl, batch, **({"num_splits": num_splits} if num_splits else {}))


# ------------------------------------------------------------------ masking: kv_start, sliding window, softcap
@IMPLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(kv_start=[0, 5, 40]), id="kv_start"),
        pytest.param(dict(sliding_window=1), id="window-1"),
        pytest.param(dict(sliding_window=20), id="window-20"),
        pytest.param(dict(sliding_window=4096), id="window-longer-than-seq"),
        pytest.param(dict(softcap=5.0), id="softcap"),
        pytest.param(dict(kv_start=[3, 2, 30], sliding_window=24, softcap=30.0), id="all"),
    ],
)
def test_decode_masking(impl, dtype, options):
    batch = make_batch([9, 33, 70], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=1)
    if "kv_start" in options:
        options = {**options, "kv_start": torch.tensor(options["kv_start"], dtype=torch.int32, device=DEVICE)}
    check_decode(impl, batch, **options)


def test_decode_no_visible_key_gives_zeros():
    """kv_start == seq_len leaves nothing to attend to: a defined zero output, not NaN."""
    batch = make_batch([5, 20], block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    kv_start = torch.tensor([5, 3], dtype=torch.int32, device=DEVICE)
    for impl in ("torch", "triton"):
        check_decode(impl, batch, kv_start=kv_start)
        result = decode_impl(impl)(*batch.args, scale=0.125, kv_start=kv_start)
        assert torch.equal(result[0].cpu(), torch.zeros(4, 64))


def test_decode_with_an_empty_block_table_gives_zeros():
    """No sequence holds a key yet (block tables of width 0, lengths 0): zeros from both implementations (the
    Triton launcher used to divide by the zero context length)."""
    query = torch.randn(2, 4, 64, device=DEVICE)
    cache = torch.randn(3, 16, 2, 64, device=DEVICE)
    tables = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    lengths = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for impl in ("torch", "triton"):
        result = decode_impl(impl)(query, cache, cache, tables, lengths, scale=0.125)
        assert torch.equal(result.cpu(), torch.zeros(2, 4, 64))


# ------------------------------------------------------------------ Triton split-K
@pytest.mark.parametrize("block_n, chunk", [(128, 512), (64, 256), (32, 128), (16, 128)])
def test_split_count_fills_the_gpu_with_chunks_of_four_tiles(monkeypatch, block_n, chunk):
    """Whatever the batch and context, the split count is one of SPLIT_COUNTS, 1 once the grid fills the GPU, and
    every chunk keeps 4 tiles of the launch's (and >= 128 tokens)."""
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    from hf_paged.attention.kernels import triton_decode

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)  # an H100/H200
    assert triton_decode.min_split_tokens(block_n) == chunk
    seen = set()
    for batch in (1, 2, 3, 5, 8, 33, 64):
        for max_context in (16, 127, 511, 512, 1000, 1500, 3000, 8192, 40_000, 200_000):
            num_splits = triton_decode.choose_num_splits(batch, 4, max_context, torch.device("cuda"), block_n)
            assert num_splits in triton_decode.SPLIT_COUNTS
            assert num_splits == 1 or max_context // num_splits >= chunk
            if batch * 4 >= 132:
                assert num_splits == 1
            seen.add(num_splits)
    assert seen == set(triton_decode.SPLIT_COUNTS)
    # one row of 512 tokens: one split of 4 tiles of 128, four of 4 tiles of 32
    assert triton_decode.choose_num_splits(1, 8, 512, torch.device("cuda"), block_n) == 512 // chunk


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param(dict(sliding_window=40), id="window"),  # early splits see no key at all
        pytest.param(dict(kv_start=[0, 150, 4], softcap=10.0), id="kv_start-softcap"),
    ],
)
def test_decode_split_k(num_splits, options):
    batch = make_batch([1, 200, 130], block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=80, dtype=torch.float16)
    if "kv_start" in options:
        options = {**options, "kv_start": torch.tensor(options["kv_start"], dtype=torch.int32, device=DEVICE)}
    check_decode("triton", batch, num_splits=num_splits, **options)


def widened(batch: PagedBatch, width: int, seed: int = 1) -> PagedBatch:
    """`batch` with block tables `width` columns wide, the new columns random blocks past every row's end (what CUDA
    graphs' tables and a `max_cache_len` cache's are: as wide as the rows may grow)."""
    tables = batch.block_tables.cpu()
    extra = torch.randint(
        0,
        batch.key_cache.shape[0],
        (tables.shape[0], width - tables.shape[1]),
        generator=torch.Generator().manual_seed(seed),
    )
    batch.block_tables = torch.cat([tables, extra.to(tables.dtype)], dim=1).to(DEVICE)
    return batch


def splits_with_keys(launch) -> list[int]:
    """Per row, how many of a split launch's chunks held a visible key (finite partial log-sum-exp)."""
    return torch.isfinite(launch.partial_lse.cpu()).all(dim=1).sum(dim=1).tolist()


@pytest.mark.parametrize(
    "options, expected",
    [
        # fp32 at head_dim 64: tiles of 32 tokens. 1000 keys in 4 runs of 256; 300 in runs of 96; 40 fill 2 tiles.
        pytest.param({}, [4, 4, 2], id="plain"),
        # a window of 200 over 1000 keys: 4 runs of 64 from tile 800; the 300-key row's window starts at 100 (tile 96)
        pytest.param(dict(sliding_window=200), [4, 4, 2], id="window"),
        # first keys 900, 0 and 39: the chunks cut [896, 1000), [0, 300) and the one tile holding 39
        pytest.param(dict(kv_start=[900, 0, 39]), [4, 4, 1], id="kv_start"),
    ],
)
def test_split_chunks_follow_each_rows_length_not_the_table_width(options, expected):
    """A block table far wider than its rows (4096 tokens for rows of 1000, 300 and 40): each row's keys are cut into
    the launch's 4 splits by its own length, so every split a row's tiles can fill holds keys (chunks cut from the
    table's width, 1024 tokens each, would leave each row one busy split); the output is the reference's."""
    from hf_paged.attention.kernels import triton_decode

    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    batch = make_batch([1000, 300, 40], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    batch = widened(batch, 4096 // 16)
    if "kv_start" in options:
        options = {**options, "kv_start": torch.tensor(options["kv_start"], dtype=torch.int32, device=DEVICE)}
    launch = triton_decode.DecodeLaunch(*batch.args, kv_start=options.get("kv_start"), num_splits=4)
    assert launch.config.block_n == 32 and launch.sizes[0] == 32  # a count asked for: runs of whole tiles
    result = launch(
        batch.query, batch.key_cache, batch.value_cache, scale=0.125, sliding_window=options.get("sliding_window")
    )
    assert splits_with_keys(launch) == expected
    expected_out = reference_decode(batch, scale=0.125, **options)
    torch.testing.assert_close(result.cpu().double(), expected_out, **TOLERANCES[torch.float32])


def test_chosen_splits_keep_their_shortest_chunk_on_a_wide_table(monkeypatch):
    """With the split count chosen (an H100's 132 SMs, 2 rows x 2 kv heads: 64 splits of a 32k-token table), each row
    is cut into chunks of at least `min_split_tokens` (128 tokens here, 4 tiles of 32) from its own length: 1600 keys
    keep 13 splits busy and 600 keep 5, where chunks of the table's 32768 / 64 = 512 tokens kept 4 and 2."""
    from hf_paged.attention.kernels import triton_decode

    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)
    batch = make_batch([1600, 600], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    batch = widened(batch, 32768 // 16)
    launch = triton_decode.DecodeLaunch(*batch.args)
    assert launch.num_splits == 64 and launch.sizes[0] == triton_decode.min_split_tokens(32) == 128
    result = launch(batch.query, batch.key_cache, batch.value_cache, scale=0.125)
    assert splits_with_keys(launch) == [13, 5]
    torch.testing.assert_close(result.cpu().double(), reference_decode(batch, scale=0.125), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("ids_ahead", [True, False], ids=["ids-ahead", "ids-in-tile"])
@pytest.mark.parametrize("block_size", [8, 128])
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(num_splits=1), id="one-split"),
        pytest.param(dict(num_splits=3, sliding_window=40), id="splits-window"),
        pytest.param(dict(num_splits=2, kv_start=[0, 150, 4, 7]), id="splits-kv_start"),
    ],
)
def test_decode_reads_block_ids_ahead_or_in_the_tile_alike(ids_ahead, block_size, options, monkeypatch):
    """Each tile's block ids read one tile ahead (`launch_config.ids_ahead`, with 3 pipeline stages) or within the
    tile: the same keys, so the same output bit for bit, right against the reference, over split chunks that start
    and end inside tiles, blocks of 8 (several a tile) and of 128 (several tiles a block), rows of 1 to 200 keys."""
    from hf_paged.attention.kernels import launch_config

    batch = make_batch(
        [1, 200, 130, 17], block_size=block_size, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    if "kv_start" in options:
        options = {**options, "kv_start": torch.tensor(options["kv_start"], dtype=torch.int32, device=DEVICE)}
    monkeypatch.setattr(launch_config, "ids_ahead", lambda num_stages: not ids_ahead)
    other = decode_impl("triton")(*batch.args, scale=0.125, **options)
    monkeypatch.setattr(launch_config, "ids_ahead", lambda num_stages: ids_ahead)
    check_decode("triton", batch, **options)
    assert torch.equal(decode_impl("triton")(*batch.args, scale=0.125, **options), other)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_launch_works_out_its_sizes_without_triton_cdiv(num_splits, monkeypatch):
    """The launchers run at every layer and step: their sizes come from integer arithmetic on the host
    (`launch_config.ceil_div`), not `triton.cdiv`, a Triton constexpr function that costs over a microsecond a call
    from Python; a launch with one split passes the same empty partials every time, not a new allocation."""
    import triton

    from hf_paged.attention.kernels import launch_config, triton_decode

    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    assert [launch_config.ceil_div(a, b) for a, b in [(0, 16), (1, 16), (16, 16), (17, 16), (1000, 7)]] == [
        0,
        1,
        1,
        2,
        143,
    ]

    def host_cdiv(*args):
        raise AssertionError("triton.cdiv called on the host")

    monkeypatch.setattr(triton, "cdiv", host_cdiv)
    batch = make_batch([1, 200, 130], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    check_decode("triton", batch, num_splits=num_splits)
    assert triton_decode.unused_fp32(DEVICE) is triton_decode.unused_fp32(DEVICE)
    assert triton_decode.unused_fp32(DEVICE).numel() == 0 and triton_decode.unused_fp32(DEVICE).dtype == torch.float32


# ------------------------------------------------------------------ strides and `out`
def as_strided_cache(cache: torch.Tensor, storage: str) -> torch.Tensor:
    """The same values as `cache` ([num_blocks, block_size, H, D]), viewed out of another storage layout."""
    if storage == "contiguous":
        return cache
    if storage == "head-major":  # [H, num_blocks, block_size, D] storage, as BlockPool.nhd_view sees it
        return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    if storage == "block-heads":  # [num_blocks, H, block_size, D] storage: a block's slots are not consecutive rows
        return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert storage == "fused-kv"  # [num_blocks, block_size, 2, H, D] storage, K at index 0 of dim 2
    return torch.stack([cache, torch.zeros_like(cache)], dim=2)[:, :, 0]


def test_slot_rows_takes_power_of_two_blocks_of_consecutive_rows():
    """The kernels address a row by its slot (`SLOT_ROWS`) where each block's slots are consecutive rows of K and V and
    the block size is a power of two: the pool's head-major view, a block-major cache and K/V fused in one storage;
    not a block size of 12, nor blocks stored head by head."""
    from hf_paged.attention.kernels.triton_decode import block_shift, slot_rows

    cache = torch.zeros(6, 16, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    for view in (cache, as_strided_cache(cache, "head-major"), as_strided_cache(cache, "fused-kv")):
        assert slot_rows(view.shape, view.stride(), view.stride())
    block_heads = as_strided_cache(cache, "block-heads")
    assert not slot_rows(block_heads.shape, block_heads.stride(), block_heads.stride())
    assert not slot_rows(cache.shape, cache.stride(), block_heads.stride())  # V's layout counts too
    odd = torch.zeros(6, 12, 2, 8)
    assert not slot_rows(odd.shape, odd.stride(), odd.stride())
    assert [block_shift(n) for n in (1, 2, 16, 128, 12)] == [0, 1, 4, 7, 0]


@pytest.mark.parametrize(
    "block_size, storage",
    [(16, "contiguous"), (16, "head-major"), (12, "contiguous"), (16, "block-heads"), (1, "contiguous")],
)
def test_decode_addresses_rows_by_slot_or_by_block_alike(block_size, storage, monkeypatch):
    """A power-of-two block size over consecutive rows reads each row at its slot, any other pool at block id times
    block stride plus offset times slot stride (blocks of 12, blocks stored head by head): both right against the
    reference, over split chunks and block boundaries, and the slot path's output the general path's bit for bit."""
    from hf_paged.attention.kernels import triton_decode

    batch = make_batch(
        [1, 200, 130, 17], block_size=block_size, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32
    )
    strided = PagedBatch(
        batch.query,
        as_strided_cache(batch.key_cache, storage),
        as_strided_cache(batch.value_cache, storage),
        batch.block_tables,
        batch.seq_lens,
    )
    slots = triton_decode.slot_rows(strided.key_cache.shape, strided.key_cache.stride(), strided.value_cache.stride())
    assert slots == (block_size in (1, 16) and storage != "block-heads")
    result = decode_impl("triton")(*strided.args, scale=0.125, num_splits=3)
    torch.testing.assert_close(result.cpu().double(), reference_decode(batch, scale=0.125), **TOLERANCES[torch.float32])
    if slots:
        monkeypatch.setattr(triton_decode, "slot_rows", lambda *args: False)
        assert torch.equal(decode_impl("triton")(*strided.args, scale=0.125, num_splits=3), result)


@IMPLS
@pytest.mark.parametrize("storage", ["head-major", "fused-kv"])
def test_decode_strided_inputs_and_out(impl, storage):
    """Caches viewed out of other storage layouts, a transposed query, and a strided `out` buffer."""
    batch = make_batch([30, 3], block_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    key_cache, value_cache = as_strided_cache(batch.key_cache, storage), as_strided_cache(batch.value_cache, storage)
    assert not key_cache.is_contiguous()
    query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    strided = PagedBatch(query, key_cache, value_cache, batch.block_tables, batch.seq_lens)
    out = torch.zeros(2, 8, 128, dtype=torch.float16, device=DEVICE)[..., ::2]
    result = decode_impl(impl)(*strided.args, scale=0.125, out=out)
    assert result is out
    expected = reference_decode(batch, scale=0.125)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[torch.float16])


def test_decode_rejects_mismatched_heads():
    batch = make_batch([4], block_size=8, num_q_heads=6, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"num_q_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        paged_decode_attention(*batch.args, scale=1.0, backend="torch")


def test_gather_kv_matches_block_walk():
    batch = make_batch([10, 3], block_size=4, num_q_heads=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    gathered = gather_kv(batch.key_cache, batch.block_tables, 10)  # [B, H, S, D]
    assert gathered.shape == (2, 2, 10, 64)
    for b, n in enumerate(batch.seq_lens.tolist()):
        for pos in range(n):
            block_id = int(batch.block_tables[b, pos // 4])
            assert torch.equal(gathered[b, :, pos], batch.key_cache[block_id, pos % 4])


# ------------------------------------------------------------------ store_kv
@pytest.mark.parametrize(
    "cache_dtype,input_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
    ids=["fp32", "bf16", "fp32-into-fp16"],
)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("storage", ["contiguous", "head-major"])
def test_store_kv_triton_matches_torch(cache_dtype, input_dtype, head_dim, storage):
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_kv_heads, num_tokens = 6, 8, 3, 13
    initial = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    if storage == "head-major":
        initial = as_strided_cache(initial, storage)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(input_dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(input_dtype).to(DEVICE)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)

    caches = {}
    for backend in ("torch", "triton"):
        # clone() keeps the strides of a non-overlapping dense view: head-major copies stay head-major
        key_cache, value_cache = initial.clone(), (initial + 1).clone()
        assert key_cache.stride() == initial.stride()
        store_kv(key, value, key_cache, value_cache, slot_mapping, backend=backend)
        caches[backend] = key_cache, value_cache
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])

    key_flat = caches["triton"][0].view(-1, num_kv_heads, head_dim)
    value_flat = caches["triton"][1].view(-1, num_kv_heads, head_dim)
    assert torch.equal(key_flat[slot_mapping], key.to(cache_dtype))
    assert torch.equal(value_flat[slot_mapping], value.to(cache_dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping] = False
    assert torch.equal(key_flat[untouched], initial.reshape(-1, num_kv_heads, head_dim)[untouched])
    assert torch.equal(value_flat[untouched], (initial + 1).reshape(-1, num_kv_heads, head_dim)[untouched])


def test_store_kv_then_decode_round_trip():
    """Writing a sequence token by token with store_kv gives the cache that decode attention reads back."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_dim, n = 8, 2, 64, 19
    key_cache = torch.zeros(5, block_size, num_kv_heads, head_dim, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.tensor([[3, 0, 4]], dtype=torch.int32, device=DEVICE)
    keys = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    values = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = torch.tensor([int(block_table[0, p // block_size]) * block_size + p % block_size for p in range(n)])
    store_kv(keys, values, key_cache, value_cache, slots.to(DEVICE), backend="torch")
    torch.testing.assert_close(gather_kv(key_cache, block_table, n)[0].transpose(0, 1), keys)
    torch.testing.assert_close(gather_kv(value_cache, block_table, n)[0].transpose(0, 1), values)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_decode_launch_serves_every_layer_of_a_step(num_splits):
    """`DecodeLaunch` is made once for a step's rows and called by each layer: layers with caches of their own (and
    a window, a softcap) over the same rows give what a launch of their own gives, the split-K workspace shared; a
    query or caches of other shapes than it was made for are refused."""
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    from hf_paged.attention.kernels import triton_decode

    first = make_batch([1, 200, 130], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16)
    # A second layer of the same step: the same tables and lengths, K/V and a query of its own (the pool's unowned
    # slots stay NaN).
    query = torch.randn(first.query.shape, generator=torch.Generator().manual_seed(1)).to(first.query)
    second = PagedBatch(query, first.key_cache * 0.5, -first.value_cache, first.block_tables, first.seq_lens)
    layers = [first, second]
    kv_start = torch.tensor([0, 7, 0], dtype=torch.int32, device=DEVICE)
    launch = triton_decode.DecodeLaunch(*first.args, kv_start=kv_start, num_splits=num_splits)
    for layer, options in zip(layers, [{}, dict(sliding_window=90, softcap=20.0)]):
        scale = layer.query.shape[-1] ** -0.5
        got = launch(layer.query, layer.key_cache, layer.value_cache, scale=scale, **options)
        expected = reference_decode(layer, scale=scale, kv_start=kv_start, **options)
        torch.testing.assert_close(got.cpu().double(), expected, **TOLERANCES[torch.float16])
    other = make_batch([5, 9, 3], block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=32, dtype=torch.float16)
    with pytest.raises(ValueError, match="made for query"):
        launch(other.query, other.key_cache, other.value_cache, scale=1.0)


def test_a_store_launch_writes_what_store_kv_writes_and_refuses_other_states():
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    from hf_paged.attention.kernels import triton_store

    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = (torch.zeros(6, 4, 2, 32, dtype=torch.float16, device=DEVICE) for _ in range(2))
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    launch = triton_store.StoreLaunch(key_cache, value_cache)
    for rows, q_len in ((3, 1), (1, 5), (2, 3)):  # decode, one row's chunk, several rows' chunks
        states = [torch.randn(rows, 2, q_len, 32, generator=gen).half().to(DEVICE) for _ in range(2)]
        slots = torch.randperm(24, generator=gen)[: rows * q_len].to(DEVICE)
        launch(*states, slots)
        rows_first = [s.transpose(1, 2).reshape(-1, 2, 32) for s in states]
        store_kv(*rows_first, expected_k, expected_v, slots, backend="torch")
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    with pytest.raises(ValueError, match=r"must be \[W, 2, q_len, 32\]"):
        launch(torch.zeros(1, 2, 1, 16, device=DEVICE), torch.zeros(1, 2, 1, 16, device=DEVICE), slots[:1])


def test_decode_plans_of_one_step_share_a_launch_per_cache_shape(monkeypatch):
    """The decode plans of a step's layers share their launches (the step's memo): a layer whose caches have other kv
    heads for the same query shape gets a launch of its own, and each layer's output is its reference's."""
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    from hf_paged.attention.decode_plan import DecodePlan

    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    shared = dict(_kv_starts={}, _backends={}, _launches={})
    lengths = [3, 40]
    wide = make_batch(lengths, block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    narrow = make_batch(lengths, block_size=8, num_q_heads=4, num_kv_heads=1, head_dim=16, dtype=torch.float32, seed=1)
    narrow.block_tables, narrow.seq_lens = wide.block_tables, wide.seq_lens
    narrow.key_cache, narrow.value_cache = wide.key_cache[:, :, :1] * 2, wide.value_cache[:, :, 1:] - 1
    module = torch.nn.Module()
    for layer in (wide, narrow, wide):
        plan = DecodePlan(
            key_cache=layer.key_cache,
            value_cache=layer.value_cache,
            block_tables=layer.block_tables,
            seq_lens=layer.seq_lens,
            kv_offset=0,
            position_offset=0,
            gather=lambda: None,
            **shared,
        )
        out, _ = plan.attend(module, layer.query[:, :, None], None, scaling=0.25)
        expected = reference_decode(layer, scale=0.25)
        torch.testing.assert_close(out[:, 0].cpu().double(), expected, **TOLERANCES[torch.float32])
    assert len(shared["_launches"]) == 2  # one a cache shape, the third layer's the first's
