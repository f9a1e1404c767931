"""Requests and the scheduler: which requests run this step, with how many tokens, on which blocks.

Every step: admit waiting requests while blocks allow, looking ahead at how the running requests will grow (see
`Scheduler.fits`), give every running request with one pending token a decode row, and spend the rest of the token
budget on prefill chunks. When a row needs a block and none is free, the most recently admitted request is
preempted: its blocks go back and it waits to be recomputed (prompt plus what it generated), so no request fails
for lack of memory unless it could never fit the whole pool.

With prefix caching on, a request's first prefill takes the longest cached prefix of its tokens (full blocks,
always leaving one token to compute), and every block that fills up is remembered by its hash chain, so requests
sharing a system prompt compute it once, and a preempted request mostly finds its own blocks again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

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
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the pool
    generator: torch.Generator | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain over its full blocks of tokens
    num_registered_blocks: int = 0  # leading blocks of block_ids the prefix cache knows
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    error: str | None = None
    finished: bool = False
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled (1 for a decoding request)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


@dataclass
class ScheduledStep:
    decode: list[Request]  # one token each, batched in one forward
    prefill: list[tuple[Request, int]]  # (request, chunk length); the engine packs all of it in one forward


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_reserve_tokens: int | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, {max_num_batched_tokens}"
            )
        if decode_reserve_tokens is not None and decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be None or >= 0, got {decode_reserve_tokens}")
        self.pool = pool
        self.decode_reserve_tokens = decode_reserve_tokens
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
        worst = self._blocks_for(len(request.prompt_ids) + request.params.max_new_tokens)
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

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for `num_tokens` tokens in total; False when the pool has too few free."""
        missing = self._blocks_for(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True
        if not self.pool.allocator.can_allocate(missing):
            return False
        request.block_ids += self.pool.allocator.allocate(missing)
        return True

    def _preempt(self, request: Request) -> None:
        self.pool.allocator.free(request.block_ids)  # cached full blocks stay findable until evicted
        request.block_ids, request.num_computed, request.num_registered_blocks = [], 0, 0
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _reuse_prefix(self, request: Request) -> None:
        """Start a request's prefill from the longest cached prefix of its tokens."""
        allocator, block_size = self.pool.allocator, self.pool.block_size
        if not allocator.enable_prefix_caching:
            return
        num_blocks = (len(request.token_ids) - 1) // block_size  # one token is always left to compute
        self._extend_hashes(request, num_blocks)
        request.block_ids = allocator.lookup_prefix(request.block_hashes[:num_blocks])
        request.num_registered_blocks = len(request.block_ids)
        request.num_computed = request.num_cached_tokens = len(request.block_ids) * block_size
        self.num_prefix_hit_tokens += request.num_computed

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
        for index in range(request.num_registered_blocks, num_full):
            allocator.cache_block(request.block_ids[index], request.block_hashes[index])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def retire(self, request: Request) -> None:
        self.pool.allocator.free(request.block_ids)
        request.block_ids = []
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
        before one of them finishes. Blocks shared through the prefix cache are counted once per holder, so the
        check errs on the side of admitting too few.

        NOTE: with the default lookahead (to every request's `max_new_tokens`) an admitted request is never
        preempted: requests can only finish earlier than planned (eos, stop tokens), which frees blocks sooner.
        A finite `decode_reserve_tokens` admits more when requests usually stop early, and relies on preemption
        when they do not.
        """
        block_size = self.pool.block_size
        growths = [self._growth(request) for request in self.running] + [self._growth(newcomer)]
        held = {block_id for request in self.running for block_id in request.block_ids}
        available = self.pool.num_free_blocks + len(held)
        # NOTE: O(n^2) in running requests (n <= max_num_seqs), and only while requests wait: a few ms at n=256.
        for t in {0, *(steps for _, steps in growths)}:
            demand = sum((tokens + t + block_size - 1) // block_size for tokens, steps in growths if steps >= t)
            if demand > available:
                return False
        return True

    def schedule(self) -> ScheduledStep:
        # NOTE: admission looks ahead instead of keeping a fixed reserve: reserving one block per running request
        # made admission and preemption chase each other (a preempted request was re-admitted as soon as blocks
        # freed, re-prefilled, and preempted again: 639 preemptions for 48 requests in the full burst run), and a
        # 64-token reserve still preempted and held concurrency below what the pool allows.
        while self.waiting and len(self.running) < self.max_num_seqs:
            if self.running and not self.fits(self.waiting[0]):
                break
            self.running.append(self.waiting.popleft())

        budget = self.max_num_batched_tokens
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        for request in list(self.running):
            if request not in self.running:  # preempted while making room for an earlier one
                continue
            if request.num_pending > 1 and budget <= 0:
                continue  # no prefill budget left this step
            if request.num_computed == 0 and not request.block_ids:
                # NOTE: looked up when its prefill starts, not at admission: requests admitted together wait for
                # the budget, and by then the first one has computed (and cached) the prefix they share.
                self._reuse_prefix(request)
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
