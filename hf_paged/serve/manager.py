"""The generation manager transformers' handlers call: one Engine, stepped on one background thread.

    event loop (handlers)                      Engine thread
    generate_streaming / _non_streaming  ─┐
      checks the request, builds a        │  inbox: ("add", stream) ("abort", stream) ("stop", None)
      RequestStream                       └──────────────────►  drains the inbox between steps
    stream.cancel() (client gone) ───────── ("abort", stream) ►  engine.add_request / abort_request
                                                                 engine.step()
    stream.deliver(tokens, finished) ◄── call_soon_threadsafe ── each live request's new tokens
                                                                 engine.pop_finished(): the Engine forgets them

Only the Engine thread touches the Engine; handlers talk to it through the inbox, and it answers through the event
loop. `metrics` is a snapshot the thread replaces after every step, read by `/metrics` on the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from transformers.cli.serving.utils import BaseGenerateManager, CBWorkerDeadError

from ..engine import Engine, SamplingParams
from ..errors import InvalidRequest
from .limits import RequestLimits
from .options import OPTIONS_ATTRIBUTE, RequestOptions, engine_sampling, stop_strings
from .parsing import tool_call_fallback
from .stream import GeneratedIds, RequestStream

logger = logging.getLogger(__name__)


# max_new_tokens where no limit of the model or the pool bounds a request that names none (transformers' default).
DEFAULT_MAX_NEW_TOKENS = 1024
LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # seconds
LATENCIES = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time")


@dataclass
class Histogram:
    """Observations counted per bucket (upper `bounds`, then +Inf), with their sum: a Prometheus histogram."""

    bounds: tuple[float, ...] = LATENCY_BOUNDS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Observations at or below each bound, then all of them (Prometheus' `le` buckets)."""
        running, out = 0, []
        for count in self.counts:
            running += count
            out.append(running)
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


