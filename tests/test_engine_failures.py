"""Bad requests fail alone: prompts the model cannot take are refused up front, a step whose forward raises is
undone, and a request whose own forward keeps raising finishes with its error while the others go on."""

import random

import pytest

from hf_paged import RequestFailed
from hf_paged.errors import PositionLimitWarning
from tests.models import greedy_reference, random_prompts, tiny_engine, tiny_model

POISON_POSITION = 100  # a forward reaching this position raises (only the poisoned requests' prompts are that long)


def _run(engine):
    while engine.has_unfinished():
        engine.step()


def _state(engine):
    """Everything a step can change, as plain values."""
    scheduler = engine.scheduler
    requests = list(scheduler.running) + list(scheduler.waiting)
    return (
        [r.request_id for r in scheduler.running],
        [r.request_id for r in scheduler.waiting],
        [
            (r.request_id, r.num_computed, list(r.output_ids), [list(t) for t in r.block_tables], list(r.first_blocks))
            for r in requests
        ],
        [(r.request_id, r.num_registered_blocks, r.num_cached_tokens, r.num_skips, r.finished) for r in requests],
        engine.pool.num_used_blocks,
        scheduler.num_prefix_hit_tokens,
    )


def _raise_once_in(monkeypatch, module, when):
    """Make `module`'s forward raise on its `when`-th call from now on (once)."""
    forward, calls = module.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == when:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", failing)


def _poison(monkeypatch, model):
    """The model's forward raises for any step that reaches position POISON_POSITION, before any layer runs."""
    forward = model.model.forward

    def poisoned(*args, position_ids=None, **kwargs):
        if position_ids is not None and int(position_ids.max()) >= POISON_POSITION:
            raise ValueError("poisoned input")
        return forward(*args, position_ids=position_ids, **kwargs)

    monkeypatch.setattr(model.model, "forward", poisoned)


def test_a_token_id_outside_the_vocabulary_is_refused_and_the_others_go_on():
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    good = engine.add_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=r"token id 128 at prompt position 1 .* ids must be in \[0, 128\)"):
        engine.add_request([3, 128, 4])
    with pytest.raises(ValueError, match=r"token id -1 at prompt position 0"):
        engine.add_request([-1, 4])
    _run(engine)
    assert engine.request(good).output_ids == greedy_reference("llama", prompts[:1], [4])[0]
    assert pool.num_used_blocks == 0


def test_generate_names_a_bad_prompt_and_returns_the_others():
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine()
    with pytest.raises(RequestFailed, match=r"input 1: request \d+: token id 300 at prompt position 2") as info:
        engine.generate([prompts[0], [4, 5, 300], prompts[2]], max_new_tokens=4, ignore_eos=True)
    reference = greedy_reference("llama", [prompts[0], prompts[2]], [4, 4])
    assert list(info.value.errors) == [1]
    assert info.value.outputs == [reference[0], [], reference[1]]
    assert pool.num_used_blocks == 0 and engine._requests == {}


def test_learned_positions_refuse_a_long_prompt_and_cap_new_tokens():
    """GPT-2's 256 positions: a prompt past them is refused; one that would cross them while decoding finishes with
    "length" at the last position, with generate()'s tokens."""
    engine, pool = tiny_engine("gpt2", num_blocks=80)
    with pytest.raises(ValueError, match="a prompt of 257 tokens is longer than the model's 256 learned positions"):
        engine.add_request(random_prompts((257,))[0])
    prompt = random_prompts((250,))[0]
    request_id = engine.add_request(prompt, max_new_tokens=20, ignore_eos=True)
    _run(engine)
    request = engine.request(request_id)
    assert request.finish_reason == "length" and len(request.output_ids) == 7  # K/V at positions 0..255
    assert request.output_ids == greedy_reference("gpt2", [prompt], [7])[0]
    assert pool.num_used_blocks == 0


def test_rotary_positions_past_the_config_warn_once():
    engine, _ = tiny_engine("llama", num_blocks=80)
    prompt = random_prompts((250,))[0]
    with pytest.warns(PositionLimitWarning, match=r"past the model's max_position_embeddings \(256\)"):
        engine.add_request(prompt, max_new_tokens=20)
    with warnings_as_errors():
        engine.add_request(prompt, max_new_tokens=20)  # once per engine


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


@pytest.mark.parametrize("where", ["before K/V writes", "after K/V writes"])
@pytest.mark.parametrize("seed", range(3))
def test_a_step_whose_forward_raises_is_undone(monkeypatch, where, seed):
    """Random prompts, some sharing a system prompt, in a tight pool with chunked prefill; at random steps the
    model's forward raises once (at the embedding, before any layer writes K/V, or at the head, after every layer
    has). The step raises, and the engine is exactly as before it: queues, every request's progress and blocks,
    the pool. Stepping on gives generate()'s tokens."""
    rng = random.Random(seed)
    system = random_prompts((16,), seed=100 + seed)[0]
    prompts = [
        (system if rng.random() < 0.5 else []) + random_prompts((rng.randint(2, 20),), seed=seed * 100 + i)[0]
        for i in range(12)
    ]
    new_tokens = [rng.randint(2, 10) for _ in prompts]
    engine, pool = tiny_engine(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=8)
    model = engine.model
    module = model.model.embed_tokens if where == "before K/V writes" else model.lm_head
    ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    num_failures = 0
    while engine.has_unfinished():
        if rng.random() < 0.3:
            before = _state(engine)
            with monkeypatch.context() as patch:
                _raise_once_in(patch, module, 1)
                with pytest.raises(RuntimeError, match="injected failure"):
                    engine.step()
            assert _state(engine) == before
            pool.allocator.check_invariants()
            num_failures += 1
        engine.step()
        pool.allocator.check_invariants()
    assert num_failures and engine.stats.num_failed_steps == num_failures
    assert [engine.request(i).output_ids for i in ids] == greedy_reference("llama", prompts, new_tokens)
    assert pool.num_used_blocks == 0


