"""The packed step's forward compiled (`Engine(compile_prefill=...)`, engine/compiled_step.py) on CPU: torch.compile
with `aot_eager` traces the model whole over `CompiledStepCache`, each layer's store and attention one call of
`hf_paged::step_attention` on the step's `StepCache`; one graph serves every token count, the tokens are generate()'s,
and a forward that cannot compile runs eagerly instead."""

from __future__ import annotations

import logging

import pytest
import torch
from models import MODEL_NAMES, greedy_reference, random_prompts, require_triton_on_cpu, tiny_engine
from torch._dynamo.utils import counters

from hf_paged.engine import compiled_step
from hf_paged.engine.compiled_step import attention_modules, running
from hf_paged.engine.step_cache import StepCache

PROMPT_LENGTHS = (5, 11, 3, 17, 8, 9, 13, 6)
NEW_TOKENS = [9, 4, 14, 6, 11, 7, 5, 12]  # past the window of 8 of the sliding models
AOT_EAGER = {"backend": "aot_eager"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _token_counts(monkeypatch, engine) -> list[int]:
    """Records the token count of every forward the packed step runs compiled."""
    step, counts = engine.step_runner.step, []
    compiled = step._compiled

    def recording(**kwargs):
        counts.append(kwargs["input_ids"].shape[1])
        return compiled(**kwargs)

    monkeypatch.setattr(step, "_compiled", recording)
    return counts


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_steps_that_prefill_run_compiled_with_generates_tokens(monkeypatch, name):
    """Prompts in chunks of up to 8 tokens beside decode rows: every step that prefills runs the compiled forward, whose
    tokens are generate()'s; one graph serves every token count (a sliding model may take two: the model's mask code
    asks whether the tokens reach the window, which torch 2.13 guards on); every block comes back."""
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine(name, 64, max_num_seqs=4, max_num_batched_tokens=8, compile_prefill=AOT_EAGER)
    counts = _token_counts(monkeypatch, engine)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        name, prompts, NEW_TOKENS
    )
    step = engine.step_runner.step
    assert step.compile_error is None and step.num_compiled_steps == len(counts) > 0
    assert len(set(counts)) >= 3  # steps of several token counts
    sliding = name in ("mistral", "gemma3")
    assert 1 <= counters["stats"]["unique_graphs"] <= (2 if sliding else 1)
    assert engine.runner.stats.eager_steps > 0  # decode-only steps stay the runner's
    assert pool.num_used_blocks == 0


@pytest.mark.slow
def test_compiled_steps_on_the_triton_kernels_with_the_decode_forward_compiled_too(monkeypatch):
    """Both forwards compiled, on the Triton kernels (the interpreter): the prefill kernel and the decode kernel run
    inside `hf_paged::step_attention`, the runner's store and decode kernel as their own custom ops."""
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    prompts = random_prompts(PROMPT_LENGTHS[:5])
    engine, pool = tiny_engine(
        "llama", 64, max_num_seqs=4, max_num_batched_tokens=8, compile_prefill=AOT_EAGER, compile_decode=AOT_EAGER
    )
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS[:5], ignore_eos=True) == greedy_reference(
        "llama", prompts, NEW_TOKENS[:5]
    )
    assert engine.step_runner.step.num_compiled_steps > 0 and engine.runner.stats.eager_steps > 0
    assert pool.num_used_blocks == 0


@pytest.mark.slow
def test_both_forwards_compiled_by_inductor_give_generates_tokens(monkeypatch):
    """inductor, the compiler a GPU run uses (C++ kernels here), around the custom ops on the Triton kernels (the
    interpreter): the store op reinplaced on the pool, the decode kernel op, `hf_paged::step_attention`; rows padded
    to buckets as under CUDA graphs. The tokens are generate()'s, and neither forward falls back to eager."""
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    prompts = random_prompts(PROMPT_LENGTHS[:4])
    inductor = {"backend": "inductor"}
    engine, pool = tiny_engine(
        "llama", 64, max_num_seqs=4, max_num_batched_tokens=8, compile_prefill=inductor, compile_decode=inductor
    )
    engine.runner.pad_to_buckets = True
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS[:4], ignore_eos=True) == greedy_reference(
        "llama", prompts, NEW_TOKENS[:4]
    )
    step, runner = engine.step_runner.step, engine.runner
    assert step.compile_error is None and runner.compile_error is None
    assert step.num_compiled_steps > 0 and runner.compiled and runner.stats.eager_steps > 0
    assert pool.num_used_blocks == 0


def test_a_forward_that_cannot_compile_runs_eagerly_and_says_why(monkeypatch, caplog):
    """A graph break in the model (fullgraph=True refuses it): the step runs eagerly, with generate()'s tokens, and
    every later step too; `compile_error` and a warning say why."""
    prompts = random_prompts(PROMPT_LENGTHS[:4])
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, max_num_batched_tokens=8, compile_prefill=AOT_EAGER)
    norm = engine.model.model.norm
    forward = norm.forward

    def breaking(hidden_states):
        torch._dynamo.graph_break()
        return forward(hidden_states)

    monkeypatch.setattr(norm, "forward", breaking)
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine.packed"):
        got = engine.generate(prompts, max_new_tokens=NEW_TOKENS[:4], ignore_eos=True)
    assert got == greedy_reference("llama", prompts, NEW_TOKENS[:4])
    step = engine.step_runner.step
    assert step.num_compiled_steps == 0 and "graph_break" in step.compile_error
    assert sum("their compiled forward failed" in record.message for record in caplog.records) == 1
    assert pool.num_used_blocks == 0


