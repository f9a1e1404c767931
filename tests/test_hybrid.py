"""Hybrid models (attention layers next to linear-attention, mamba or conv layers) under generate() with a PagedCache.

The attention layers are paged; the states stay in transformers' own cache layers (cache/hybrid.py). Each case
compares with `DynamicCache(config=model.config)`: greedy, beams and sampling give the same tokens and scores, row
operations move the states with the block tables, and what cannot work (prefix reuse, cropping a recurrent state,
the Engine) is refused with a typed error naming the model type and the reason.

The tiny models are the zoo's (tests/zoo.py): Qwen3-Next (gated delta net + full attention), Jamba (mamba + full),
LFM2 (conv + full: croppable), Falcon-H1 ("hybrid" layers: mamba and attention in one layer), Nemotron-H (mamba, an
MLP-only "moe" layer, attention) and RecurrentGemma (recurrent + sliding attention).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
import zoo
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, LinearAttentionLayer

import hf_paged
from hf_paged import BlockPool, Engine, KVLayout, PagedCache, PagedLayer, PoolExhausted, UnsupportedModel
from hf_paged.cache.hybrid import PagedHybridLayer
from hf_paged.errors import GradientsUnsupported, IncompleteStep

MODEL_TYPES = ("qwen3_next", "jamba", "lfm2", "falcon_h1", "nemotron_h", "recurrent_gemma")
NEW_TOKENS = 6
# Mamba-2 mixers the zoo leaves at their default sizes (hundreds of heads and state dims): seconds per generate().
SMALLER = {
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=16),
    "inkling_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16),
}


def build(model_type: str):
    """The zoo's tiny model of `model_type` (seed 0), with `SMALLER` mixers."""
    config_class = zoo.config_class_of(model_type)
    kwargs = zoo._shrunk_kwargs(config_class()) | zoo.OVERRIDES.get(model_type, {}) | SMALLER.get(model_type, {})
    torch.manual_seed(0)
    return getattr(transformers, zoo.architectures()[model_type])(config_class(**kwargs)).float().eval()


tiny = functools.cache(build)  # shared by the tests: never changed (enable() gets a model of its own)


def run(model, cache, model_inputs=None, **options):
    """Greedy (unless options say otherwise) generate() of NEW_TOKENS with its scores."""
    model_inputs = zoo.inputs() if model_inputs is None else model_inputs
    torch.manual_seed(0)
    out = model.generate(
        **model_inputs,
        past_key_values=cache,
        max_new_tokens=NEW_TOKENS,
        output_scores=True,
        return_dict_in_generate=True,
        **{"do_sample": False, **options},
    )
    return out.sequences, torch.stack(out.scores)


def assert_same(got, expected):
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], **zoo.TOLERANCE)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_beams_and_sampling_match_dynamic_cache_and_free_every_block(model_type):
    model = tiny(model_type)
    for options in (dict(), dict(num_beams=3), dict(do_sample=True, num_return_sequences=2, top_k=20)):
        pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
        with PagedCache(config=model.config, pool=pool) as cache:
            got = run(model, cache, **options)
            assert pool.num_used_blocks > 0
        assert pool.num_used_blocks == 0, options
        assert_same(got, run(model, DynamicCache(config=model.config), **options))


@pytest.mark.parametrize(
    ("model_type", "layer_classes", "kv_layers"),
    [
        ("qwen3_next", (LinearAttentionLayer, PagedLayer), (1,)),
        ("falcon_h1", (PagedHybridLayer, PagedHybridLayer), (0, 1)),
        ("nemotron_h", (LinearAttentionLayer, DummyLayer, PagedLayer, DummyLayer), (2,)),
    ],
)
def test_only_attention_layers_get_pool_storage(model_type, layer_classes, kv_layers):
    config = tiny(model_type).config
    layout = KVLayout.from_config(config)
    assert layout.kv_layers == kv_layers and layout.num_layers == len(kv_layers)
    cache = PagedCache(config=config)
    assert tuple(type(layer) for layer in cache.layers) == layer_classes
    assert len(cache.layers) == config.num_hidden_layers


