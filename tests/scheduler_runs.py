"""Driving a `Scheduler` without a model, as the engine would: every computed prompt samples token 7, every step
must fit its token budget, and every block must come back."""

from hf_paged import SamplingParams
from hf_paged.engine import Request, Scheduler


def new_request(request_id: int, prompt_len: int, max_new_tokens: int) -> Request:
    """A greedy request whose prompt is `prompt_len` ids of its own (no prefix shared with another request id)."""
    prompt = list(range(100 * request_id + 1, 100 * request_id + 1 + prompt_len))
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def drive(
    scheduler: Scheduler, requests: list[Request], max_steps: int | None = None, *, num_held_outside: int = 0
) -> int:
    """Run `requests` to the end as the engine would, without a model (every computed prompt samples token 7);
    returns the steps taken, asserting they stay under `max_steps` when given (a loop that never ends fails) and
    that every block comes back but the `num_held_outside` that something else holds."""
    for request in requests:
        scheduler.add(request)
    num_steps = 0
    while scheduler.has_unfinished():
        assert max_steps is None or num_steps < max_steps, f"still running after {num_steps} steps"
        run_step(scheduler)
        num_steps += 1
    assert scheduler.pool.num_used_blocks == num_held_outside
    return num_steps


def run_step(scheduler: Scheduler) -> None:
    finish_step(scheduler, scheduler.schedule())


def finish_step(scheduler: Scheduler, step) -> None:
    """What the engine does after the forward of `step` (which must fit the step's token budget)."""
    assert len(step.decode) + sum(num_tokens for _, num_tokens in step.prefill) <= scheduler.max_num_batched_tokens
    for request, num_tokens in [(r, 1) for r in step.decode] + step.prefill:
        request.num_computed += num_tokens
        scheduler.cache_full_blocks(request)
        if request.num_pending == 0:
            request.output_ids.append(7)
    done = [r for r in scheduler.running if r.num_pending == 1 and len(r.output_ids) >= r.params.max_new_tokens]
    for request in done:
        scheduler.retire(request)
