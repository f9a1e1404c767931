"""bench/linear.py: weight-major linear layers compute what F.linear computes, switch on and off per model (all
row counts or some), `auto` picks per row count from a calibration, and none of it changes the benchmark's greedy
outputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from bench.linear import (
    ALL_ROWS,
    MAX_WEIGHT_MAJOR_ROWS,
    calibrate,
    describe_linear,
    pick_linear,
    use_linear,
    weight_major_linear,
)
from hf_paged import BlockPool, Engine


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (3, 64), (2, 4, 64), (1, 16, 64), (1, 17, 64), (0, 64)])
def test_weight_major_matches_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    out = weight_major_linear(layer, x)
    assert out.shape == (*shape[:-1], 96)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_use_linear_switches_cpu_float32_layers_and_back():
    model = _model()
    num_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert use_linear(model, "weight-major") == num_linears == 2 * 7 + 1  # q k v o gate up down per layer + LM head
    assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert use_linear(model, "torch") == 0
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert use_linear(model.to(torch.bfloat16), "weight-major") == 0  # only CPU float32 weights change


def test_use_linear_leaves_a_forward_someone_else_replaced():
    model = _model()
    hooked = model.lm_head
    hooked.forward = lambda x: F.linear(x, hooked.weight) * 2  # like an offloading hook's wrapper
    assert use_linear(model, "weight-major") == 2 * 7
    assert use_linear(model, "torch") == 0
    assert torch.equal(hooked(torch.ones(1, 64)), F.linear(torch.ones(1, 64), hooked.weight) * 2)


def test_use_linear_rejects_unknown_kind_and_rows():
    with pytest.raises(ValueError, match=r"auto, weight-major, torch, got 'fast'"):
        use_linear(_model(), "fast")
    with pytest.raises(ValueError, match=r"auto, weight-major, torch, got 'fast'"):
        pick_linear(_model(), "fast")
    with pytest.raises(ValueError, match=rf"within 1..{MAX_WEIGHT_MAJOR_ROWS}, got \[0, 17\]"):
        use_linear(_model(), "weight-major", weight_major_rows=frozenset({0, 17}))


def test_weight_major_rows_choose_the_path_per_row_count(monkeypatch):
    """With `weight_major_rows`, only those row counts take `W @ x.T`; the others call F.linear."""
    layer = nn.Linear(64, 96)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args: calls.append("mm") or real_mm(*args))
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 64)
        out = weight_major_linear(layer, x, rows_set=frozenset({2, 4}))
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ["mm", "mm"]  # rows 2 and 4 only


def test_calibrate_times_both_ways_for_every_row_count():
    timings = calibrate(_model(), repeats=1)
    assert sorted(timings) == sorted(ALL_ROWS)
    assert all(stock > 0 and major > 0 for stock, major in timings.values())
    assert calibrate(_model().to(torch.bfloat16), repeats=1) == {}  # no CPU float32 layer to time


def test_pick_linear_auto_applies_what_the_calibration_found(monkeypatch):
    """`auto` computes weight-major exactly the row counts the calibration found faster that way; the fixed kinds
    ignore the calibration."""
    import bench.linear as linear

    fake = {rows: (1.0, 0.5 if rows % 2 else 2.0) for rows in ALL_ROWS}  # weight-major faster at odd row counts
    monkeypatch.setattr(linear, "calibrate", lambda model: fake)
    model = _model()
    rows, timings = pick_linear(model, "auto")
    assert rows == frozenset(r for r in ALL_ROWS if r % 2) and timings == fake
    assert all(m.forward.keywords["rows_set"] == rows for m in model.modules() if isinstance(m, nn.Linear))
    assert "weight-major at rows 1,3,5" in describe_linear("auto", rows, timings)
    assert "2: 1.0/2.0" in describe_linear("auto", rows, timings)

    monkeypatch.setattr(linear, "calibrate", lambda model: {r: (1.0, 2.0) for r in ALL_ROWS})
    assert pick_linear(model, "auto")[0] == frozenset()
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert pick_linear(model, "weight-major") == (ALL_ROWS, {})
    assert describe_linear("weight-major", ALL_ROWS, {}) == (
        f"weight-major: weight-major at 1-{MAX_WEIGHT_MAJOR_ROWS} rows; bench/linear.py"
    )
    assert pick_linear(model, "torch") == (frozenset(), {})
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))  # undone
    assert describe_linear("torch", frozenset(), {}).startswith("torch: stock F.linear at every row count")


def test_weight_major_model_generates_the_same_tokens():
    """Greedy outputs through generate() (batched, so decode rows > 1) and through the Engine (packed rows, one
    prefill chunk over MAX_WEIGHT_MAJOR_ROWS tokens) match the stock model's."""
    model = _model()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 256, (3, MAX_WEIGHT_MAJOR_ROWS + 4), generator=generator)
    prompts = [row[: 5 + 6 * i].tolist() for i, row in enumerate(input_ids)]
    expected_batch = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    expected_engine = Engine(model, BlockPool.for_model(model, num_blocks=32, block_size=4)).generate(
        prompts, max_new_tokens=12, ignore_eos=True
    )
    use_linear(model, "weight-major")
    assert torch.equal(model.generate(input_ids, max_new_tokens=12, do_sample=False), expected_batch)
    engine = Engine(model, BlockPool.for_model(model, num_blocks=32, block_size=4))
    assert engine.generate(prompts, max_new_tokens=12, ignore_eos=True) == expected_engine


def test_a_model_without_cpu_float32_linears_is_described_as_left_alone():
    """A bf16 (or GPU) model has no layer to change, whatever was asked for, and the header says so."""
    bf16 = _model().to(torch.bfloat16)
    for kind in ("weight-major", "auto"):
        assert describe_linear(kind, *pick_linear(bf16, kind)).startswith(f"{kind}: no CPU float32 linear layer")
