"""bench/host_overhead.py's steps that prefill, eager against compiled, on a short burst (aot_eager)."""

from __future__ import annotations

from bench.host_overhead import negligible_model, prefill_steps


def test_prefill_steps_time_eager_and_compiled_steps_of_the_same_burst(capsys):
    assert prefill_steps(negligible_model(), "aot_eager", 1, num_requests=4, prompt_len=40) == 0
    out = capsys.readouterr().out
    assert "  eager " in out and "  compiled " in out and "compile error: None" in out
    assert "compiled steps: 0," not in out


def test_compiled_decode_steps_are_timed_per_cache_with_static_caches_tokens(capsys):
    from bench.host_overhead import compiled_decode
    from tests.models import tiny_model

    assert compiled_decode(tiny_model("llama"), "aot_eager", 1, prompt_len=16, steps=4) == 0
    out = capsys.readouterr().out
    for name in ("StaticCache", "PagedCache, sdpa", 'PagedCache, "hf_paged"'):
        assert f"  {name} " in out
    assert out.count("same tokens: True") == 3
    assert "PagedCache.reserve, a decode step's host share:" in out