def test_a_hybrid_layer_is_both_a_state_layer_and_a_paged_layer():
    model = tiny("falcon_h1")
    cache = PagedCache(config=model.config)
    run(model, cache)
    layer = cache.layers[1]
    assert layer.has_previous_state[0] and layer.conv_states[0].shape[0] == 2  # the mamba part, per row
    assert layer.get_seq_length() == zoo.PROMPT_LEN + NEW_TOKENS - 1  # the attention part, in the pool
    assert cache.layer_block_tables(1) and cache.get_seq_length() == layer.get_seq_length()


@torch.no_grad()
def test_beam_reorder_moves_states_with_block_tables():
    model = tiny("qwen3_next")
    cache = PagedCache(config=model.config)
    model(**zoo.inputs(batch=3), past_key_values=cache)
    state = cache.layers[0].recurrent_states[0].clone()  # [3, heads, k_dim, v_dim]
    tables = cache.block_tables
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(cache.layers[0].recurrent_states[0], state[[2, 2, 0]], rtol=0, atol=0)
    assert cache.block_tables == [tables[2], tables[2], tables[0]]
    cache.batch_select_indices(torch.tensor([2]))
    torch.testing.assert_close(cache.layers[0].recurrent_states[0], state[[0]], rtol=0, atol=0)
    assert cache.block_tables == [tables[0]]


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2"])
@torch.no_grad()
def test_batch_repeat_interleave_continues_like_a_batch_of_copies(model_type):
    """A prompt prefilled once and repeated continues exactly like the prompt prefilled in every row."""
    model = tiny(model_type)
    prompt = zoo.inputs(batch=1)["input_ids"]
    paged = PagedCache(config=model.config)
    model(prompt, past_key_values=paged)
    paged.batch_repeat_interleave(3)
    dynamic = DynamicCache(config=model.config)
    model(prompt.repeat(3, 1), past_key_values=dynamic)
    next_tokens = torch.tensor([[5], [6], [7]])
    got = model(next_tokens, past_key_values=paged).logits
    expected = model(next_tokens, past_key_values=dynamic).logits
    torch.testing.assert_close(got, expected, **zoo.TOLERANCE)


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
@torch.no_grad()
def test_deepcopy_branches_states_and_blocks(model_type):
    model = tiny(model_type)
    prompt = zoo.inputs(batch=1)["input_ids"]
    paged, dynamic = PagedCache(config=model.config), DynamicCache(config=model.config)
    model(prompt, past_key_values=paged)
    model(prompt, past_key_values=dynamic)
    branch, dynamic_branch = copy.deepcopy(paged), copy.deepcopy(dynamic)
    for token, (cache, reference) in zip((9, 17), ((paged, dynamic), (branch, dynamic_branch))):
        for step in range(3):  # each continues on its own: the other's states and blocks stay as they were
            ids = torch.tensor([[token + step]])
            got = model(ids, past_key_values=cache).logits
            torch.testing.assert_close(got, model(ids, past_key_values=reference).logits, **zoo.TOLERANCE)
    branch.release()
    paged.release()
    assert paged.pool.num_used_blocks == 0


def test_release_forgets_states_so_the_cache_serves_another_batch():
    model = tiny("jamba")
    cache = PagedCache(config=model.config)
    run(model, cache)
    cache.release()
    assert not cache.layers[0].has_previous_state[0] and cache.pool.num_used_blocks == 0
    single = zoo.inputs(batch=1)
    assert_same(run(model, cache, single), run(model, DynamicCache(config=model.config), single))