def test_a_model_that_asks_the_cache_its_length_runs_eagerly_with_generates_tokens():
    """Llama 4's no-rope layers with temperature tuning scale their queries by `cache.get_seq_length(layer) +
    arange(T)`: one number a compiled step's rows of different lengths cannot share. The compiled cache refuses to say
    (any one number would give other tokens, silently), so the step runs eagerly, with generate()'s tokens."""
    import copy

    from transformers import DynamicCache, Llama4ForCausalLM
    from zoo import tiny_model

    import hf_paged
    from hf_paged import BlockPool, Engine

    base = tiny_model("llama4_text", "Llama4ForCausalLM")
    config = copy.deepcopy(base.config)
    config.floor_scale, config.attn_scale, config.no_rope_layers = 2, 1.0, [1, 0]  # layer 1: no rope, tuned
    model = Llama4ForCausalLM(config).eval()
    model.load_state_dict(base.state_dict())
    prompts, new_tokens = random_prompts((13, 7)), [4, 4]
    expected = [
        model.generate(torch.tensor([p]), past_key_values=DynamicCache(), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, new_tokens)
    ]
    model = hf_paged.enable(model)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=1, max_num_batched_tokens=4, compile_prefill=AOT_EAGER)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == expected
    step = engine.step_runner.step
    assert step.num_compiled_steps == 0 and step.compile_error is not None
    assert pool.num_used_blocks == 0


def test_an_error_the_eager_forward_raises_too_is_the_rows_own(monkeypatch):
    """A forward that raises compiled and eagerly alike fails its rows (the Engine isolates them) and leaves the
    compiled forward on; a failure of the compiled forward alone, of any kind, turns it off."""
    prompts = random_prompts(PROMPT_LENGTHS[:2])
    engine, pool = tiny_engine("llama", 64, max_num_seqs=2, max_num_batched_tokens=8, compile_prefill=AOT_EAGER)
    step = engine.step_runner.step
    eager_forward = step._eager_forward

    def failing(rows):
        raise RuntimeError("the rows fail eagerly too")

    monkeypatch.setattr(step, "_eager_forward", failing)
    monkeypatch.setattr(step, "_compiled", lambda **kwargs: failing(None))
    with pytest.raises(RuntimeError, match="the rows fail eagerly too"):  # or RequestFailed, a RuntimeError
        engine.generate(prompts, max_new_tokens=[3, 3], ignore_eos=True)
    assert step.compile_error is None and pool.num_used_blocks == 0
    monkeypatch.setattr(step, "_eager_forward", eager_forward)

    def compile_failure(**kwargs):
        raise AssertionError("an assertion inside the compiler")

    monkeypatch.setattr(step, "_compiled", compile_failure)
    assert engine.generate(prompts, max_new_tokens=[3, 3], ignore_eos=True) == greedy_reference(
        "llama", prompts, [3, 3]
    )
    assert step.compile_error == "AssertionError: an assertion inside the compiler"


def test_compile_prefill_refuses_bad_values_and_engines_without_the_packed_step(monkeypatch):
    with pytest.raises(
        ValueError, match="compile_prefill must be True, False or a dict of torch.compile keywords, got 'yes'"
    ):
        tiny_engine("llama", 8, compile_prefill="yes")
    engine, _ = tiny_engine("llama", 8, compile_prefill=False)
    assert engine.step_runner.step._compiled is None
    import hf_paged.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "choose_step_mode", lambda model: ("per-request", "chosen by the test"))
    with pytest.raises(ValueError, match="compile_prefill needs the packed step .* runs one forward per request"):
        tiny_engine("llama", 8, compile_prefill=True)


def _step(pool, engine) -> StepCache:
    """A packed step of two rows: one decode row holding 5 keys, a 3-token chunk after 4 cached ones."""
    blocks = pool.allocator.allocate(4)
    return StepCache(
        pool, [[blocks[:2], blocks[2:]]], [5, 4], [1, 3], token_ids=[3, 4, 5, 6], num_logits=4, model_type="llama"
    )


def test_the_step_attention_op_passes_opcheck_and_is_refused_outside_a_step():
    """`torch.library.opcheck` (schema, fake tensor, aot dispatch with dynamic shapes) on one layer of a real step;
    called outside a packed step's forward, it says where it runs. It is tagged unsafe for CUDA graphs: what it does
    depends on the step the host made current."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.hf_paged.step_attention.default.tags
    engine, pool = tiny_engine("llama", 16)
    cache = _step(pool, engine)
    attention = attention_modules(engine.model)
    assert sorted(attention) == [0, 1] and all("Attention" in type(m).__name__ for m in attention.values())
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 4, 16, generator=generator)
    key, value = (torch.randn(1, 2, 4, 16, generator=generator) for _ in range(2))
    args = (query, key, value, 0, 0.0, 0.25, None, None, None)
    with running(cache, attention):
        torch.library.opcheck(torch.ops.hf_paged.step_attention.default, args)
        out = torch.ops.hf_paged.step_attention(*args)
    assert out.shape == (1, 4, 4, 16) and cache.num_updates > 0
    with pytest.raises(RuntimeError, match="runs only inside a packed step's forward"):
        torch.ops.hf_paged.step_attention(*args)
    assert getattr(compiled_step._current, "step", None) is None


def test_logits_indices_are_padded_to_num_logits_with_the_last_row():
    engine, pool = tiny_engine("llama", 16)
    cache = _step(pool, engine)
    assert cache.logits_indices.tolist() == [0, 3, 3, 3]
    with pytest.raises(ValueError, match=r"num_logits must be at least the number of rows \(2\), got 1"):
        StepCache(pool, [[[0], [1]]], [1, 1], [1, 2], num_logits=1)
