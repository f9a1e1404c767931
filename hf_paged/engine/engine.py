"""Engine: continuous batching of many requests on one BlockPool.

    engine = Engine(model, BlockPool.for_model(model, max_memory="1GiB"), max_num_seqs=64)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # token ids, in input order

Each `step()` runs one forward over every scheduled request: the decode rows' next tokens and the prefill chunks
packed into one sequence (see `StepCache`), attention through "hf_paged" (ragged decode rows read the pool, no
padding to the longest sequence); then samples, retires finished requests and frees their blocks. `Engine` switches
the model to the "hf_paged" attention implementation (which behaves exactly like sdpa with any other cache).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention import enable
from ..errors import RequestFailed
from ..storage import BlockPool, KVLayout, sliding_windows
from .request import Request
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .step_cache import StepCache


@dataclass
class EngineStats:
    num_steps: int = 0
    peak_running: int = 0
    running_sum: int = 0  # sum over steps of the requests that ran, for the mean
    num_preemptions: int = 0
    num_aborted: int = 0  # requests stopped by `abort_request` before their end
    prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    prefill_tokens: int = 0  # input tokens computed before a request's first output (recomputation included)
    decode_tokens: int = 0  # generated tokens fed back
    used_blocks: list[int] = field(default_factory=list)  # pool blocks in use after each step

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.num_steps if self.num_steps else 0.0


class Engine:
    """Serve many requests from one `BlockPool` with any model that works with `PagedCache`.

    Args:
        model: a transformers causal LM (decoder-only, full or sliding-window attention layers). Each request
            holds one block table per layer group of the pool; a group whose layers all slide gives back the blocks
            that left the window, so sliding-window models hold about a window of K/V per request.
        pool (`BlockPool`): built for this model (`BlockPool.for_model(model, ...)`).
        max_num_seqs (`int`, defaults to 64): requests running at once.
        max_num_batched_tokens (`int`, defaults to 512): tokens per step (decode rows count one each; the rest
            goes to prefill chunks, so one long prompt cannot stall decoding). At least `max_num_seqs`.
        enable_prefix_caching (`bool`, defaults to `True`): reuse cached prompt prefixes when a request's prefill
            starts. Requests that share prompt blocks (a system prompt, parallel samples of one prompt) compute them
            once: a request waits while another computes blocks it would reuse, and admission counts a block that
            several running requests hold once, in a full-attention group or a sliding window (also the blocks a
            waiting request would take from the cache: it takes them when admitted). With layer groups, each group
            caches its own blocks, and a sliding group needs only the blocks its window still sees for a hit. Turns
            the pool's prefix cache on (a pool with prefix caching belongs to one model).
        decode_reserve_tokens (`int`, *optional*): how far admission looks ahead. A waiting request is admitted
            only if, at every step until each running request reaches its `max_new_tokens` (by default) or for
            the next `decode_reserve_tokens` steps, the pool holds what every request will have grown to, counting
            the blocks of requests that finish first. The default never preempts an admitted request (sliding
            groups included: each is counted at the blocks its window can span); a finite value admits more when
            requests usually stop early (eos) and preempts when they do not.
        backfill_window (`int`, defaults to 8): how many waiting requests admission considers, in queue order
            (arrival order; a preempted request goes back to the front).
            When the first does not fit, the first of the others that does is admitted instead (backfill); a
            request passed over `Admission.MAX_SKIPS` (16) times blocks backfill behind it, so none waits forever.
            1: strict arrival order.
    """

    def __init__(
        self,
        model,
        pool: BlockPool,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        decode_reserve_tokens: int | None = None,
        backfill_window: int = 8,
    ):
        pool.check_compatible(KVLayout.from_config(model.config))
        if enable_prefix_caching:
            pool.allocator.enable_prefix_caching = True
        self.model = enable(model) if model.config._attn_implementation != "hf_paged" else model
        self.pool = pool
        self.scheduler = Scheduler(
            pool,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_reserve_tokens=decode_reserve_tokens,
            backfill_window=backfill_window,
            sliding_windows=sliding_windows(model.config.get_text_config(decoder=True)),
        )
        self.stats = EngineStats()
        self._workspace: dict = {}  # StepCache gather buffers, reused across steps
        self._requests: dict[int, Request] = {}
        self._in_step = False
        self._deferred_aborts: list[Request] = []  # aborts asked for during a step, done when it ends
        self._ids = itertools.count()
        generation_config = getattr(model, "generation_config", None)
        self._eos_token_id = getattr(generation_config, "eos_token_id", None)
        if isinstance(self._eos_token_id, list):
            self._eos_token_id = self._eos_token_id[0] if self._eos_token_id else None

    # ------------------------------------------------------------------ API
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int = 16, **sampling) -> int:
        """Queue a request; returns its id. `sampling`: SamplingParams fields (temperature, top_k, top_p, seed,
        stop_token_ids, ignore_eos, eos_token_id; eos defaults to the model's generation config)."""
        prompt_ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        sampling.setdefault("eos_token_id", self._eos_token_id)
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        request = Request(next(self._ids), prompt_ids, params, generator=generator)
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def abort_request(self, request_id: int) -> bool:
        """Stop a request before its end (a client that went away), like vLLM's `abort_request`: a running request's
        blocks go back to the pool at once, a waiting one leaves the queue, and neither runs again. Its `output_ids`
        keep what it generated so far, `engine.request(request_id).aborted` is set and its `finish_reason` is "abort".
        Greedy and seeded requests that go on produce the same tokens as without the abort.

        Call it between steps, from the loop that calls `step()`; called during one (say, by a stream that the
        garbage collector closes while a forward runs), it takes effect when the step ends. Returns True when the
        request was unfinished, False when it had already finished (nothing changes). Unlike vLLM, which ignores ids
        it does not know, an id this engine never issued raises `ValueError`.
        """
        request = self._requests.get(request_id)
        if request is None:
            issued = f"ids 0 to {len(self._requests) - 1}" if self._requests else "no ids yet"
            raise ValueError(f"no request with id {request_id!r}: this engine has issued {issued}")
        if request.finished:
            return False
        self._abort([request])
        return True

    def _abort(self, requests: list[Request]) -> None:
        """Abort unfinished `requests` now, or when the step under way ends."""
        if self._in_step:
            self._deferred_aborts += requests
            return
        requests = [request for request in dict.fromkeys(requests) if not request.finished]
        if requests:
            self.scheduler.abort(requests)
            self.stats.num_aborted += len(requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[tuple[int, int]]:
        """Run one scheduling step (one forward); returns the (request_id, token_id) pairs it produced."""
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            self._abort(deferred)

    def _step(self) -> list[tuple[int, int]]:
        plan = self.scheduler.schedule()
        rows = [(request, 1) for request in plan.decode] + plan.prefill
        rows.sort(key=lambda row: row[1] > 1)  # one-token rows first (a stable sort keeps the scheduler's order)
        events: list[tuple[int, int]] = []
        if rows:
            with torch.inference_mode():
                logits = self._forward(rows)
                # One device read per step, not one per row: every row's argmax, and the logits of the rows that
                # sample (their generators live on the CPU), copied to the host together.
                greedy_ids = logits.argmax(-1).tolist()
                sampled = [
                    row
                    for row, (request, num_tokens) in enumerate(rows)
                    if request.params.temperature > 0.0 and request.num_pending == num_tokens
                ]
                host_logits = dict(zip(sampled, logits[sampled].float().cpu())) if sampled else {}
            for row, (request, num_tokens) in enumerate(rows):
                if request.output_ids and request.num_pending == 1:  # feeding back its last output
                    self.stats.decode_tokens += 1
                else:  # prompt tokens, or a preempted request's recomputation: prefill work
                    self.stats.prefill_tokens += num_tokens
                request.num_computed += num_tokens
                self.scheduler.cache_full_blocks(request)
                if request.num_pending:
                    continue  # a prefill chunk short of the end of its input: nothing to sample
                if request.params.temperature == 0.0:
                    token = greedy_ids[row]
                else:
                    try:
                        token = sample(host_logits[row], request.params, request.generator)
                    except RuntimeError as error:  # e.g. torch.multinomial on nan or inf probabilities
                        # This request fails alone; the others' rows of the step are applied as usual.
                        request.error = f"request {request.request_id} could not sample its next token: {error}"
                        continue
                events.append(self._append(request, token))
        for request in [r for r in self.scheduler.running if r.error is not None or self._is_done(r)]:
            self.scheduler.retire(request)
        stats = self.stats
        stats.num_steps += 1
        stats.running_sum += len(rows)
        stats.peak_running = max(stats.peak_running, len(rows))
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        stats.used_blocks.append(self.pool.num_used_blocks)
        return events

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, **sampling):
        """Yield (input index, token id) as tokens are produced, in order per input, until every input has finished;
        failed inputs raise `RequestFailed` at the end. Tokens that other calls' steps produce for these inputs (a
        `generate()` inside the loop, another stream) are yielded too. Closing the stream early (`break` out of a
        `for` loop over `engine.stream(...)` itself, or `close()` on a stream kept in a variable) or an exception
        from a step aborts the inputs still unfinished, so their blocks go back to the pool. Requests added otherwise
        (`add_request`) share the steps and are left to their own loop."""
        request_ids = self._add_all(prompts, max_new_tokens, sampling)
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        yielded = [0] * len(request_ids)  # per input: tokens yielded so far

        def new_tokens(indices):
            for index in indices:
                output = self._requests[request_ids[index]].output_ids
                while yielded[index] < len(output):
                    yielded[index] += 1
                    yield index, output[yielded[index] - 1]

        everyone = range(len(request_ids))
        try:
            num_steps = self.stats.num_steps
            for events in self._steps_until_finished(request_ids):
                # NOTE: read the counter before yielding: the caller may step the engine while this is suspended.
                only_ours, num_steps = self.stats.num_steps == num_steps + 1, self.stats.num_steps
                produced = dict.fromkeys(index_of[r] for r, _ in events if r in index_of) if only_ours else everyone
                yield from new_tokens(produced)
            yield from new_tokens(everyone)  # tokens of steps other calls ran since
        finally:
            self._abort_unfinished(request_ids)
        self._raise_failures(request_ids)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, **sampling
    ) -> list[list[int]]:
        """Generated token ids per prompt, in input order (`ignore_eos`, `temperature`, ... as in add_request). Steps
        until every input has finished; an exception from a step aborts the inputs still unfinished."""
        request_ids = self._add_all(prompts, max_new_tokens, sampling)
        try:
            for _ in self._steps_until_finished(request_ids):
                pass
        finally:
            self._abort_unfinished(request_ids)
        self._raise_failures(request_ids)
        return [self._requests[request_id].output_ids for request_id in request_ids]

    # -------------------------------------------------------------- internals
    def _add_all(self, prompts, max_new_tokens, sampling) -> list[int]:
        """Add every prompt; a bad one (empty, bad sampling values), or an interrupt, aborts those added before it
        (their ids are used up, and they count as aborted)."""
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
        request_ids: list[int] = []
        try:
            for prompt, num_new in zip(prompts, max_new_tokens):
                request_ids.append(self.add_request(prompt, num_new, **sampling))
        except BaseException:
            self._abort_unfinished(request_ids)
            raise
        return request_ids

    def _steps_until_finished(self, request_ids: list[int]):
        """Step until every one of `request_ids` has finished; yields each step's events."""
        first = 0  # the requests before it have finished (for good), so each is checked until it has, then no more
        while True:
            while first < len(request_ids) and self._requests[request_ids[first]].finished:
                first += 1
            if first == len(request_ids):
                return
            yield self.step()

    def _abort_unfinished(self, request_ids: list[int]) -> None:
        self._abort([self._requests[request_id] for request_id in request_ids])

    def _raise_failures(self, request_ids: list[int]) -> None:
        errors = {i: self._requests[r].error for i, r in enumerate(request_ids) if self._requests[r].error}
        if errors:
            raise RequestFailed(errors, [self._requests[r].output_ids for r in request_ids])

    def _forward(self, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """One forward over `rows` (request, new tokens), packed into one sequence (decode rows first); returns
        [len(rows), vocab] logits at each row's last new token."""
        groups = range(self.pool.num_groups)
        cache = StepCache(
            self.pool,
            [[request.block_tables[g] for request, _ in rows] for g in groups],
            [request.num_computed for request, _ in rows],
            [num_tokens for _, num_tokens in rows],
            first_blocks=[[request.first_blocks[g] for request, _ in rows] for g in groups],
            workspace=self._workspace,
        )
        token_ids = [
            token
            for request, num_tokens in rows
            for token in request.token_ids[request.num_computed : request.num_computed + num_tokens]
        ]
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([token_ids], device=device),
            position_ids=cache.position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(cache.last_token_indices, device=device),
        )
        return out.logits[0]

    def _append(self, request: Request, token: int) -> tuple[int, int]:
        request.output_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        return request.request_id, token

    def _is_done(self, request: Request) -> bool:
        if not request.output_ids or request.num_pending != 1:
            return False
        return len(request.output_ids) >= request.params.max_new_tokens or request.params.is_stop(
            request.output_ids[-1]
        )

    def request(self, request_id: int) -> Request:
        return self._requests[request_id]
