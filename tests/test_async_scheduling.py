"""Asynchronous scheduling (`Engine(async_scheduling=True)`): a decode step of greedy rows is launched before the host
reads the tokens of the step before it, which the device feeds to it. On CPU nothing overlaps (every op runs when it
is issued), but every decision is the one the device would see: these tests check that tokens, finish reasons,
blocks and counters are those of the synchronous engine."""

from __future__ import annotations

import random

import pytest
import torch
import zoo
from models import greedy_reference, random_prompts, tiny_engine, tiny_model

from hf_paged import BlockPool, Engine
from hf_paged.engine.sampling import SamplingParams, sample_batch

PROMPT_LENGTHS = (5, 11, 3, 17, 8)
NEW_TOKENS = [9, 4, 14, 6, 11]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma3", "gpt2", "phi3"])
def test_async_steps_give_generates_tokens(name):
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine(name, 64, max_num_seqs=5, max_num_batched_tokens=8, async_scheduling=True)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        name, prompts, NEW_TOKENS
    )
    stats = engine.stats
    assert stats.num_async_steps > stats.num_steps // 2  # most steps are decode-only
    assert stats.decode_tokens == sum(NEW_TOKENS) - len(prompts)  # every token but each request's last fed back
    assert pool.num_used_blocks == 0 and not engine.has_unfinished() and engine._inflight is None


def _serve(engine: Engine, arrivals: dict[int, list[tuple[list[int], dict]]]) -> dict:
    """A serving loop: requests added at the `step()` call their key names, finished ones taken after every call.
    Returns {request id: (output ids, finish reason, log probabilities)}."""
    results, call = {}, 0
    while engine.has_unfinished() or any(at >= call for at in arrivals):
        for prompt, kwargs in arrivals.get(call, []):
            engine.add_request(prompt, **kwargs)
        if engine.has_unfinished():
            engine.step()
        for request in engine.pop_finished():
            results[request.request_id] = (request.output_ids, request.finish_reason, request.logprobs)
        call += 1
    return results


def _mixed_arrivals(stops: list[list[int]]) -> dict[int, list[tuple[list[int], dict]]]:
    """Greedy requests that stop at a stop token or at their length, with seeded samples, penalties and log
    probabilities among them, arriving over the first steps."""
    prompts = random_prompts((5, 11, 3, 17, 8, 6, 9, 4), seed=4)
    kwargs = [
        dict(max_new_tokens=12, stop_token_ids=stops[0]),
        dict(max_new_tokens=7),
        dict(max_new_tokens=10, temperature=0.8, seed=3),
        dict(max_new_tokens=9, stop_token_ids=stops[3]),
        dict(max_new_tokens=8, frequency_penalty=1.5),
        dict(max_new_tokens=6, logprobs=2),
        dict(max_new_tokens=15, stop_token_ids=stops[6]),
        dict(max_new_tokens=5),
    ]
    return {
        0: [(prompts[i], kwargs[i]) for i in (0, 1, 2)],
        3: [(prompts[3], kwargs[3])],
        6: [(prompts[i], kwargs[i]) for i in (4, 5, 6, 7)],
    }


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_a_serving_loop_gets_the_synchronous_engines_results(name):
    """Arrivals between steps, stop tokens met while the next step is in flight, rows that sample, process their
    logits or record log probabilities (their steps wait for the tokens in flight): same tokens, finish reasons and
    log probabilities as without async scheduling, every block back."""
    # Stop tokens that greedy requests meet part way (their third token in a run without stops).
    probe, _ = tiny_engine(name, 64, max_num_seqs=4, max_num_batched_tokens=8)
    plain = _serve(probe, _mixed_arrivals([[]] * 8))
    stops = [[plain[i][0][2]] if len(plain[i][0]) > 2 else [] for i in range(8)]
    results = {}
    for mode in (False, True):
        engine, pool = tiny_engine(name, 64, max_num_seqs=4, max_num_batched_tokens=8, async_scheduling=mode)
        results[mode] = _serve(engine, _mixed_arrivals(stops))
        assert pool.num_used_blocks == 0
        if mode:
            assert engine.stats.num_async_steps > 0
    assert results[True] == results[False]
    assert [results[True][i][1] for i in (0, 3, 6)] == ["stop"] * 3  # ended by a token read after the next launch


