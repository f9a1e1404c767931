"""pytest-benchmark microbenchmarks of the PyTorch kernel references (CPU, small sizes).

`pytest tests/test_bench_kernels.py --benchmark-disable` runs each once as a smoke test (the default test run does
this too, in well under a second); `--benchmark-only` times them. GPU timings of the Triton kernels live in
`bench/decode_attention.py` and `bench/prefill_attention.py` (smoke-run here on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import prefill_attention
from bench.gpu_report import _decode_section, _prefill_section
from hf_paged.attention.kernels import paged_decode_attention_torch, store_kv_torch
from tests.models import require_triton_on_cpu

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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_benchmark_smoke_run_matches_sdpa(tmp_path, backend):
    """`python -m bench.prefill_attention --device cpu --tiny` (the GPU benchmark's script on CPU; the Triton kernel
    in the interpreter): every cell timed for both methods, the paged output equal to SDPA's."""
    if backend == "triton":
        require_triton_on_cpu()
    path = tmp_path / "prefill_bf16_d64.json"  # the name `make bench-gpu` gives its first prefill run
    argv = ["--device", "cpu", "--tiny", "--backend", backend, "--rep-ms", "1", "--json", str(path)]
    assert prefill_attention.main(argv) == 0
    results = json.loads(path.read_text())["results"]
    assert [(r["batch"], r["new"], r["cached"], r["method"]) for r in results] == [
        (1, 48, 0, f"paged ({backend})"),
        (1, 48, 0, "sdpa-contig"),
        (2, 16, 40, f"paged ({backend})"),
        (2, 16, 40, "sdpa-contig"),
    ]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in results)
    assert all(r["max_abs_err_vs_sdpa"] < 1e-4 for r in results if "max_abs_err_vs_sdpa" in r)
    section = _prefill_section(tmp_path)  # the GPU report's table of it
    assert section.count("sdpa-contig") == 2 and f"paged ({backend})" in section


def test_prefill_benchmark_times_the_kernel_with_masked_tiles_only_too(tmp_path):
    """In 16 bits the Triton kernel runs twice, the second time with `unmasked_tiles` the other way (at head_dim 64 it
    is on by default: "masked tiles only"): both against SDPA."""
    require_triton_on_cpu()
    path = tmp_path / "prefill_bf16_d64.json"
    argv = ["--device", "cpu", "--backend", "triton", "--dtype", "bf16", "--num-q-heads", "4", "--num-kv-heads", "2"]
    argv += ["--head-dim", "64", "--cells", "1:80:0", "--rep-ms", "1", "--json", str(path)]
    assert prefill_attention.main(argv) == 0
    results = json.loads(path.read_text())["results"]
    assert [r["method"] for r in results] == ["paged (triton)", "paged (triton, masked tiles only)", "sdpa-contig"]
    assert all(r["max_abs_err_vs_sdpa"] < 2e-2 and r["speed_vs_sdpa"] > 0 for r in results[:2])
    assert "paged (triton, masked tiles only)" in _prefill_section(tmp_path)


def test_decode_benchmark_smoke_run_matches_sdpa(tmp_path):
    """`python bench/decode_attention.py --device cpu --tiny`: every cell timed for the three methods (no CUDA graph
    time off CUDA), the paged output and the library gather's (gather+sdpa) equal to SDPA's, and the GPU report's
    table of it with its graph column."""
    import bench.decode_attention as decode_attention

    path = tmp_path / "decode_bf16_d64.json"  # the name `make bench-gpu` gives its first decode run
    argv = ["--device", "cpu", "--tiny", "--backend", "torch", "--rep-ms", "1", "--warmup-ms", "1", "--json", str(path)]
    assert decode_attention.main(argv) == 0
    results = json.loads(path.read_text())["results"]
    assert [r["method"] for r in results[:3]] == ["paged (torch)", "gather+sdpa", "sdpa-contig"]
    assert len(results) == 4 * 3 and all(r["ms"] > 0 and r["graph_ms"] is None for r in results)
    checked = [r["method"] for r in results if r.get("max_abs_err_vs_sdpa", 1.0) < 1e-4]
    assert checked == ["paged (torch)", "gather+sdpa"] * 4
    section = _decode_section(tmp_path)
    assert "under a CUDA graph (us)" in section and section.count("sdpa-contig") == 4


def test_decode_benchmark_times_wide_tables_at_the_shorter_contexts(tmp_path):
    """`--table-tokens`: the paged method again with block tables that wide, at every cell whose context is shorter
    (tables of 200 tokens: the tiny grid's context 64, not its 256), its output SDPA's too."""
    import bench.decode_attention as decode_attention

    path = tmp_path / "decode.json"
    argv = ["--device", "cpu", "--tiny", "--backend", "torch", "--rep-ms", "1", "--warmup-ms", "1", "--json", str(path)]
    assert decode_attention.main([*argv, "--table-tokens", "200"]) == 0
    results = json.loads(path.read_text())["results"]
    wide = [r for r in results if r["method"] == "paged (torch), table of 200 tokens"]
    assert [(r["batch"], r["context"]) for r in wide] == [(1, 64), (2, 64)]
    assert len(results) == 4 * 3 + 2 and all(r["max_abs_err_vs_sdpa"] < 1e-4 and r["ms"] > 0 for r in wide)
