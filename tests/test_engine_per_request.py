"""The Engine's per-request step (hf_paged/engine/per_request.py): models the packed step cannot run (no
position_ids, no logits_to_keep, attention code of their own, K/V read after the update, a window from the mask)
served one forward per scheduled request, and identical to a batch-1 `DynamicCache` for every request: prefill in
chunks next to decode rows, prefix-cache hits, preemption, a failing row, aborts, seeded sampling; no block leaked."""

from __future__ import annotations

import pytest
import torch
import zoo
from transformers import DynamicCache

from hf_paged import BlockPool, Engine, RequestFailed
from hf_paged.engine.sampling import SamplingParams, sample

# Models that take no position_ids (bart), ignore logits_to_keep (whisper), attend with code of their own (bloom,
# gpt_neo, whose local layers take their window from the model's mask), split V after the update (diffllama), or
# slide through the model's mask over a window of 8 (moshi: blocks leave the window).
MODEL_TYPES = ("bloom", "gpt_neo", "bart", "whisper", "diffllama", "moshi")
PROMPTS = [
    [5, 17, 33, 2, 90, 41, 7, 64, 12, 3, 77, 21, 9],
    [8, 99, 14, 3, 56],
    [5, 17, 33, 2, 90, 41, 7, 64, 30, 31],  # shares two blocks of 4 with the first
    [120, 6],
]
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def models():
    built = {}

    def model_of(model_type: str):
        if model_type not in built:
            config = zoo.tiny_config(model_type)
            if model_type == "gpt_neo":
                config.window_size = 4  # its local layers mask all but the last 4 positions
            import transformers

            torch.manual_seed(0)
            model_class = getattr(transformers, zoo.architectures()[model_type])
            built[model_type] = model_class(config).float().eval()
        return built[model_type]

    return model_of


def reference(model, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS, params=None, seed=None) -> list[int]:
    """Batch-1 decoding with a DynamicCache: the whole prompt in one forward, then one token at a time; greedy, or
    drawn with `sample(params)` from a generator seeded like the Engine's."""
    cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    input_ids, output = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
            token = int(logits.argmax()) if params is None else sample(logits, params, generator)
            output.append(token)
            input_ids = torch.tensor([[token]])
    return output


def engine_of(model, num_blocks: int = 64, **options) -> Engine:
    options.setdefault("max_num_seqs", 4)
    options.setdefault("max_num_batched_tokens", 6)  # prompts in chunks, next to decode rows
    return Engine(model, BlockPool.for_model(model, num_blocks=num_blocks, block_size=4), **options)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_per_request_step_equals_dynamic_cache_of_each_prompt_alone(models, model_type):
    model = models(model_type)
    engine = engine_of(model)
    assert engine.step_mode == "per-request"
    outputs = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    assert outputs == [reference(model, prompt) for prompt in PROMPTS]
    stats = engine.stats
    # The third prompt reused the first's two blocks; a sliding model (moshi) caches no prefix.
    assert stats.prefix_hit_tokens == (0 if model_type == "moshi" else 8)
    assert stats.num_steps < sum(len(p) for p in PROMPTS)  # steps held several rows (chunks and decode rows)
    assert engine.pool.num_used_blocks == 0


def test_each_row_of_a_step_is_a_forward_of_its_own(models, monkeypatch):
    model = models("bloom")
    engine = engine_of(model)
    calls = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    engine.add_request(PROMPTS[0], max_new_tokens=3)
    engine.add_request(PROMPTS[1], max_new_tokens=3)
    engine.step()  # a chunk of 6 of the first prompt (the budget)
    engine.step()  # the rest of the first prompt (7 > 6 budget: 6), then ...
    while engine.has_unfinished():
        engine.step()
    assert all(shape[0] == 1 for shape in calls)  # batch 1, always
    assert calls[0] == (1, 6)
    assert sum(shape[1] for shape in calls) == len(PROMPTS[0]) + len(PROMPTS[1]) + 2 * 2  # every token fed once


@pytest.mark.parametrize("model_type", ["bart", "moshi"])
def test_preempted_requests_are_recomputed_identically(models, model_type):
    model = models(model_type)
    # 10 blocks of 4 tokens, admission looking one step ahead: requests are preempted and computed again.
    engine = engine_of(model, num_blocks=10, decode_reserve_tokens=1)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    outputs = engine.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    if model_type == "bart":
        assert engine.stats.num_preemptions > 0
    assert outputs == [reference(model, prompt) for prompt in prompts]
    assert engine.pool.num_used_blocks == 0


def test_a_row_whose_forward_raises_fails_alone(models, monkeypatch):
    model = models("bloom")
    poison = 127
    embeddings = model.get_input_embeddings()
    embed = embeddings.forward

    def poisoned(input_ids):
        if (input_ids == poison).any():
            raise ValueError("poisoned token")
        return embed(input_ids)

    monkeypatch.setattr(embeddings, "forward", poisoned)
    engine = engine_of(model)
    prompts = [PROMPTS[0], [3, 4, poison, 5], PROMPTS[1]]
    with pytest.raises(RequestFailed) as failed:
        engine.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    assert list(failed.value.errors) == [1]
    assert "poisoned token" in failed.value.errors[1]
    monkeypatch.undo()
    assert failed.value.outputs[0] == reference(model, PROMPTS[0])
    assert failed.value.outputs[2] == reference(model, PROMPTS[1])
    assert engine.pool.num_used_blocks == 0


