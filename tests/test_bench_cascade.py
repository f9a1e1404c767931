"""bench/cascade.py on the embedded model, small: both settings run, the split happens, the tokens agree."""

from __future__ import annotations

import hf_paged.attention.fixed_plan as fixed_plan
from bench import cascade


def test_cascade_benchmark_compares_both_settings_on_the_same_tokens(capsys, monkeypatch):
    calls = []
    original = fixed_plan.shared_prefix_attention

    def counting(query, prefix_keys, *args, **kwargs):
        calls.append(prefix_keys.shape[2])
        return original(query, prefix_keys, *args, **kwargs)

    monkeypatch.setattr(fixed_plan, "shared_prefix_attention", counting)
    argv = ["--concurrency", "8", "--requests", "8", "--prefix-len", "260", "--unique-len", "3"]
    assert cascade.main([*argv, "--new-tokens", "6", "--repeats", "1", "--max-memory", "16MiB"]) == 0
    out = capsys.readouterr().out
    row = out.strip().splitlines()[-1].split()
    assert row[0] == "8" and row[-1] == "True", out
    assert calls and set(calls) == {256}  # the 16 whole blocks of the system prompt, read once per layer and step


def test_layer_timing_compares_two_ways_to_the_same_attention():
    whole, split, difference = cascade.layer_times(3, 32, 20, repeats=1)
    assert whole > 0 and split > 0 and difference < 1e-5


def test_chunks_benchmark_compares_both_reads_on_the_same_tokens(capsys, monkeypatch):
    import hf_paged.engine.runner_cache as runner_cache

    chunked = []
    gather_rows = runner_cache.GroupStep.gather_rows

    def recording(self, layer, first, end):
        chunked.append(end - first)
        return gather_rows(self, layer, first, end)

    monkeypatch.setattr(runner_cache.GroupStep, "gather_rows", recording)
    argv = ["--chunks", "--requests", "6", "--repeats", "1", "--max-memory", "16MiB", "--prompt-lens", "4", "12"]
    # A tiny burst: thresholds that chunk it one row at a time.
    argv += ["--output-lens", "4", "8", "--chunk-bytes", "1", "--chunk-min-bytes", "0"]
    assert cascade.main(argv) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[0] == "6" and row[-1] == "True"
    assert chunked and set(chunked) == {1}
