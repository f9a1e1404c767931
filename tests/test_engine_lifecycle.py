"""Engine under long-running use: requests leave once handed back, stats stay bounded, each prompt of a call
samples on its own, and misuse gets typed errors naming the allowed values."""

import numpy as np
import pytest
import torch

from hf_paged import BlockPool, Engine, RequestFailed
from hf_paged.engine.stats import RECENT_STEPS
from hf_paged.errors import UnknownRequest
from tests.models import greedy_reference, random_prompts, tiny_engine, tiny_model


def test_generate_and_stream_leave_no_request_behind():
    prompts = random_prompts((5, 9, 7))
    engine, pool = tiny_engine()
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True) == greedy_reference("llama", prompts, [4] * 3)
    assert list(engine.stream(prompts[:2], max_new_tokens=3, ignore_eos=True))
    stream = engine.stream(prompts, max_new_tokens=6, ignore_eos=True)
    next(stream)
    stream.close()
    with pytest.raises(RequestFailed):
        engine.generate([prompts[0], [1, 500]], max_new_tokens=3)
    assert engine._requests == {} and engine._finished == {} and engine._owned == set()
    assert pool.num_used_blocks == 0


def test_a_serving_loop_takes_finished_requests_with_pop_finished():
    prompts = random_prompts((5, 8, 6))
    engine, pool = tiny_engine(num_blocks=16)
    ids = [engine.add_request(p, max_new_tokens=4, ignore_eos=True) for p in prompts]
    aborted = engine.add_request(prompts[0], max_new_tokens=4)
    engine.abort_request(aborted)
    refused = engine.add_request(prompts[0], max_new_tokens=100)  # larger than the pool: finished at once
    finished = engine.pop_finished()
    assert [(r.request_id, r.finish_reason) for r in finished] == [(aborted, "abort"), (refused, "error")]
    assert engine.request(ids[0]).finish_reason is None  # unfinished ones stay
    outputs = {}
    while engine.has_unfinished():
        engine.step()
        for request in engine.pop_finished():
            outputs[request.request_id] = request.output_ids
            assert request.finish_reason == "length"
    assert [outputs[i] for i in ids] == greedy_reference("llama", prompts, [4, 4, 4])
    assert engine._requests == {} and engine.pop_finished() == []
    with pytest.raises(UnknownRequest, match=f"request {ids[0]} has finished and was handed back"):
        engine.request(ids[0])
    assert engine.abort_request(ids[0]) is False  # finished, handed back: nothing to do
    with pytest.raises(UnknownRequest, match="no request with id 999: this engine has issued ids 0 to 4"):
        engine.request(999)
    assert pool.num_used_blocks == 0


def test_a_generate_call_keeps_its_own_finished_requests_from_pop_finished():
    """A stream's finished inputs are the stream's to hand back, even when its caller pops finished requests of its
    own loop meanwhile."""
    prompts = random_prompts((5, 9))
    engine, _ = tiny_engine()
    other = engine.add_request(prompts[1], max_new_tokens=2, ignore_eos=True)
    popped = []
    streamed = []
    for index, token in engine.stream(prompts, max_new_tokens=[1, 6], ignore_eos=True):
        streamed.append((index, token))
        popped += engine.pop_finished()
    assert [r.request_id for r in popped] == [other]
    assert len(streamed) == 7 and engine._requests == {}


def test_aborting_many_added_requests_leaves_nothing_once_popped():
    engine, _ = tiny_engine()
    for _ in range(1000):
        engine.abort_request(engine.add_request([1, 2, 3]))
    assert len(engine.pop_finished()) == 1000
    assert engine._requests == {} and engine.stats.num_aborted == 1000


def test_stats_keep_bounded_aggregates():
    engine, pool = tiny_engine()
    prompts = random_prompts((5, 9, 7))
    engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    stats = engine.stats
    assert len(stats.used_blocks) == stats.num_steps  # a short run keeps every step
    assert stats.used_blocks_sum == sum(stats.used_blocks) and stats.peak_used_blocks == max(stats.used_blocks)
    assert stats.mean_used_blocks == sum(stats.used_blocks) / stats.num_steps
    assert stats.used_blocks.maxlen == RECENT_STEPS
    for _ in range(RECENT_STEPS + 10):
        stats.record_step(1, 2)
    assert len(stats.used_blocks) == RECENT_STEPS