@pytest.mark.parametrize("seed", range(24))
def test_random_serving_runs_in_tight_pools_match_the_synchronous_engine(seed):
    """Random arrivals, lengths and stop tokens in pools of 10-18 blocks with lookaheads of 0-2 steps (preemptions):
    the same tokens and finish reasons as the synchronous engine, every block back."""
    rng = random.Random(seed)
    num_requests = rng.randint(3, 6)
    prompts = random_prompts([rng.randint(3, 20) for _ in range(num_requests)], seed=seed)
    new_tokens = [rng.randint(3, 16) for _ in range(num_requests)]
    arrival = sorted(rng.randint(0, 8) for _ in range(num_requests))
    options = dict(
        max_num_seqs=4, max_num_batched_tokens=rng.choice([4, 8]), decode_reserve_tokens=rng.choice([0, 1, 2])
    )
    num_blocks = rng.randint(10, 18)

    def arrivals(stops):
        at: dict[int, list] = {}
        for i in range(num_requests):
            at.setdefault(arrival[i], []).append(
                (prompts[i], dict(max_new_tokens=new_tokens[i], stop_token_ids=stops[i]))
            )
        return at

    probe, _ = tiny_engine("llama", num_blocks, **options)
    plain = _serve(probe, arrivals([[]] * num_requests))
    stops = [
        [out[rng.randint(1, len(out) - 1)]] if len(out) > 2 and rng.random() < 0.7 else []
        for out, *_ in (plain[i] for i in range(num_requests))
    ]
    results = {}
    for mode in (False, True):
        engine, pool = tiny_engine("llama", num_blocks, async_scheduling=mode, **options)
        results[mode] = {i: (out, reason) for i, (out, reason, _) in _serve(engine, arrivals(stops)).items()}
        assert pool.num_used_blocks == 0
    assert results[True] == results[False]


def test_a_request_waiting_for_its_last_token_holds_no_blocks():
    """A request whose last token (by length) is in flight gives its blocks back before the next step is scheduled,
    as its retirement would, and finishes when the token is read."""
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, async_scheduling=True)
    short = engine.add_request(random_prompts((6,))[0], max_new_tokens=3)
    engine.add_request(random_prompts((9,), seed=1)[0], max_new_tokens=10)
    request = engine.request(short)
    schedule, seen = engine.scheduler.schedule, []

    def watched_schedule():
        seen.append((request in engine.scheduler.finishing, request.block_tables, request.finished))
        return schedule()

    engine.scheduler.schedule = watched_schedule
    while not request.finished:
        engine.step()
    assert (True, [], False) in seen  # scheduled around it, its blocks back, not finished yet
    assert request.finish_reason == "length" and len(request.output_ids) == 3
    assert not engine.scheduler.finishing
    assert [r.request_id for r in engine.pop_finished()] == [short]
    while engine.has_unfinished():
        engine.step()
    assert pool.num_used_blocks == 0


def test_the_last_token_in_flight_does_not_cost_a_preemption():
    """Blocks that the request ending in the step in flight gives back are there for the next step's rows: a long
    request that needs one more block is not preempted (the synchronous engine's schedule, no preemption)."""
    generator = torch.Generator().manual_seed(3)
    lengths, new_tokens = (12, 40, 6, 5, 7), [8, 8, 6, 6, 6]
    prompts = [torch.randint(2, 128, (n,), generator=generator).tolist() for n in lengths]
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    engine = Engine(model, pool, max_num_seqs=8, backfill_depth=1, async_scheduling=True)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert engine.stats.num_preemptions == 0 and engine.stats.num_async_steps > 0


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_preemption_with_a_token_in_flight(name):
    """A pool too small for the requests admitted (a lookahead of 0 steps): requests are preempted and computed
    again, tokens in flight included, with generate()'s tokens."""
    prompts = random_prompts((5, 11, 3, 17, 8, 9))
    new_tokens = [14, 9, 20, 6, 11, 16]
    engine, pool = tiny_engine(
        name, 11, max_num_seqs=4, max_num_batched_tokens=8, decode_reserve_tokens=0, async_scheduling=True
    )
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert engine.stats.num_preemptions > 0 and engine.stats.num_async_steps > 0
    assert pool.num_used_blocks == 0