def test_an_abort_leaves_the_others_identical(models):
    model = models("whisper")
    engine = engine_of(model)
    ids = [engine.add_request(prompt, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None) for prompt in PROMPTS[:2]]
    for _ in range(4):
        engine.step()
    assert engine.abort_request(ids[0])
    while engine.has_unfinished():
        engine.step()
    finished = {request.request_id: request for request in engine.pop_finished()}
    assert finished[ids[0]].finish_reason == "abort"
    assert finished[ids[1]].output_ids == reference(model, PROMPTS[1])
    assert engine.pool.num_used_blocks == 0


def test_seeded_sampling_draws_what_the_same_generator_draws_alone(models):
    model = models("gpt_neo")
    params = dict(temperature=0.8, top_k=20)
    engine = engine_of(model)
    outputs = engine.generate(
        PROMPTS[:3], max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, seed=[11, 12, 13], **params
    )
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, **params)
    expected = [reference(model, p, params=sampling, seed=s) for p, s in zip(PROMPTS[:3], [11, 12, 13])]
    assert outputs == expected
    assert len(set(map(tuple, outputs))) == 3
    assert engine.pool.num_used_blocks == 0


def test_a_model_with_is_causal_false_and_a_causal_mask_is_served(models):
    # BigBird-Pegasus's decoder attention says is_causal=False and builds a causal mask itself (eager).
    model = models("bigbird_pegasus")
    engine = engine_of(model)
    assert engine.step_mode == "per-request"
    assert engine.generate(PROMPTS[:2], max_new_tokens=4, eos_token_id=None) == [
        reference(model, prompt, 4) for prompt in PROMPTS[:2]
    ]


@pytest.mark.parametrize("consecutive", [True, False])
def test_row_cache_returns_what_dynamic_cache_returns(models, consecutive):
    """Every layer's update: the same K/V as a DynamicCache, through a sliding window whose first blocks were
    released; a view of the pool where the row's blocks are consecutive, else a gather."""
    from hf_paged.engine.per_request import RowCache
    from hf_paged.storage import sliding_windows

    model = models("moshi")  # window 8
    config = model.config.get_text_config(decoder=True)
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    windows = sliding_windows(config)
    num_layers, heads, head_dim = len(windows), pool.layout.num_kv_heads[0], pool.layout.head_dims[0]
    reference_cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(0)
    seq_len, table = 0, list(range(16)) if consecutive else [5, 2, 9, 0, 14, 7, 3, 11]
    for q_len in (6, 5, 1, 1):
        keys = [torch.randn(1, heads, q_len, head_dim, generator=generator) for _ in range(num_layers)]
        # The sliding group keeps the blocks from the one the window starts in (positions seq_len - 7 ...).
        first_block = max(seq_len - windows[0] + 1, 0) // 4
        cache = RowCache(pool, [table[first_block:]], [first_block], seq_len, q_len, windows)
        for layer_idx in range(num_layers):
            got = cache.update(keys[layer_idx], -keys[layer_idx], layer_idx)
            expected = reference_cache.update(keys[layer_idx], -keys[layer_idx], layer_idx)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            if seq_len:  # a first prefill returns the forward's own K/V
                pool_storage = pool.key_cache[layer_idx].untyped_storage().data_ptr()
                assert (got[0].untyped_storage().data_ptr() == pool_storage) == consecutive
            assert cache.layers[layer_idx].get_mask_sizes(q_len) == reference_cache.layers[layer_idx].get_mask_sizes(
                q_len
            )
        seq_len += q_len
        assert cache.get_seq_length() == reference_cache.get_seq_length() == seq_len


def test_a_packed_model_run_per_request_gives_the_packed_tokens(monkeypatch):
    """The per-request step on a model the packed step runs (Llama, sdpa): the same tokens, prompts in chunks next
    to decode rows, a prefix-cache hit."""
    import hf_paged.engine.engine as engine_module

    model = zoo.tiny_model("llama", "LlamaForCausalLM")
    packed = engine_of(model)
    expected = packed.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    model.set_attn_implementation("sdpa")
    monkeypatch.setattr(engine_module, "choose_step_mode", lambda model: ("per-request", "chosen by the test"))
    engine = engine_of(model)
    assert (engine.step_mode, engine.model.config._attn_implementation) == ("per-request", "sdpa")
    assert engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None) == expected
    assert engine.stats.prefix_hit_tokens == 8
    assert engine.pool.num_used_blocks == 0


def test_a_sliding_model_continues_a_conversation_as_generate_does(models, caplog):
    """Moshi's window comes from its cache: generate() computes a prompt over the whole prompt, a generated token
    through the window. A second turn whose prompt holds the first turn's output gets what generate() gives it
    alone: the per-request step of a sliding model caches no prefix (and says so)."""
    model = models("moshi")
    with caplog.at_level("WARNING", logger="hf_paged.engine.engine"):
        engine = engine_of(model)
    assert "prefix caching is off" in caplog.text
    first = engine.generate([PROMPTS[0]], max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)[0]
    second_prompt = PROMPTS[0] + first + [4, 5, 6]
    second = engine.generate([second_prompt], max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)[0]
    assert second == reference(model, second_prompt)
    assert engine.stats.prefix_hit_tokens == 0
    assert engine.pool.num_used_blocks == 0
