"""Engine: continuous batching on one pool gives each request what generate() with DynamicCache gives it."""

import pytest
import torch
from transformers import DynamicCache

from hf_paged import BlockPool, Engine, RequestFailed, SamplingParams
from tests.models import tiny_model

NEW_TOKENS = [8, 12, 5, 10, 7]


def _prompts(lengths=(5, 17, 9, 30, 3), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]


def _reference(name, prompts, new_tokens):
    model = tiny_model(name, "sdpa")
    return [
        model.generate(torch.tensor([p]), past_key_values=DynamicCache(), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, new_tokens)
    ]


def _engine(name, num_blocks, **kwargs):
    model = tiny_model(name, "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=num_blocks, block_size=4)
    return Engine(model, pool, **kwargs), pool


@pytest.mark.parametrize(
    "num_blocks, max_num_batched_tokens, decode_reserve_tokens",
    [(64, 512, 64), (64, 8, 64), (12, 512, 0)],
    ids=["ample", "chunked-prefill", "preempting"],  # no growth reserve: admission outruns the pool
)
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_output_equals_generate_per_request(name, num_blocks, max_num_batched_tokens, decode_reserve_tokens):
    prompts = _prompts()
    engine, pool = _engine(
        name,
        num_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_reserve_tokens=decode_reserve_tokens,
    )
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert outputs == _reference(name, prompts, NEW_TOKENS)
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
    stats = engine.stats
    assert stats.peak_running <= 4 and stats.mean_running > 1
    if num_blocks == 12:  # 5 requests of up to 10 blocks each in 12 blocks: someone must be recomputed
        assert stats.num_preemptions > 0
    else:
        assert stats.num_preemptions == 0
        assert stats.prefill_tokens == sum(map(len, prompts))
        assert stats.decode_tokens == sum(NEW_TOKENS) - len(prompts)


def test_ragged_decode_through_the_triton_kernel(monkeypatch):
    import hf_paged.attention

    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    batch_sizes = []
    kernel = hf_paged.attention.paged_decode_attention
    monkeypatch.setattr(
        hf_paged.attention,
        "paged_decode_attention",
        lambda query, *a, **k: batch_sizes.append(query.shape[0]) or kernel(query, *a, **k),
    )
    prompts = _prompts((5, 11, 3))
    engine, pool = _engine("llama", 32, max_num_seqs=3)
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True) == _reference("llama", prompts, [4, 4, 4])
    assert pool.num_used_blocks == 0
    assert batch_sizes and max(batch_sizes) == 3  # rows of lengths 6, 12 and 4 went through one kernel call


def test_a_request_larger_than_the_pool_fails_alone():
    prompts = _prompts()
    engine, pool = _engine("llama", 9, max_num_seqs=4)  # request 3 needs 10 blocks, the pool has 9
    with pytest.raises(RequestFailed, match="input 3: request 3 needs 10 blocks .* the pool has 9") as info:
        engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reference = _reference("llama", prompts, NEW_TOKENS)
    assert list(info.value.errors) == [3]
    assert [out for i, out in enumerate(info.value.outputs) if i != 3] == reference[:3] + reference[4:]
    assert pool.num_used_blocks == 0


def test_seeded_sampling_does_not_depend_on_the_batch():
    prompts = _prompts((6, 9, 4))
    engine, _ = _engine("llama", 64, max_num_seqs=4)
    kwargs = dict(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    together = engine.generate(prompts, **kwargs)
    alone = [engine.generate([p], **kwargs)[0] for p in prompts]
    assert together == alone
    assert len({tuple(out) for out in together}) == 3
    greedy = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert engine.generate(prompts, max_new_tokens=10, ignore_eos=True, temperature=1.0, top_k=1, seed=0) == greedy


def test_stop_tokens_end_a_request_and_are_kept():
    prompts = _prompts((6,))
    engine, _ = _engine("llama", 64)
    full = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)[0]
    stop = full[4]
    out = engine.generate(prompts, max_new_tokens=10, stop_token_ids=(stop,))[0]
    assert out == full[: full.index(stop) + 1]
    assert engine.generate(prompts, max_new_tokens=10, eos_token_id=stop)[0] == out
    assert engine.generate(prompts, max_new_tokens=10, eos_token_id=stop, ignore_eos=True)[0] == full


def test_stream_yields_every_token_in_order_per_request():
    prompts = _prompts((5, 8))
    engine, _ = _engine("llama", 64)
    expected = engine.generate(prompts, max_new_tokens=[6, 3], ignore_eos=True)
    streamed = [[], []]
    for index, token in engine.stream(prompts, max_new_tokens=[6, 3], ignore_eos=True):
        streamed[index].append(token)
    assert streamed == expected


def test_serving_loop_with_add_request_and_step():
    prompts = _prompts((5, 8))
    engine, pool = _engine("llama", 64)
    first = engine.add_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    engine.step()  # the first request is running when the second arrives
    second = engine.add_request(prompts[1], max_new_tokens=4, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    assert [engine.request(first).output_ids, engine.request(second).output_ids] == _reference("llama", prompts, [4, 4])
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be >= 0"),
    ],
)
def test_bad_sampling_parameters_name_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_arguments():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="max_num_seqs and max_num_batched_tokens must be >= 1"):
        Engine(model, pool, max_num_seqs=0)
    engine = Engine(model, pool)
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], max_new_tokens=[3])


def _shared_prefix_prompts(num_requests=6, prefix_len=40, seed=3):
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 128, (prefix_len,), generator=generator).tolist()
    return [system + torch.randint(1, 128, (5 + i,), generator=generator).tolist() for i in range(num_requests)]


def test_shared_system_prompt_is_computed_once_with_identical_output():
    prompts = _shared_prefix_prompts()
    new_tokens = [6] * len(prompts)
    reference = _reference("llama", prompts, new_tokens)
    results = {}
    for caching in (False, True):
        model = tiny_model("llama", "hf_paged")
        pool = BlockPool.for_model(model, num_blocks=96, block_size=4)
        # A budget of 44 tokens: the first request's prefill fills a step, the others start after it is cached.
        engine = Engine(model, pool, max_num_seqs=8, max_num_batched_tokens=44, enable_prefix_caching=caching)
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        results[caching] = engine.stats
        assert pool.num_used_blocks == 0
    cold, warm = results[False], results[True]
    assert cold.prefill_tokens == sum(map(len, prompts)) and cold.prefix_hit_tokens == 0
    # Every request after the first finds the 40-token system prompt (10 full blocks of 4) cached.
    assert warm.prefix_hit_tokens == 40 * (len(prompts) - 1)
    assert warm.prefill_tokens == cold.prefill_tokens - warm.prefix_hit_tokens
    assert warm.decode_tokens == cold.decode_tokens == sum(new_tokens) - len(prompts)


def test_the_growth_reserve_prevents_preemption_that_a_one_block_reserve_causes():
    prompts = _prompts()
    runs = {}
    for reserve in (0, 16):
        engine, pool = _engine("llama", 16, max_num_seqs=5, decode_reserve_tokens=reserve)
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == _reference(
            "llama", prompts, NEW_TOKENS
        )
        runs[reserve] = engine.stats.num_preemptions
    assert runs[16] < runs[0]
    with pytest.raises(ValueError, match="decode_reserve_tokens must be >= 0"):
        _engine("llama", 16, decode_reserve_tokens=-1)
