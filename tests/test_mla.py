"""Multi-head latent attention (DeepSeek-V2/V3) and K/V of different widths: every path identical to DynamicCache.

MLA models cache two latents per token, `[B, 1, S, kv_lora_rank]` as K and `[B, 1, S, qk_rope_head_dim]` as V, and
expand them to every head after `cache.update()`. The pool keeps K and V shapes per layer (`KVLayout.key_shape` /
`value_shape`); a cache returns the stored latents themselves (never a decode plan), and the Engine hands its packed
step's plan to attention beside the expanded K/V. MiMo-V2-Flash-style layers (`v_head_dim != head_dim`) do take a
decode plan, and the paged kernels, which read K and V of one shape, leave them to the torch path.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    DynamicCache,
    MiMoV2FlashConfig,
    MiMoV2FlashForCausalLM,
)
from transformers.models.mistral_large4.configuration_mistral_large4 import MistralLarge4TextConfig
from transformers.models.mistral_large4.modeling_mistral_large4 import MistralLarge4TextModel

import hf_paged
from hf_paged import (
    BlockPool,
    Engine,
    KVLayout,
    PagedCache,
    PoolMismatch,
    UnsupportedCacheAttribute,
    UnsupportedModel,
)
from hf_paged.attention import paged_attention_forward, store_kv_rows
from hf_paged.attention.kernels import paged_decode_attention
from hf_paged.cache.visible import VisibleKV
from hf_paged.engine import StepCache
from hf_paged.storage import block_windows
from tests.models import _COMMON, count_decode_launches, left_padded_batch, random_prompts, require_triton_on_cpu
from tests.zoo import tiny_model as zoo_model

KV_LORA_RANK, ROPE_DIM, NOPE_DIM, V_HEAD_DIM = 32, 16, 16, 8  # K latent 32 wide, V latent 16, expanded V 8
NUM_LAYERS = 2

_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS, max_position_embeddings=256)
_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=KV_LORA_RANK,
    qk_rope_head_dim=ROPE_DIM,
    qk_nope_head_dim=NOPE_DIM,
    v_head_dim=V_HEAD_DIM,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
)


def mla_config(name: str):
    if name == "deepseek_v3":  # q through a low-rank projection, interleaved rope
        return DeepseekV3ForCausalLM, DeepseekV3Config(**_COMMON, **_DECODER, **_MLA, q_lora_rank=32)
    if name == "deepseek_v2":  # q through a full projection
        return DeepseekV2ForCausalLM, DeepseekV2Config(**_COMMON, **_DECODER, **_MLA, q_lora_rank=None)
    if name == "deepseek_v32":  # MLA with DeepSeek Sparse Attention: each query attends the indexer's top 4 keys
        config = DeepseekV32Config(
            **_COMMON, **_DECODER, **_MLA, q_lora_rank=32, index_topk=4, index_head_dim=32, index_n_heads=2
        )
        return DeepseekV32ForCausalLM, config
    if name == "mimo":  # not MLA: K head_dim 32, V head_dim 16; a sliding layer (with sinks) and a full one
        config = MiMoV2FlashConfig(
            **_COMMON,
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            v_head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"],
        )
        return MiMoV2FlashForCausalLM, config
    raise ValueError(name)


@functools.cache
def mla_model(name: str = "deepseek_v3", paged_attention: bool = False):
    """A tiny random-weight model on its default attention (sdpa; eager for MiMo), or with `paged_attention` after
    `hf_paged.enable` (torch backend unless HF_PAGED_ATTENTION_BACKEND says otherwise). Cached: do not mutate."""
    model_class, config = mla_config(name)
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    return hf_paged.enable(model) if paged_attention else model


def _generate(model, cache, **options):
    input_ids, attention_mask = left_padded_batch(batch=3, length=10)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        max_new_tokens=6,
        output_scores=True,
        return_dict_in_generate=True,
        **options,
    )
    return out.sequences, out.scores


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for got_scores, expected_scores in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(got_scores, expected_scores, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------ layout
def test_layout_holds_the_latent_shapes_of_k_and_v():
    layout = KVLayout.from_config(mla_config("deepseek_v3")[1])
    assert layout.latent
    assert layout.key_shape(0) == (1, KV_LORA_RANK) and layout.value_shape(1) == (1, ROPE_DIM)
    assert layout.shapes() == [(1, KV_LORA_RANK, 1, ROPE_DIM)] * NUM_LAYERS
    mimo = KVLayout.from_config(mla_config("mimo")[1])
    assert not mimo.latent
    # MiMo's sliding layer caches twice the kv heads; V is 16 wide where K is 32.
    assert mimo.shapes() == [(4, 32, 4, 16), (2, 32, 2, 16)]
    # V shapes take part in equality: a pool of other V widths does not serve the model.
    assert layout != KVLayout((1,) * NUM_LAYERS, (KV_LORA_RANK,) * NUM_LAYERS)
    with pytest.raises(ValueError, match="value_head_dims needs one entry per layer"):
        KVLayout((1, 1), (32, 32), value_head_dims=(16,))


def test_block_bytes_count_k_and_v_of_their_own_widths():
    config = mla_config("deepseek_v3")[1]
    block_size, itemsize = 4, 4
    bytes_per_block = NUM_LAYERS * block_size * itemsize * (KV_LORA_RANK + ROPE_DIM)  # not 2 * K's width
    assert KVLayout.from_config(config).bytes_per_block(block_size, torch.float32) == bytes_per_block == 1536
    pool = BlockPool.for_model(config, max_memory=10 * bytes_per_block + 100, block_size=block_size)
    assert pool.bytes_per_block == bytes_per_block and pool.num_blocks == 10
    assert pool.key_cache[0].shape == (1, 10, block_size, KV_LORA_RANK)
    assert pool.value_cache[1].shape == (1, 10, block_size, ROPE_DIM)
    model = mla_model("deepseek_v3")
    cache = PagedCache(config=model.config, pool=pool)
    input_ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.num_held_blocks == 3  # 11 tokens cached (the last generated token is never fed back)
    assert cache.held_bytes == 3 * bytes_per_block
    cache.release()
    assert pool.num_used_blocks == 0


def test_states_of_other_shapes_raise_pool_mismatch():
    cache = PagedCache(config=mla_config("deepseek_v3")[1])
    keys = torch.randn(2, 1, 3, KV_LORA_RANK)
    with pytest.raises(PoolMismatch, match=r"V of 1 x 16, the model gave .* value_states of shape \(2, 1, 3, 32\)"):
        cache.update(keys, keys.clone(), 0)
    with pytest.raises(PoolMismatch, match="pool holds 1 kv heads x head_dim 32, key_states have 4 x 32"):
        cache.update(torch.randn(2, 4, 3, KV_LORA_RANK), torch.randn(2, 4, 3, ROPE_DIM), 0)
    with pytest.raises(PoolMismatch, match="value_states are torch.float16"):
        cache.update(keys, torch.randn(2, 1, 3, ROPE_DIM, dtype=torch.float16), 0)
    values = torch.randn(2, 1, 3, ROPE_DIM)
    out_keys, out_values = cache.update(keys, values, 0)
    assert out_keys is keys and out_values is values  # a first prefill returns the step's own latents
    step_keys, step_values = torch.randn(2, 1, 1, KV_LORA_RANK), torch.randn(2, 1, 1, ROPE_DIM)
    out_keys, out_values = cache.update(step_keys, step_values, 0)
    torch.testing.assert_close(out_keys, torch.cat([keys, step_keys], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(out_values, torch.cat([values, step_values], dim=2), rtol=0, atol=0)


def test_a_pool_of_one_kv_shape_does_not_serve_an_mla_model():
    config = mla_config("deepseek_v3")[1]
    pool = BlockPool(KVLayout((1,) * NUM_LAYERS, (KV_LORA_RANK,) * NUM_LAYERS), num_blocks=4)
    with pytest.raises(PoolMismatch, match=r"head_dim \[32\].*\(V: kv heads \[1\] and head_dim \[16\]\)"):
        PagedCache(config=config, pool=pool)


# ------------------------------------------------------------------------------------------------- generate()
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize(
    "options",
    [dict(do_sample=False), dict(do_sample=False, num_beams=3), dict(do_sample=True, top_k=8)],
    ids=["greedy", "beams", "sampling"],
)
def test_generate_equals_dynamic_cache(name, options):
    model = mla_model(name)
    torch.manual_seed(1)
    expected = _generate(model, DynamicCache(config=model.config), **options)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)  # a shared pool: rows gathered block by block
    torch.manual_seed(1)
    _assert_same(_generate(model, PagedCache(config=model.config, pool=pool), **options), expected)
    torch.manual_seed(1)
    _assert_same(_generate(model, PagedCache(config=model.config), **options), expected)  # a private pool


@pytest.mark.parametrize("name", ["deepseek_v3", "mimo"])
def test_enable_equals_dynamic_cache(monkeypatch, name):
    """The "hf_paged" attention: MLA gets the gathered latents on decode steps (a plan would be lost in the model's
    expansion); MiMo gets a decode plan whose V is narrower than K."""
    plans = []
    decode_placeholders = VisibleKV._decode_placeholders

    def recording(self, *args):
        plans.append(args[0])
        return decode_placeholders(self, *args)

    monkeypatch.setattr(VisibleKV, "_decode_placeholders", recording)
    expected = _generate(mla_model(name), None, do_sample=False)
    model = mla_model(name, paged_attention=True)
    _assert_same(_generate(model, PagedCache(config=model.config), do_sample=False), expected)
    assert bool(plans) == (name == "mimo")


def test_decode_plans_of_other_v_widths_leave_the_triton_kernel_for_torch(monkeypatch):
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    kernel_calls = count_decode_launches(monkeypatch)
    expected = _generate(mla_model("mimo"), None, do_sample=False)
    model = mla_model("mimo", paged_attention=True)
    _assert_same(_generate(model, PagedCache(config=model.config), do_sample=False), expected)
    assert not kernel_calls


def test_paged_kernels_refuse_k_and_v_of_different_widths():
    query = torch.randn(2, 4, 32)
    key_cache, value_cache = torch.randn(6, 4, 2, 32), torch.randn(6, 4, 2, 16)
    block_tables, seq_lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"key_cache \(6, 4, 2, 32\) and value_cache \(6, 4, 2, 16\) differ"):
        paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=1.0, backend="torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_writes_k_and_v_of_their_own_widths(backend):
    if backend == "triton":
        require_triton_on_cpu()
    key_cache, value_cache = torch.zeros(1, 3, 4, KV_LORA_RANK), torch.zeros(1, 3, 4, ROPE_DIM)
    keys, values = torch.randn(2, 1, 1, KV_LORA_RANK), torch.randn(2, 1, 1, ROPE_DIM)
    store_kv_rows(key_cache, value_cache, keys, values, torch.tensor([5, 8]), backend=backend)
    torch.testing.assert_close(key_cache[0, 1, 1], keys[0, 0, 0], rtol=0, atol=0)  # slot 5: block 1, offset 1
    torch.testing.assert_close(value_cache[0, 2, 0], values[1, 0, 0], rtol=0, atol=0)  # slot 8: block 2, offset 0
    assert key_cache.count_nonzero() == 2 * KV_LORA_RANK and value_cache.count_nonzero() == 2 * ROPE_DIM


def test_attention_without_keys_or_plan_is_refused():
    module = mla_model("deepseek_v3").model.layers[0].self_attn
    empty = torch.zeros(1, 4, 0, 32)
    with pytest.raises(UnsupportedModel, match="deepseek_v3.*got no keys"):
        paged_attention_forward(module, torch.randn(1, 4, 1, 32), empty, empty, None)


# ----------------------------------------------------------------------------------------------------- Engine
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "mimo"])
def test_engine_equals_generate_of_each_prompt_alone(name):
    prompts, new_tokens = random_prompts((5, 13, 3, 9)), [6, 4, 7, 5]
    reference = mla_model(name)
    expected = [
        reference.generate(torch.tensor([p]), past_key_values=DynamicCache(), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, new_tokens)
    ]
    model = mla_model(name, paged_attention=True)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    # 6 tokens per step: prompts prefilled in chunks over cached tokens, packed with decode rows.
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=6)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == expected
    assert engine.stats.mean_running > 1
    assert pool.num_used_blocks == 0


def test_step_cache_of_a_latent_pool_needs_the_attention_keywords():
    pool = BlockPool.for_model(mla_config("deepseek_v3")[1], num_blocks=8, block_size=4)
    cache = StepCache(pool, [[[0], [1]]], seq_lens=[0, 0], q_lens=[2, 3], model_type="deepseek_v3")
    keys, values = torch.randn(1, 1, 5, KV_LORA_RANK), torch.randn(1, 1, 5, ROPE_DIM)
    with pytest.raises(UnsupportedModel, match="deepseek_v3.*update\\(..., kwargs=kwargs\\)"):
        cache.update(keys, values, 0)
    attention_kwargs = {}
    out_keys, out_values = cache.update(keys, values, 0, kwargs=attention_kwargs)
    # Every row's latents, padded to the longest row (3 keys); the plan waits in the attention keywords.
    assert out_keys.shape == (2, 1, 3, KV_LORA_RANK) and out_values.shape == (2, 1, 3, ROPE_DIM)
    torch.testing.assert_close(out_keys[:1, :, :2], keys[:, :, :2], rtol=0, atol=0)
    torch.testing.assert_close(out_values[1:], values[:, :, 2:], rtol=0, atol=0)
    assert list(attention_kwargs) == [hf_paged.attention.plan.EXPANDED_PLAN_KWARG]


def test_every_tensor_parallel_rank_holds_the_whole_latent():
    config = mla_config("deepseek_v3")[1]
    layout = KVLayout.from_config(config, tp_size=2)  # heads are split only after the model expands the latent
    assert layout.tp_size == 2 and layout.shapes() == [(1, KV_LORA_RANK, 1, ROPE_DIM)] * NUM_LAYERS
    pool = BlockPool.for_model(config, tp_size=2, num_blocks=4)
    PagedCache(config=config, pool=pool)  # the config's layout fits the pool of one rank
    with pytest.raises(ValueError, match="need one int factor per layer"):
        layout.shard((2,))


# ----------------------------------------------------------------------------------------- DeepSeek Sparse Attention
@pytest.mark.parametrize("options", [dict(), dict(num_beams=3)], ids=["greedy", "beams"])
def test_indexed_attention_equals_dynamic_cache(options):
    """Indexer keys kept beside the paged K/V; with the "hf_paged" attention, the top-k indices the model hands the
    attention function (instead of folding them into the mask, as it does for sdpa) are folded in there."""
    expected = _generate(mla_model("deepseek_v32"), None, do_sample=False, **options)
    for model in (mla_model("deepseek_v32"), mla_model("deepseek_v32", paged_attention=True)):
        cache = PagedCache(config=model.config)
        _assert_same(_generate(model, cache, do_sample=False, **options), expected)
        rows = 3 * options.get("num_beams", 1)
        assert _indexer_bytes(cache) == NUM_LAYERS * rows * 15 * 32 * 4  # 10 prompt + 5 fed back tokens, 32 wide


def _indexer_bytes(cache: PagedCache) -> int:
    """Bytes of the indexer keys (and position ids) of "indexed_attention" layers a cache keeps beside the pool."""
    indexer = cache._rows.indexer
    return sum(t.numel() * t.element_size() for t in (*indexer.keys.values(), *indexer.positions.values()))


def test_indexer_keys_follow_the_rows_and_lengths_of_the_cache():
    config = mla_config("deepseek_v32")[1]
    cache = PagedCache(config=config)
    keys = torch.randn(2, 5, 32)
    assert cache.update_indexer(keys, 0) is keys
    cache.update(torch.randn(2, 1, 5, KV_LORA_RANK), torch.randn(2, 1, 5, ROPE_DIM), 0)
    step = torch.randn(2, 1, 32)
    torch.testing.assert_close(cache.update_indexer(step, 0), torch.cat([keys, step], dim=1), rtol=0, atol=0)
    cache.reorder_cache(torch.tensor([1, 1]))
    torch.testing.assert_close(cache._rows.indexer.keys[0][0, :5], keys[1], rtol=0, atol=0)
    branch = copy.deepcopy(cache)
    cache.crop(-2)  # the layer holds 5 tokens: 3 stay
    assert cache._rows.indexer.keys[0].shape == (2, 3, 32) and branch._rows.indexer.keys[0].shape == (2, 6, 32)
    with pytest.raises(ValueError, match=r"indexer key states must be \[batch, q_len, index_head_dim\]"):
        cache.update_indexer(torch.randn(2, 32), 0)
    cache.release()
    assert _indexer_bytes(cache) == 0 and _indexer_bytes(branch) == 2 * 6 * 32 * 4
    pool = BlockPool.for_model(config, num_blocks=8, enable_prefix_caching=True)
    with pytest.raises(UnsupportedModel, match="indexer keys"):
        PagedCache.from_prefix(pool, torch.arange(1, 40), config)


def test_engine_refuses_indexed_attention_up_front():
    model = mla_model("deepseek_v32", paged_attention=True)
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    with pytest.raises(UnsupportedModel, match="Engine does not support model type 'deepseek_v32'.*indexer keys"):
        Engine(model, pool)
    cache = StepCache(pool, [[[0]]], seq_lens=[0], q_lens=[2], model_type="deepseek_v32")
    with pytest.raises(UnsupportedModel, match="indexer keys"):
        cache.update_indexer(torch.randn(1, 2, 32), 0)


# ------------------------------------------------------------------------------------------ Qwen4-Exp (QSA indexer)
@functools.cache
def qwen4_model():
    """Qwen4-Exp from the zoo's tiny config: a GatedDeltaNet layer and an "indexed_attention" layer whose QSA indexer
    keeps 4 keys (blocks of 2) and reads the position ids it keeps on `cache.layers[1].indexer_position_ids`."""
    return zoo_model("qwen4_exp_text", "Qwen4ExpForCausalLM")


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3)], ids=["greedy", "beams"])
def test_qwen4_exp_equals_dynamic_cache(options):
    model = qwen4_model()
    expected = _generate(model, DynamicCache(config=model.config), do_sample=False, **options)
    cache = PagedCache(config=model.config)
    _assert_same(_generate(model, cache, do_sample=False, **options), expected)
    rows = 3 * options.get("num_beams", 1)
    positions = cache.layers[1].indexer_position_ids  # [3 rope sections, rows, 10 prompt + 5 fed back tokens]
    assert positions.shape == (3, rows, 15) and cache.get_seq_length() == 15
    enabled = copy.deepcopy(model)
    hf_paged.enable(enabled, backend="torch")
    _assert_same(_generate(enabled, PagedCache(config=model.config), do_sample=False, **options), expected)


def test_qwen4_exp_indexer_positions_follow_the_rows_and_lengths_of_the_cache():
    cache = PagedCache(config=qwen4_model().config)
    layer = cache.layers[1]
    assert layer.indexer_position_ids is None
    positions = torch.arange(10).view(1, 2, 5).expand(3, 2, 5)  # [sections, rows, tokens]: row 1 is 5..9
    layer.indexer_position_ids = positions
    cache.update(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), 1)
    cache.reorder_cache(torch.tensor([1, 1]))
    assert layer.indexer_position_ids[:, 0].tolist() == [[5, 6, 7, 8, 9]] * 3
    branch = copy.deepcopy(cache)
    cache.crop(-2)  # 5 tokens held: 3 stay
    assert layer.indexer_position_ids.shape == (3, 2, 3) and branch.layers[1].indexer_position_ids.shape == (3, 2, 5)
    cache.batch_repeat_interleave(2)
    assert layer.indexer_position_ids.shape == (3, 4, 3)
    with pytest.raises(ValueError, match=r"indexer position ids must be a tensor \[\.\.\., batch, seq_len\]"):
        layer.indexer_position_ids = torch.arange(3)
    cache.release()
    assert layer.indexer_position_ids is None and branch.layers[1].indexer_position_ids is not None
    # Only the indexed layer keeps them: reading them elsewhere is the generic refusal (and hasattr says no).
    assert not hasattr(cache.layers[1], "keys")


def test_a_cache_layer_attribute_a_paged_layer_lacks_is_refused_by_name():
    """A model reading what transformers' own layers have and a PagedLayer does not (`keys`, a state of its own)
    gets UnsupportedModel naming the model type and the attribute, not an AttributeError from inside its forward."""
    cache = PagedCache(config=mla_config("deepseek_v3")[1])
    with pytest.raises(UnsupportedCacheAttribute, match="model type 'deepseek_v3'.*cache layer attribute 'keys'") as e:
        cache.layers[0].keys  # noqa: B018
    assert isinstance(e.value, UnsupportedModel) and isinstance(e.value, AttributeError) and e.value.name == "keys"
    assert not hasattr(cache.layers[0], "indexer_position_ids")  # not an indexed layer
    assert getattr(cache.layers[0], "conv_states", "absent") == "absent"
    with pytest.raises(AttributeError, match="_private") as e:
        cache.layers[0]._private  # noqa: B018
    assert not isinstance(e.value, UnsupportedModel)
    assert copy.deepcopy(cache).layers[0].layer_idx == 0  # copy's private lookups are plain AttributeErrors


# --------------------------------------------------------------------------------------------------- KV sharing
@functools.cache
def kv_sharing_model(paged_attention: bool = False):
    """The zoo's tiny Gemma 3n: layers 0 (sliding) and 1 (full) store K/V; layers 2 and 3 attend theirs again."""
    model = zoo_model("gemma3n_text", "Gemma3nForCausalLM")
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    return hf_paged.enable(model) if paged_attention else model


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3)], ids=["greedy", "beams"])
def test_kv_sharing_layers_read_their_source_layers_blocks(options):
    model = kv_sharing_model()
    expected = _generate(model, None, do_sample=False, **options)
    layout = KVLayout.from_config(model.config)
    assert layout.layer_types == ("sliding_attention", "full_attention", "dummy", "dummy")
    pool = BlockPool.for_model(model, num_blocks=128, block_size=4)
    for cache in (PagedCache(config=model.config), PagedCache(config=model.config, pool=pool)):
        # Batches of rows gather through the shared workspace: the source layers' K/V must outlive other gathers.
        _assert_same(_generate(model, cache, do_sample=False, **options), expected)
        held = cache.held_blocks_per_group
        assert len(held) == 4 and held[2:] == (0, 0) and min(held[:2]) > 0  # sharing layers hold no block
    paged = kv_sharing_model(paged_attention=True)
    _assert_same(_generate(paged, PagedCache(config=paged.config), do_sample=False, **options), expected)