def test_an_abort_while_a_token_is_in_flight_drops_it():
    """An aborted request keeps the tokens read before the abort (a prefix of its greedy tokens), the token in
    flight is dropped when read, and the others go on unchanged."""
    prompts = random_prompts(PROMPT_LENGTHS)
    reference = greedy_reference("llama", prompts, NEW_TOKENS)
    engine, pool = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=64, async_scheduling=True)
    ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, NEW_TOKENS)]
    while engine._inflight is None or len(engine.request(ids[2]).output_ids) < 3:
        engine.step()
    aborted = engine.request(ids[2])
    assert aborted.num_inflight == 1
    assert engine.abort_request(ids[2])
    kept = list(aborted.output_ids)
    while engine.has_unfinished():
        engine.step()
    assert aborted.finish_reason == "abort" and aborted.output_ids == kept == reference[2][: len(kept)]
    outputs = {r.request_id: r.output_ids for r in engine.pop_finished()}
    assert [outputs[i] for i in ids if i != ids[2]] == [reference[i] for i in range(5) if i != 2]
    assert pool.num_used_blocks == 0 and engine._inflight is None


def test_a_launch_that_raises_runs_its_rows_again_synchronously():
    """A forward that raises at an asynchronous launch is undone; the tokens in flight are read and the rows run again
    synchronously in the same step (where a row that fails alone would be found). A failure that does not come back
    costs nothing: same tokens, no failed step."""
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=8, async_scheduling=True)
    forward, calls = engine.runner.forward, []

    def flaky(rows, feed=None):
        calls.append(feed is not None)
        if len(calls) == 6:
            raise RuntimeError("a forward that fails once")
        return forward(rows, feed)

    engine.runner.forward = flaky
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        "llama", prompts, NEW_TOKENS
    )
    assert calls[5] and not calls[6]  # launched with a token in flight; run again with every token read
    assert engine.stats.num_failed_steps == 0 and engine.stats.num_async_steps > 0 and pool.num_used_blocks == 0


@pytest.mark.parametrize("healthy", [True, False], ids=["beside-others", "alone"])
def test_a_request_whose_forward_always_raises_fails_alone_as_without_async(healthy):
    """A request whose decode forward raises every time fails with its error, as with the synchronous engine: beside
    other rows it is found by running the rows in halves, with no exception to the caller; alone, after one step
    that raises (nothing else to run), at the next. The other requests get generate()'s tokens."""
    prompts = random_prompts((6, 9, 4) if healthy else (6,))
    new_tokens = [8, 10, 6] if healthy else [8]
    reference = greedy_reference("llama", prompts, new_tokens)
    outcomes = {}
    for mode in (False, True):
        engine, pool = tiny_engine("llama", 64, max_num_seqs=4, async_scheduling=mode)
        forward = engine.runner.forward

        def poisoned(rows, feed=None, forward=forward):
            # Its row that feeds its third token (by position: the host may not have read that token yet).
            if any(
                request.request_id == 0 and request.num_computed >= len(request.prompt_ids) + 2 for request, _ in rows
            ):
                raise RuntimeError("request 0 cannot go on")
            return forward(rows, feed)

        engine.runner.forward = poisoned
        ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
        raised = 0
        while engine.has_unfinished():
            try:
                engine.step()
            except RuntimeError:
                raised += 1
        requests = [engine.request(i) for i in ids]
        outcomes[mode] = (raised, [(r.output_ids, r.finish_reason) for r in requests])
        assert requests[0].finish_reason == "error" and "cannot go on" in requests[0].error
        assert requests[0].output_ids == reference[0][:3]
        assert [r.output_ids for r in requests[1:]] == reference[1:]
        assert pool.num_used_blocks == 0
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][0] == (0 if healthy else 1)


