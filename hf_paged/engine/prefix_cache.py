"""Prefix reuse: what a request takes from the pool's prefix cache when its prefill starts, and what it gives back.

A request's full blocks of tokens are named by a hash chain (`Request.block_hashes`). Its first prefill takes the
longest cached prefix of them (full blocks, always leaving one token to compute; a sliding group only the blocks
its window still sees), and every block that fills up is remembered by its hash, in each layer group, so requests
sharing a system prompt compute it once and a preempted request mostly finds its own blocks again.
"""

from __future__ import annotations

from ..storage import BlockPool
from .blocks import BlockCounts
from .request import PrefixHit, Request


class PrefixReuse:
    """The engine's side of the pool's prefix cache: lookups (`peek`, `take`), registration (`cache_full_blocks`),
    and when a request should take its prefix (`waits`, `takes_at_admission`). Does nothing while the pool's
    prefix caching is off."""

    def __init__(self, pool: BlockPool, counts: BlockCounts, enabled: bool | None = None):
        self.pool = pool
        self.counts = counts
        self.num_hit_tokens = 0  # prompt tokens taken from the cache instead of computed
        self._enabled = enabled  # None: whatever the pool's prefix caching is

    @property
    def enabled(self) -> bool:
        """Whether lookups and registration happen: the pool keeps a prefix cache and its user has not opted out."""
        return self.pool.allocator.enable_prefix_caching and self._enabled is not False

    def peek(self, request: Request) -> PrefixHit:
        """What a prefix lookup for `request` would take now, without taking it (see `PrefixHit`).

        The hit is the longest run of `n` leading blocks of its tokens that every layer group can start from
        (`BlockAllocator.peek_longest_prefix`): a full group needs its blocks 0..n-1 cached, a sliding group only
        those its window still sees from position `n * block_size` on, so a sliding group's blocks that were
        released and evicted do not shorten the hit. Layer groups cache their own blocks."""
        hashes = self._lookup_hashes(request)
        num_blocks, first_blocks, tables = self.pool.allocator.peek_longest_prefix(
            hashes, self.counts.group_windows, self.counts.block_size
        )
        return PrefixHit(
            num_blocks=num_blocks,
            first_blocks=first_blocks,
            tables=tables,
            waits_for=hashes[num_blocks] if num_blocks < len(hashes) else None,
        )

    def take(self, request: Request) -> None:
        """Start `request`'s prefill from the longest cached prefix of its tokens (what `peek` names): it holds
        those blocks and its computation goes on after them."""
        if not self.enabled:
            return
        num_blocks, request.first_blocks, request.block_tables = self.pool.allocator.take_longest_prefix(
            self._lookup_hashes(request), self.counts.group_windows, self.counts.block_size
        )
        request.num_registered_blocks = num_blocks
        request.num_computed = request.num_cached_tokens = num_blocks * self.counts.block_size
        self.num_hit_tokens += request.num_computed

    def waits(self, request: Request, computing: set[bytes]) -> bool:
        """Whether `request`'s prefill should wait: the first of its blocks that is not cached is one that another
        request is computing (`computing`: their hashes; parallel samples of one prompt, requests sharing a system
        prompt admitted together). Started together, both would compute the shared blocks and hold two copies;
        once the other has computed them, the prefix cache hands them over. The one computing started earlier, so
        it gets its prefill budget first every step and the wait ends."""
        if not self.enabled:
            return False
        return self.peek(request).waits_for in computing

    def takes_at_admission(self, request: Request, computing: dict[bytes, int], hit: PrefixHit | None = None) -> bool:
        """Whether `request` takes its cached prefix when it is admitted rather than when its prefill starts: with
        prefix caching, when it has one and its first uncached block is not one a running request is computing
        (`computing`; then it waits for that block, `waits`, and looks up later).

        Why: evicting one free cached block before a later lookup can shorten the hit below blocks the running
        requests hold (a shared system prompt), and the request would compute copies of them: a sliding group's
        window block, one full group's copy of a block another group still holds, or, in one full group, a free copy
        that a chain of held blocks hangs from (two requests compute the same block in one step, the copy cached
        first goes free, and the blocks after it are held by the other). Taken at once, its blocks are held and
        admission counts them as shared (`Lookahead`), and a sliding group counts from the window where its
        computation goes on (`GrowthModel.demand`'s `start`).
        `hit`: the request's `peek`, when the caller has it."""
        if request.block_tables or request.num_computed or not self.enabled:
            return False
        return (hit if hit is not None else self.peek(request)).taken_at_admission(computing)

    def cache_full_blocks(self, request: Request) -> None:
        """After a forward: remember every block of `request` that is now full of computed tokens, in every layer
        group (a sliding group's blocks before its table's first entry went back already and are not its own)."""
        allocator = self.pool.allocator
        if not self.enabled:
            return
        num_full = request.num_computed // self.counts.block_size
        if num_full <= request.num_registered_blocks:  # most steps: no block filled up
            return
        request.extend_hashes(num_full, self.counts.block_size)
        for group, (table, first) in enumerate(zip(request.block_tables, request.first_blocks)):
            for index in range(max(request.num_registered_blocks, first), num_full):
                allocator.cache_block(table[index - first], request.block_hashes[index], group)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def _lookup_hashes(self, request: Request) -> list[bytes]:
        """The hashes a prefix lookup for `request` uses: its full blocks of tokens, one token always left to
        compute (so a hit never covers the whole input); none while its prompt's log probabilities are still to be
        recorded (their logits are computed, not taken)."""
        if request.records_prompt_logprobs:
            return []
        num_blocks = (len(request.token_ids) - 1) // self.counts.block_size
        request.extend_hashes(num_blocks, self.counts.block_size)
        return request.block_hashes[:num_blocks]