def test_engine_serves_kv_sharing_and_holds_blocks_only_for_the_layers_that_cache():
    assert block_windows(kv_sharing_model().config) == [8, None, 1, 1]  # sharing layers: a step's own blocks
    prompts, new_tokens = random_prompts((5, 19, 3)), [12, 10, 7]
    reference = kv_sharing_model()
    expected = [
        reference.generate(torch.tensor([p]), past_key_values=DynamicCache(), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, new_tokens)
    ]
    model = kv_sharing_model(paged_attention=True)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=1, max_num_batched_tokens=64)
    used = []
    run_step = engine.step

    def step():
        outputs = run_step()
        used.append(pool.num_used_blocks)
        return outputs

    engine.step = step
    assert engine.generate(prompts[1:2], max_new_tokens=new_tokens[1], ignore_eos=True) == expected[1:2]
    # 19 + 9 tokens at the end: 7 blocks in the full group, at most 3 in the sliding one (window 8), at most 1 each
    # in the sharing layers' groups (a decode step's own block), not 7 each.
    assert max(used[1:-1]) <= 7 + 3 + 2
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=6)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == expected
    assert pool.num_used_blocks == 0


def test_compile_prefill_refuses_latent_k_v():
    """A latent model's packed step expands latents after `update`, which a compiled step's attention op cannot do."""
    model = mla_model("deepseek_v3", paged_attention=True)
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="compile_prefill needs the packed step .*: its K/V are latents"):
        Engine(model, pool, compile_prefill=True)


