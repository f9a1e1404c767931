"""bench/layer_costs.py as a dry run on CPU: each layer path and operation timed, the report section it feeds."""

from __future__ import annotations

import json

from bench import gpu_report, layer_costs


def test_dry_run_times_each_layer_path_and_operation_at_each_batch(tmp_path):
    out = tmp_path / "layer_costs.json"
    argv = ["--tiny", "--device", "cpu", "--batch", "1", "3", "--context", "40", "--iters", "3", "--json", str(out)]
    assert layer_costs.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["batch"], r["what"]): r for r in report["rows"]}
    for batch in (1, 3):
        for variant in ("dynamic", "paged", "paged+hf_paged"):
            row = rows[batch, f"layer: {variant}"]
            assert row["host_us"] > 0 and row["gpu_us"] is None  # no GPU time on CPU
        assert rows[batch, "torch.cat x2 (DynamicCache.update)"]["host_us"] > 0
        assert rows[batch, "index_select x2 (gather)"]["host_us"] > 0
    assert not any("Triton" in what for _, what in rows)  # the torch backend on CPU: no Triton launch to time
    section = gpu_report._layers_section(tmp_path)
    assert "context 40, 3 calls each" in section and "| layer: paged+hf_paged" in section


def test_a_layer_path_returns_what_its_cache_gives_attention():
    """The paged paths' steps hand attention what a model's forward would: the pool's K/V for sdpa, a decode plan on
    empty placeholders for "hf_paged"."""
    import torch

    from bench.models import TINY_SHAPE, llama_shaped
    from hf_paged.attention.plan import plan_of

    model = llama_shaped(TINY_SHAPE, torch.float32, "cpu")
    seen = {}
    with torch.inference_mode():
        for variant in ("dynamic", "paged", "paged+hf_paged"):
            steps = layer_costs.LayerSteps(variant, model, batch=2, context=20, iters=2)
            attention = steps.attention

            def recording(module, query, key, value, mask, variant=variant, attention=attention):
                seen.setdefault(variant, (tuple(key.shape), plan_of(key) is not None))
                return attention(module, query, key, value, mask)

            steps.attention = recording
            steps.step()
    assert seen["dynamic"] == ((2, 2, 21, 16), False)
    assert seen["paged"] == ((2, 2, 21, 16), False)
    assert seen["paged+hf_paged"] == ((2, 2, 0, 16), True)
