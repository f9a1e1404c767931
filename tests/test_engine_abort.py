"""How requests end early: Engine.abort_request stops a request between steps, which gives its blocks back and
never runs again, while the others finish with exactly the tokens they would have produced without it (and the
lookahead still never preempts); Request.finish_reason says how each request ended."""

import random

import pytest

from tests.models import greedy_reference, random_prompts, tiny_engine


def _run(engine):
    while engine.has_unfinished():
        engine.step()


def test_aborting_a_running_request_frees_its_blocks_at_once():
    prompts = random_prompts((9, 14))
    engine, pool = tiny_engine(enable_prefix_caching=False)
    first, second = (engine.add_request(p, max_new_tokens=12, ignore_eos=True) for p in prompts)
    for _ in range(4):  # both decoding
        engine.step()
    held = sum(len(table) for table in engine.request(first).block_tables)
    used = pool.num_used_blocks
    assert held > 0 and engine.abort_request(first)
    assert pool.num_used_blocks == used - held
    assert engine.request(first).aborted and engine.request(first).finished
    produced = list(engine.request(first).output_ids)
    _run(engine)
    reference = greedy_reference("llama", prompts, [12, 12])
    assert engine.request(second).output_ids == reference[1]
    assert produced == engine.request(first).output_ids == reference[0][: len(produced)]  # nothing after the abort
    assert 0 < len(produced) < 12
    assert pool.num_used_blocks == 0 and engine.stats.num_aborted == 1
    pool.allocator.check_invariants()


