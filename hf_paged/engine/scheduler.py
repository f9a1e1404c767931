"""Requests and the scheduler: which requests run this step, with how many tokens, on which blocks.

Every step: admit waiting requests while blocks allow, looking ahead at how the running requests will grow (see
`Scheduler.fits`); when the first waiting request does not fit, a later one of the next few that does goes first
(backfill, see `Scheduler.admit`). Then give every running request with one pending token a decode row, and spend
the rest of the token budget on prefill chunks. When a row needs a block and none is free, the most recently
admitted request is preempted: its blocks go back and it waits to be recomputed (prompt plus what it generated);
a request running alone computes the part of its chunk that fits instead. So no request fails for lack of memory
unless it could never fit the whole pool (`add` turns those away at once).

Layer groups: a request holds one block table per layer group of the pool (one for a uniform model; Gemma-style
models have sliding and full groups). A group whose layers all slide gives back, at the start of every step, the
blocks that no query from then on can see, so its table keeps only about a window of blocks; `first_blocks[g]`
counts the blocks released before the table's first entry.

With prefix caching on, a request's first prefill takes the longest cached prefix of its tokens (full blocks, always
leaving one token to compute; a sliding group only the blocks its window still sees), and every block that fills up
is remembered by its hash chain, in each layer group, so requests sharing a system prompt compute it once, and a
preempted request mostly finds its own blocks again. A request whose prompt continues with blocks another request is
computing right now waits for them instead of computing a copy (parallel samples of one prompt start one after the
other). Admission counts a block that several running requests hold once (in a sliding group, while one of them
runs), and a waiting request's cached prefix too (a request takes that prefix when admitted: see `Admission.fits`).
"""

from __future__ import annotations

import time
from collections import deque

from ..storage import BlockPool, first_window_block, group_windows, hash_block_tokens
from .admission import Admission
from .request import PrefixHit, Request, ScheduledStep