def test_streamed_tokens_are_the_read_ones():
    """`stream()` yields every input's tokens in order, none of them in flight."""
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, _ = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=8, async_scheduling=True)
    streamed = [[] for _ in prompts]
    for index, token in engine.stream(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True):
        assert 0 <= token < tiny_model("llama").config.vocab_size
        streamed[index].append(token)
    assert streamed == greedy_reference("llama", prompts, NEW_TOKENS)


def test_unseeded_samples_are_drawn_on_the_device_in_async_steps():
    """Requests that sample without a seed run asynchronously, their tokens drawn on the device (`sample_batch`);
    top_k=1 leaves one token to draw: generate()'s greedy tokens."""
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=8, async_scheduling=True)
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_k=1)
    assert outputs == greedy_reference("llama", prompts, NEW_TOKENS)
    assert engine.stats.num_async_steps > engine.stats.num_steps // 2
    torch.manual_seed(0)
    sampled = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.5)
    assert [len(output) for output in sampled] == NEW_TOKENS and sampled != outputs
    assert pool.num_used_blocks == 0


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sample_batch_draws_each_token_with_its_probability(device):
    """`sample_batch` against the distribution `sample` draws from, row by row: temperature, top-k, top-p, greedy,
    over 20,000 draws of each row."""
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], device=device))  # the last token can never be drawn
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.65),
        SamplingParams(temperature=1e-40),  # logits / 1e-40 overflow: the greedy limit
        SamplingParams(temperature=1.0, top_p=1e-46),  # 0 in float32: the first token still stays
    ]
    draws = 20_000
    torch.manual_seed(0)
    tokens = sample_batch(logits.repeat(len(params) * draws, 1), params * draws).view(draws, len(params)).cpu()
    frequencies = torch.stack([torch.bincount(tokens[:, row], minlength=5) for row in range(len(params))]) / draws
    sharpened = torch.tensor([0.3, 0.4]) ** 2 / (torch.tensor([0.3, 0.4]) ** 2).sum()  # temperature 0.5, top 2
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.0, 1.0, 0.0],
            [0.1, 0.2, 0.3, 0.4, 0.0],
            [0.0, 0.0, *sharpened.tolist(), 0.0],
            [0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7, 0.0],  # 0.4 then 0.3 reach 0.65: 0.2 and 0.1 are dropped
            [0.0, 0.0, 0.0, 1.0, 0.0],
            [0.0, 0.0, 0.0, 1.0, 0.0],
        ]
    )
    assert torch.allclose(frequencies, expected, atol=0.015), frequencies


