"""The registered "hf_paged" attention: generate() through it equals DynamicCache + sdpa, on both backends.

The Triton path runs in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1), so these cases
keep generations short.
"""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import hf_paged
from hf_paged import PAGED_ATTENTION, BlockPool, PagedCache
from hf_paged.attention import plan_of
from hf_paged.attention.kernels.launch_config import INDEX_DTYPE
from tests.models import (
    count_decode_launches,
    count_store_launches,
    left_padded_batch,
    random_prompt,
    require_triton_on_cpu,
    tiny_model,
)

MAX_NEW_TOKENS = 6  # mistral's window is 8: prompts of 12 already slide, and its blocks get released


def _generate(model, cache, mode):
    kwargs = dict(past_key_values=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    if mode == "batch1":
        return model.generate(random_prompt(12), **kwargs)
    if mode == "padded3":
        input_ids, attention_mask = left_padded_batch(3, 12)
        return model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    if mode == "beams":
        return model.generate(random_prompt(12), num_beams=3, num_return_sequences=2, **kwargs)
    raise ValueError(mode)


def test_registered_with_transformers():
    assert PAGED_ATTENTION in AttentionInterface._global_mapping
    assert PAGED_ATTENTION in AttentionMaskInterface._global_mapping
    assert AttentionInterface._global_mapping[PAGED_ATTENTION] is hf_paged.paged_attention_forward


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["batch1", "padded3", "beams"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gpt2", "mistral"])
def test_generate_through_paged_attention_matches_sdpa(name, mode, backend, monkeypatch):
    if backend == "triton":
        require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", backend)
    kernel_calls = count_decode_launches(monkeypatch)
    store_calls = count_store_launches(monkeypatch)  # the Triton store kernel's launches
    reference = _generate(tiny_model(name, "sdpa"), DynamicCache(config=tiny_model(name, "sdpa").config), mode)
    model = tiny_model(name, PAGED_ATTENTION)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    with PagedCache(config=model.config, pool=pool) as cache:
        out = _generate(model, cache, mode)
    assert torch.equal(out, reference)
    assert pool.num_used_blocks == 0
    # Every decode step of every layer went through the kernel on "triton", none on "torch" (gather + SDPA).
    num_layers = model.config.num_hidden_layers
    assert len(kernel_calls) == (num_layers * (MAX_NEW_TOKENS - 1) if backend == "triton" else 0)
    # New rows go through the Triton store kernel on "triton" (prefill and decode), index_copy_ on "torch".
    assert len(store_calls) == (num_layers * MAX_NEW_TOKENS if backend == "triton" else 0)


@pytest.mark.parametrize("mode", ["batch1", "padded3"])
def test_non_paged_cache_behaves_exactly_like_sdpa(mode):
    reference = _generate(tiny_model("llama", "sdpa"), DynamicCache(), mode)
    out = _generate(tiny_model("llama", PAGED_ATTENTION), DynamicCache(), mode)
    assert torch.equal(out, reference)


def test_decode_step_returns_a_plan_instead_of_gathered_kv():
    model = tiny_model("llama", PAGED_ATTENTION)
    cache = PagedCache(config=model.config)
    config = model.config
    num_kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    prefill = torch.randn(2, num_kv_heads, 5, head_dim)
    keys, _ = cache.update(prefill, prefill, 0)
    assert keys.shape == (2, num_kv_heads, 5, head_dim)  # prefill: gathered K/V for SDPA
    assert plan_of(keys) is None
    step = torch.randn(2, num_kv_heads, 1, head_dim)
    keys, _ = cache.update(step, step, 0)
    assert keys.shape == (2, num_kv_heads, 0, head_dim)
    plan = plan_of(keys)
    assert plan.seq_lens.tolist() == [6, 6] and plan.block_tables.dtype == plan.seq_lens.dtype == INDEX_DTYPE
    gathered, _ = plan.gather()
    assert torch.equal(gathered[:, :, :5], prefill) and torch.equal(gathered[:, :, 5:], step)
    # The plan's pool view is [num_blocks, block_size, kv_heads, head_dim] and holds the new token in place.
    block, offset = plan.block_tables[0, 5 // cache.block_size], 5 % cache.block_size
    assert torch.equal(plan.key_cache[block, offset], step[0, :, 0])
    cache.release()


def test_a_layer_hands_each_step_its_plan_on_the_same_placeholders():
    model = tiny_model("llama", PAGED_ATTENTION)
    cache = PagedCache(config=model.config)
    num_kv_heads, head_dim = (
        model.config.num_key_value_heads,
        model.config.hidden_size // model.config.num_attention_heads,
    )
    prompt = torch.randn(1, num_kv_heads, 5, head_dim)
    cache.update(prompt, prompt, 0)
    steps = [torch.randn(1, num_kv_heads, 1, head_dim) for _ in range(3)]
    handed = [cache.update(step, step, 0) for step in steps[:2]]
    # the same two empty tensors, each time with that step's plan: the step's lengths and its token in the pool
    assert handed[0][0] is handed[1][0] and handed[0][1] is handed[1][1]
    plan = plan_of(handed[1][0])
    assert plan is plan_of(handed[1][1]) and plan.seq_lens.tolist() == [7]
    assert torch.equal(plan.gather()[0][:, :, 6:], steps[1])
    # new ones where the states change shape or the inference mode changes
    with torch.inference_mode():
        keys, _ = cache.update(steps[2], steps[2], 0)
    assert keys is not handed[0][0] and keys.is_inference() and plan_of(keys).seq_lens.tolist() == [8]
    cache.release()


def test_a_dropped_cache_frees_its_pool_without_the_garbage_collector():
    """A layer's placeholders keep its last plan between steps: nothing they reach may point back at the cache, or a
    dropped cache's private pool would wait for a garbage collection."""
    import gc
    import weakref

    model = tiny_model("llama", PAGED_ATTENTION)
    gc.collect()
    gc.disable()
    try:
        cache = PagedCache(config=model.config)
        model.generate(random_prompt(12), past_key_values=cache, max_new_tokens=4, do_sample=False)
        pool = weakref.ref(cache.pool)
        pool_tensor = weakref.ref(cache.pool.key_cache[0])
        del cache
        assert pool() is None and pool_tensor() is None
    finally:
        gc.enable()


def test_a_grown_pool_frees_its_old_tensors_though_its_layers_keep_placeholders():
    """A layer's kept placeholders lose their plan (which views the pool) at each step's start, at a grow and at
    release, so a growing private pool's old tensors go at the grow, as without them."""
    import gc
    import weakref

    model = tiny_model("llama", PAGED_ATTENTION)
    config = model.config
    num_kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    gc.collect()
    gc.disable()
    try:
        cache = PagedCache(config=config)
        prompt = torch.randn(1, num_kv_heads, 5, head_dim)
        for layer in range(config.num_hidden_layers):
            cache.update(prompt, prompt, layer)
        old_tensor, num_blocks = weakref.ref(cache.pool.key_cache[1]), cache.pool.num_blocks
        step = torch.randn(1, num_kv_heads, 1, head_dim)
        while cache.pool.num_blocks == num_blocks:
            kept = [cache.update(step, step, layer)[0] for layer in range(config.num_hidden_layers)]
        assert plan_of(kept[-1]) is not None and old_tensor() is None
        cache.release()
        assert plan_of(kept[-1]) is None
    finally:
        gc.enable()


def test_a_grow_in_a_step_keeps_the_plans_of_kv_sharing_source_layers():
    """Later layers of a step attend through a KV-sharing source layer's placeholders again: a grow in that step
    takes the other layers' plans off (their pool views go), not a source's; the next step's start takes all off."""
    from hf_paged.cache.visible import VisibleKV

    visible = VisibleKV(tables=None, config=None, latent=False, kv_sources=frozenset({0}))
    visible._reuse_placeholders = True
    states = torch.zeros(1, 2, 1, 8)
    plans = {layer: object() for layer in (0, 1)}
    handed = {layer: visible._placeholders_of(layer, states, states, plan)[0] for layer, plan in plans.items()}
    visible.drop_plans(in_step=True)
    assert plan_of(handed[0]) is plans[0] and plan_of(handed[1]) is None
    visible.drop_plans()
    assert plan_of(handed[0]) is None


def test_kv_start_reads_left_padding_and_refuses_holes():
    model = tiny_model("llama", PAGED_ATTENTION)
    cache = PagedCache(config=model.config)
    states = torch.randn(2, 2, 4, 16)
    cache.update(states, states, 0)
    keys, _ = cache.update(states[:, :, :1], states[:, :, :1], 0)
    plan = plan_of(keys)
    padded = torch.tensor([[False, False, True, True, True], [True] * 5])[:, None, None, :]
    assert plan.kv_start(padded).tolist() == [2, 0]
    assert plan.kv_start(None).tolist() == [0, 0]
    holes = torch.tensor([[True, False, True, True, True], [True] * 5])[:, None, None, :]
    assert plan.kv_start(holes) is None  # the attention falls back to gather + SDPA
    cache.release()


def test_enable_switches_a_model_and_validates_the_backend():
    model = tiny_model("gpt2", "sdpa", seed=3)  # a private instance: enable() mutates it
    with pytest.raises(ValueError, match="'auto', 'triton', 'torch'"):
        hf_paged.enable(model, backend="cuda-graphs")
    hf_paged.enable(model, backend="torch")
    assert model.config._attn_implementation == PAGED_ATTENTION
    reference = _generate(tiny_model("gpt2", "sdpa", seed=3), DynamicCache(), "padded3")
    with PagedCache(config=model.config) as cache:
        assert torch.equal(_generate(model, cache, "padded3"), reference)
    model.set_attn_implementation("sdpa")


def test_a_backend_spelled_in_capitals_runs_the_engines_decode_steps():
    """`enable(model, backend=" Torch ")` is accepted as "torch" (as `resolve_backend` reads it), and the modules
    carry it so: the plans look the setting up among BACKENDS, and the Engine's decode runner gives generate()'s
    tokens."""
    import copy

    from hf_paged import BlockPool, Engine
    from hf_paged.attention.plan import BACKEND_ATTR

    model = hf_paged.enable(copy.deepcopy(tiny_model("llama", "sdpa", seed=5)), backend=" Torch ")  # cached: a copy
    assert {getattr(m, BACKEND_ATTR) for m in model.modules() if hasattr(m, BACKEND_ATTR)} == {"torch"}
    prompt = random_prompt(12)
    reference = tiny_model("llama", "sdpa", seed=5).generate(
        prompt, past_key_values=DynamicCache(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
    )
    engine = Engine(model, BlockPool.for_model(model, num_blocks=16))
    out = engine.generate([prompt[0].tolist()], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert out[0] == reference[0, prompt.shape[1] :].tolist()
    assert engine.runner.stats.eager_steps > 0
    for module in model.modules():  # a setting put on the modules by hand, spelled otherwise: resolved as given
        if hasattr(module, BACKEND_ATTR):
            setattr(module, BACKEND_ATTR, "TORCH")
    out = engine.generate([prompt[0].tolist()], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert out[0] == reference[0, prompt.shape[1] :].tolist()


def test_from_pretrained_with_the_registered_name(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("qwen3", "sdpa").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=PAGED_ATTENTION).eval()
    assert model.config._attn_implementation == PAGED_ATTENTION
    reference = _generate(tiny_model("qwen3", "sdpa"), DynamicCache(), "padded3")
    with PagedCache(config=model.config) as cache:
        assert torch.equal(_generate(model, cache, "padded3"), reference)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])  # full; every layer sliding; mixed
def test_a_second_turn_reads_the_pool_through_the_paged_prefill_kernel(name, backend, monkeypatch):
    """A second generate() on the same cache (a chat's next turn): its prompt is several tokens over cached ones, a
    step the "hf_paged" attention runs through the paged prefill kernel on the Triton backend (the mask checked to
    be causal after each row's padding, within the window), and through gather + SDPA on torch; both give
    DynamicCache's tokens, on a left-padded batch."""
    if backend == "triton":
        require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", backend)
    calls = []
    kernel = hf_paged.attention.prefill_plan.paged_prefill_attention
    monkeypatch.setattr(
        hf_paged.attention.prefill_plan, "paged_prefill_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    input_ids, attention_mask = left_padded_batch(3, 12)
    follow_up = torch.randint(1, 128, (3, 5), generator=torch.Generator().manual_seed(1))

    def two_turns(model, cache):
        first = model.generate(
            input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=4, do_sample=False
        )
        second_ids = torch.cat([first, follow_up], dim=1)
        second_mask = torch.cat([attention_mask, torch.ones(3, 4 + 5, dtype=attention_mask.dtype)], dim=1)
        return model.generate(
            second_ids, attention_mask=second_mask, past_key_values=cache, max_new_tokens=4, do_sample=False
        )

    sdpa = tiny_model(name, "sdpa")
    expected = two_turns(sdpa, DynamicCache(config=sdpa.config))
    model = tiny_model(name, PAGED_ATTENTION)
    with PagedCache(config=model.config, pool=BlockPool.for_model(model, num_blocks=64, block_size=4)) as cache:
        assert torch.equal(two_turns(model, cache), expected)
    # the second turn's prompt step, in every layer
    assert len(calls) == (model.config.num_hidden_layers if backend == "triton" else 0)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, value_dim",
    [(4, 2, 16, 16), (4, 4, 32, 32), (8, 1, 64, 64), (4, 2, 16, 8), (4, 2, 320, 320), (4, 4, 320, 320), (4, 4, 16, 8)],
)
def test_decode_sdpa_is_transformers_sdpa_bit_for_bit(heads, kv_heads, head_dim, value_dim):
    """A decode step's SDPA called directly gives what transformers' `sdpa_attention_forward` gives (the same call),
    on strided K/V as a gather leaves them; it does not apply where the wrapper would pack the query's groups (head
    sizes it does not pass to SDPA's GQA), apply a position bias or sinks, or see more than one new token."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_paged.attention.torch_attention import decode_sdpa, decode_sdpa_applies, sdpa_or_torch_attention

    generator = torch.Generator().manual_seed(heads * head_dim + value_dim)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    query = torch.randn(3, heads, 1, head_dim, generator=generator)
    key = torch.randn(3, kv_heads, 40, head_dim, generator=generator)[:, :, :37]  # strided, as gathered
    value = torch.randn(3, kv_heads, 40, value_dim, generator=generator)[:, :, :37]
    reference, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3, position_ids=None)
    applies = decode_sdpa_applies(module, query, head_dim, value_dim, {"position_ids": None})
    assert applies == (heads == kv_heads or head_dim == value_dim <= 256)  # else the wrapper packs the groups
    if applies:
        direct = decode_sdpa(module, query, key, value, 0.0, 0.3)
        assert direct.shape == (3, 1, heads, value_dim) and torch.equal(direct, reference)
    assert torch.equal(sdpa_or_torch_attention(module, query, key, value, None, scaling=0.3)[0], reference)
    bias = torch.randn(3, heads, 1, 37, generator=generator)
    assert not decode_sdpa_applies(module, query, head_dim, value_dim, {"position_bias": bias})
    assert not decode_sdpa_applies(module, query, head_dim, value_dim, {"s_aux": torch.zeros(heads)})
    two_tokens = torch.randn(3, heads, 2, head_dim, generator=generator)
    assert not decode_sdpa_applies(module, two_tokens, head_dim, value_dim, {})