class Scheduler(Admission):
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_reserve_tokens: int | None = None,
        sliding_windows: list[int | None] | None = None,
        backfill_window: int = 8,
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
        if isinstance(backfill_window, bool) or not isinstance(backfill_window, int) or backfill_window < 1:
            raise ValueError(f"backfill_window must be an int >= 1 (1: strict arrival order), got {backfill_window!r}")
        if decode_reserve_tokens is not None and decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be None or >= 0, got {decode_reserve_tokens}")
        self.pool = pool
        # Per layer group: the window when every layer of the group slides (the largest), else None (keeps all).
        windows = sliding_windows if sliding_windows is not None else [None] * pool.layout.num_layers
        if len(windows) != pool.layout.num_layers:
            raise ValueError(
                f"sliding_windows needs one entry per layer ({pool.layout.num_layers}), got {len(windows)}"
            )
        self.group_windows = group_windows(pool.layer_groups, windows)
        self.decode_reserve_tokens = decode_reserve_tokens
        self.backfill_window = backfill_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def add(self, request: Request) -> None:
        """Queue a request; one that could not run even alone in the whole pool (`_solo_need`) fails at once, alone."""
        need = self._solo_need(request)
        if need > self.pool.num_blocks:
            request.error = (
                f"request {request.request_id} needs {need} blocks ({len(request.prompt_ids)} prompt + "
                f"{request.params.max_new_tokens} new tokens, block_size {self.pool.block_size}); the pool has "
                f"{self.pool.num_blocks}"
            )
            request.finished = True
            return
        self.waiting.append(request)

    def _solo_need(self, request: Request) -> int:
        """The fewest blocks `request` runs in: alone, a step computing as few tokens as it must (a prefill chunk
        shrinks to what the pool holds when a request runs alone, `_fit_chunk`), so one query at each position.

        A full group holds every block up to the query, a sliding group the blocks from the one its window starts
        in (`_held_at`). The most over the request's positions is at one of its last `block_size`: a query one block
        further on holds one more block in a full group and no fewer in a sliding one.

        NOTE: admission (`fits`) counts whole prefill chunks (`_demand`), an upper bound that can pass this; a
        request whose count passes the pool is admitted only when nothing else runs, and nothing joins it while
        its prompt is computed (once it decodes, its count is about what it holds, and others may).
        """
        # The last sampled token is never fed back: the K/V end at prompt + max_new_tokens - 1 tokens.
        end = len(request.prompt_ids) + request.params.max_new_tokens - 1
        return max(self._held_at(position) for position in range(max(end - self.pool.block_size, 0), end))

    def _held_at(self, position: int) -> int:
        """Blocks, over all groups, that a step whose last query is at `position` holds when the step's first is
        there too (a decode row, or a one-token chunk)."""
        end_block = self._blocks_for(position + 1)
        return sum(end_block - self._first_needed_block(group, position) for group in range(len(self.group_windows)))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _first_needed_block(self, group: int, position: int) -> int:
        """The first block of `group` that a query at `position` (or later) can see."""
        return first_window_block(position, self.group_windows[group], self.pool.block_size)

    def _release_out_of_window(self, request: Request) -> None:
        """Give back each sliding group's blocks that no query from `num_computed` on can see."""
        for group, window in enumerate(self.group_windows):
            if window is None:
                continue
            num_released = self._first_needed_block(group, request.num_computed) - request.first_blocks[group]
            if num_released > 0:
                table = request.block_tables[group]
                self.pool.allocator.free(table[:num_released])
                del table[:num_released]
                request.first_blocks[group] += num_released

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for `num_tokens` tokens in every group; False when the pool has too few free."""
        if not request.block_tables:
            request.block_tables = [[] for _ in self.group_windows]
            request.first_blocks = [0] * len(self.group_windows)
        missing = self._missing_blocks(request, num_tokens)
        total = sum(missing)
        if total == 0:
            return True
        if not self.pool.allocator.can_allocate(total):
            return False
        new = self.pool.allocator.allocate(total)  # one allocation for every group: all or nothing
        for table, count in zip(request.block_tables, missing):
            table += new[:count]
            del new[:count]
        return True

    def _missing_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Per group: the blocks `request` must add to hold `num_tokens` tokens (a request without tables has none)."""
        end_block = self._blocks_for(num_tokens)
        if not request.block_tables:
            return [end_block] * len(self.group_windows)
        tables = zip(request.block_tables, request.first_blocks)
        return [max(end_block - first - len(table), 0) for table, first in tables]

    def _free_blocks(self, request: Request) -> None:
        self.pool.allocator.free(request.block_ids)  # cached full blocks stay findable until evicted
        request.block_tables, request.first_blocks = [], []

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.num_computed, request.num_registered_blocks = 0, 0
        request.num_skips = 0  # back at the head of the queue: its count starts again
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _reuse_prefix(self, request: Request) -> None:
        """Start a request's prefill from the longest cached prefix of its tokens (`_cached_prefix`)."""
        allocator = self.pool.allocator
        if not allocator.enable_prefix_caching:
            return
        num_blocks, request.first_blocks, request.block_tables = allocator.take_longest_prefix(
            self._lookup_hashes(request), self.group_windows, self.pool.block_size
        )
        request.num_registered_blocks = num_blocks
        request.num_computed = request.num_cached_tokens = num_blocks * self.pool.block_size
        self.num_prefix_hit_tokens += request.num_computed

    def _waits_for_prefix(self, request: Request, computing: set[bytes]) -> bool:
        """Whether `request`'s prefill should wait: the first of its blocks that is not cached is one that another
        request is computing (parallel samples of one prompt, requests sharing a system prompt admitted together).
        Started together, both would compute the shared blocks and hold two copies; once the other has computed
        them, the prefix cache hands them over. The one computing started earlier, so it gets its prefill budget
        first every step and the wait ends."""
        if not self.pool.allocator.enable_prefix_caching:
            return False
        return self._cached_prefix(request).waits_for in computing

    def _cached_prefix(self, request: Request) -> PrefixHit:
        """What a prefix lookup for `request` would take now, without taking it (see `PrefixHit`).

        The hit is the longest run of `n` leading blocks of its tokens that every layer group can start from
        (`BlockAllocator.peek_longest_prefix`): a full group needs its blocks 0..n-1 cached, a sliding group only
        those its window still sees from position `n * block_size` on, so a sliding group's blocks that were
        released and evicted do not shorten the hit. Layer groups cache their own blocks."""
        hashes = self._lookup_hashes(request)
        num_blocks, first_blocks, tables = self.pool.allocator.peek_longest_prefix(
            hashes, self.group_windows, self.pool.block_size
        )
        return PrefixHit(
            num_blocks=num_blocks,
            first_blocks=first_blocks,
            tables=tables,
            waits_for=hashes[num_blocks] if num_blocks < len(hashes) else None,
        )

    def _lookup_hashes(self, request: Request) -> list[bytes]:
        """The hashes a prefix lookup for `request` uses: its full blocks of tokens, one token always left to
        compute (so a hit never covers the whole input)."""
        num_blocks = (len(request.token_ids) - 1) // self.pool.block_size
        self._extend_hashes(request, num_blocks)
        return request.block_hashes[:num_blocks]

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        block_size, tokens = self.pool.block_size, request.token_ids
        for index in range(len(request.block_hashes), num_blocks):
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.append(
                hash_block_tokens(parent, index, tokens[index * block_size : (index + 1) * block_size])
            )

    def cache_full_blocks(self, request: Request) -> None:
        """After a forward: remember every block of `request` that is now full of computed tokens, in every layer
        group (a sliding group's blocks before its table's first entry went back already and are not its own)."""
        allocator = self.pool.allocator
        if not allocator.enable_prefix_caching:
            return
        num_full = request.num_computed // self.pool.block_size
        self._extend_hashes(request, num_full)
        for group, (table, first) in enumerate(zip(request.block_tables, request.first_blocks)):
            for index in range(max(request.num_registered_blocks, first), num_full):
                allocator.cache_block(table[index - first], request.block_hashes[index], group)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def _fit_chunk(self, request: Request, chunk: int) -> int:
        """The most of `chunk` tokens (ending at a block boundary when fewer) that `request` can compute now with the
        pool's free blocks; 0 when not even one."""
        free, block_size = self.pool.allocator.num_free_blocks, self.pool.block_size
        while chunk > 0:
            if sum(self._missing_blocks(request, request.num_computed + chunk)) <= free:
                return chunk
            end_block = self._blocks_for(request.num_computed + chunk)
            chunk = (end_block - 1) * block_size - request.num_computed  # back to the end of the block before
        return 0

    def _fail_alone(self, request: Request, chunk: int) -> None:
        """`request` runs alone and the pool still cannot hold its next `chunk` tokens, so it can never run: it
        fails (the engine raises `RequestFailed` for it once the others finish) instead of being preempted and
        re-admitted forever.

        NOTE: `add` turns away a request that could not run even alone (`_solo_need`), and a request running alone
        computes a smaller chunk when its next one does not fit (`_fit_chunk`), so this is only reached when blocks
        of the pool are held outside the engine (a `PagedCache` on the same pool).
        """
        request.error = (
            f"request {request.request_id} cannot hold {request.num_computed + chunk} tokens "
            f"({len(request.prompt_ids)} prompt + {len(request.output_ids)} generated) even alone in a pool of "
            f"{self.pool.num_blocks} blocks"
        )
        self.retire(request)

    def retire(self, request: Request) -> None:
        self._free_blocks(request)
        request.finished = True
        request.finish_time = time.perf_counter()
        self.running.remove(request)

    def abort(self, requests: list[Request]) -> None:
        """Stop unfinished `requests` for good, between steps: a running one's blocks go back at once (with prefix
        caching, its computed full blocks stay cached, findable until evicted); a waiting one leaves the queue (one
        pass over it for all of them).

        NOTE: the lookahead's promise (no preemption) still holds with nothing else done. The plan counted each
        running request from its admission at its whole prompt, growing a token a step, until the latest end its
        prefill's wait allows (`Lookahead`). An aborted request's blocks leave, and if it was prefilling, the prompts
        behind it get its prefill budget: they start sooner, which at every step holds no more than that count and
        ends no later. A request waiting for prompt blocks the aborted one was computing (`_waits_for_prefix`) finds
        them out of the next step's `computing` and computes what the cache does not hold; its plan counted its
        prompt as fresh."""
        assert not any(request.finished for request in requests), [r.request_id for r in requests if r.finished]
        leaving = set(requests)
        for request in [r for r in self.running if r in leaving]:
            self.retire(request)
            leaving.discard(request)
        if leaving:
            # A waiting request holds no blocks: a preempted one gave them back.
            assert not any(request.block_tables for request in leaving)
            self.waiting = deque(r for r in self.waiting if r not in leaving)
            now = time.perf_counter()
            for request in leaving:
                request.finished, request.finish_time = True, now
        for request in requests:
            request.aborted = True

    def schedule(self) -> ScheduledStep:
        # Out-of-window blocks go back first, so admission sees them free and every running request holds at most
        # what the lookahead counts for it (`_demand`).
        for request in self.running:
            if request.block_tables:
                self._release_out_of_window(request)
        self.admit()

        # Every request with one token to feed gets its row, so its token is set aside first; prefill chunks share
        # the rest in order, and the step never passes max_num_batched_tokens.
        decode_rows = {request.request_id for request in self.running if request.num_pending == 1}
        budget = self.max_num_batched_tokens - len(decode_rows)
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        # Hashes of the prompt blocks being computed, not cached yet (prefix caching): a request whose next uncached
        # block is one of them waits until it is cached, then takes it instead of computing a copy.
        computing = set()
        for running in self.running:
            if running.block_tables and running.num_pending > 1:
                computing.update(running.block_hashes[running.num_registered_blocks :])
        for request in list(self.running):
            if request not in self.running:  # preempted while making room for an earlier one
                continue
            if request.num_pending > 1 and budget <= 0:
                continue  # no prefill budget left this step
            if request.num_computed == 0 and not request.block_tables:
                if self._waits_for_prefix(request, computing):
                    continue
                # NOTE: a request with a cached prefix took it when admitted (`_takes_prefix_at_admission`); one
                # that waited for blocks another was computing (or had no hit) looks up when its prefill starts,
                # and finds what was computed and cached meanwhile.
                self._reuse_prefix(request)
                if request.num_pending > 1:
                    computing.update(request.block_hashes[request.num_registered_blocks :])
            chunk = 1 if request.num_pending == 1 else min(request.num_pending, budget)
            while not self._grow(request, request.num_computed + chunk):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    # Alone: compute what the pool holds this step (a sliding group gives blocks back as it goes).
                    fitting = self._fit_chunk(request, chunk)
                    if fitting == 0:
                        self._fail_alone(request, chunk)
                        break
                    chunk = fitting
                    continue
                self._preempt(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            if request.request_id not in decode_rows:
                budget -= chunk
            (decode.append(request) if request.num_pending == 1 else prefill.append((request, chunk)))
        return ScheduledStep(decode=decode, prefill=prefill)
