"""A serving loop under long-running use: thousands of tiny requests through `add_request` / `step()` /
`pop_finished()` on a tight pool (preemption: vLLM's admission), with shared system prompts, random aborts, bad
requests (token ids outside the vocabulary, larger than the pool, a forward that always raises) and exceptions
injected in the model's forward before and after the layers write K/V. After every step the allocator's invariants
hold; at the end no block is held, no request is left in the engine, a sample of the greedy requests have
generate()'s tokens, and memory stayed flat.

CI runs a small loop; `HF_PAGED_SOAK_REQUESTS=100000` runs a long one (`-s` prints its numbers).
"""

import gc
import os
import random
import resource
import time
import tracemalloc

import pytest

from tests.models import VOCAB_SIZE, greedy_reference, random_prompts, tiny_engine

NUM_REQUESTS = int(os.environ.get("HF_PAGED_SOAK_REQUESTS", "3000"))
POISON_POSITION = 40  # a forward reaching this position raises; only poisoned prompts are that long
CHECKED = 40  # greedy requests compared with generate() at the end


class Injector:
    """The model's forward, with failures: one raising at the embedding (before any layer writes K/V) or at the head
    (after every layer has), in the first forward after it is armed; and one raising for any forward that reaches
    position POISON_POSITION, before any layer runs."""

    def __init__(self, monkeypatch, model):
        self.armed = None  # the module to fail in the next forward
        self.active = None  # the module failing in this forward
        self.modules = (model.model.embed_tokens, model.lm_head)
        for module in self.modules:
            self._wrap(monkeypatch, module)
        forward = model.model.forward

        def poisoned(*args, position_ids=None, **kwargs):
            self.active, self.armed = self.armed, None  # only the first forward after arming fails
            if position_ids is not None and int(position_ids.max()) >= POISON_POSITION:
                raise ValueError("poisoned input")
            return forward(*args, position_ids=position_ids, **kwargs)

        monkeypatch.setattr(model.model, "forward", poisoned)

    def _wrap(self, monkeypatch, module):
        forward = module.forward

        def maybe_failing(*args, **kwargs):
            if self.active is module:
                self.active = None
                raise RuntimeError("injected failure")
            return forward(*args, **kwargs)

        monkeypatch.setattr(module, "forward", maybe_failing)


