"""Requests and the scheduler: which requests run this step, with how many tokens, on which blocks.

Every step: admit waiting requests while blocks allow, looking ahead at how the running requests will grow (see
`Scheduler.fits`); when the first waiting request does not fit, a later one of the next few that does goes first
(backfill, see `Scheduler.admit`). Then give every running request with one pending token a decode row, and spend
the rest of the token budget on prefill chunks. When a row needs a block and none is free, the most recently
admitted request is preempted: its blocks go back and it waits to be recomputed (prompt plus what it generated),
so no request fails for lack of memory unless it could never fit the whole pool.

Layer groups: a request holds one block table per layer group of the pool (one for a uniform model; Gemma-style
models have sliding and full groups). A group whose layers all slide gives back, at the start of every step, the
blocks that no query from then on can see, so its table keeps only about a window of blocks; `first_blocks[g]`
counts the blocks released before the table's first entry.

With prefix caching on (one-group pools only), a request's first prefill takes the longest cached prefix of its tokens (full blocks,
always leaving one token to compute), and every block that fills up is remembered by its hash chain, so requests
sharing a system prompt compute it once, and a preempted request mostly finds its own blocks again. A request whose
prompt continues with blocks another request is computing right now waits for them instead of computing a copy
(parallel samples of one prompt start one after the other), and admission counts a block that several running
requests hold once, a waiting request's cached prefix included.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..allocator import hash_block_tokens
from ..pool import BlockPool
from .sampling import SamplingParams


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per layer group: its held block ids
    first_blocks: list[int] = field(default_factory=list)  # per layer group: leading blocks released before them
    num_computed: int = 0  # tokens whose K/V are in the pool
    generator: torch.Generator | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain over its full blocks of tokens
    num_registered_blocks: int = 0  # leading blocks (of group 0) the prefix cache knows
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    num_skips: int = 0  # admissions of later requests (backfill) while it waited first in line or near it
    error: str | None = None
    finished: bool = False
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def block_ids(self) -> list[int]:
        """Every block id the request holds, all groups."""
        return [block_id for table in self.block_tables for block_id in table]

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled (1 for a decoding request)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


@dataclass
class ScheduledStep:
    decode: list[Request]  # one token each, batched in one forward
    prefill: list[tuple[Request, int]]  # (request, chunk length); the engine packs all of it in one forward


class _Growth(NamedTuple):
    """How a request's K/V grow in the lookahead: from `tokens` by one a step for `steps` steps, held until step
    `end` (`end - steps`: the steps its prefill may still wait for budget)."""

    tokens: int
    steps: int
    end: int
    prefilling: bool


class Scheduler:
    # NOTE: a request passed over this many times stops backfill behind it until it is admitted, so a large request
    # is delayed by at most this many smaller ones (arrivals that keep coming cannot starve it).
    MAX_SKIPS = 16

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
        if not isinstance(backfill_window, int) or backfill_window < 1:
            raise ValueError(f"backfill_window must be an int >= 1 (1: strict arrival order), got {backfill_window!r}")
        if decode_reserve_tokens is not None and decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be None or >= 0, got {decode_reserve_tokens}")
        self.pool = pool
        # Per layer group: the window when every layer of the group slides (the largest), else None (keeps all).
        windows = sliding_windows if sliding_windows is not None else [None] * pool.layout.num_layers
        if len(windows) != pool.layout.num_layers:
            raise ValueError(f"sliding_windows needs one entry per layer ({pool.layout.num_layers}), got {len(windows)}")
        self.group_windows = [
            None if any(windows[layer] is None for layer in group) else max(windows[layer] for layer in group)
            for group in pool.layer_groups
        ]
        if pool.allocator.enable_prefix_caching:
            pool.check_one_group("prefix caching")
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
        """Queue a request; one that could never fit the whole pool fails at once, alone."""
        tokens, steps = len(request.prompt_ids), request.params.max_new_tokens - 1
        worst = max(self._demand(tokens, prefilling=True), self._demand(tokens + steps, prefilling=False))
        if worst > self.pool.num_blocks:
            request.error = (
                f"request {request.request_id} needs {worst} blocks ({len(request.prompt_ids)} prompt + "
                f"{request.params.max_new_tokens} new tokens, block_size {self.pool.block_size}); the pool has "
                f"{self.pool.num_blocks}"
            )
            request.finished = True
            return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _first_needed_block(self, group: int, position: int) -> int:
        """The first block of `group` that a query at `position` (or later) can see."""
        window = self.group_windows[group]
        return 0 if window is None else max(position - window + 1, 0) // self.pool.block_size

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
        end_block = self._blocks_for(num_tokens)
        missing = [
            max(end_block - first - len(table), 0) for table, first in zip(request.block_tables, request.first_blocks)
        ]
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

    def _free_blocks(self, request: Request) -> None:
        self.pool.allocator.free(request.block_ids)  # cached full blocks stay findable until evicted
        request.block_tables, request.first_blocks = [], []

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.num_computed, request.num_registered_blocks = 0, 0
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _reuse_prefix(self, request: Request) -> None:
        """Start a request's prefill from the longest cached prefix of its tokens."""
        allocator, block_size = self.pool.allocator, self.pool.block_size
        if not allocator.enable_prefix_caching:
            return
        hit = allocator.lookup_prefix(self._lookup_hashes(request))
        request.block_tables, request.first_blocks = [hit], [0]  # prefix caching implies one layer group
        request.num_registered_blocks = len(hit)
        request.num_computed = request.num_cached_tokens = len(hit) * block_size
        self.num_prefix_hit_tokens += request.num_computed

    def _waits_for_prefix(self, request: Request, computing: set[bytes]) -> bool:
        """Whether `request`'s prefill should wait: the first of its blocks that is not cached is one that another
        request is computing (parallel samples of one prompt, requests sharing a system prompt admitted together).
        Started together, both would compute the shared blocks and hold two copies; once the other has computed
        them, the prefix cache hands them over. The one computing started earlier, so it gets its prefill budget
        first every step and the wait ends."""
        allocator = self.pool.allocator
        if not allocator.enable_prefix_caching:
            return False
        hashes = self._lookup_hashes(request)
        num_cached = len(allocator.peek_prefix(hashes))
        return num_cached < len(hashes) and hashes[num_cached] in computing

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
        """After a forward: remember every block of `request` that is now full of computed tokens."""
        allocator = self.pool.allocator
        if not allocator.enable_prefix_caching:
            return
        num_full = request.num_computed // self.pool.block_size
        self._extend_hashes(request, num_full)
        table, first = request.block_tables[0], request.first_blocks[0]
        for index in range(max(request.num_registered_blocks, first), num_full):
            allocator.cache_block(table[index - first], request.block_hashes[index])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def retire(self, request: Request) -> None:
        self._free_blocks(request)
        request.finished = True
        request.finish_time = time.perf_counter()
        self.running.remove(request)

    def _growth(self, request: Request) -> tuple[int, int]:
        """(tokens `request` holds once its input is computed, decode steps until its K/V stop growing)."""
        num_tokens = len(request.prompt_ids) + len(request.output_ids)
        # NOTE: the last sampled token is never fed back, so K/V peak at prompt + max_new_tokens - 1 tokens.
        final = len(request.prompt_ids) + request.params.max_new_tokens - 1
        steps = max(final - num_tokens, 0)
        if self.decode_reserve_tokens is not None:
            steps = min(steps, self.decode_reserve_tokens)
        return num_tokens, steps

    def fits(self, newcomer: Request) -> bool:
        """Whether the pool can hold `newcomer` next to the running requests at every step of the lookahead.

        Every running request grows by one token per step until its `max_new_tokens` (or for
        `decode_reserve_tokens` steps, when set) and its blocks come back when it finishes, so the demand at step
        t is the sum of blocks(tokens + t) over the requests still running at t; its peak is at t = 0 or just
        before one of them finishes.

        With prefix caching (one group, no window), blocks that several running requests hold (a shared system
        prompt, parallel samples of one prompt) count once: the demand at t is every block held now by a request
        still running at t, plus the blocks each of those will add by t. A request that has not looked up its
        prefix yet (the newcomer, or one admitted but not yet prefilling) counts the cached blocks its lookup
        would take now (`peek_prefix`) as held, and the rest of its prompt as fresh. That is still an upper
        bound: a held block cannot be evicted, and a free cached block that is evicted before the lookup goes to
        a request whose new blocks are counted already, one block for the one it must then compute.

        A request whose prompt is not computed yet starts growing only once its prefill has had budget: the
        requests before it take the step's prefill tokens first, so it may start (and finish) up to `end - steps`
        steps late (`_growths`). It is counted at its full size for those extra steps, an upper bound on what it
        holds then.

        NOTE: with the default lookahead (to every request's `max_new_tokens`) an admitted request is never
        preempted: requests can only finish earlier than planned (eos, stop tokens), which frees blocks sooner.
        A finite `decode_reserve_tokens` admits more when requests usually stop early, and relies on preemption
        when they do not.
        """
        growths = self._growths([*self.running, newcomer])
        held = {block_id for request in self.running for block_id in request.block_ids}
        available = self.pool.num_free_blocks + len(held)
        if self.pool.allocator.enable_prefix_caching and self.group_windows == [None]:
            return self._fits_shared(growths, [*self.running, newcomer], available)
        # NOTE: O(n^2) in running requests (n <= max_num_seqs), and only while requests wait: a few ms at n=256.
        for t in {0, *(growth.end for growth in growths)}:
            demand = sum(
                self._demand(growth.tokens + min(t, growth.steps), prefilling=growth.prefilling and t == 0)
                for growth in growths
                if growth.end >= t
            )
            if demand > available:
                return False
        return True

    def _growths(self, requests: list[Request]) -> list[_Growth]:
        """The lookahead's plan for `requests` in scheduling order (the newcomer last).

        NOTE: decode rows run every step, but prefill chunks share what is left of `max_num_batched_tokens` in
        scheduling order, so a prompt waits for the prompts before it: admitting many requests at once (a burst)
        starts the last of them several steps late, and they end as late. Without counting that delay, a burst
        admitted on a plan that fitted ran out of blocks at its end and preempted.
        """
        # Prefill tokens a step surely has: the budget less one token for each request's decode row.
        per_step = max(self.max_num_batched_tokens - len(requests), 1)
        queued = 0  # prompt tokens still to compute, this request's and those before it
        growths = []
        for request in requests:
            tokens, steps = self._growth(request)
            prefilling = request.num_pending > 1 or not request.block_tables
            delay = 0
            if prefilling:
                queued += request.num_pending
                delay = -(-queued // per_step) - 1  # steps before the one that computes its last prompt token
            growths.append(_Growth(tokens, steps, steps + delay, prefilling))
        return growths

    def _fits_shared(self, growths: list[_Growth], requests: list[Request], available: int) -> bool:
        """`fits` for one full-attention group, counting each held block once (see `fits`). `growths[i]` is the
        plan of `requests[i]`. The steps that matter are visited from the last down, so the requests still running
        grow by one set each time and the union of their blocks is kept, not rebuilt."""
        allocator = self.pool.allocator
        tables = [
            request.block_tables[0] if request.block_tables else allocator.peek_prefix(self._lookup_hashes(request))
            for request in requests
        ]
        order = sorted(range(len(requests)), key=lambda i: growths[i].end, reverse=True)
        union: set[int] = set()
        alive: list[int] = []  # requests running at the current t
        position = 0
        for t in sorted({0, *(growth.end for growth in growths)}, reverse=True):
            while position < len(order) and growths[order[position]].end >= t:
                alive.append(order[position])
                union.update(tables[order[position]])
                position += 1
            fresh = sum(
                max(self._blocks_for(growths[i].tokens + min(t, growths[i].steps)) - len(tables[i]), 0) for i in alive
            )
            if len(union) + fresh > available:
                return False
        return True

    def _demand(self, num_tokens: int, *, prefilling: bool) -> int:
        """Blocks a request of `num_tokens` tokens holds over all groups: everything in a full group; in a sliding
        group, from the first block its last token's query sees (all of them while its prompt is computed).

        NOTE: a prompt prefilled in several chunks holds a little more in a sliding group than this counts after
        step 0 (the chunk's own blocks); preemption covers that rare overshoot.
        """
        end_block = self._blocks_for(num_tokens)
        if prefilling:
            return end_block * len(self.group_windows)
        groups = range(len(self.group_windows))
        return sum(end_block - self._first_needed_block(group, num_tokens - 1) for group in groups)

    def admit(self) -> None:
        """Move waiting requests to running while they fit (`fits`), in arrival order with backfill: when the first
        waiting request does not fit, the first of the next `backfill_window - 1` that does is admitted instead, and
        every request it passes counts a skip. A request skipped `MAX_SKIPS` times blocks backfill behind it.

        Why: a burst's head may need blocks that only a finishing request gives back, while a smaller request
        behind it fits now; without backfill the pool idles at that size gap (the full burst at 2 reservations ran
        2.8 requests at a time in arrival order, about 2.9 with backfill in a simulation of the same scheduler).
        """
        # NOTE: admission looks ahead instead of keeping a fixed reserve: reserving one block per running request
        # made admission and preemption chase each other (a preempted request was re-admitted as soon as blocks
        # freed, re-prefilled, and preempted again: 639 preemptions for 48 requests in the full burst run), and a
        # 64-token reserve still preempted and held concurrency below what the pool allows.
        while self.waiting and len(self.running) < self.max_num_seqs:
            chosen = 0 if not self.running else self._first_fitting()
            if chosen is None:
                return
            for passed in itertools.islice(self.waiting, chosen):
                passed.num_skips += 1
            request = self.waiting[chosen]
            del self.waiting[chosen]
            self.running.append(request)

    def _first_fitting(self) -> int | None:
        """Position in `waiting` of the first request that fits, within the backfill window and not behind a
        request that was skipped `MAX_SKIPS` times; None when none does."""
        for position, request in enumerate(itertools.islice(self.waiting, self.backfill_window)):
            if self.fits(request):
                return position
            if request.num_skips >= self.MAX_SKIPS:
                return None
        return None

    def schedule(self) -> ScheduledStep:
        self.admit()

        budget = self.max_num_batched_tokens
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
                # NOTE: looked up when its prefill starts, not at admission: requests admitted together wait for
                # the budget, and by then the first one has computed (and cached) the prefix they share.
                self._reuse_prefix(request)
                if request.num_pending > 1:
                    computing.update(request.block_hashes[request.num_registered_blocks :])
            if request.block_tables:
                self._release_out_of_window(request)
            chunk = 1 if request.num_pending == 1 else min(request.num_pending, budget)
            while not self._grow(request, request.num_computed + chunk):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            budget -= chunk
            (decode.append(request) if request.num_pending == 1 else prefill.append((request, chunk)))
        return ScheduledStep(decode=decode, prefill=prefill)