def test_engine_refuses_a_latent_model_its_packed_step_cannot_run():
    """A model the packed step cannot run goes per request, which never expands latents: refused up front."""

    class NoLogitsToKeep(DeepseekV3ForCausalLM):  # a forward that names no logits_to_keep (as remote code may)
        def forward(self, input_ids=None, cache=None, **kwargs):
            return super().forward(input_ids=input_ids, cache=cache, **kwargs)

    _, config = mla_config("deepseek_v3")
    model = NoLogitsToKeep(config).eval()
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    with pytest.raises(UnsupportedModel, match="multi-head latent attention") as error:
        Engine(model, pool)
    assert error.value.path == "Engine" and "logits_to_keep" in error.value.reason


def test_indexer_keys_of_kv_sharing_layers_survive_crop():
    """Mistral-Large-4's "reuse_but_indexer" layers keep indexer keys but store no K/V: they take no pool layer, and
    crop() cuts every layer's indexer keys by the same count (assisted decoding), as DynamicCache does."""
    config = MistralLarge4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=4,
        index_head_dim=32, index_n_heads=2, kv_source_layers=[0, 0, 2, 2], indexer_types=["full"] * 4,
        max_position_embeddings=256, no_rope_layers=[1] * 4,
    )  # fmt: skip
    config._attn_implementation = "eager"
    assert config.kv_sharing_modes == ["store", "reuse_but_indexer", "store", "reuse_but_indexer"]
    assert KVLayout.from_config(config).layer_types == ("indexed_attention", "dummy", "indexed_attention", "dummy")
    torch.manual_seed(0)
    model = MistralLarge4TextModel(config).eval()
    prompt, more = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 3))

    def run(cache):
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            model(input_ids=more[:, :2], past_key_values=cache, use_cache=True)
            cache.crop(-1)
            return model(input_ids=more[:, 2:], past_key_values=cache, use_cache=True).last_hidden_state

    expected = run(DynamicCache(config=config))
    paged = PagedCache(config=config)
    torch.testing.assert_close(run(paged), expected, rtol=0, atol=1e-5)
    assert {tuple(keys.shape) for keys in paged._rows.indexer.keys.values()} == {(1, 9, 32)}
    paged.release()