def test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps():
    """min_p, on the device (`sample_batch`) and on the host (`sample`, a seeded request's), draws each token with the
    probability transformers' warpers give it (temperature, top-k, top-p, then `MinPLogitsWarper`), beside top-k
    and top-p and alone; min_p 1 is the greedy limit."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from hf_paged.engine.sampling import sample

    logits = torch.log(torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4]))
    params = [
        SamplingParams(temperature=1.0, min_p=0.6),
        SamplingParams(temperature=0.5, min_p=0.3),
        SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3),  # 3 tokens; min_p before top-p (vLLM's) keeps 2
        SamplingParams(temperature=1.5, top_k=3, min_p=0.7),
        SamplingParams(temperature=1.0, min_p=1.0),
    ]
    expected = []
    for p in params:
        scores = TemperatureLogitsWarper(p.temperature)(None, logits[None].clone())
        if p.top_k:
            scores = TopKLogitsWarper(p.top_k)(None, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(p.top_p)(None, scores)
        expected.append(MinPLogitsWarper(p.min_p)(None, scores).softmax(-1)[0])
    expected = torch.stack(expected)
    assert (expected > 0).sum(-1).tolist() == [2, 2, 3, 2, 1]  # each filter drops tokens here

    draws = 20_000
    torch.manual_seed(0)
    tokens = sample_batch(logits.repeat(len(params) * draws, 1), params * draws).view(draws, len(params))
    frequencies = torch.stack([torch.bincount(tokens[:, row], minlength=5) for row in range(len(params))]) / draws
    assert torch.allclose(frequencies, expected, atol=0.015), frequencies
    generator = torch.Generator().manual_seed(0)
    host = torch.tensor([[sample(logits, p, generator) for p in params] for _ in range(3000)])
    host_frequencies = torch.stack([torch.bincount(host[:, row], minlength=5) for row in range(len(params))]) / 3000
    assert torch.allclose(host_frequencies, expected, atol=0.03), host_frequencies
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_sample_batch_applies_top_p_only_to_the_rows_that_ask_for_it(monkeypatch):
    """A row without top-p keeps its least likely token beside a row with top-p (float32 sums of its probabilities
    reach 1.0 long before its last token). The race is rigged so that the last token wins wherever it can."""
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0  # one token holds all but about 1e-10 of the probability
    exponential = torch.Tensor.exponential_

    def rigged(tensor, *args, **kwargs):
        exponential(tensor, *args, **kwargs).fill_(1.0)
        tensor[:, -1] = 1e-30
        return tensor

    monkeypatch.setattr(torch.Tensor, "exponential_", rigged)
    both = sample_batch(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)])
    assert both.tolist() == [999, 0]


def test_a_row_that_cannot_sample_fails_its_request_alone():
    """Logits with no distribution to draw from (all -inf here) in an asynchronous step: the request fails with its
    error when the token is read, as `sample()` makes it fail in a synchronous step; the others go on."""
    prompts = random_prompts((6, 9))
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, async_scheduling=True)
    forward = engine.runner.forward

    def broken(rows, feed=None):
        logits = forward(rows, feed)
        for row, (request, _) in enumerate(rows):
            if request.request_id == 0 and request.num_computed >= len(request.prompt_ids) + 2:
                logits[row] = float("-inf")
        return logits

    engine.runner.forward = broken
    ids = [engine.add_request(prompts[0], max_new_tokens=8, temperature=0.7), engine.add_request(prompts[1], 8)]
    while engine.has_unfinished():
        engine.step()
    failed, other = (engine.request(i) for i in ids)
    assert failed.finish_reason == "error" and "could not sample its next token" in failed.error
    assert len(failed.output_ids) == 3 and engine.stats.num_failed == 1 and engine.stats.num_async_steps > 0
    assert other.output_ids == greedy_reference("llama", [prompts[1]], [8])[0]
    assert pool.num_used_blocks == 0


def test_tokens_read_in_a_step_that_raises_come_back_with_the_next_step():
    """A step that reads the tokens in flight and then raises (its synchronous forward) keeps their events: the next
    step returns them, so a loop that sends each step's events sends every token once."""
    prompts = random_prompts((6, 9, 5))
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, async_scheduling=True)
    step_forward, fail = engine.step_runner.forward, [False]

    def flaky(rows):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("device lost for a moment")
        return step_forward(rows)

    engine.step_runner.forward = flaky
    ids = [engine.add_request(p, max_new_tokens=10, ignore_eos=True) for p in prompts[:2]]
    sent: dict[int, list[int]] = {}
    raised = 0
    while engine.has_unfinished():
        if engine._inflight is not None and len(ids) == 2:
            ids.append(engine.add_request(prompts[2], max_new_tokens=10, ignore_eos=True))  # a prefill: synchronous
            fail[0] = True
        try:
            events = engine.step()
        except RuntimeError:
            raised += 1
            continue
        for request_id, token in events:
            sent.setdefault(request_id, []).append(token)
    assert raised == 1
    assert [sent[i] for i in ids] == [engine.request(i).output_ids for i in ids]
    assert [engine.request(i).output_ids for i in ids] == greedy_reference("llama", prompts, [10, 10, 10])
    assert pool.num_used_blocks == 0


def test_async_scheduling_argument():
    engine, _ = tiny_engine("llama")
    assert engine.async_scheduling is False  # on by default only on CUDA
    model = tiny_model("llama", "hf_paged")
    with pytest.raises(ValueError, match="async_scheduling must be None, True or False, got 'yes'"):
        Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4), async_scheduling="yes")
    bloom = zoo.tiny_model("bloom", zoo.architectures()["bloom"])
    pool = BlockPool.for_model(bloom, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="async_scheduling=True needs the decode runner.*one forward per request"):
        Engine(bloom, pool, async_scheduling=True)
