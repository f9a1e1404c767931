"""Engine: continuous batching of many requests on one BlockPool.

    engine = Engine(model, BlockPool.for_model(model, max_memory="1GiB"), max_num_seqs=64)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # token ids, in input order

Each `step()`: the scheduler decides (scheduler.py), the step runner runs the rows on the device (step_runner.py),
then the engine appends tokens and retires finished requests:

    Scheduler.schedule()     which requests run, with how many tokens, on which blocks
      ├─ Admission           who may start (admission.py, with the Lookahead of lookahead.py)
      ├─ BlockManager        the blocks: grow, free, release, roll back (block_manager.py)
      └─ PrefixReuse         the pool's prefix cache (prefix_cache.py)
    StepRunner.run(rows)     one forward (or one per row), logits processing, per-row results; failures isolated
      ├─ PackedStep          every row packed into one sequence, attention through "hf_paged" (packed.py,
      │                      step_cache.py); decode-only steps on the DecodeRunner (decode_runner.py: CUDA graphs)
      └─ PerRequestStep      a forward per row with the model's own attention (per_request.py)

With asynchronous scheduling (on CUDA by default) a decode-only step is launched before the host reads the tokens of
the step before it; the device feeds those tokens to it, and the host reads them (and appends, streams and retires)
while the new step runs: `_launch`, `_resolve`, `_advance` below, docs/engine.md.

A request lives in the engine from `add_request` until its results are handed back: `generate()` / `stream()`
return their own, a serving loop takes finished ones with `pop_finished()`. So the engine holds what is in flight,
not what ever ran.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import torch

from ..attention import enable
from ..errors import LockstepError, PoolMismatch, RequestFailed, UnknownRequest
from ..storage import BlockPool, KVLayout, block_windows
from .checkpoint import StepCheckpoint
from .decode_runner import DecodeRunner, Feed, build_decode_runner
from .inputs import PromptLimits, as_prompt, as_prompts, check_sampling_keywords, spread_over_prompts
from .lockstep import Lockstep
from .model_support import PACKED, cache_keyword, choose_step_mode, chunk_sizes
from .packed import PackedStep
from .per_request import PerRequestStep, check_chunked_prompt, prefix_caching_reason
from .request import Request, ScheduledStep
from .sampling import SamplingParams, sample_batch, token_logprob
from .scheduler import Scheduler
from .stats import EngineStats
from .step_runner import StepRunner

logger = logging.getLogger(__name__)


# `max_waiting_steps` where decode steps replay CUDA graphs. On an H200 (a 1B model, ~40 rows) a replayed decode step
# took 3-5 ms and an eager step that prefills about 60; at 8 the GPU workload of bench/engine_speed.py runs 37 steps
# that prefill instead of 67, with as many rows per decode step (`python -m bench.scheduler_host --max-waiting-steps
# 0 8`).
GRAPH_MAX_WAITING_STEPS = 8


class Engine:
    """Serve many requests from one `BlockPool` with any model that works with `PagedCache` (docs/engine.md has each
    argument in full).

    Args:
        model: a transformers causal LM. A model the packed step would run wrong (`engine/model_support.py`) runs one
            forward per scheduled request (`step_mode` "per-request"); one neither step serves raises
            `UnsupportedModel` here, naming its type and the reason.
        pool (`BlockPool`): built for this model (`BlockPool.for_model(model, ...)`).
        max_num_seqs (`int`, defaults to 64): requests running at once.
        max_num_batched_tokens (`int`, defaults to 512): tokens per step, a decode row counting one, so one long
            prompt cannot stall decoding. At least `max_num_seqs`.
        enable_prefix_caching (`bool`, defaults to `True`): reuse cached prompt prefixes; turns the pool's prefix
            cache on when nothing uses the pool yet, and raises `ValueError` on a pool in use built without one.
        decode_reserve_tokens (`int`, *optional*): how far admission looks ahead: None to every running request's
            end (an admitted request is never preempted), N the next N steps (more admitted, some preempted).
        backfill_depth (`int`, defaults to 8): waiting requests admission considers, in queue order; 1 is strict
            arrival order.
        max_waiting_steps (`int`, *optional*): while every running request decodes, try admission only once this
            many steps have passed since the last try, so waiting requests start together in one step that prefills
            (text-generation-inference's `max_waiting_tokens`); 0: every step. Defaults to
            `GRAPH_MAX_WAITING_STEPS` where decode steps replay CUDA graphs (an eager step that prefills costs the
            host as much as ten or more of them), else 0.
        cuda_graphs (`bool`, *optional*): replay decode-only steps as CUDA graphs, one per batch bucket; defaults
            to True on CUDA, not available elsewhere.
        async_scheduling (`bool`, *optional*): launch a decode-only step before reading the tokens of the step
            before it, which the device feeds to it, so the host schedules step n + 1 while the device runs step n
            (vLLM's async scheduling); greedy and seeded tokens are the same, unseeded samples are drawn on the
            device. Defaults to True on CUDA where the Engine has a decode runner (`runner`); True needs one.
        compile_decode (`bool` or `dict`, defaults to `False`): compile the model's forward of decode-only steps with
            `torch.compile(model, fullgraph=True, ...)` before their CUDA graphs are captured, so inductor fuses each
            layer's small operations; a dict gives `torch.compile`'s keywords (`{"backend": "aot_eager"}`), True its
            defaults. Needs the decode runner on the Triton kernels (CUDA). Compiling takes a while at the first
            decode steps, and the fused operations round differently from the eager forward's.
        compile_prefill (`bool` or `dict`, defaults to `False`): compile the model's forward of the other steps (those
            that prefill) the same way, one graph for every token count, each layer's attention one custom op over the
            step's pool (`engine/compiled_step.py`): on a GPU an eager step that prefills costs the host a launch per
            operation of every layer. Needs the packed step; a forward that cannot compile runs eagerly and
            `step_runner.step.compile_error` says why.
        lockstep_timeout (`float`, defaults to 300): under tensor parallelism (one engine per rank), the seconds a
            rank waits for the others at a step's agreement points before raising `LockstepError`.

    Attributes:
        step_mode (`str`): "packed" (one forward over all rows of a step) or "per-request" (a forward per row).
        step_mode_reason (`str` or None): why the packed step cannot run the model.
        runner (`DecodeRunner` or None): what runs decode-only steps (its `stats`: steps replayed and run eagerly,
            graph capture time and memory); None where they stay packed (`runner_reason` says why).
        step_runner (`StepRunner`): what runs a step's rows on the device (`engine/step_runner.py`).
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
        backfill_depth: int = 8,
        max_waiting_steps: int | None = None,
        cuda_graphs: bool | None = None,
        async_scheduling: bool | None = None,
        compile_decode: bool | dict = False,
        compile_prefill: bool | dict = False,
        lockstep_timeout: float = 300.0,
    ):
        # Before anything: a model neither step serves raises.
        self.step_mode, self.step_mode_reason = choose_step_mode(model)
        packed = self.step_mode == PACKED
        notes = [self.step_mode_reason]
        if not packed:
            check_chunked_prompt(model, cache_keyword(model))
            if enable_prefix_caching and (note := prefix_caching_reason(model)) is not None:
                enable_prefix_caching = False
                notes.append(note)
        pool.check_compatible(KVLayout.from_config(model))  # a tensor-parallel model: this rank's kv heads
        if pool.is_multi_device:
            raise PoolMismatch(
                f"the Engine runs a pool on one device; this one places layers on {pool.devices} (a model split with "
                "device_map): serve such a model with PagedCache and generate(), or load it on one device"
            )
        _check_prefix_caching(pool, enable_prefix_caching)
        self.model = enable(model) if packed and model.config._attn_implementation != "hf_paged" else model
        self.pool = pool
        self.scheduler = Scheduler(
            pool,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_reserve_tokens=decode_reserve_tokens,
            backfill_depth=backfill_depth,
            max_waiting_steps=0 if max_waiting_steps is None else max_waiting_steps,
            # The per-request step keeps every block: a prompt chunk sees the whole prompt before it.
            sliding_windows=block_windows(model.config.get_text_config(decoder=True)) if packed else None,
            enable_prefix_caching=enable_prefix_caching,
        )
        if enable_prefix_caching:
            pool.allocator.enable_prefix_caching = True
        pool.serve_model(self.model)  # a prefix-caching pool serves one model: another one's raises PoolMismatch
        self.limits = PromptLimits.from_model(model)
        self.stats = EngineStats()
        if not packed:
            logger.warning(
                "Engine: model type %r runs one forward per scheduled request (no batching gain), with its own "
                "attention: %s",
                getattr(model.config, "model_type", None),
                "; ".join(notes),
            )
        self._requests: dict[int, Request] = {}  # issued and not handed back yet
        self._finished: dict[int, Request] = {}  # finished requests of add_request, for `pop_finished`
        self._owned: set[int] = set()  # requests of generate()/stream() calls, handed back by the call
        self._num_issued = 0
        self._num_attempts = 0  # steps run or tried (a step undone counts)
        self._in_step = False
        self._deferred_aborts: list[Request] = []  # aborts asked for during a step, done when it ends
        generation_config = getattr(model, "generation_config", None)
        self._eos_token_id = getattr(generation_config, "eos_token_id", None)
        self._lockstep = Lockstep.for_model(model, lockstep_timeout)  # None on one rank
        if isinstance(self._eos_token_id, list):
            self._eos_token_id = self._eos_token_id[0] if self._eos_token_id else None
        self.step_runner, self.runner_reason = self._step_runner(packed, max_num_seqs, cuda_graphs)
        if max_waiting_steps is None and self.runner is not None and self.runner.cuda_graphs:
            self.scheduler.max_waiting_steps = GRAPH_MAX_WAITING_STEPS
        self.async_scheduling = self._check_async_scheduling(async_scheduling)
        if compile_decode is not False:
            self._compile_decode(compile_decode)
        if compile_prefill is not False:
            self._compile_prefill(compile_prefill, max_num_seqs)
        self._inflight: _InFlight | None = None  # the step launched last whose tokens the host has not read
        self._sync_next = False  # an asynchronous launch raised: the next step runs synchronously
        self._unreported: list[tuple[int, int]] = []  # events of tokens read, not returned by a step yet
        self._host_tokens = (
            [torch.empty(max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
            if self.async_scheduling and pool.device.type == "cuda"
            else []
        )

    @property
    def runner(self) -> DecodeRunner | None:
        """What runs decode-only steps (the packed step's decode runner), None where they stay packed."""
        return getattr(self.step_runner.step, "runner", None)

    def _step_runner(self, packed: bool, max_num_seqs: int, cuda_graphs: bool | None) -> tuple[StepRunner, str | None]:
        """The step runner over the packed or the per-request step, and why there is no decode runner (or None)."""
        keyword = cache_keyword(self.model)
        if not packed:
            reason = "the model runs one forward per request"
        elif self._lockstep is not None:
            reason = "tensor-parallel ranks run the packed step in lockstep"
        else:
            reason = None
        sizes = chunk_sizes(self.model.config.get_text_config(decoder=True))
        runner, reason = build_decode_runner(
            self.model,
            self.pool,
            max_num_seqs=max_num_seqs,
            cache_keyword=keyword,
            chunk_sizes=sizes,
            max_positions=self.limits.max_positions if self.limits.learned_positions else None,
            cuda_graphs=cuda_graphs,
            reason=reason,
        )
        if not packed:
            return StepRunner(PerRequestStep(self.model, self.pool, keyword), rows_alone=True), reason
        return StepRunner(PackedStep(self.model, self.pool, keyword, sizes, runner), rows_alone=False), reason

    def _check_async_scheduling(self, async_scheduling: bool | None) -> bool:
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None, True or False, got {async_scheduling!r}")
        if async_scheduling is None:
            return self.runner is not None and self.pool.device.type == "cuda"
        if async_scheduling and self.runner is None:
            raise ValueError(
                f"async_scheduling=True needs the decode runner, and this Engine has none: {self.runner_reason}"
            )
        return async_scheduling

    def _compile_decode(self, compile_decode) -> None:
        options = _compile_options("compile_decode", compile_decode)
        if options is None:
            return
        if self.runner is None:
            raise ValueError(f"compile_decode needs the decode runner, and this Engine has none: {self.runner_reason}")
        if self.runner.store != "triton":
            # NOTE: the torch path writes and reads the pool through views of it, which aot_autograd cannot replay
            raise ValueError(
                "compile_decode needs the Triton kernels (a pool on CUDA, or HF_PAGED_ATTENTION_BACKEND=triton under "
                f"TRITON_INTERPRET=1), this Engine stores K/V with the {self.runner.store!r} backend"
            )
        self.runner.compile_forward(options)

    def _compile_prefill(self, compile_prefill, max_num_seqs: int) -> None:
        options = _compile_options("compile_prefill", compile_prefill)
        if options is None:
            return
        if self.step_mode != PACKED:
            reason = f"model type {getattr(self.model.config, 'model_type', None)!r} runs one forward per request"
        elif self._lockstep is not None:
            reason = "tensor-parallel ranks run the packed step in lockstep"
        elif self.pool.layout.latent:
            reason = "its K/V are latents the model expands after cache.update()"
        elif not isinstance(self.model, torch.nn.Module):
            reason = "the model is no torch module"
        else:
            reason = None
        if reason is not None:
            raise ValueError(f"compile_prefill needs the packed step over the pool, and this Engine cannot: {reason}")
        self.step_runner.step.compile_forward(options, max_num_seqs)

    # ------------------------------------------------------------------ API
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int = 16, **sampling) -> int:
        """Queue a request; returns its id. `sampling`: SamplingParams fields (temperature, top_k, top_p, min_p, seed,
        stop_token_ids, ignore_eos, eos_token_id; eos defaults to the model's generation config).

        Raises `TypeError` for a misspelled keyword or a prompt that is not token ids, `ValueError` for bad values:
        an empty prompt, a token id outside the model's vocabulary, a prompt longer than a learned-position model's
        `max_position_embeddings` (GPT-2's `n_positions`). On such a model `max_new_tokens` is lowered to what its
        positions hold, and the request finishes with "length" there; other models warn once past
        `max_position_embeddings`, as `generate()` does.

        The request stays in the engine until it is handed back: once it has finished, `pop_finished()` returns it
        (and `request(request_id)` finds it until then).
        """
        prompt_ids = as_prompt(prompt_ids)
        params = self._params(prompt_ids, max_new_tokens, sampling)
        error = self.limits.prompt_error(prompt_ids)
        if error is not None:
            raise ValueError(error)
        return self._queue(prompt_ids, params)

    def pop_finished(self) -> list[Request]:
        """The requests added with `add_request` that have finished since the last call, in the order they
        finished (`finish_reason` "stop", "length", "abort" or "error"; `output_ids`, `error`, times), and forget
        them: the engine keeps no finished request once it is handed back, so a serving loop that calls this after
        each `step()` holds only the requests in flight. `request(request_id)` finds a request until then.
        Requests of `generate()` / `stream()` calls are handed back by their call instead."""
        finished = list(self._finished.values())
        self._finished.clear()
        for request in finished:
            del self._requests[request.request_id]
        return finished

    def request(self, request_id: int) -> Request:
        """The request `request_id` (unfinished, or finished and not handed back yet)."""
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(self._unknown(request_id))
        return request

    def abort_request(self, request_id: int) -> bool:
        """Stop a request before its end (a client that went away), like vLLM's `abort_request`: a running request's
        blocks go back to the pool at once, a waiting one leaves the queue, and neither runs again. Its `output_ids`
        keep what it generated so far, `engine.request(request_id).aborted` is set and its `finish_reason` is "abort".
        Greedy and seeded requests that go on produce the same tokens as without the abort.

        Call it between steps, from the loop that calls `step()`; called during one (say, by a stream that the
        garbage collector closes while a forward runs), it takes effect when the step ends. Returns True when the
        request was unfinished, False when it had already finished (nothing changes; also once it was handed back).
        Unlike vLLM, which ignores ids it does not know, an id this engine never issued raises `UnknownRequest`
        (a `ValueError`).
        """
        request = self._requests.get(request_id)
        if request is None:
            if isinstance(request_id, int) and 0 <= request_id < self._num_issued:  # issued, handed back
                return False
            raise UnknownRequest(self._unknown(request_id))
        if request.finished:
            return False
        self._abort([request])
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests admitted and holding blocks (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (a preempted request included)."""
        return len(self.scheduler.waiting)

    @functools.cached_property
    def max_pool_tokens(self) -> int | None:
        """The most tokens (prompt and generated) whose K/V one request can hold running alone in the pool, up to
        the model's `max_position_embeddings` (`limits.max_positions`); None when the pool never runs out first
        (every layer slides). A request that needs more blocks than the pool has finishes at once with an error."""
        return self.scheduler.block_manager.counts.max_tokens(self.pool.num_blocks, self.limits.max_positions)

    def step(self) -> list[tuple[int, int]]:
        """Run one scheduling step (one forward); returns the (request_id, token_id) pairs it produced.

        A forward that raises is undone (`Scheduler.restore`): no request advances and the blocks the step gave out go
        back, so the engine can be stepped again. Before that the step's rows are run again in halves: a row whose
        forward raises alone while other rows run is its request's own failure, and that request finishes with
        the error (`finish_reason` "error") while the others' rows are applied as usual; so does one whose forward
        raised alone, nothing else succeeding, in its previous step too. When no row can be blamed, the exception
        goes to the caller."""
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            self._abort(deferred)

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, **sampling):
        """Yield (input index, token id) as tokens are produced, in order per input, until every input has finished;
        failed inputs raise `RequestFailed` at the end. Arguments as in `generate`. Tokens that other calls' steps
        produce for these inputs (a `generate()` inside the loop, another stream) are yielded too. Closing the stream
        early (`break` out of a `for` loop over `engine.stream(...)` itself, or `close()` on a stream kept in a
        variable) or an exception from a step aborts the inputs still unfinished, so their blocks go back to the
        pool. Requests added otherwise (`add_request`) share the steps and are left to their own loop. The stream's
        requests leave the engine when it ends."""
        request_ids = self._add_all(prompts, max_new_tokens, sampling)
        requests = [self._requests[request_id] for request_id in request_ids]
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        yielded = [0] * len(requests)  # per input: tokens yielded so far

        def new_tokens(indices):
            for index in indices:
                output = requests[index].output_ids
                while yielded[index] < len(output):
                    yielded[index] += 1
                    yield index, output[yielded[index] - 1]

        everyone = range(len(requests))
        try:
            num_steps = self.stats.num_steps
            for events in self._steps_until_finished(requests):
                # NOTE: read the counter before yielding: the caller may step the engine while this is suspended.
                only_ours, num_steps = self.stats.num_steps == num_steps + 1, self.stats.num_steps
                produced = dict.fromkeys(index_of[r] for r, _ in events if r in index_of) if only_ours else everyone
                yield from new_tokens(produced)
            yield from new_tokens(everyone)  # tokens of steps other calls ran since
            errors = _errors(requests)
        finally:
            self._abort(requests)
            self._release(request_ids)
        if errors:
            raise RequestFailed(errors, [request.output_ids for request in requests])

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, **sampling
    ) -> list[list[int]]:
        """Generated token ids per prompt, in input order. Steps until every input has finished; an exception from a
        step aborts the inputs still unfinished. The call's requests leave the engine when it returns.

        `prompts`: a list of prompts, each a list of token ids (or a 1-D tensor), or a 2-D tensor. `max_new_tokens`
        and every sampling keyword of `add_request` take one value for all prompts or a list of one per prompt
        (`stop_token_ids`: a list of lists). An int `seed` gives prompt i its own generator seeded with `seed + i`,
        so identical prompts draw different samples and each reproduces alone; `seed=[...]` picks each seed.

        A prompt the model cannot take (a token id outside its vocabulary, longer than its learned positions) fails
        alone, as does one that can never fit the pool or whose forward or sampling fails: the others run, and
        `RequestFailed` then names each failed input (index and reason) and carries every input's tokens. Wrong
        arguments for the whole call (types, misspelled keywords, values out of range, an empty prompt) raise
        `TypeError` / `ValueError` before anything runs.
        """
        request_ids = self._add_all(prompts, max_new_tokens, sampling)
        requests = [self._requests[request_id] for request_id in request_ids]
        try:
            for _ in self._steps_until_finished(requests):
                pass
            errors = _errors(requests)
        finally:
            self._abort(requests)
            self._release(request_ids)
        outputs = [request.output_ids for request in requests]
        if errors:
            raise RequestFailed(errors, outputs)
        return outputs

    # -------------------------------------------------------------- requests
    def _params(self, prompt_ids: list[int], max_new_tokens, sampling: dict) -> SamplingParams:
        check_sampling_keywords(sampling)
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        sampling = dict(sampling)
        sampling.setdefault("eos_token_id", self._eos_token_id)
        if isinstance(sampling.get("stop_token_ids"), list):
            sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        if isinstance(sampling.get("logit_bias"), dict):  # OpenAI's {token id: bias}
            sampling["logit_bias"] = tuple((int(token), bias) for token, bias in sampling["logit_bias"].items())
        elif isinstance(sampling.get("logit_bias"), list):  # [(token id, bias), ...]
            sampling["logit_bias"] = tuple(tuple(p) if isinstance(p, list) else p for p in sampling["logit_bias"])
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        if (error := self.limits.logit_bias_error(params.logit_bias)) is not None:
            raise ValueError(error)
        capped = self.limits.cap_new_tokens(len(prompt_ids), params.max_new_tokens)
        if capped != params.max_new_tokens and capped >= 1:
            params = dataclasses.replace(params, max_new_tokens=capped)
        return params

    def _queue(self, prompt_ids: list[int], params: SamplingParams, error: str | None = None) -> int:
        """Issue a request id for `prompt_ids`; queue it, or finish it at once with `error`."""
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        request = Request(self._num_issued, prompt_ids, params, generator=generator)
        self._num_issued += 1
        self._requests[request.request_id] = request
        if error is None:
            self.scheduler.add(request)  # finishes it at once when it could never fit the pool
        else:
            request.error = f"request {request.request_id}: {error}"
            request.finished, request.finish_time = True, time.perf_counter()
        if request.finished:
            self._note_finished(request)
        return request.request_id

    def _add_all(self, prompts, max_new_tokens, sampling) -> list[int]:
        """Add every prompt of a generate/stream call, owned by the call. Arguments are checked for every prompt
        before any is added; a prompt the model cannot take is added finished with its error. An interrupt while
        adding aborts those added before it (their ids are used up, and they count as aborted)."""
        prompts = as_prompts(prompts)
        per_prompt = spread_over_prompts(len(prompts), max_new_tokens, sampling)
        for prompt, kwargs in zip(prompts, per_prompt):
            self._params(prompt, kwargs["max_new_tokens"], {k: v for k, v in kwargs.items() if k != "max_new_tokens"})
        request_ids: list[int] = []
        try:
            for prompt, kwargs in zip(prompts, per_prompt):
                error = self.limits.prompt_error(prompt)
                if error is None:
                    request_id = self.add_request(prompt, **kwargs)
                else:
                    new_tokens = kwargs.pop("max_new_tokens")
                    request_id = self._queue(prompt, self._params(prompt, new_tokens, kwargs), error)
                request_ids.append(request_id)
                self._owned.add(request_id)
                self._finished.pop(request_id, None)
        except BaseException:
            self._abort([self._requests[request_id] for request_id in request_ids])
            self._release(request_ids)
            raise
        return request_ids

    def _release(self, request_ids: list[int]) -> None:
        """Hand back a call's requests: the engine forgets them."""
        for request_id in request_ids:
            self._owned.discard(request_id)
            self._requests.pop(request_id, None)
            self._finished.pop(request_id, None)

    def _note_finished(self, request: Request) -> None:
        if request.error is not None and not request.aborted:
            self.stats.num_failed += 1
        if request.request_id in self._requests and request.request_id not in self._owned:
            self._finished[request.request_id] = request

    def _abort(self, requests: list[Request]) -> None:
        """Abort unfinished `requests` now, or when the step under way ends."""
        if self._in_step:
            self._deferred_aborts += requests
            return
        requests = [request for request in dict.fromkeys(requests) if not request.finished]
        if requests:
            self.scheduler.abort(requests)
            self.stats.num_aborted += len(requests)
            for request in requests:
                self._note_finished(request)
            self._release_runner_when_idle()

    def _place_padding_block(self) -> None:
        """The block the decode runner's padding rows write to, taken or given back only while no request runs, so
        that admission sees it held: taken while requests run, it would be a block admission's lookahead counted on
        for them (a preemption, or a request that fits the pool alone failing), and held, it would keep a waiting
        request that needs every block from running (that one then runs unpadded)."""
        runner, scheduler = self.runner, self.scheduler
        if runner is None:
            return
        if not runner.pads:  # padding turned off (a capture failed): the block serves nothing
            runner.release()
            return
        if scheduler.running or not scheduler.waiting:
            return
        spare = self.pool.num_free_blocks - scheduler.block_manager.solo_need(scheduler.waiting[0])
        if runner.holds_padding_block and spare < 0:
            runner.release()
        elif not runner.holds_padding_block and spare >= 1:
            runner.hold_padding_block()

    def _release_runner_when_idle(self) -> None:
        """No request left: the runner gives back the block its padding rows write to."""
        if self.runner is not None and not self.scheduler.has_unfinished():
            self.runner.release()

    def _unknown(self, request_id) -> str:
        if isinstance(request_id, int) and 0 <= request_id < self._num_issued:
            return (
                f"request {request_id} has finished and was handed back (pop_finished, or the generate/stream call "
                "that added it returned): the engine keeps no request after that"
            )
        issued = f"ids 0 to {self._num_issued - 1}" if self._num_issued else "no ids yet"
        return f"no request with id {request_id!r}: this engine has issued {issued}"

    def _steps_until_finished(self, requests: list[Request]):
        """Step until every one of `requests` has finished; yields each step's events."""
        first = 0  # the requests before it have finished (for good), so each is checked until it has, then no more
        while True:
            while first < len(requests) and requests[first].finished:
                first += 1
            if first == len(requests):
                return
            yield self.step()

    # ----------------------------------------------------------------- step
    def _step(self) -> list[tuple[int, int]]:
        self._num_attempts += 1
        if not self.async_scheduling:
            return self._sync_step()
        # The events of tokens read in a step that then raised are handed back by the next one (`_read`).
        events = self._async_step()
        events, self._unreported = self._unreported + events, []
        return events

    def _async_step(self) -> list[tuple[int, int]]:
        """A step with asynchronous scheduling: launched when its rows allow (`_overlaps`), else synchronous; the
        tokens in flight are read (`_read`) when its rows are launched, or first."""
        inflight = self._inflight
        if inflight is not None:
            self.scheduler.set_aside_finishing()
            # Rows that could be preempted for blocks a token in flight may free, and the steps after a launch that
            # raised (until one runs: a row whose forward raises alone is found there), run with every token read.
            if self._sync_next or not self.scheduler.decode_step_fits():
                self._read(inflight)
                inflight = None
        if self._sync_next:
            events = self._sync_step() if self.scheduler.has_unfinished() else []
            self._sync_next = False
            return events
        self._place_padding_block()  # after the set-aside: requests whose last token is in flight no longer run
        checkpoint = self.scheduler.checkpoint()
        try:
            scheduled = self.scheduler.schedule()
        except BaseException:
            self.scheduler.restore(checkpoint)
            self.stats.num_failed_steps += 1
            raise
        rows = scheduled.decode
        if rows and not scheduled.prefill and all(_overlaps(request) for request in rows):
            try:
                launched = self._launch(rows, inflight)
            except Exception as error:
                # Undone, and run again synchronously with the tokens in flight read: a row whose forward raises
                # alone is found there (its request fails, the others go on), or the exception goes to the caller
                # and the steps after it run synchronously until one runs.
                self.scheduler.restore(checkpoint)
                self._note_finished_since(checkpoint)
                self.stats.num_failed_launches += 1
                if self.stats.num_failed_launches == 1:
                    logger.warning("Engine: an asynchronous launch raised, its rows run again synchronously: %r", error)
                self._sync_next = True
                if inflight is not None:
                    self._read(inflight)
                events = self._sync_step()
                self._sync_next = False
                return events
            self._note_finished_since(checkpoint)  # a request that could never fit, failed while scheduling
            if inflight is not None:
                self._read(inflight)
            self._advance(launched)
            return []
        if inflight is not None:
            # Prefill chunks, or rows that sample with a seed, process their logits or record log probabilities: this
            # step runs synchronously once the tokens in flight are read, without the rows of requests they finished.
            self._read(inflight)
            scheduled = ScheduledStep(
                decode=[request for request in scheduled.decode if not request.finished],
                prefill=[(request, chunk) for request, chunk in scheduled.prefill if not request.finished],
            )
            if not scheduled.decode and not scheduled.prefill:  # the tokens read finished every request
                self._note_finished_since(checkpoint)
                return []
        return self._sync_step(checkpoint, scheduled)

    def _read(self, inflight: _InFlight) -> None:
        """Read the tokens in flight (`_resolve`); their events wait in `_unreported` for the step to return them."""
        self._unreported += self._resolve(inflight)

    def _launch(self, requests: list[Request], inflight: _InFlight | None) -> _InFlight:
        """Run decode rows of `requests` on the decode runner, their inputs in flight fed from `inflight`'s tokens on
        the device, pick their tokens there (`sample_batch`) and start copying them to the host: nothing here waits
        for the device."""
        fed = inflight.feed if inflight is not None else None
        with torch.inference_mode():
            logits = self.runner.forward([(request, 1) for request in requests], fed)
            tokens = sample_batch(logits, [request.params for request in requests])
            if tokens.is_cuda:
                # Two pinned buffers in turn: the step before's tokens are read after this copy is issued.
                self._host_tokens.reverse()
                host = self._host_tokens[0][: len(requests)]
                host.copy_(tokens, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(tokens.device))
            else:
                host, copied = tokens, None
        # A row that could not sample (-1) feeds a valid id to the step after it; its request fails when read.
        feed = Feed(tokens.clamp(min=0), {r.request_id: row for row, r in enumerate(requests)})
        return _InFlight(requests, feed, host, copied)

    def _advance(self, launched: _InFlight) -> None:
        """What a launched step changes before its tokens are read: each row's input is computed, and a token is in
        flight (requests finished since the launch left out)."""
        stats = self.stats
        for request in launched.requests:
            if request.finished:
                continue
            if request.output_ids or request.num_inflight:
                stats.decode_tokens += 1
            else:  # the prompt's last token (the rest was cached): prefill work
                stats.prefill_tokens += 1
            request.num_computed += 1
            request.num_inflight += 1
            self.scheduler.cache_full_blocks(request)
        # Its tokens are read by the next step, unless every row's request finished meanwhile (nothing to read).
        self._inflight = None if all(request.finished for request in launched.requests) else launched
        stats.num_async_steps += 1
        self._record_step(len(launched.requests))

    def _resolve(self, inflight: _InFlight) -> list[tuple[int, int]]:
        """Read the tokens of the step in flight and apply them: append each row's token, finish the requests it
        ends. Returns the step's (request_id, token_id) pairs."""
        if inflight.copied is not None:
            inflight.copied.synchronize()
        tokens = inflight.host.tolist()
        self._inflight = None
        now = time.perf_counter()
        events: list[tuple[int, int]] = []
        finishing = set(self.scheduler.finishing)
        ended: list[Request] = []  # set aside for their last token (`Scheduler.set_aside_finishing`)
        preempted: list[Request] = []  # ended by this token while waiting to be computed again
        failed: list[Request] = []  # could not sample (`sample_batch`: no distribution to draw from)
        for request, token in zip(inflight.requests, tokens):
            if request.finished:  # aborted meanwhile: the token is dropped
                request.num_inflight = 0
                continue
            request.num_inflight -= 1
            if token < 0:
                request.error = f"request {request.request_id} could not sample its next token: {_NO_DISTRIBUTION}"
                failed.append(request)
                continue
            request.output_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            events.append((request.request_id, token))
            if request in finishing:
                self.scheduler.finish(request)
                ended.append(request)
            elif not request.block_tables and request.is_stopped:
                preempted.append(request)
        if preempted or failed:
            self.scheduler.remove(preempted + failed)
        done = [request for request in self.scheduler.running if request.is_done]
        for request in done:
            self.scheduler.retire(request)
        for request in ended + preempted + failed + done:
            self._note_finished(request)
        self._release_runner_when_idle()
        return events

    def _note_finished_since(self, checkpoint: StepCheckpoint) -> None:
        for request in checkpoint.saved:  # every request the step could have finished
            if request.finished:
                self._note_finished(request)

    def _record_step(self, num_rows: int) -> None:
        stats = self.stats
        stats.record_step(num_rows, self.pool.num_used_blocks)
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens

    def _sync_step(
        self, checkpoint: StepCheckpoint | None = None, scheduled: ScheduledStep | None = None
    ) -> list[tuple[int, int]]:
        """A step whose tokens are read before it returns (`scheduled`: the step `schedule()` gave after
        `checkpoint`, when already made)."""
        if scheduled is None:
            self._place_padding_block()
        if checkpoint is None:
            checkpoint = self.scheduler.checkpoint()
        lockstep = self._lockstep
        generators: list[tuple[torch.Generator, torch.Tensor]] = []  # seeded samplers' states before this step
        try:
            if scheduled is None:
                scheduled = self.scheduler.schedule()
            rows = [(request, 1) for request in scheduled.decode] + scheduled.prefill
            rows.sort(key=lambda row: row[1] > 1)  # one-token rows first (a stable sort keeps the scheduler's order)
            if lockstep is not None:
                lockstep.agree_rows([(r.request_id, r.num_computed, n) for r, n in rows])
            results = self._run(rows, checkpoint) if rows else {}
            if results is None:  # undone, but for the requests it failed
                rows = []
            # A step undone after sampling (a lockstep agreement that fails) must draw the same tokens when run again:
            # keep the states of the generators this step draws from (rows that reach the end of their input).
            generators = [
                (r.generator, r.generator.get_state())
                for r, n in rows
                if r.generator is not None and r.params.temperature > 0.0 and r.num_pending == n
            ]
            decisions = [
                self.step_runner.decide(request, num_tokens, results[row])
                for row, (request, num_tokens) in enumerate(rows)
            ]
            if lockstep is not None:
                decisions = lockstep.agree_tokens(decisions)  # rank 0's tokens, on every rank
                if len(decisions) != len(rows):
                    raise LockstepError({lockstep.rank: f"{len(rows)} rows, rank 0 decided {len(decisions)}"})
        except BaseException as error:
            self.scheduler.restore(checkpoint)
            for generator, state in generators:
                generator.set_state(state)
            self.stats.num_failed_steps += 1
            if lockstep is not None and not isinstance(error, LockstepError):
                raise lockstep.fail(error) from error
            raise
        events: list[tuple[int, int]] = []
        for row, ((request, num_tokens), decision) in enumerate(zip(rows, decisions)):
            if isinstance(decision, str):
                request.error = decision
                continue
            if request.output_ids and request.num_pending == 1:  # feeding back its last output
                self.stats.decode_tokens += 1
            else:  # prompt tokens, or a preempted request's recomputation: prefill work
                self.stats.prefill_tokens += num_tokens
            request.prompt_logprobs.extend(results[row].prompt_logprobs)
            request.num_computed += num_tokens
            self.scheduler.cache_full_blocks(request)
            if decision is not None:  # None: a prefill chunk short of the end of its input, nothing sampled
                request.output_ids.append(decision)
                if request.first_token_time is None:
                    request.first_token_time = time.perf_counter()
                events.append((request.request_id, decision))
                if request.params.logprobs is not None:
                    request.logprobs.append(token_logprob(results[row].logprobs, decision, request.params.logprobs))
        for request in [r for r in self.scheduler.running if r.error is not None or r.is_done]:
            self.scheduler.retire(request)
        self._note_finished_since(checkpoint)
        self._release_runner_when_idle()
        self._record_step(len(rows))
        return events

    def _run(self, rows: list[tuple[Request, int]], checkpoint: StepCheckpoint) -> dict | None:
        """Each row's result (`StepRunner.run`). When every row failed alone, only the rows that failed so in the step
        before too are blamed: the step is undone (`checkpoint`), the requests blamed finish with their error, and
        None is returned; with none blamed the step's first exception is raised."""
        results, first_error = self.step_runner.run(rows)
        if first_error is None:
            return results
        failed = {row for row, result in results.items() if isinstance(result, BaseException)}
        if len(failed) == len(rows):  # nothing ran: blame only rows that failed so in the step before too
            blamed = [row for row in failed if rows[row][0].failed_alone_at == self._num_attempts - 1]
            for row in failed:
                rows[row][0].failed_alone_at = self._num_attempts
            if not blamed:
                raise first_error
            self.scheduler.restore(checkpoint)  # the others are undone, the blamed ones finish with their error
            for row in blamed:
                request = rows[row][0]
                request.error = f"request {request.request_id} failed in the model's forward: {results[row]!r}"
            self.scheduler.remove([rows[row][0] for row in blamed])
            return None
        return results


@dataclasses.dataclass
class _InFlight:
    """A step launched and not read yet: its rows' requests, their tokens on the device (fed to the next step), the
    host copy of them and the event that says the copy is done (None on CPU)."""

    requests: list[Request]
    feed: Feed
    host: torch.Tensor
    copied: torch.cuda.Event | None


_NO_DISTRIBUTION = "its probabilities are not a distribution (logits all -inf, or nan or inf among them)"


def _overlaps(request: Request) -> bool:
    """Whether a decode row of `request` can run before the host reads its last token: it is greedy or samples
    without a seed (on the device, `sample_batch`; a seeded request draws from its own generator on the host), with
    no penalties, bias or minimum length on its logits and no log probabilities to record."""
    params = request.params
    return (
        (params.temperature == 0.0 or params.seed is None) and params.logprobs is None and not params.processes_logits
    )


def _check_prefix_caching(pool: BlockPool, enable_prefix_caching: bool) -> None:
    allocator = pool.allocator
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    if enable_prefix_caching and not allocator.enable_prefix_caching and allocator.num_used_blocks:
        raise ValueError(
            f"enable_prefix_caching=True on a pool built without prefix caching whose blocks are in use "
            f"({allocator.num_used_blocks} of {allocator.num_blocks} held, by a PagedCache or another engine): build "
            "the pool with BlockPool.for_model(model, ..., enable_prefix_caching=True), or pass "
            "enable_prefix_caching=False"
        )


def _compile_options(name: str, value) -> dict | None:
    """torch.compile's keywords for the Engine argument `name` (`compile_decode`, `compile_prefill`): True its
    defaults, a dict its keywords, False None (nothing compiled)."""
    if not isinstance(value, (bool, dict)):
        raise ValueError(f"{name} must be True, False or a dict of torch.compile keywords, got {value!r}")
    if value is False:
        return None
    return {} if value is True else dict(value)


def _errors(requests: list[Request]) -> dict[int, str]:
    return {index: request.error for index, request in enumerate(requests) if request.error}
