"""The scheduler: which requests run this step, with how many tokens, on which blocks.

Every step: admit waiting requests while blocks allow, looking ahead at how the running requests will grow (see
`Admission.fits`); when the first waiting request does not fit, a later one of the next few that does goes first
(backfill, see `Admission.admit`). Then give every running request with one pending token a decode row, and spend
the rest of the token budget on prefill chunks. When a row needs a block and none is free, the most recently
admitted request is preempted: its blocks go back and it waits to be recomputed (prompt plus what it generated);
a request running alone computes the part of its chunk that fits instead. So no request fails for lack of memory
unless it could never fit the whole pool (`Scheduler.add` turns those away at once).

Layer groups: a request holds one block table per layer group of the pool (one for a uniform model; Gemma-style
models have sliding and full groups). A group whose layers all slide gives back, at the start of every step, the
blocks that no query from then on can see, so its table keeps only about a window of blocks; `first_blocks[g]`
counts the blocks released before the table's first entry.

With prefix caching on, a request's first prefill takes the longest cached prefix of its tokens (see `PrefixReuse`).
A request whose prompt continues with blocks another request is computing right now waits for them instead of
computing a copy (parallel samples of one prompt start one after the other). Admission counts a block that several
running requests hold once (in a sliding group, while one of them runs), and a waiting request's cached prefix too
(a request takes that prefix when admitted: see `Admission.fits`).

The scheduler owns the queues and decides; the parts it composes, siblings that never call each other's private
methods, do the rest:

    Scheduler ── waiting, running; decides each step's rows, whom to preempt, when a request ends
      ├─ BlockManager   the blocks: grow, fit a chunk, release out of the window, free, roll back (block_manager.py)
      ├─ PrefixReuse    lookups in and registration with the pool's prefix cache (prefix_cache.py)
      ├─ GrowthModel    how each request grows and is counted in the lookahead (lookahead.py)
      └─ Admission      fits / admit on the queues it is handed; builds a Lookahead per admission round (admission.py)
"""

from __future__ import annotations

import time
from collections import deque

from ..storage import BlockPool, group_windows
from .admission import Admission
from .block_manager import BlockManager
from .blocks import BlockCounts
from .checkpoint import StepCheckpoint
from .lookahead import GrowthModel
from .prefix_cache import PrefixReuse
from .request import Request, ScheduledStep