@torch.no_grad()
def test_caches_of_one_shared_pool_keep_their_own_states():
    model = tiny("qwen3_next")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    first, second = PagedCache(config=model.config, pool=pool), PagedCache(config=model.config, pool=pool)
    other_prompt = zoo.inputs(batch=1, length=5)["input_ids"].flip(1)
    reference = DynamicCache(config=model.config)
    model(other_prompt, past_key_values=second)  # holds blocks and states while the first cache generates
    model(other_prompt, past_key_values=reference)
    assert_same(run(model, first), run(model, DynamicCache(config=model.config)))
    first.release()
    ids = torch.tensor([[7]])
    got = model(ids, past_key_values=second).logits
    torch.testing.assert_close(got, model(ids, past_key_values=reference).logits, **zoo.TOLERANCE)
    second.release()
    assert pool.num_used_blocks == 0


@torch.no_grad()
def test_crop_rolls_back_conv_states_like_dynamic_cache():
    model = tiny("lfm2")  # conv + attention: no recurrent state, so transformers' layer can crop
    prompt = zoo.inputs(batch=1)["input_ids"]
    caches = PagedCache(config=model.config), DynamicCache(config=model.config)
    for cache in caches:
        model(prompt, past_key_values=cache)
        cache.activate_past_recording()
        model(torch.tensor([[3, 4, 5]]), past_key_values=cache)
        cache.crop(-2)
        cache.crop(0)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == prompt.shape[1] + 1
    for step in range(2):
        ids = torch.tensor([[11 + step]])
        torch.testing.assert_close(
            model(ids, past_key_values=caches[0]).logits, model(ids, past_key_values=caches[1]).logits, **zoo.TOLERANCE
        )


def test_prompt_lookup_decoding_matches_dynamic_cache_on_a_croppable_hybrid():
    model = tiny("lfm2")
    model_inputs = {key: value[:1] for key, value in zoo.inputs(batch=1).items()}
    model_inputs["input_ids"] = model_inputs["input_ids"].repeat(1, 3)  # repeats give the lookup candidates
    model_inputs["attention_mask"] = torch.ones_like(model_inputs["input_ids"])
    got = run(model, PagedCache(config=model.config), model_inputs, prompt_lookup_num_tokens=3)
    expected = run(model, DynamicCache(config=model.config), model_inputs, prompt_lookup_num_tokens=3)
    assert torch.equal(got[0], expected[0])


@torch.no_grad()
def test_crop_of_a_recurrent_state_is_refused_and_changes_nothing():
    model = tiny("qwen3_next")
    cache = PagedCache(config=model.config)
    cache.activate_past_recording()
    model(zoo.inputs(batch=1)["input_ids"], past_key_values=cache)
    assert not cache.is_croppable  # generate() refuses assisted decoding on this, as with DynamicCache
    with pytest.raises(UnsupportedModel, match="'qwen3_next'.*recurrent state") as error:
        cache.crop(-2)
    assert error.value.path == "PagedCache.crop"
    assert cache.get_seq_length() == zoo.PROMPT_LEN


def test_prefix_reuse_is_refused_for_hybrids():
    model = tiny("jamba")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = zoo.inputs(batch=1)["input_ids"]
    with pytest.raises(UnsupportedModel, match="'jamba'.*cannot be rebuilt from the K/V blocks"):
        PagedCache.from_prefix(pool, prompt, model.config)
    cache = PagedCache(config=model.config, pool=pool)  # a prefix-caching pool still serves it, without reuse
    sequences, _ = run(model, cache, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})
    with pytest.raises(UnsupportedModel, match="release"):
        cache.release(token_ids=sequences)
    assert pool.num_used_blocks == 0 and pool.allocator.num_cached_blocks == 0


def test_a_cache_on_a_hybrid_pool_needs_the_config():
    pool = BlockPool.for_model(tiny("qwen3_next"), num_blocks=8)
    with pytest.raises(ValueError, match=r"decoder layers \[1\] only.*PagedCache\(config=model.config, pool=pool\)"):
        PagedCache(pool=pool)


