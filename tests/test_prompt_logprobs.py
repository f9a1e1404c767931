"""`SamplingParams.prompt_logprobs` (vLLM's): each prompt token's log probability given the tokens before it, and the
top k there, in `Request.prompt_logprobs`, against the log-softmax of one forward over the whole prompt; in chunks
that start mid-block, beside rows that record nothing, past the prefix cache, and on the per-request step."""

from __future__ import annotations

import pytest
import torch
import zoo
from models import random_prompts, tiny_engine, tiny_model

from hf_paged import BlockPool, Engine, SamplingParams

TOP = 3


def finished_requests(engine: Engine, request_ids: list[int]) -> list:
    while engine.has_unfinished():
        engine.step()
    finished = {request.request_id: request for request in engine.pop_finished()}
    return [finished[request_id] for request_id in request_ids]


def assert_prompt_logprobs(model, request, top: int = TOP) -> None:
    """`request.prompt_logprobs` against the log-softmax of `model`'s logits over its prompt in one forward."""
    prompt = request.prompt_ids
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    assert len(request.prompt_logprobs) == len(prompt) - 1
    for position, recorded in enumerate(request.prompt_logprobs):
        assert recorded.logprob == pytest.approx(expected[position, prompt[position + 1]].item(), abs=1e-4)
        best = torch.topk(expected[position], top)
        assert [token for token, _ in recorded.top] == best.indices.tolist()
        assert [lp for _, lp in recorded.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_the_log_softmax_of_one_forward_over_the_prompt():
    """Prompts of 5-23 tokens in chunks of at most 6 tokens a step (chunks start mid-block, blocks of 4), packed with
    decode rows and with a request that records nothing; the tokens generated are those of a run without them."""
    prompts = random_prompts((23, 5, 14, 9))
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, max_num_batched_tokens=6)
    plain = engine.generate(prompts, max_new_tokens=5)
    request_ids = [
        engine.add_request(prompt, max_new_tokens=5, **({} if index == 1 else {"prompt_logprobs": TOP}))
        for index, prompt in enumerate(prompts)
    ]
    requests = finished_requests(engine, request_ids)
    model = tiny_model("llama", "sdpa")
    for index, request in enumerate(requests):
        assert request.output_ids == plain[index]
        if index == 1:
            assert request.prompt_logprobs == []
        else:
            assert_prompt_logprobs(model, request)
    assert pool.num_used_blocks == 0


def test_a_prompt_recording_its_logprobs_takes_nothing_from_the_prefix_cache_and_leaves_its_blocks_there():
    prompts = random_prompts((17,))
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool)
    engine.generate(prompts, max_new_tokens=2)  # its blocks cached
    hits = engine.stats.prefix_hit_tokens
    assert hits == 0
    (request,) = finished_requests(engine, [engine.add_request(prompts[0], max_new_tokens=2, prompt_logprobs=0)])
    assert engine.stats.prefix_hit_tokens == hits  # computed whole
    assert_prompt_logprobs(tiny_model("llama", "sdpa"), request, top=0)
    assert all(recorded.top == () for recorded in request.prompt_logprobs)
    engine.generate(prompts, max_new_tokens=2)  # the same prompt again, without prompt_logprobs: a hit
    assert engine.stats.prefix_hit_tokens == hits + 16
    assert pool.num_used_blocks == 0


def test_prompt_logprobs_on_the_per_request_step():
    """bloom attends with code of its own, so the Engine runs each request in a forward of its own."""
    config = zoo.tiny_config("bloom")
    import transformers

    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).eval()
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=2, max_num_batched_tokens=6)
    assert type(engine.step_runner.step).__name__ == "PerRequestStep"
    prompts = random_prompts((13, 4), seed=1)
    plain = engine.generate(prompts, max_new_tokens=4)
    request_ids = [engine.add_request(prompt, max_new_tokens=4, prompt_logprobs=2) for prompt in prompts]
    requests = finished_requests(engine, request_ids)
    for request, tokens in zip(requests, plain):
        assert request.output_ids == tokens
        assert_prompt_logprobs(model, request, top=2)
    assert pool.num_used_blocks == 0


def test_a_one_token_prompt_has_no_prompt_logprobs_and_a_bad_value_is_refused():
    engine, _ = tiny_engine("llama", 64)
    (request,) = finished_requests(engine, [engine.add_request([7], max_new_tokens=2, prompt_logprobs=1)])
    assert request.prompt_logprobs == [] and len(request.output_ids) == 2
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an int in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an int in \[0, 20\], got True"):
        engine.add_request([1, 2], prompt_logprobs=True)


def test_preempted_requests_record_each_prompt_position_once():
    """A pool of 10 blocks of 4 and admission that reserves one token of growth: requests are preempted and computed
    again; each prompt's log probabilities are still one entry a position, the tokens those of a run without them."""
    prompts = random_prompts((18, 15, 21))
    options = dict(max_num_seqs=3, max_num_batched_tokens=3, decode_reserve_tokens=1)
    engine, pool = tiny_engine("llama", 10, **options)
    plain = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    preemptions = engine.stats.num_preemptions
    request_ids = [engine.add_request(p, max_new_tokens=12, ignore_eos=True, prompt_logprobs=1) for p in prompts]
    requests = finished_requests(engine, request_ids)
    assert engine.stats.num_preemptions > preemptions
    model = tiny_model("llama", "sdpa")
    for request, tokens in zip(requests, plain):
        assert request.output_ids == tokens
        assert_prompt_logprobs(model, request, top=1)
    assert pool.num_used_blocks == 0