class Scheduler:
    """Continuous batching on one `BlockPool`: `add` requests, then each step `schedule` one, and after its forward
    `cache_full_blocks` and `retire` the finished ones (what `Engine.step` does).

    Args:
        pool (`BlockPool`): the blocks every request's tables come from.
        max_num_seqs (`int`): requests running at once.
        max_num_batched_tokens (`int`): tokens per step, a decode row counting one; at least `max_num_seqs`.
        decode_reserve_tokens (`int`, *optional*): how many steps of growth admission looks ahead (None: to every
            running request's end, so no admitted request is preempted).
        sliding_windows (`list[int | None]`, *optional*): per layer, its sliding window or None (default: none).
        backfill_depth (`int`, defaults to 8): waiting requests admission considers, in queue order.
        enable_prefix_caching (`bool`, *optional*): False: never look up or register prefixes, even on a pool that
            keeps a prefix cache (default: as the pool does).
        max_waiting_steps (`int`, defaults to 0): while requests decode and none prefills, admission is tried only
            once this many steps have passed since it was last tried (text-generation-inference's
            `max_waiting_tokens`), so that waiting requests start together in one step that prefills instead of one
            such step each; 0 tries every step (vLLM's way).
    """

    # How admission counts each request; a subclass may count otherwise.
    growth_model_class: type[GrowthModel] = GrowthModel

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_reserve_tokens: int | None = None,
        sliding_windows: list[int | None] | None = None,
        backfill_depth: int = 8,
        enable_prefix_caching: bool | None = None,
        max_waiting_steps: int = 0,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, {max_num_batched_tokens}"
            )
        if max_num_batched_tokens < max_num_seqs:
            # NOTE: as vLLM requires: every running request's decode row takes one token of a step's budget, so a
            # smaller budget can leave a prompt no prefill token for as long as the others decode.
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}): each "
                "running request's decode row takes one token of a step's budget"
            )
        if isinstance(backfill_depth, bool) or not isinstance(backfill_depth, int) or backfill_depth < 1:
            raise ValueError(f"backfill_depth must be an int >= 1 (1: strict arrival order), got {backfill_depth!r}")
        if decode_reserve_tokens is not None and decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be None or >= 0, got {decode_reserve_tokens}")
        if isinstance(max_waiting_steps, bool) or not isinstance(max_waiting_steps, int) or max_waiting_steps < 0:
            raise ValueError(f"max_waiting_steps must be an int >= 0 (0: every step), got {max_waiting_steps!r}")
        self.max_waiting_steps = max_waiting_steps
        self._steps_waited = 0  # decode-only steps since admission was last tried (`max_waiting_steps`)
        self.pool = pool
        # Per layer group: the window when every layer of the group slides (the largest), else None (keeps all).
        windows = sliding_windows if sliding_windows is not None else [None] * pool.layout.num_layers
        if len(windows) != pool.layout.num_layers:
            raise ValueError(
                f"sliding_windows needs one entry per layer ({pool.layout.num_layers}), got {len(windows)}"
            )
        self.group_windows = group_windows(pool.layer_groups, windows)
        self.decode_reserve_tokens = decode_reserve_tokens
        self.backfill_depth = backfill_depth
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        counts = BlockCounts(pool.block_size, self.group_windows)
        self.block_manager = BlockManager(pool, counts)
        self.prefix = PrefixReuse(pool, counts, enable_prefix_caching)
        self.growth_model = self.growth_model_class(
            counts, max_num_batched_tokens=max_num_batched_tokens, decode_reserve_tokens=decode_reserve_tokens
        )
        self.admission = Admission(
            pool, self.prefix, self.growth_model, max_num_seqs=max_num_seqs, backfill_depth=backfill_depth
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        # Requests whose last token a step still in flight computes (asynchronous scheduling), their blocks given back
        # (`set_aside_finishing`), until the engine reads the token and `finish`es them.
        self.finishing: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache instead of computed."""
        return self.prefix.num_hit_tokens

    def add(self, request: Request) -> None:
        """Queue a request; one that could not run even alone in the whole pool (`BlockManager.solo_need`) fails at
        once, alone."""
        need = self.block_manager.solo_need(request)
        if need > self.pool.num_blocks:
            request.error = (
                f"request {request.request_id} needs {need} blocks ({len(request.prompt_ids)} prompt + "
                f"{request.params.max_new_tokens} new tokens, block_size {self.pool.block_size}); the pool has "
                f"{self.pool.num_blocks}"
            )
            request.finished = True
            return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.finishing)

    def set_aside_finishing(self) -> None:
        """Give back the blocks of the running requests whose last token (by `max_new_tokens`) is in flight, as their
        retirement would once it is read: the next step is scheduled as if they had finished. The device runs steps
        in order, so the step in flight has written their K/V before a later step writes blocks they held."""
        for request in [r for r in self.running if r.awaits_last_token]:
            self.block_manager.free(request)
            self.running.remove(request)
            self.finishing.append(request)

    def decode_step_fits(self) -> bool:
        """Whether the free blocks hold one more token of every running request (all decode rows of a step grow
        without preempting anyone)."""
        need = sum(self.block_manager.need(request, request.num_computed + 1) for request in self.running)
        return need == 0 or self.pool.allocator.can_allocate(need)

    def finish(self, request: Request) -> None:
        """A request set aside while its last token was in flight (`set_aside_finishing`) has it now: it finishes."""
        self.finishing.remove(request)
        _end(request)

    def fits(self, newcomer: Request) -> bool:
        """Whether admission would let `newcomer` in next to the running requests now (`Admission.fits`)."""
        return self.admission.fits(newcomer, self.running)

    def admit(self) -> None:
        """Move waiting requests to running while they fit (`Admission.admit`); with `max_waiting_steps`, only every
        so many steps while the running requests all decode (a step that prefills anyway admits at once, as does an
        idle scheduler)."""
        if (
            self.max_waiting_steps
            and self.waiting
            and self.running
            and self._steps_waited < self.max_waiting_steps
            and all(request.num_pending <= 1 for request in self.running)
        ):
            self._steps_waited += 1
            return
        self._steps_waited = 0
        self.admission.admit(self.waiting, self.running)

    def checkpoint(self) -> StepCheckpoint:
        """What a step can change, taken before `schedule()`, for `restore`."""
        num_head = self.backfill_depth + self.max_num_seqs
        return StepCheckpoint(self.waiting, self.running, num_head, self.prefix.num_hit_tokens, self._steps_waited)

    def restore(self, checkpoint: StepCheckpoint) -> None:
        """Undo the step begun after `checkpoint` (checkpoint.py says what goes back and what stands): the blocks it
        gave out go back, every request is where it was."""
        for request in self.running:
            self.block_manager.roll_back(request, *checkpoint.tables(request))
        self.running, self.waiting = checkpoint.queues(self.running, self.waiting)
        self.prefix.num_hit_tokens = checkpoint.num_hit_tokens
        self._steps_waited = checkpoint.steps_waited

    def cache_full_blocks(self, request: Request) -> None:
        """After a forward: remember `request`'s blocks that are now full (`PrefixReuse.cache_full_blocks`)."""
        self.prefix.cache_full_blocks(request)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed, request.num_registered_blocks = 0, 0
        request.states = None  # computed again from its first token: new states then
        request.num_skips = 0  # back at the head of the queue: its count starts again
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _fail_alone(self, request: Request, chunk: int) -> None:
        """`request` runs alone and the pool still cannot hold its next `chunk` tokens, so it can never run: it
        fails (the engine raises `RequestFailed` for it once the others finish) instead of being preempted and
        re-admitted forever.

        NOTE: `add` turns away a request that could not run even alone (`BlockManager.solo_need`), and a request
        running alone computes a smaller chunk when its next one does not fit (`BlockManager.fit_chunk`), so this is
        only reached
        when blocks of the pool are held outside the engine (a `PagedCache` on the same pool).
        """
        held_outside = self.block_manager.held_outside(request)
        request.error = (
            f"request {request.request_id} cannot hold {request.num_computed + chunk} tokens "
            f"({len(request.prompt_ids)} prompt + {len(request.output_ids)} generated) even alone: "
            + (
                f"{held_outside} of the pool's {self.pool.num_blocks} blocks are held outside this engine (a "
                "PagedCache on the same pool?); release them or give the engine a pool of its own"
                if held_outside
                else f"the pool has {self.pool.num_blocks} blocks"
            )
        )
        self.retire(request)

    def retire(self, request: Request) -> None:
        self.block_manager.free(request)
        self.running.remove(request)
        _end(request)

    def abort(self, requests: list[Request]) -> None:
        """Stop unfinished `requests` for good, between steps: a running one's blocks go back at once (with prefix
        caching, its computed full blocks stay cached, findable until evicted); a waiting one leaves the queue (one
        pass over it for all of them).

        NOTE: the lookahead's promise (no preemption) still holds with nothing else done. The forecast counted each
        running request from its admission at its whole prompt, growing a token a step, until the latest end its
        prefill's wait allows (`Lookahead`). An aborted request's blocks leave, and if it was prefilling, the prompts
        behind it get its prefill budget: they start sooner, which at every step holds no more than that count and
        ends no later. A request waiting for prompt blocks the aborted one was computing (`PrefixReuse.waits`) finds
        them out of the next step's `computing` and computes what the cache does not hold; its forecast counted its
        prompt as fresh."""
        self.remove(requests)
        for request in requests:
            request.aborted = True

    def remove(self, requests: list[Request]) -> None:
        """Finish unfinished `requests` now, wherever they are: a running one is retired (its blocks go back), a
        waiting one leaves the queue (one pass over it for all of them). `abort` and a request failed by the engine
        (its `error` set first) end this way."""
        assert not any(request.finished for request in requests), [r.request_id for r in requests if r.finished]
        leaving = set(requests)
        if self.finishing:
            self.finishing = [request for request in self.finishing if request not in leaving]
        for request in [r for r in self.running if r in leaving]:
            self.retire(request)
            leaving.discard(request)
        if leaving:
            # A waiting request holds no blocks: a preempted one gave them back.
            assert not any(request.block_tables for request in leaving)
            self.waiting = deque(r for r in self.waiting if r not in leaving)
            for request in leaving:
                _end(request)

    def schedule(self) -> ScheduledStep:
        # Out-of-window blocks go back first, so admission sees them free and every running request holds at most
        # what the lookahead counts for it (`GrowthModel.demand`).
        for request in self.running:
            if request.block_tables:
                self.block_manager.release_out_of_window(request)
        self.admit()

        # Every request with one token to feed gets its row, so its token is set aside first; prefill chunks share
        # the rest in order, and the step never passes max_num_batched_tokens.
        pending = {request: request.num_pending for request in self.running}
        budget = self.max_num_batched_tokens - sum(1 for num_pending in pending.values() if num_pending == 1)
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        # Hashes of the prompt blocks being computed, not cached yet (prefix caching): a request whose next uncached
        # block is one of them waits until it is cached, then takes it instead of computing a copy.
        computing = set()
        for running, num_pending in pending.items():
            if running.block_tables and num_pending > 1:
                computing.update(running.block_hashes[running.num_registered_blocks :])
        left: set[Request] = set()  # preempted (or failed alone) while making room: out of `self.running`
        for request, num_pending in pending.items():
            if request in left:  # preempted while making room for an earlier one
                continue
            if num_pending > 1 and budget <= 0:
                continue  # no prefill budget left this step
            if request.num_computed == 0 and not request.block_tables:
                if self.prefix.waits(request, computing):
                    continue
                # NOTE: a request with a cached prefix takes it when admitted (`PrefixReuse.takes_at_admission`);
                # one that waits for blocks another is computing (or has no hit) looks up when its prefill starts,
                # and finds what is computed and cached meanwhile.
                self.prefix.take(request)
                num_pending = request.num_pending
                if num_pending > 1:
                    computing.update(request.block_hashes[request.num_registered_blocks :])
            chunk = 1 if num_pending == 1 else min(num_pending, budget)
            while not self.block_manager.grow(request, request.num_computed + chunk):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    # Alone: compute what the pool holds this step (a sliding group gives blocks back as it goes).
                    fitting = self.block_manager.fit_chunk(request, chunk)
                    if fitting == 0:
                        self._fail_alone(request, chunk)
                        left.add(request)
                        break
                    chunk = fitting
                    continue
                self._preempt(victim)
                left.add(victim)
                if victim is request:
                    break
            if request in left:
                continue
            if pending[request] != 1:  # not a decode row when the step began: its tokens come out of the budget
                budget -= chunk
            (decode.append(request) if num_pending == 1 else prefill.append((request, chunk)))
        return ScheduledStep(decode=decode, prefill=prefill)


def _end(request: Request) -> None:
    """`request` is finished: no forward of it follows (a hybrid model's recurrent states are dropped)."""
    request.finished = True
    request.finish_time = time.perf_counter()
    request.states = None
