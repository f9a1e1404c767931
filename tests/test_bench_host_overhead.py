"""bench/host_overhead.py's steps that prefill, eager against compiled, on a short burst (aot_eager)."""

from __future__ import annotations

from bench.host_overhead import negligible_model, prefill_steps


def test_prefill_steps_time_eager_and_compiled_steps_of_the_same_burst(capsys):
    assert prefill_steps(negligible_model(), "aot_eager", 1, num_requests=4, prompt_len=40) == 0
    out = capsys.readouterr().out
    assert "  eager " in out and "  compiled " in out and "compile error: None" in out
    assert "compiled steps: 0," not in out