def test_each_prompt_of_a_call_samples_on_its_own():
    engine, _ = tiny_engine()
    kwargs = dict(max_new_tokens=8, ignore_eos=True, temperature=1.0)
    four = engine.generate([[1, 2, 3]] * 4, seed=0, **kwargs)
    assert len({tuple(out) for out in four}) == 4
    # Prompt i draws from seed + i: each reproduces alone, and a list of seeds picks them.
    assert four == [engine.generate([[1, 2, 3]], seed=i, **kwargs)[0] for i in range(4)]
    assert engine.generate([[1, 2, 3]] * 4, seed=[0, 1, 2, 3], **kwargs) == four
    assert (
        engine.generate([[1, 2, 3]] * 2, seed=[5, 5], **kwargs)
        == [engine.generate([[1, 2, 3]], seed=5, **kwargs)[0]] * 2
    )
    # Beside other requests, a seeded request's tokens are the same.
    others = engine.add_request([7, 8, 9, 10], max_new_tokens=20, temperature=1.0)
    assert engine.generate([[1, 2, 3]] * 4, seed=0, **kwargs) == four
    engine.abort_request(others)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (dict(prompts=[1, 2, 3]), TypeError, r"one flat list of ints \[1, 2, 3\]: for one prompt pass \[\[1, 2, 3\]\]"),
        (dict(prompts="hello"), TypeError, "got str 'hello'; tokenize text first"),
        (dict(prompts=[[1, 2], "hi"]), TypeError, "a prompt must be a list of token ids"),
        (dict(prompts=[[1, 2.5]]), TypeError, "token ids must be ints, got float 2.5"),
        (dict(prompts=[[1]], max_new_tokens=None), ValueError, "max_new_tokens must be an int >= 1, got None"),
        (dict(prompts=[[1]], max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1, got 0"),
        (dict(prompts=[[1]], max_new_tokens=True), ValueError, "max_new_tokens must be an int >= 1, got True"),
        (
            dict(prompts=[[1]], temprature=1.0),
            TypeError,
            "unknown sampling keyword 'temprature' .did you mean 'temperature'",
        ),
        (dict(prompts=[[1]] * 3, temperature=[0, 0.8]), ValueError, "temperature has 2 entries for 3 prompts"),
        (dict(prompts=[[1]], temperature=-1), ValueError, r"temperature must be >= 0 .*, got -1"),
        (dict(prompts=[[1]], temperature=float("nan")), ValueError, r"temperature must be >= 0 .*, got nan"),
        (dict(prompts=[[1]], top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        (dict(prompts=[[1]], top_p=0), ValueError, r"top_p must be in \(0, 1\], got 0"),
        (dict(prompts=[[1]] * 4, seed=[0, 1]), ValueError, "seed has 2 entries for 4 prompts"),
        (dict(prompts=[[1]], seed="0"), TypeError, "seed must be an int"),
        # prompt i is seeded with seed + i: the last one past 64 bits
        (
            dict(prompts=[[1]] * 2, seed=2**64 - 1),
            ValueError,
            r"seed must be a 64-bit integer, .* got 18446744073709551616",
        ),
        (dict(prompts=[[1]], stop_token_ids=[[1], [2]]), ValueError, "stop_token_ids has 2 entries for 1 prompts"),
    ],
)
def test_misuse_of_generate_names_the_allowed_and_actual_values(call, error, message):
    engine, pool = tiny_engine()
    with pytest.raises(error, match=message):
        engine.generate(**call)
    assert not engine.has_unfinished() and engine._requests == {} and pool.num_used_blocks == 0


def test_per_prompt_lists_of_sampling_values():
    prompts = random_prompts((5, 9))
    engine, _ = tiny_engine()
    mixed = engine.generate(prompts, max_new_tokens=[3, 5], temperature=[0, 0.8], seed=[0, 4], ignore_eos=True)
    assert mixed[0] == greedy_reference("llama", prompts[:1], [3])[0]
    assert mixed[1] == engine.generate(prompts[1:], max_new_tokens=5, temperature=0.8, seed=4, ignore_eos=True)[0]
    stop = mixed[1][1]
    assert (
        engine.generate(prompts, max_new_tokens=5, temperature=[0, 0.8], seed=[0, 4], stop_token_ids=[[], [stop]])[1]
        == mixed[1][: mixed[1].index(stop) + 1]
    )


def test_numpy_scalars_and_lists_of_bias_pairs_are_values_for_every_prompt():
    """np.int64 / np.float32 arguments sample as the Python numbers they stand for; a list of (token id, bias) pairs
    is one bias for every prompt (a list of dicts, one per prompt)."""
    prompts = random_prompts((5, 9))
    engine, pool = tiny_engine()
    kwargs = dict(ignore_eos=True, temperature=0.8, top_k=5)
    plain = engine.generate(prompts, max_new_tokens=4, seed=3, **kwargs)
    numpy = engine.generate(
        prompts, max_new_tokens=np.int64(4), seed=np.int64(3), **{**kwargs, "temperature": np.float32(0.8)}
    )
    assert numpy == plain
    pairs = engine.generate(prompts, max_new_tokens=3, ignore_eos=True, logit_bias=[(7, 100.0), [8, 1.0]])
    assert pairs == [[7, 7, 7], [7, 7, 7]]
    per_prompt = engine.generate(prompts, max_new_tokens=3, ignore_eos=True, logit_bias=[{7: 100.0}, {9: 100.0}])
    assert per_prompt == [[7, 7, 7], [9, 9, 9]]
    assert pool.num_used_blocks == 0


def test_a_tiny_temperature_or_top_p_is_the_greedy_limit():
    """logits / 1e-40 overflow: the logits are shifted by their maximum first, so every other token gets -inf."""
    prompts = random_prompts((5, 9))
    engine, _ = tiny_engine()
    greedy = engine.generate(prompts, max_new_tokens=4, ignore_eos=True)
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True, temperature=1e-40, seed=0) == greedy
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True, temperature=1e-40) == greedy
    # below float32's range (0 there): the same limit
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True, temperature=1e-300, seed=0) == greedy
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True, temperature=5e-324) == greedy
    # top_p below float32's smallest number: 0 there, and the most likely token still stays
    assert engine.generate(prompts, max_new_tokens=4, ignore_eos=True, temperature=1.0, top_p=1e-46, seed=0) == greedy