def test_engine_serves_hybrids_one_forward_per_request():
    """Qwen3-Next in the Engine: the per-request step, each request's recurrent states kept between its forwards
    (prompts in chunks over cached tokens, preemption computing one again from scratch), prefix caching off; every
    request's tokens equal generate() of its prompt alone."""
    model = tiny("qwen3_next")
    prompts = [zoo.inputs(batch=1, length=n)["input_ids"][0].tolist() for n in (13, 7, 10)]
    new_tokens = [6, 9, 4]
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
        for p, n in zip(prompts, new_tokens)
    ]
    # blocks of 4, 5 tokens a step: prompts in chunks; 9 blocks for 3 requests of up to 19 tokens: preemption
    pool = BlockPool.for_model(model, num_blocks=9, block_size=4)
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=5, decode_reserve_tokens=0)
    assert engine.step_mode == "per-request" and "hybrid model" in engine.step_mode_reason
    assert not engine.scheduler.prefix.enabled
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == expected
    assert engine.stats.num_preemptions > 0 and pool.num_used_blocks == 0


@pytest.mark.parametrize("loss", ["lost", "undone"])
def test_a_hybrid_request_whose_states_do_not_match_its_cache_is_computed_again(loss):
    """States lost to a forward that failed part-way (`None`), or that saw other tokens than the cache holds (a step
    undone after they advanced): the request's next forward computes it again from its first token over its own
    blocks, and it gives generate()'s tokens, as does the request beside it."""
    model = tiny("qwen3_next")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    engine = Engine(model, pool, max_num_seqs=2, max_num_batched_tokens=8)
    prompts = [zoo.inputs(batch=1, length=n)["input_ids"][0].tolist() for n in (10, 6)]
    first = engine.add_request(prompts[0], max_new_tokens=3)
    engine.step()  # the first prompt's first chunk: its states made
    request = engine.request(first)
    assert request.states is not None and request.states.num_tokens == request.num_computed > 0
    if loss == "lost":
        request.states = None  # what a forward that raised part-way leaves
    else:  # as if they had advanced over 2 more tokens in a step that was then undone
        for layer in request.states.layers:
            if isinstance(layer, LinearAttentionLayer):
                for states in (layer.conv_states, layer.recurrent_states):
                    for index, state in states.items():
                        if state is not None:
                            states[index] = state + 1.0
        request.states.num_tokens += 2
    other = engine.add_request(prompts[1], max_new_tokens=3)
    while engine.has_unfinished():
        engine.step()
    finished = {request.request_id: request for request in engine.pop_finished()}
    for request_id, prompt in ((first, prompts[0]), (other, prompts[1])):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, len(prompt) :]
        assert finished[request_id].output_ids == expected.tolist() and finished[request_id].states is None
    assert pool.num_used_blocks == 0


def test_models_without_attention_layers_stay_refused():
    config = zoo.tiny_config("qwen3_next")
    config.layer_types = ["linear_attention"] * config.num_hidden_layers
    with pytest.raises(UnsupportedModel, match="none of its layers holds attention K/V"):
        PagedCache(config=config)


def test_enable_refuses_per_query_attention_sinks():
    model = zoo.tiny_model("inkling2_text", zoo.architectures()["inkling2_text"])
    with pytest.raises(UnsupportedModel, match="'inkling2_text'.*sinks"):
        hf_paged.enable(model)


