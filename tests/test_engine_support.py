"""The Engine's up-front refusals (hf_paged/engine/model_support.py) and the packed-step fixes the zoo relies on,
checked directly on tiny zoo models (fast): each refusal is an `UnsupportedModel` from `Engine(...)`, before any step,
naming the model type and the reason; a model the Engine serves gives each prompt what generate() gives it alone."""

from __future__ import annotations

import re

import pytest
import torch
import zoo

import hf_paged
from hf_paged import BlockPool, Engine, UnsupportedModel


def engine_of(model_type: str, **config) -> Engine:
    model = zoo.tiny_model(model_type, zoo.architectures()[model_type])
    for key, value in config.items():
        setattr(model.config, key, value)
    return Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("bart", "BartForCausalLM.forward takes no position_ids"),
        ("pegasus", "PegasusForCausalLM.forward takes no position_ids"),
        ("whisper", "WhisperForCausalLM.forward takes no logits_to_keep"),
        ("moshi", "layer 0 slides \\(window 8\\) but its attention \\(MoshiAttention\\) does not pass sliding_window"),
        ("gemma4_unified", "its vision tokens attend bidirectionally"),
        ("bloom", "its attention \\(BloomAttention\\) is its own code"),
        ("diffllama", "it splits V into two halves after cache.update"),
    ],
)
def test_what_the_packed_step_cannot_run_is_served_per_request(model_type, reason):
    engine = engine_of(model_type)
    assert engine.step_mode == "per-request"
    assert re.match(reason, engine.step_mode_reason)


def test_a_model_the_packed_step_runs_is_packed():
    engine = engine_of("llama")
    assert (engine.step_mode, engine.step_mode_reason) == ("packed", None)
    assert engine.model.config._attn_implementation == "hf_paged"


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("prophetnet", "computing a prompt in chunks over cached tokens raises AssertionError: At the moment"),
        ("xlm", "computing a prompt in chunks over cached tokens raises AssertionError"),
        ("cpmant", "computing a prompt in chunks over cached tokens raises RuntimeError"),
    ],
)
def test_neither_step_serves_a_prompt_that_cannot_be_chunked(model_type, reason):
    with pytest.raises(UnsupportedModel, match=f"Engine does not support model type '{model_type}': {reason}"):
        engine_of(model_type)


def test_engine_refuses_bidirectional_attention():
    model = zoo.tiny_model("gemma4_unified", zoo.architectures()["gemma4_unified"])
    model.config.get_text_config(decoder=True).use_bidirectional_attention = "all"
    with pytest.raises(UnsupportedModel, match="'gemma4_unified': it attends bidirectionally \\(use_bidirectional"):
        Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))


def test_engine_refuses_non_causal_attention():
    # A BERT-style model whose attention modules say is_causal=False: sdpa skips the causal mask, so each prompt
    # token sees the later ones. The packed step names the modules; the per-request step's probe sees the logits.
    model = zoo.tiny_model("bert", "BertLMHeadModel")
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    with pytest.raises(UnsupportedModel, match="'bert': its logits differ when a prompt is computed in chunks"):
        Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))
    with pytest.raises(UnsupportedModel, match="'bert': its attention is not causal \\(is_causal=False on BertSelf"):
        hf_paged.engine.model_support.refuse_unsupported_engine(model)


def test_a_refused_model_is_left_as_it_was():
    model = zoo.tiny_model("xlm", "XLMWithLMHeadModel")
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedModel):
        Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))
    assert model.config._attn_implementation == implementation


def test_encoder_layers_of_a_multimodal_model_are_not_judged():
    # Its audio encoder's attention is bidirectional; its decoder (a Qwen3) is what the Engine runs.
    model = zoo.tiny_model("moss_transcribe_diarize", zoo.architectures()["moss_transcribe_diarize"])
    assert any(getattr(module, "is_causal", None) is False for module in model.modules())
    hf_paged.engine.model_support.refuse_unsupported_engine(model)