def test_a_prompt_tensor_is_one_prompt_and_a_2d_tensor_is_many():
    prompts = random_prompts((6, 6))
    engine, _ = tiny_engine()
    expected = greedy_reference("llama", prompts, [3, 3])
    assert engine.generate(torch.tensor(prompts), max_new_tokens=3, ignore_eos=True) == expected
    assert engine.generate([torch.tensor(p) for p in prompts], max_new_tokens=3, ignore_eos=True) == expected
    assert engine.generate([np.array(p) for p in prompts], max_new_tokens=3, ignore_eos=True) == expected
    assert engine.generate([[np.int64(t) for t in p] for p in prompts], max_new_tokens=3, ignore_eos=True) == expected
    with pytest.raises(TypeError, match="must be 2-D"):
        engine.generate(torch.tensor(prompts[0]), max_new_tokens=3)


def test_add_request_misuse():
    engine, _ = tiny_engine()
    with pytest.raises(TypeError, match="unknown sampling keyword 'top_pp' .did you mean 'top_p'"):
        engine.add_request([1, 2], top_pp=0.5)
    with pytest.raises(ValueError, match="seed must be None or a 64-bit int, .* got \\[0, 1\\]"):
        engine.add_request([1, 2], seed=[0, 1])
    with pytest.raises(ValueError, match="seed must be None or a 64-bit int, .* got 18446744073709551616"):
        engine.add_request([1, 2], seed=2**64)
    with pytest.raises(ValueError, match="no request with id 'a': this engine has issued no ids yet"):
        engine.request("a")
    assert not engine.has_unfinished()


def test_the_engine_never_switches_prefix_caching_on_in_a_pool_in_use():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    held = pool.allocator.allocate(3)  # a PagedCache's blocks
    with pytest.raises(ValueError, match="pool built without prefix caching whose blocks are in use .3 of 16 held"):
        Engine(model, pool)
    assert not pool.allocator.enable_prefix_caching
    Engine(model, pool, enable_prefix_caching=False)
    assert not pool.allocator.enable_prefix_caching
    pool.allocator.free(held)
    Engine(model, pool)  # nothing uses it: the engine's pool, with its prefix cache on
    assert pool.allocator.enable_prefix_caching


def test_an_engine_without_prefix_caching_leaves_the_pools_cache_alone():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool, enable_prefix_caching=False)
    prompt = random_prompts((20,))[0]
    engine.generate([prompt, prompt], max_new_tokens=3)
    assert engine.stats.prefix_hit_tokens == 0 and pool.allocator.num_cached_blocks == 0
    assert pool.allocator.enable_prefix_caching