def soak(monkeypatch, num_requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    engine, pool = tiny_engine(
        "llama", num_blocks=20, max_num_seqs=12, max_num_batched_tokens=48, decode_reserve_tokens=0
    )
    injector = Injector(monkeypatch, engine.model)
    systems = random_prompts((8, 12), seed=seed + 1000)
    expected_kind: dict[int, str] = {}  # request id -> what it is: good, sampled, poison, huge
    specs: dict[int, tuple[list[int], int]] = {}  # request id -> (prompt, max_new_tokens), for the check sample
    checked: list[tuple[list[int], int, list[int], bool]] = []  # (prompt, max_new_tokens, output, aborted)
    counts = dict(added=0, refused=0, aborted=0, failed=0, injected=0, raised=0, finished=0)
    in_flight: set[int] = set()
    max_in_engine = 0
    last_injected = -2
    tracing_from = num_requests // 5
    traced = []
    start = time.perf_counter()
    while counts["added"] + counts["refused"] < num_requests or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if counts["added"] + counts["refused"] >= num_requests:
                break
            kind = rng.choices(["good", "sampled", "bad", "huge", "poison"], [80, 10, 4, 3, 3])[0]
            prompt = random_prompts((rng.randint(1, 6),), seed=rng.randrange(10**9))[0]
            if rng.random() < 0.5:
                prompt = rng.choice(systems) + prompt
            new_tokens = rng.randint(1, 5)
            if kind == "bad":
                prompt[rng.randrange(len(prompt))] = rng.choice([VOCAB_SIZE, VOCAB_SIZE + 7, -1])
                with pytest.raises(ValueError, match="outside the model's vocabulary"):
                    engine.add_request(prompt, max_new_tokens=new_tokens)
                counts["refused"] += 1
                continue
            if kind == "huge":
                new_tokens = 20 * 4
            if kind == "poison":
                prompt = random_prompts((POISON_POSITION + 1,), seed=rng.randrange(10**9))[0]
            sampling = dict(temperature=0.8, seed=rng.randrange(1000)) if kind == "sampled" else {}
            request_id = engine.add_request(prompt, max_new_tokens=new_tokens, ignore_eos=True, **sampling)
            expected_kind[request_id], specs[request_id] = kind, (prompt, new_tokens)
            in_flight.add(request_id)
            counts["added"] += 1
        if in_flight and rng.random() < 0.04:
            victim = rng.choice(sorted(in_flight))
            engine.abort_request(victim)
        if engine.has_unfinished():
            if engine.stats.num_steps - last_injected > 1 and rng.random() < 0.03:
                injector.armed = rng.choice(injector.modules)  # never two steps in a row: a lone row would be blamed
                last_injected = engine.stats.num_steps
                counts["injected"] += 1
            try:
                engine.step()
            except RuntimeError as error:
                assert "injected failure" in str(error)
                counts["raised"] += 1
            except ValueError as error:  # a poisoned request alone: its first failure in a row
                assert "poisoned input" in str(error)
                counts["raised"] += 1
            injector.armed = None
            pool.allocator.check_invariants()
        for request in engine.pop_finished():
            in_flight.discard(request.request_id)
            kind = expected_kind.pop(request.request_id)
            prompt, new_tokens = specs.pop(request.request_id)
            counts["finished"] += 1
            reason = request.finish_reason
            if reason == "abort":
                counts["aborted"] += 1
            elif kind in ("huge", "poison"):
                assert reason == "error", (kind, request.error)
                counts["failed"] += 1
            else:
                assert reason == "length" and len(request.output_ids) == new_tokens, (kind, request.error)
            if kind == "good" and len(checked) < CHECKED and rng.random() < 0.2:
                checked.append((prompt, new_tokens, list(request.output_ids), reason == "abort"))
        assert len(engine._requests) == len(in_flight)  # what is in flight, never what ran
        max_in_engine = max(max_in_engine, len(engine._requests))
        if counts["added"] >= tracing_from and not tracemalloc.is_tracing():
            tracemalloc.start()
        if tracemalloc.is_tracing() and engine.stats.num_steps % 100 == 0:
            gc.collect()  # a step's cache and its layers form cycles: count what is live, not what awaits the collector
            traced.append(tracemalloc.get_traced_memory()[0])
    seconds = time.perf_counter() - start
    peak_traced = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    tracemalloc.stop()

    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
    assert engine._requests == {} and engine._finished == {} and engine._owned == set()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert counts["finished"] == counts["added"]
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert counts["injected"] and counts["raised"] and counts["aborted"] and counts["failed"]
    assert stats.num_failed == counts["failed"] and stats.num_aborted == counts["aborted"]
    # Memory is flat: Python objects traced after the warm-up do not grow with the requests served.
    # (traced[0] is taken as tracing starts; traced[1] once the run's objects are traced)
    assert len(traced) >= 3 and traced[-1] - traced[1] < 256 * 1024, traced
    references = greedy_reference("llama", [c[0] for c in checked], [c[1] for c in checked])
    for (_, _, output, aborted), reference in zip(checked, references):
        assert output == (reference[: len(output)] if aborted else reference)
    return dict(
        requests=num_requests,
        steps=stats.num_steps,
        seconds=round(seconds, 1),
        preemptions=stats.num_preemptions,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        checked=len(checked),
        traced_kib=(traced[1] // 1024, traced[-1] // 1024),
        peak_traced_kib=peak_traced // 1024,
        max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        max_in_engine=max_in_engine,
        **counts,
    )


@pytest.mark.slow
def test_serving_loop_soak(monkeypatch, one_torch_thread):
    summary = soak(monkeypatch, NUM_REQUESTS)
    print(f"\nsoak: {summary}")