@pytest.mark.parametrize(
    "model_type", ["gemma2", "vaultgemma", "gpt_oss", "granite_swa", "llama4_text", "llama", "mistral", "bert"]
)
def test_engine_equals_generate_of_each_prompt_alone(model_type):
    """Softcap (gemma2, vaultgemma) and attention sinks (gpt_oss, granite_swa) in the packed step's prefill chunks
    and decode rows, chunked attention (llama4_text, chunks of 4 positions), sliding windows, a BERT-style decoder.
    Tokens and raw logits per step, prompts prefilled in chunks and packed with decode rows (zoo shapes)."""
    model = zoo.tiny_model(model_type, zoo.architectures()[model_type])
    model_inputs = zoo.inputs()
    expected = zoo.single_reference(model, model_inputs)
    got = zoo._engine(model, model_inputs)
    assert zoo.compare(got, expected) is None
    assert got.sequences.shape == (2, zoo.MAX_NEW_TOKENS)


def test_chunks_are_masked_in_the_packed_step():
    # Chunks of 4 positions, prompts of 8 and 6 tokens. Llama 4 passes no window to the attention function: without
    # the step's chunk mask every row would see all the keys it holds, and differ from step 0.
    model = zoo.tiny_model("llama4_text", "Llama4ForCausalLM")
    model_inputs = zoo.inputs()
    expected = zoo.single_reference(model, model_inputs)
    assert model.config.attention_chunk_size == 4
    assert zoo.compare(zoo._engine(model, model_inputs), expected) is None
    engine = Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))
    expected_sizes = [4 if t == "chunked_attention" else None for t in model.config.layer_types]
    assert engine.step_runner.step.chunk_sizes == expected_sizes


def test_softcap_is_applied_in_the_packed_step():
    # Without the softcap the same model computes other logits: the check above would see a missing softcap.
    model = zoo.tiny_model("gemma2", "Gemma2ForCausalLM")
    model_inputs = zoo.inputs()
    expected = zoo.single_reference(model, model_inputs)
    model.config.attn_logit_softcapping = None
    for module in model.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
    assert zoo.compare(zoo._engine(model, model_inputs), expected) is not None


def test_a_forward_that_never_stores_kv_in_the_step_is_refused():
    # Dory's forward takes its cache as `cache` only: a cache passed as past_key_values= would go unused while the
    # model runs on a DynamicCache of its own. The Engine passes the keyword the forward takes...
    model = zoo.tiny_model("dory", "DoryForCausalLM")
    model.config.n_recurrent_loops = 1  # no looped cache layers
    engine = Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))
    assert engine.step_runner.step.cache_keyword == "cache"
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2
    # ... and a step whose forward stores nothing raises instead of returning what the model's own cache gave.
    engine.step_runner.step.cache_keyword = "past_key_values"
    with pytest.raises(UnsupportedModel, match="'dory': its forward never stored K/V in the Engine's cache"):
        engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert engine.pool.num_used_blocks == 0


def test_a_write_to_a_layer_the_pool_does_not_hold_is_refused():
    from hf_paged.engine import StepCache

    model = zoo.tiny_model("llama", "LlamaForCausalLM")
    pool = BlockPool.for_model(model, num_blocks=4, block_size=4)
    cache = StepCache(pool, [[[0]]], [0], [2], model_type="llama")
    states = torch.zeros(1, 2, 2, 16)
    with pytest.raises(UnsupportedModel, match="'llama': it writes cache layer 2, while the pool holds its 2 layers"):
        cache.update(states, states, 2)


def test_a_model_with_a_generate_of_its_own_is_refused_by_the_engine():
    """MusicGen's generate() applies a codebook delay pattern around the forward; the Engine only takes tokens from
    the logits, so it refuses the model up front (generate() with a PagedCache serves it: the zoo)."""
    model = zoo.tiny_model("musicgen", "MusicgenForCausalLM")
    with pytest.raises(UnsupportedModel, match=r"generate\(\) of its own \(MusicgenForCausalLM.generate\)") as error:
        Engine(model, BlockPool.for_model(model, num_blocks=8, block_size=4))
    assert error.value.path == "Engine"