def test_a_request_crowded_out_by_a_paged_cache_says_so():
    """Blocks of the pool held outside the engine: the error names them, not only the pool's size."""
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    engine = Engine(model, pool, enable_prefix_caching=False)
    held = pool.allocator.allocate(6)
    with pytest.raises(RequestFailed, match="6 of the pool's 8 blocks are held outside this engine"):
        engine.generate(random_prompts((20,)), max_new_tokens=3)
    pool.allocator.free(held)
    assert pool.num_used_blocks == 0


def test_a_prefix_caching_pool_serves_one_model():
    """Cached K/V are found by token ids alone: a second model of the same shapes on the engine's prefix-caching pool
    is refused."""
    from hf_paged import PoolMismatch

    engine, pool = tiny_engine()
    other = tiny_model("llama", "hf_paged", seed=1)
    with pytest.raises(PoolMismatch, match="a prefix-caching pool serves one model"):
        Engine(other, pool)
    Engine(engine.model, pool)  # the same model again: fine


def test_a_prefix_caching_pool_refuses_a_config_of_another_architecture():
    """A cache built from a config alone (no model, no checkpoint name) on a pool that serves a model: a config of
    other sizes with the same K/V shapes is another model, refused naming what differs; a copy of the served
    model's config is the same model."""
    import copy

    from hf_paged import PagedCache, PoolMismatch

    engine, pool = tiny_engine()
    config = copy.deepcopy(engine.model.config)
    PagedCache(config=config, pool=pool).release()
    config.vocab_size += 1  # an embedding of another size: the K/V shapes are unchanged
    with pytest.raises(PoolMismatch, match=r"vocab_size \d+, the model served \d+"):
        PagedCache(config=config, pool=pool)
    unshared = BlockPool.for_model(engine.model, num_blocks=8, block_size=4, enable_prefix_caching=False)
    PagedCache(config=config, pool=unshared).release()  # without prefix caching nothing is shared


def test_max_waiting_steps_tries_admission_every_so_many_decode_only_steps():
    """While every running request decodes, admission is tried once `max_waiting_steps` steps have passed since the
    last try; a step that prefills anyway, and an idle engine, try at once."""
    from types import SimpleNamespace

    engine, _ = tiny_engine("llama", 64, max_waiting_steps=3)
    scheduler = engine.scheduler
    tries = []
    scheduler.admission.admit = lambda waiting, running: tries.append(len(running))
    decoding, prefilling = SimpleNamespace(num_pending=1), SimpleNamespace(num_pending=5)
    scheduler.waiting.append(SimpleNamespace())
    scheduler.running = [decoding]
    counts = []
    for _ in range(8):
        scheduler.admit()
        counts.append(len(tries))
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2]
    scheduler.running = [decoding, prefilling]  # this step prefills: admitting costs no step of its own
    scheduler.admit()
    scheduler.running = []  # nothing runs: nothing to wait for
    scheduler.admit()
    assert tries == [1, 1, 2, 0]
    scheduler.running, scheduler.waiting = [], type(scheduler.waiting)()
    scheduler._steps_waited = 2
    checkpoint = scheduler.checkpoint()  # a step that fails puts the count back with the queues
    scheduler._steps_waited = 3
    scheduler.restore(checkpoint)
    assert scheduler._steps_waited == 2
    with pytest.raises(ValueError, match=r"max_waiting_steps must be an int >= 0 \(0: every step\), got -1"):
        tiny_engine("llama", 8, max_waiting_steps=-1)


def test_max_waiting_steps_defaults_to_eight_where_decode_steps_replay_graphs(monkeypatch):
    import hf_paged.engine.engine as engine_module

    assert tiny_engine("llama", 8)[0].scheduler.max_waiting_steps == 0  # on CPU: no graphs
    build = engine_module.build_decode_runner

    def with_graphs(*args, **kwargs):
        runner, reason = build(*args, **kwargs)
        runner.cuda_graphs = True  # as on CUDA
        return runner, reason

    monkeypatch.setattr(engine_module, "build_decode_runner", with_graphs)
    assert tiny_engine("llama", 8)[0].scheduler.max_waiting_steps == engine_module.GRAPH_MAX_WAITING_STEPS == 8
    assert tiny_engine("llama", 8, max_waiting_steps=0)[0].scheduler.max_waiting_steps == 0


def test_requests_that_wait_steps_give_the_same_tokens():
    prompts = random_prompts((5, 11, 3, 17, 8, 9))
    new_tokens = [9, 4, 14, 6, 11, 7]
    engine, pool = tiny_engine("llama", 20, max_num_seqs=3, max_waiting_steps=4)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert pool.num_used_blocks == 0 and engine.stats.num_preemptions == 0
