"""A request as the scheduler tracks it, what a prefix lookup would give it, and what one step runs."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..storage import hash_block_tokens
from .sampling import SamplingParams


# NOTE: eq=False: requests compare (and hash) by identity. No two requests are ever the same one, and a field-by-field
# __eq__ would build two tuples of ~20 fields for every request an `in` or `remove` on the queues passes.
@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per layer group: its held block ids
    first_blocks: list[int] = field(default_factory=list)  # per layer group: leading blocks released before them
    # Bumped whenever its tables change other than by blocks appended at their ends (freed, rolled back, released
    # out of the window): the decode runner then writes the row's whole table again, else only the new blocks.
    table_epoch: int = 0
    num_computed: int = 0  # tokens whose K/V are in the pool
    # Tokens a step still running on the device has picked and the host has not read yet (0 or 1; asynchronous
    # scheduling, `Engine(async_scheduling=True)`): they follow `output_ids`, and the next step feeds one from the
    # device.
    num_inflight: int = 0
    generator: torch.Generator | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain over its full blocks of tokens
    num_registered_blocks: int = 0  # leading blocks the prefix cache knows (in every group)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    num_skips: int = 0  # admissions of later requests (backfill) while it waited first in line or near it
    error: str | None = None
    failed_alone_at: int | None = None  # the engine step whose forward last raised for it alone, none running
    finished: bool = False
    aborted: bool = False  # stopped by `Engine.abort_request` before its end
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # its first admission (a preempted request keeps it)
    first_token_time: float | None = None
    finish_time: float | None = None
    states: object | None = None  # a hybrid model's recurrent states between per-request forwards (RequestStates)
    logprobs: list = field(default_factory=list)  # one TokenLogprob per output token, when params.logprobs is set
    # When params.prompt_logprobs is set: the TokenLogprob of prompt token i + 1 at entry i, once computed.
    prompt_logprobs: list = field(default_factory=list)

    @functools.cached_property
    def prompt_tensor(self) -> torch.Tensor:
        """The prompt's token ids as a 1-D int64 CPU tensor, made once (the sampler's penalties count them)."""
        return torch.tensor(self.prompt_ids, dtype=torch.long)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def block_ids(self) -> list[int]:
        """Every block id the request holds, all groups."""
        return [block_id for table in self.block_tables for block_id in table]

    @property
    def finish_reason(self) -> str | None:
        """Why the request finished, in vLLM's words: "stop" (it generated eos or a stop token, kept as its last),
        "length" (`max_new_tokens`), "abort" (`Engine.abort_request`), "error" (it could never run; `error` says
        why); None while it is unfinished."""
        if not self.finished:
            return None
        if self.aborted:
            return "abort"
        if self.error is not None:
            return "error"
        return "stop" if self.output_ids and self.params.is_stop(self.output_ids[-1]) else "length"

    @property
    def records_prompt_logprobs(self) -> bool:
        """Whether its prompt's log probabilities are still to be recorded (`SamplingParams.prompt_logprobs`)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def prompt_logprob_positions(self, num_tokens: int) -> range:
        """The positions of its next `num_tokens` tokens whose logits give a prompt log probability not recorded
        yet: each prompt position but the last (whose logits pick the first output token)."""
        if not self.records_prompt_logprobs:
            return range(0)
        start = max(self.num_computed, len(self.prompt_logprobs))
        return range(start, max(start, min(self.num_computed + num_tokens, len(self.prompt_ids) - 1)))

    @property
    def max_kv_tokens(self) -> int:
        """The K/V tokens it holds at its end: its prompt and `max_new_tokens` but the last sampled token, which is
        never fed back."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled (1 for a decoding request)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight - self.num_computed

    @property
    def is_done(self) -> bool:
        """It fed back its last token and reached `max_new_tokens` or a stop token."""
        return self.num_pending == 1 and not self.num_inflight and self.is_stopped

    @property
    def is_stopped(self) -> bool:
        """Its tokens reached `max_new_tokens` or end with a stop token."""
        if not self.output_ids:
            return False
        return len(self.output_ids) >= self.params.max_new_tokens or self.params.is_stop(self.output_ids[-1])

    @property
    def awaits_last_token(self) -> bool:
        """The token in flight is its last by `max_new_tokens`: nothing to schedule until it is read."""
        return self.num_inflight > 0 and len(self.output_ids) + self.num_inflight >= self.params.max_new_tokens

    def extend_hashes(self, num_blocks: int, block_size: int) -> None:
        """Hash its tokens up to `num_blocks` full blocks of `block_size` (`block_hashes`), the missing ones only."""
        if len(self.block_hashes) >= num_blocks:  # most steps: no block filled up
            return
        tokens = self.token_ids
        for index in range(len(self.block_hashes), num_blocks):
            parent = self.block_hashes[-1] if self.block_hashes else None
            block = tokens[index * block_size : (index + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, index, block))


class PrefixHit(NamedTuple):
    """What a prefix lookup would take: the first `num_blocks` blocks of a request's tokens are cached."""

    num_blocks: int
    first_blocks: list[int]  # per layer group: the first block it needs (0 in a full group; a sliding group's window)
    tables: list[list[int]]  # per layer group: the cached blocks `first_blocks[g] .. num_blocks - 1`
    waits_for: bytes | None  # the hash of the first block not found (None: every block a lookup tries was)

    def taken_at_admission(self, computing) -> bool:
        """Whether a waiting request with this hit takes it when admitted (`PrefixReuse.takes_at_admission`): it
        has one, and its first uncached block is not one a running request is computing (`computing`: hashes)."""
        return self.num_blocks > 0 and self.waits_for not in computing


@dataclass
class ScheduledStep:
    decode: list[Request]  # one token each, batched in one forward
    prefill: list[tuple[Request, int]]  # (request, chunk length); the engine packs all of it in one forward