@dataclass(frozen=True)
class EngineMetrics:
    """What `/metrics` reports, as of the Engine thread's last step (or inbox drain)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 0
    # Counters, since the server started:
    prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache
    prefill_tokens: int = 0  # prompt tokens computed (a preempted request's recomputation included)
    generation_tokens: int = 0  # tokens generated
    num_finished: int = 0  # requests ended by eos, a stop token or string, or max_tokens
    num_aborted: int = 0  # requests whose client went away
    num_failed: int = 0  # requests refused by the Engine or failed in a step
    num_preemptions: int = 0  # running requests sent back to the queue to free blocks
    # Latency histograms (`LATENCIES`), seconds from the moment the server took the request.
    latencies: dict[str, Histogram] = field(default_factory=lambda: {name: Histogram() for name in LATENCIES})


# The streams `EngineManager` makes in one asyncio task while `recording_submissions()` is open there.
_SUBMITTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("hf_paged_submitted", default=None)


@contextlib.contextmanager
def recording_submissions():
    """Within, in the current task and the tasks it starts: every `RequestStream` the manager makes is added to the
    list this yields, so the handler of one HTTP request can cancel every Engine request it submitted: those already
    in when a later one is refused, and those of a response whose body never started (such a stream has no other
    way to stop its Engine request)."""
    streams: list[RequestStream] = []
    token = _SUBMITTED.set(streams)
    try:
        yield streams
    finally:
        _SUBMITTED.reset(token)


class EngineManager(BaseGenerateManager):
    """Serve transformers' handlers from one Engine on one thread (see the module docstring).

    The manager takes each finished request back from the Engine (`Engine.pop_finished`), after which the Engine no
    longer holds it, so a server that runs for days holds only the requests in flight.

    Args:
        engine (`Engine`): the Engine; from then on only the manager's thread calls it.
        limits (`RequestLimits`): the model's and the pool's limits on one request.
    """

    MAX_FAILED_STEPS = 3

    def __init__(self, engine: Engine, limits: RequestLimits):
        self.engine = engine
        self.limits = limits
        self.metrics = EngineMetrics(num_blocks=self.engine.pool.num_blocks)
        self._latencies = {name: Histogram() for name in LATENCIES}  # Engine thread only; copied into `metrics`
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, RequestStream] = {}  # Engine request id -> stream, Engine thread only
        self._counts = {"generation_tokens": 0, "num_finished": 0, "num_aborted": 0, "num_failed": 0}
        self._error: BaseException | None = None
        self._num_failed_steps = 0  # Engine steps failed in a row
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    def init_cb(self, model, gen_config) -> None:
        """Nothing to do: the Engine was built with the server."""

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        # A tool call the parser cannot read: the answer is read on without tool calls (`parsing`).
        fallback = None
        if response_parser is not None:
            fallback = tool_call_fallback(processor, model, inputs["input_ids"])
        stream = self._submit(
            processor, inputs, gen_config, streaming=True, response_parser=response_parser, fallback=fallback
        )
        return stream.queue, stream

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        stream = self._submit(processor, inputs, gen_config, streaming=False)
        try:
            text = await stream.result
        except asyncio.CancelledError:  # the client went away (see DisconnectGuard)
            stream.cancel()
            raise
        generated = GeneratedIds(
            stream.token_ids,
            stream.logprobs[: len(stream.token_ids)],
            previous=stream.text_after,
            text_offset=stream.echo_chars,
            text_end=stream.echo_chars + len(text),
            finish_reason=stream.finish_reason,
            parse_text=stream.parse_text(),
            **stream.prompt_fields(),
        )
        return text, len(stream.prompt_ids), generated

    def stop(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout=5)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # Called on the event loop:
    def _submit(
        self, processor, inputs, gen_config, *, streaming: bool, response_parser=None, fallback=None
    ) -> RequestStream:
        if not self.is_alive():
            raise CBWorkerDeadError(f"the hf-paged Engine thread has stopped: {self._error!r}")
        prompt_ids = inputs["input_ids"]
        prompt_ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        if prompt_ids and isinstance(prompt_ids[0], list):  # one sequence, batched
            prompt_ids = prompt_ids[0]
        # A config that did not come through a request handler (no options on it) was made by code: its
        # max_new_tokens is what that code asked for.
        options = getattr(gen_config, OPTIONS_ATTRIBUTE, None) or RequestOptions(max_tokens_given=True)
        # (A request's generation_config without max_new_tokens leaves None: the room left, as without max_tokens.)
        requested = gen_config.max_new_tokens if gen_config.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        # A prompt answered alone: its Engine request generates one token, which the stream leaves out.
        max_new_tokens = self.limits.max_new_tokens(
            len(prompt_ids),
            int(requested),
            options.max_tokens_given,
            options.prompt_field,
            options.max_tokens_field,
            prompt_only=options.prompt_only,
        )
        # the handler reads it back for the finish reason
        gen_config.max_new_tokens = 0 if options.prompt_only else max_new_tokens
        sampling = engine_sampling(gen_config)
        # Token ids the request names, against the model's vocabulary, before a stream starts.
        requested_ids = {
            "logit_bias": [token for token, _ in sampling["logit_bias"]],
            "stop_token_ids": options.stop_token_ids,
            "generation_config.eos_token_id": options.requested_eos_ids,
        }
        for name, token_ids in requested_ids.items():
            if (error := self.engine.limits.token_ids_error(name, token_ids)) is not None:
                raise InvalidRequest(error, name)
        try:
            SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        except ValueError as error:
            raise InvalidRequest(str(error)) from error
        tokenizer = getattr(processor, "tokenizer", processor)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        stream = RequestStream(
            loop=asyncio.get_running_loop(),
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            tokenizer=tokenizer._tokenizer,
            decode=decode,
            stop_strings=stop_strings(gen_config),
            response_parser=response_parser,
            tool_call_fallback=fallback,
            streaming=streaming,
            on_cancel=self._cancel,
            generation_config=gen_config,
            prompt_only=options.prompt_only,
            echoed_prompt=options.echoed_prompt,
            logprob_tokenizer=tokenizer,
            continues_prompt=options.continues_prompt,
            content_logprobs=options.content_logprobs,
        )
        self._inbox.put(("add", stream))
        submitted = _SUBMITTED.get()
        if submitted is not None:
            submitted.append(stream)
        return stream

    def _cancel(self, stream: RequestStream) -> None:
        self._inbox.put(("abort", stream))

    # Run on the Engine thread:
    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished()):
                    return
                if self.engine.has_unfinished():
                    self._step()
                self._deliver()
                self._publish()
        except BaseException as error:
            self._error = error
            logger.exception("the hf-paged Engine thread stopped")
            self._fail_live(f"the hf-paged Engine thread stopped: {error!r}")
            raise

    def _step(self) -> None:
        """One Engine step. A step that raises was undone by the Engine, which finishes a request whose forward
        fails alone with its error (the others go on); a failure it cannot pin on one request is tried again, and
        after `MAX_FAILED_STEPS` in a row the requests in flight fail, so the loop never spins on it."""
        try:
            self.engine.step()
        except Exception as error:
            self._num_failed_steps += 1
            if self._num_failed_steps < self.MAX_FAILED_STEPS:
                logger.warning("an Engine step failed (%d in a row); trying again: %r", self._num_failed_steps, error)
                return
            logger.exception("%d Engine steps failed in a row; failing the requests in flight", self._num_failed_steps)
            self._num_failed_steps = 0
            self._fail_live(f"the server failed to run this request: {error!r}")
        else:
            self._num_failed_steps = 0

    def _drain(self, block: bool) -> bool:
        """Apply the inbox's commands (waiting for one when `block`); False once asked to stop."""
        while True:
            try:
                command, stream = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            if command == "add":
                self._add(stream)
            elif command == "abort":
                self._abort(stream)

    def _add(self, stream: RequestStream) -> None:
        try:
            request_id = self.engine.add_request(stream.prompt_ids, stream.max_new_tokens, **stream.sampling)
        except (TypeError, ValueError) as error:
            self._post(stream, [], True, str(error), True)
            self._counts["num_failed"] += 1
            return
        stream.engine_id = request_id
        request = self.engine.request(request_id)
        if request.finished:  # refused at once: it could never fit the pool
            self._post(stream, [], True, request.error, True)
            self._counts["num_failed"] += 1
            return
        self._live[request_id] = stream

    def _abort(self, stream: RequestStream) -> None:
        if stream.engine_id is None or self._live.get(stream.engine_id) is not stream:
            return  # never added, or already finished
        del self._live[stream.engine_id]
        if stream.stopped:  # a stop string ended it: a request that ran to its end
            self._latencies["e2e_request_latency"].observe(time.perf_counter() - stream.created)
        self.engine.abort_request(stream.engine_id)
        self._counts["num_finished" if stream.stopped else "num_aborted"] += 1

    def _deliver(self) -> None:
        """Hand every live request's new tokens to its stream, and its end once it has finished."""
        finished = {request.request_id: request for request in self.engine.pop_finished()}
        now = time.perf_counter()
        for request_id, stream in list(self._live.items()):
            request = finished.get(request_id) or self.engine.request(request_id)
            start = stream.num_sent
            new_tokens = request.output_ids[start:]
            # their TokenLogprobs, when the request records them (Request.logprobs grows with output_ids)
            logprobs = (
                request.logprobs[start : start + len(new_tokens)] if request.params.logprobs is not None else None
            )
            self._observe(stream, request, len(new_tokens), now)
            stream.num_sent += len(new_tokens)
            self._counts["generation_tokens"] += len(new_tokens)
            if not (new_tokens or request.finished):
                continue
            # the prompt tokens' (all recorded once it has a token), with its first tokens, when it records them
            records_prompt = request.params.prompt_logprobs is not None and start == 0
            prompt_logprobs = list(request.prompt_logprobs) if records_prompt else None
            error = request.error if request.finish_reason == "error" else None
            self._post(
                stream, new_tokens, request.finished, error, False, logprobs, request.finish_reason, prompt_logprobs
            )
            if request.finished:
                del self._live[request_id]
                self._counts["num_failed" if error else "num_finished"] += 1

    def _observe(self, stream: RequestStream, request, num_new_tokens: int, now: float) -> None:
        """Latencies of a request whose step gave it `num_new_tokens` (at `now`), and its end once finished."""
        latencies = self._latencies
        if stream.queue_time is None and request.scheduled_time is not None:
            stream.queue_time = max(request.scheduled_time - stream.created, 0.0)
            latencies["request_queue_time"].observe(stream.queue_time)
        if num_new_tokens:
            if stream.last_token_time is None:
                latencies["time_to_first_token"].observe(now - stream.created)
            else:
                for _ in range(num_new_tokens):
                    latencies["inter_token_latency"].observe((now - stream.last_token_time) / num_new_tokens)
            stream.last_token_time = now
        if request.finished and request.finish_reason != "error":
            latencies["e2e_request_latency"].observe(now - stream.created)

    def _post(
        self,
        stream: RequestStream,
        tokens: list[int],
        finished: bool,
        error: str | None,
        invalid: bool,
        logprobs: list | None = None,
        finish_reason: str | None = None,
        prompt_logprobs: list | None = None,
    ):
        try:
            stream.result.get_loop().call_soon_threadsafe(
                stream.deliver, tokens, finished, error, invalid, logprobs, finish_reason, prompt_logprobs
            )
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _fail_live(self, message: str) -> None:
        live, self._live = self._live, {}
        for request_id, stream in live.items():
            self._post(stream, [], True, message, False)
            self._counts["num_failed"] += 1
            self.engine.abort_request(request_id)

    def _publish(self) -> None:
        engine = self.engine
        self.metrics = EngineMetrics(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_used_blocks=engine.pool.num_used_blocks,
            num_blocks=engine.pool.num_blocks,
            prefix_hit_tokens=engine.stats.prefix_hit_tokens,
            prefill_tokens=engine.stats.prefill_tokens,
            num_preemptions=engine.stats.num_preemptions,
            latencies={name: histogram.copy() for name, histogram in self._latencies.items()},
            **self._counts,
        )
