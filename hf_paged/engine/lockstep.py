"""Lockstep: the ranks of a tensor-parallel Engine run every step alike.

Under `torchrun`, each rank runs its own `Engine` on its shard of the model, and every forward is a collective: the
ranks must feed the same rows in the same order, or they deadlock or compute garbage. The engine is deterministic
(same requests, same pool size -> same schedule), so lockstep needs only two checks per step, each one small
collective on a CPU (gloo) group with a timeout:

    rank 0:  schedule -> agree(rows) -> forward ... -> agree(tokens: rank 0's) -> apply
    rank 1:  schedule -> agree(rows) -> forward ... -> agree(tokens: rank 0's) -> apply
                         |                            |
                         every rank's error, or       every rank's error; the tokens rank 0 chose
                         row signature: equal or      (its sampling, its generators) are every rank's
                         LockstepError on all ranks

- Sampled tokens: rank 0 draws, the others take its tokens, so unseeded requests (the global generator, which
  differs per rank) stay in step too; greedy ties and per-request failures follow rank 0 alike.
- An error on one rank (a scheduler bug, a failed sampling) reaches the others at the next agreement point, and every
  rank raises `LockstepError` from its step: the step is undone on all of them.
- No rank waits forever: an agreement that does not complete within `timeout` seconds raises `LockstepError` on the
  ranks that got there. A rank that fails *inside* the forward leaves the others in the model's own collectives
  until the process group's timeout (`init_process_group(timeout=...)`).
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch.distributed as dist

from ..errors import LockstepError
from ..storage.sharding import model_tp_size, tp_process_group


class Lockstep:
    """Agreement points for one tensor-parallel engine. Build it on every rank at once (`Lockstep.for_model`
    creates a process group, a collective)."""

    def __init__(self, group, timeout: float):
        ranks = dist.get_process_group_ranks(group)
        self.timeout = timeout
        self.group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=timeout),
            use_local_synchronization=len(ranks) < dist.get_world_size(),
        )
        self.rank = dist.get_rank(self.group)
        self.size = len(ranks)
        # NOTE: each engine's group holds connections to every peer: give them back with the engine, not at exit
        # (the process group may be gone by then, and destroying it there already closes this one).
        self._finalizer = weakref.finalize(self, _destroy, self.group)
        self._finalizer.atexit = False

    @classmethod
    def for_model(cls, model, timeout: float) -> Lockstep | None:
        """The lockstep of `model`'s tensor-parallel ranks; None for a model on one rank."""
        if model_tp_size(model) == 1:
            return None
        group = tp_process_group(model)
        if group is None:
            return None
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"lockstep_timeout must be a positive number of seconds, got {timeout!r}")
        return cls(group, float(timeout))

    def agree_rows(self, rows: list[tuple[int, int, int]]) -> None:
        """Before a forward: every rank schedules `rows` ((request_id, num_computed, num_tokens) per row), or
        `LockstepError` on every rank."""
        gathered = self._gather((None, rows))
        signatures = {rank: rows for rank, (_, rows) in enumerate(gathered)}
        if any(signature != signatures[0] for signature in signatures.values()):
            raise LockstepError(
                {rank: f"scheduled rows (request_id, num_computed, num_tokens) {s}" for rank, s in signatures.items()}
            )

    def agree_tokens(self, decisions: list) -> list:
        """After a forward: rank 0's `decisions` (per row: what the step does with it), on every rank."""
        gathered = self._gather((None, decisions if self.rank == 0 else None))
        return gathered[0][1]

    def fail(self, error: BaseException) -> LockstepError:
        """This rank's step raised `error`: tell the others at the agreement point they are at (they raise too) and
        return the `LockstepError` to raise here."""
        try:
            self._gather((f"{type(error).__name__}: {error}", None))
        except LockstepError as lockstep_error:
            return lockstep_error
        return LockstepError({self.rank: f"{type(error).__name__}: {error}"})

    def _gather(self, item: tuple) -> list[tuple]:
        """Every rank's `item`; raises `LockstepError` when a rank sent an error or a rank did not answer in time."""
        gathered: list = [None] * self.size
        try:
            dist.all_gather_object(gathered, item, group=self.group)
        except RuntimeError as error:  # gloo's timeout, or a peer that went away
            raise LockstepError(
                {self.rank: f"no agreement with the other ranks within {self.timeout:g} s ({error})"}
            ) from error
        errors = {rank: error for rank, (error, _) in enumerate(gathered) if error is not None}
        if errors:
            raise LockstepError(errors)
        return gathered


def _destroy(group) -> None:
    """Destroy a lockstep group (local: no collective), unless the process group it belonged to is gone already."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already destroyed with its parent
            pass