def test_a_failed_step_that_preempted_leaves_no_block_behind(monkeypatch):
    """vLLM's admission in a tight pool preempts; failed steps among them give back every block they took, and
    every request still gets generate()'s tokens."""
    prompts = random_prompts((5, 17, 9, 30, 3))
    new_tokens = [8, 12, 5, 10, 7]
    engine, pool = tiny_engine(num_blocks=12, max_num_seqs=4, decode_reserve_tokens=0)
    ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    step = 0
    while engine.has_unfinished():
        step += 1
        if step % 3 == 0:
            held = pool.num_used_blocks
            with monkeypatch.context() as patch:
                _raise_once_in(patch, engine.model.lm_head, 1)
                with pytest.raises(RuntimeError):
                    engine.step()
            assert pool.num_used_blocks <= held  # preemptions it decided stand; nothing it allocated stays
            assert sum(len(r.block_ids) for r in engine.scheduler.running) <= pool.num_used_blocks
            pool.allocator.check_invariants()
        engine.step()
    assert engine.stats.num_preemptions > 0
    assert [engine.request(i).output_ids for i in ids] == greedy_reference("llama", prompts, new_tokens)
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_a_request_whose_forward_keeps_raising_fails_alone(monkeypatch):
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine(num_blocks=64)
    _poison(monkeypatch, engine.model)
    good = [engine.add_request(p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    bad = engine.add_request(random_prompts((110,), seed=1)[0], max_new_tokens=6, ignore_eos=True)
    _run(engine)  # never raises: the poisoned row is found and retired within its step
    request = engine.request(bad)
    assert request.finish_reason == "error" and "failed in the model's forward: ValueError('poisoned input')" in (
        request.error
    )
    assert [engine.request(i).output_ids for i in good] == greedy_reference("llama", prompts, [6, 6, 6])
    assert engine.stats.num_failed == 1 and engine.stats.num_failed_steps == 0
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_a_lone_request_whose_forward_keeps_raising_does_not_stall_the_loop(monkeypatch):
    """Alone, a failing forward cannot be told from a broken model: the first step raises (undone), and the second
    failure in a row finishes the request with its error."""
    engine, pool = tiny_engine(num_blocks=64)
    _poison(monkeypatch, engine.model)
    bad = engine.add_request(random_prompts((110,), seed=1)[0], max_new_tokens=6)
    with pytest.raises(ValueError, match="poisoned input"):
        engine.step()
    assert not engine.request(bad).finished and engine.request(bad).num_computed == 0
    engine.step()
    assert engine.request(bad).finish_reason == "error" and not engine.has_unfinished()
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_generate_with_a_prompt_whose_forward_raises_returns_the_others(monkeypatch):
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine(num_blocks=64)
    _poison(monkeypatch, engine.model)
    poisoned = random_prompts((110,), seed=1)[0]
    with pytest.raises(RequestFailed, match=r"input 1: request \d+ failed in the model's forward") as info:
        engine.generate([prompts[0], poisoned, prompts[1]], max_new_tokens=5, ignore_eos=True)
    reference = greedy_reference("llama", prompts, [5, 5])
    assert list(info.value.errors) == [1]
    assert info.value.outputs[0] == reference[0] and info.value.outputs[2] == reference[1]
    assert pool.num_used_blocks == 0


def test_a_failure_no_row_reproduces_goes_to_the_caller(monkeypatch):
    """A forward that raises once, then runs for every half of the rows: nothing to blame, so the step raises and
    is undone (a caller retrying gets the same tokens)."""
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine()
    ids = [engine.add_request(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    engine.step()
    with monkeypatch.context() as patch:
        _raise_once_in(patch, tiny_model("llama", "hf_paged").lm_head, 1)
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
    _run(engine)
    assert [engine.request(i).output_ids for i in ids] == greedy_reference("llama", prompts, [5, 5, 5])
    assert pool.num_used_blocks == 0


def test_a_step_undone_after_sampling_draws_the_same_seeded_tokens_again():
    """A step that fails after its rows sampled (a lockstep agreement that raises) is undone with its requests'
    generators, so seeded requests produce the tokens of a run in which nothing failed."""
    from hf_paged.errors import LockstepError

    prompts = random_prompts((5, 9))
    reference, _ = tiny_engine("llama", 64)
    expected = reference.generate(prompts, max_new_tokens=6, temperature=1.0, seed=[3, 4], ignore_eos=True)

    class FailingOnce:
        rank, failures = 0, 0

        def agree_rows(self, rows):
            pass

        def agree_tokens(self, decisions):
            self.failures += 1
            if self.failures in (1, 3):  # the first prefill and a decode step
                raise LockstepError({0: "no agreement"})
            return decisions

    engine, pool = tiny_engine("llama", 64)
    engine._lockstep = FailingOnce()
    ids = [
        engine.add_request(p, max_new_tokens=6, temperature=1.0, seed=s, ignore_eos=True)
        for p, s in zip(prompts, [3, 4])
    ]
    raised = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except LockstepError:
            raised += 1
    assert raised == 2
    assert [engine.request(i).output_ids for i in ids] == expected
    assert pool.num_used_blocks == 0