def test_a_step_stopped_by_pool_exhausted_leaves_the_cache_good_for_release_only():
    """The states of the layers before the failing attention layer advanced: running the step again would advance
    them twice, so the cache refuses every update until release()."""
    model = tiny("qwen3_next")
    pool = BlockPool.for_model(model, num_blocks=2, block_size=4)  # 8 tokens: the prompt, not one more
    cache = PagedCache(config=model.config, pool=pool)
    prompt = zoo.inputs(batch=1)["input_ids"]
    with torch.no_grad():
        model(prompt, past_key_values=cache)
        with pytest.raises(PoolExhausted):
            model(torch.tensor([[5]]), past_key_values=cache)
        with pytest.raises(IncompleteStep, match="'qwen3_next'.*release"):
            model(torch.tensor([[5]]), past_key_values=cache)
    cache.release()
    assert pool.num_used_blocks == 0
    short = {"input_ids": prompt[:, :5], "attention_mask": torch.ones_like(prompt[:, :5])}
    got = model.generate(**short, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, model.generate(**short, max_new_tokens=3, do_sample=False))


def test_a_forward_with_autograd_after_a_state_layer_leaves_the_cache_good_for_release_only():
    """Qwen3-Next's layer 0 (linear attention) advanced its states before layer 1's K/V, which require grad, were
    refused: the step cannot run again on those states."""
    model = tiny("qwen3_next")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    cache = PagedCache(config=model.config, pool=pool)
    prompt = zoo.inputs(batch=1)["input_ids"]
    with pytest.raises(GradientsUnsupported, match="layer 1's"):
        model(prompt, past_key_values=cache)
    assert pool.num_used_blocks == 0
    with torch.no_grad(), pytest.raises(IncompleteStep, match="GradientsUnsupported.*release"):
        model(prompt, past_key_values=cache)
    cache.release()
    with torch.no_grad():
        got = model(prompt, past_key_values=cache).logits
    torch.testing.assert_close(got, model(prompt).logits.detach())
    cache.release()
    assert pool.num_used_blocks == 0


def test_paged_decode_applies_a_position_bias():
    """Inkling passes its relative logits as `position_bias`: a decode step through the Triton kernel (interpreted
    on CPU) would drop it, so such a step gathers its K/V and runs SDPA, which adds it."""
    model = build("inkling_text")  # its own: enable() changes it
    expected = run(model, DynamicCache(config=model.config))
    hf_paged.enable(model, backend="triton")
    assert_same(run(model, PagedCache(config=model.config)), expected)


def test_mlp_only_layers_in_generate_and_the_engine():
    """Nemotron-H's MLP-only layers take no pool layer: generate() with a PagedCache serves it, and the Engine runs
    it per request (its packed step maps cache layers to pool layers one to one), mapping decoder layers to the
    pool's."""
    config = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layer_types=["mlp", "full_attention", "mlp", "full_attention"], mamba_num_heads=4,
        mamba_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    assert KVLayout.from_config(config).kv_layers == (1, 3)
    prompt = torch.randint(0, 128, (1, 9))
    options = dict(max_new_tokens=6, do_sample=False)
    expected = model.generate(prompt, past_key_values=DynamicCache(config=config), **options)
    assert torch.equal(model.generate(prompt, past_key_values=PagedCache(config=config), **options), expected)
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    engine = Engine(model, pool, max_num_seqs=2, max_num_batched_tokens=4)  # the prompt in chunks
    assert engine.step_mode == "per-request" and "layers [0, 2] are MLP-only" in engine.step_mode_reason
    assert engine.generate([prompt[0].tolist()], max_new_tokens=6, ignore_eos=True) == [expected[0, 9:].tolist()]
    assert pool.num_used_blocks == 0


def test_pool_layers_maps_cache_layers_to_pool_layers():
    """The one decoder-to-pool layer map the caches use: a hybrid model's attention layers only, a looped model's
    per-loop copies after its decoder layers."""
    hybrid = KVLayout.from_config(zoo.tiny_config("qwen3_next"))  # a linear-attention layer, then attention
    assert hybrid.kv_layers == (1,) and hybrid.pool_layers(2) == [None, 0]
    looped = KVLayout.from_config(zoo.tiny_config("dory"))  # 3 decoder layers, the middle one looped twice
    assert looped.num_layers == 4 and looped.pool_layers(4) == [0, 1, 2, 3]
