"""pytest-benchmark microbenchmarks of the PyTorch kernel references (CPU, small sizes).

`pytest tests/test_bench_kernels.py --benchmark-disable` runs each once as a smoke test (the default test run does
this too, in well under a second); `--benchmark-only` times them. GPU timings of the Triton kernels live in
`bench/decode_attention.py`.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention.kernels import paged_decode_attention_torch, store_kv_torch

pytest.importorskip("pytest_benchmark")


def make_pool(num_seqs: int, seq_len: int, *, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    # caches: [num_blocks, block_size, num_kv_heads, head_dim]; block tables: a random scatter of all blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, blocks_per_seq).int()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    return key_cache, value_cache, block_tables, seq_lens


@pytest.mark.parametrize("num_seqs,seq_len", [(1, 512), (8, 128)])
def test_bench_decode_attention_torch(benchmark, num_seqs, seq_len):
    key_cache, value_cache, block_tables, seq_lens = make_pool(num_seqs, seq_len)
    query = torch.randn(num_seqs, 8, 64)  # GQA: 8 q heads over 2 kv heads
    out = benchmark(paged_decode_attention_torch, query, key_cache, value_cache, block_tables, seq_lens, scale=0.125)
    assert out.shape == query.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("num_tokens", [1, 256])
def test_bench_store_kv_torch(benchmark, num_tokens):
    key_cache, value_cache, _, _ = make_pool(4, 128)
    key = torch.randn(num_tokens, 2, 64)
    value = torch.randn(num_tokens, 2, 64)
    slot_mapping = torch.randperm(key_cache.shape[0] * key_cache.shape[1])[:num_tokens]
    benchmark(store_kv_torch, key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache.view(-1, 2, 64)[slot_mapping], key)