def test_aborting_a_waiting_request_drops_it_from_the_queue():
    prompts = random_prompts((9, 14, 6))
    engine, pool = tiny_engine(max_num_seqs=1)  # one at a time: the others wait
    ids = [engine.add_request(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    engine.step()
    assert engine.abort_request(ids[1])
    _run(engine)
    assert engine.request(ids[1]).output_ids == [] and engine.request(ids[1]).aborted
    reference = greedy_reference("llama", prompts, [5, 5, 5])
    assert [engine.request(i).output_ids for i in (ids[0], ids[2])] == [reference[0], reference[2]]
    assert pool.num_used_blocks == 0


def test_aborting_a_prompt_between_prefill_chunks():
    prompts = random_prompts((40, 7))
    engine, pool = tiny_engine(max_num_seqs=4, max_num_batched_tokens=8)  # the 40-token prompt takes five steps
    long_id = engine.add_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    short_id = engine.add_request(prompts[1], max_new_tokens=4, ignore_eos=True)
    engine.step()
    request = engine.request(long_id)
    assert 0 < request.num_computed < 40 and not request.output_ids
    engine.abort_request(long_id)
    _run(engine)
    assert engine.request(short_id).output_ids == greedy_reference("llama", prompts[1:], [4])[0]
    assert engine.request(long_id).output_ids == []
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_a_request_waiting_for_an_aborted_requests_prompt_computes_it_itself():
    """Parallel samples of one prompt: the first computes the prompt, the others wait for its blocks. Aborted in
    the middle of it, the others must not wait for blocks nobody computes."""
    prompt = random_prompts((40,))[0]
    engine, pool = tiny_engine(max_num_seqs=4, max_num_batched_tokens=12)
    ids = [engine.add_request(prompt, max_new_tokens=6, ignore_eos=True) for _ in range(3)]
    engine.step()
    assert engine.request(ids[0]).num_computed > 0 and all(engine.request(i).num_computed == 0 for i in ids[1:])
    engine.abort_request(ids[0])
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    reference = greedy_reference("llama", [prompt], [6])[0]
    assert [engine.request(i).output_ids for i in ids[1:]] == [reference, reference]
    assert engine.stats.prefix_hit_tokens > 0  # the first's computed blocks stayed cached for the others
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_abort_of_a_finished_or_unknown_request():
    engine, _ = tiny_engine()
    with pytest.raises(ValueError, match="no request with id 0: this engine has issued no ids yet"):
        engine.abort_request(0)
    request_id = engine.add_request([5, 6, 7], max_new_tokens=2, ignore_eos=True)
    _run(engine)
    output = list(engine.request(request_id).output_ids)
    assert engine.abort_request(request_id) is False
    assert engine.request(request_id).output_ids == output and not engine.request(request_id).aborted
    with pytest.raises(ValueError, match="no request with id 3: this engine has issued ids 0 to 0"):
        engine.abort_request(3)


@pytest.mark.parametrize("name", ["llama", "gemma3"])  # gemma3: sliding and full layer groups
@pytest.mark.parametrize("seed", range(3))
def test_random_aborts_never_preempt_leak_or_change_the_others(name, seed):
    """Random prompts (half of them sharing a system prompt) in a tight pool with the default lookahead; at random
    steps, a random unfinished request is aborted: waiting, between prefill chunks or decoding (each kind occurs
    over these seeds; chunks of at most 8 tokens make prompts span steps)."""
    rng = random.Random(seed)
    system = random_prompts((16,), seed=100 + seed)[0]
    prompts = [
        (system if rng.random() < 0.5 else []) + random_prompts((rng.randint(2, 20),), seed=seed * 100 + i)[0]
        for i in range(14)
    ]
    new_tokens = [rng.randint(2, 14) for _ in prompts]
    engine, pool = tiny_engine(name, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=8)
    ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    aborted = set()
    while engine.has_unfinished():
        engine.step()
        unfinished = [i for i in ids if not engine.request(i).finished]
        if unfinished and rng.random() < 0.3:
            victim = rng.choice(unfinished)
            assert engine.abort_request(victim)
            aborted.add(victim)
    assert aborted and engine.stats.num_aborted == len(aborted)
    assert engine.stats.num_preemptions == 0
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
    reference = greedy_reference(name, prompts, new_tokens)
    for request_id, expected in zip(ids, reference):
        output = engine.request(request_id).output_ids
        if request_id in aborted:
            assert output == expected[: len(output)] and len(output) < len(expected)
        else:
            assert output == expected


def test_aborting_a_preempted_request_waiting_to_be_recomputed():
    """vLLM's admission (no lookahead) in a tight pool preempts; the preempted request, back in the queue with the
    tokens it generated, is aborted there."""
    prompts = random_prompts((5, 17, 9, 30, 3))
    new_tokens = [8, 12, 5, 10, 7]
    engine, pool = tiny_engine(num_blocks=12, max_num_seqs=4, decode_reserve_tokens=0)
    ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    while engine.stats.num_preemptions == 0:
        engine.step()
    preempted = next(r for r in engine.scheduler.waiting if r.output_ids)
    produced = list(preempted.output_ids)
    assert engine.abort_request(preempted.request_id)
    _run(engine)
    reference = greedy_reference("llama", prompts, new_tokens)
    for request_id, expected in zip(ids, reference):
        expected = produced if request_id == preempted.request_id else expected
        assert engine.request(request_id).output_ids == expected
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_finish_reason_says_how_each_request_ended():
    prompt = random_prompts((6,))[0]
    engine, pool = tiny_engine(num_blocks=16)
    full = engine.generate([prompt], max_new_tokens=10, ignore_eos=True)[0]
    ids = {
        "length": engine.add_request(prompt, max_new_tokens=10, ignore_eos=True),
        "stop": engine.add_request(prompt, max_new_tokens=10, stop_token_ids=(full[4],)),
        "eos": engine.add_request(prompt, max_new_tokens=10, eos_token_id=full[2]),
        "abort": engine.add_request(prompt, max_new_tokens=10, ignore_eos=True),
        "error": engine.add_request(prompt, max_new_tokens=100, ignore_eos=True),  # 106 tokens > 16 blocks of 4
    }
    assert engine.request(ids["length"]).finish_reason is None  # not finished yet
    engine.step()
    engine.abort_request(ids["abort"])
    _run(engine)
    reasons = {name: engine.request(request_id).finish_reason for name, request_id in ids.items()}
    assert reasons == {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort", "error": "error"}
    assert engine.request(ids["length"]).output_ids == full
    assert engine.request(ids["eos"]).output_ids == full[:3]
    assert pool.num_used_blocks == 0


def test_leaving_a_stream_early_aborts_its_unfinished_inputs():
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine(max_num_seqs=2)  # the third input waits
    stream = engine.stream(prompts, max_new_tokens=6, ignore_eos=True)
    received = [next(stream) for _ in range(3)]
    stream.close()  # what `break` out of a for loop does
    assert not engine.has_unfinished() and pool.num_used_blocks == 0
    assert engine.stats.num_aborted == 3 and len(received) == 3
    # The engine serves the next call as usual.
    reference = greedy_reference("llama", prompts, [6, 6, 6])
    assert engine.generate(prompts, max_new_tokens=6, ignore_eos=True) == reference


def test_generate_leaves_no_request_behind_when_a_step_raises(monkeypatch):
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    forward, calls = engine.step_runner.forward, []

    def failing_forward(rows):
        calls.append(len(rows))
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return forward(rows)

    monkeypatch.setattr(engine.step_runner, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert not engine.has_unfinished() and pool.num_used_blocks == 0
    monkeypatch.setattr(engine.step_runner, "forward", forward)
    assert engine.generate(prompts, max_new_tokens=6, ignore_eos=True) == greedy_reference("llama", prompts, [6, 6])
    pool.allocator.check_invariants()


def test_a_bad_prompt_adds_none_of_a_generate_calls_prompts():
    engine, pool = tiny_engine()
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.generate([[1, 2, 3], []], max_new_tokens=4)
    assert not engine.has_unfinished()


def test_generate_returns_when_its_own_requests_finish():
    """A request added for a serving loop shares generate()'s steps but does not keep generate() running."""
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    other = engine.add_request(prompts[1], max_new_tokens=30, ignore_eos=True)
    expected = greedy_reference("llama", prompts[:1], [3])
    assert engine.generate(prompts[:1], max_new_tokens=3, ignore_eos=True) == expected
    assert not engine.request(other).finished and 0 < len(engine.request(other).output_ids) < 30
    _run(engine)
    assert engine.request(other).output_ids == greedy_reference("llama", prompts[1:], [30])[0]
    assert pool.num_used_blocks == 0


def test_a_stream_yields_its_tokens_from_steps_other_calls_run():
    """A generate() inside the stream's loop, and two streams advanced in turn, step the engine for each other's
    inputs too: every token still comes out of its own stream, in order."""
    prompts = random_prompts((5, 9, 7))
    reference = greedy_reference("llama", prompts, [8, 8, 8])
    engine, pool = tiny_engine()
    streamed = [[], []]
    for index, token in engine.stream(prompts[:2], max_new_tokens=8, ignore_eos=True):
        streamed[index].append(token)
        if len(streamed[0]) + len(streamed[1]) == 2:  # after the last token of a step
            assert engine.generate(prompts[2:], max_new_tokens=8, ignore_eos=True) == reference[2:]
    assert streamed == reference[:2]

    first = engine.stream(prompts[:1], max_new_tokens=8, ignore_eos=True)
    second = engine.stream(prompts[1:], max_new_tokens=8, ignore_eos=True)
    out_first, out_second = [], [[], []]
    for a, b in zip(first, second):  # ends when the first stream does
        out_first.append(a[1])
        out_second[b[0]].append(b[1])
    out_second_rest = list(second)
    for index, token in out_second_rest:
        out_second[index].append(token)
    assert [out_first] + out_second == reference
    assert pool.num_used_blocks == 0


def test_a_stream_kept_in_a_variable_aborts_on_close():
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    stream = engine.stream(prompts, max_new_tokens=6, ignore_eos=True)
    for _ in stream:
        break  # the stream lives on in `stream`: its inputs are paused, not aborted
    assert engine.has_unfinished() and engine.stats.num_aborted == 0
    stream.close()
    assert not engine.has_unfinished() and pool.num_used_blocks == 0 and engine.stats.num_aborted == 2


def test_an_abort_during_a_step_takes_effect_when_the_step_ends(monkeypatch):
    """A stream the garbage collector closes while a forward runs aborts its inputs from inside the step."""
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    first, second = (engine.add_request(p, max_new_tokens=6, ignore_eos=True) for p in prompts)
    engine.step()
    forward = engine.step_runner.forward

    def forward_that_aborts(rows):
        assert engine.abort_request(first)  # deferred: the step's rows and blocks are in use
        assert not engine.request(first).finished
        return forward(rows)

    monkeypatch.setattr(engine.step_runner, "forward", forward_that_aborts)
    engine.step()
    monkeypatch.setattr(engine.step_runner, "forward", forward)
    assert engine.request(first).finish_reason == "abort" and len(engine.request(first).output_ids) == 2
    _run(engine)
    reference = greedy_reference("llama", prompts, [6, 6])
    assert engine.request(second).output_ids == reference[1]
    assert engine.request(first).output_ids == reference[0][:2]
    assert pool.num_used_blocks == 0


def test_an_interrupt_while_adding_prompts_leaves_none_queued(monkeypatch):
    engine, _ = tiny_engine()
    add_request, calls = engine.add_request, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(random_prompts((5, 9, 7)), max_new_tokens=4)
    assert not engine.has_unfinished() and engine.stats.num_aborted == 2


def test_aborting_several_waiting_requests_at_once_keeps_the_others_in_order():
    engine, _ = tiny_engine(max_num_seqs=1)
    ids = [engine.add_request([3, 4, 5 + i], max_new_tokens=2, ignore_eos=True) for i in range(6)]
    engine.step()  # the first runs, the others wait
    engine.scheduler.abort([engine.request(i) for i in (ids[2], ids[4], ids[1])])
    assert [r.request_id for r in engine.scheduler.waiting] == [ids[3], ids[5]]
    assert all(engine.request(i).finish_reason == "abort" for i in (ids[1], ids[2], ids[4]))


def test_a_request_that_cannot_sample_fails_alone(monkeypatch):
    """Sampling raises for one request (nan logits make torch.multinomial raise): that request fails with the
    reason, its blocks go back, and the others finish as they would have."""
    import hf_paged.engine.step_runner as engine_module

    sample = engine_module.sample

    def sample_or_fail(logits, params, generator):
        if params.seed == 13:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return sample(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample_or_fail)
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine()
    ids = [engine.add_request(p, max_new_tokens=6, ignore_eos=True) for p in (prompts[0], prompts[2])]
    bad = engine.add_request(prompts[1], max_new_tokens=6, temperature=1.0, seed=13)
    _run(engine)
    request = engine.request(bad)
    assert request.finish_reason == "error" and "could not sample its next token" in request.error
    assert request.output_ids == []
    reference = greedy_reference("llama", [prompts[0], prompts[2]], [6, 6])
    assert [engine.request(i).output_ids for i in ids] == reference
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
