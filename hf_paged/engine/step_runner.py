"""StepRunner: the device side of an Engine step, from its rows to each row's result.

    rows ──> step.forward(rows) ──> logits processing ──> argmax, host logits, log probabilities ──> results
             (PackedStep: one forward; PerRequestStep: one a row)                   (one device read per forward)

Rows whose requests record their prompt's log probabilities (`SamplingParams.prompt_logprobs`) run through
`step.forward_with_prompt_logits`, which also keeps the logits at their prompt positions.

A forward that raises is run again in halves, down to single rows, so a row whose forward raises alone is found
and only its request fails (`Engine.step` decides what to do with the rows that failed). The per-request step runs
each row alone already.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..errors import UnsupportedModel
from .request import Request
from .sampling import SamplingParams, apply_logits_processing, prompt_token_logprobs, sample

# A stand-in for the rows of a step that pick no token (a prefill chunk short of its input's end).
_NO_PROCESSING = Request(-1, [], SamplingParams())

Rows = list[tuple[Request, int]]  # (request, new tokens) per row


class Step(Protocol):
    """A way to run an Engine step's rows: `PackedStep` (packed.py) or `PerRequestStep` (per_request.py)."""

    def forward(self, rows: Rows) -> torch.Tensor:
        """rows -> [len(rows), vocab] logits at each row's last new token."""

    def forward_with_prompt_logits(self, rows: Rows, positions: dict[int, range]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows, and per row index the token positions (of its new tokens) whose logits are wanted too ->
        ([len(rows), vocab] logits at each row's last new token, [sum of the positions, vocab] logits at those
        positions, row by row in `positions`' order)."""


class RowResult(NamedTuple):
    """One row's result: its greedy token id, its logits on the host when it samples, its log probabilities on the
    host when its request records them, and the `TokenLogprob`s of the prompt tokens its logits gave (its request's
    `prompt_logprob_positions`, each for the token after its position; () when none)."""

    greedy_id: int
    logits: torch.Tensor | None
    logprobs: torch.Tensor | None
    prompt_logprobs: list | tuple = ()


class StepResults(NamedTuple):
    """Per row: its `RowResult`, or the exception its forward raised alone. `error`: the exception of the step's
    first forward (None when it ran)."""

    results: dict
    error: Exception | None


class StepRunner:
    """Runs a step's rows through `step` (`rows_alone`: it runs each row in a forward of its own)."""

    def __init__(self, step: Step, rows_alone: bool):
        self.step = step
        self.rows_alone = rows_alone

    def forward(self, rows: Rows) -> torch.Tensor:
        """The step's forward over `rows` -> [len(rows), vocab] logits."""
        return self.step.forward(rows)

    def run(self, rows: Rows) -> StepResults:
        """Each row's result. Runs every row in one forward; when that raises, runs them again in halves to find rows
        whose forward raises alone. Raises the first forward's exception when every row ran in a smaller forward
        (nothing to blame), and `UnsupportedModel` (the model's, not a row's) at once."""
        results: dict = {}
        first_error = None
        if self.rows_alone:
            for row in range(len(rows)):
                try:
                    results.update(self._results([rows[row]], [row]))
                except UnsupportedModel:
                    raise
                except Exception as error:
                    results[row], first_error = error, first_error or error
            if first_error is None:
                return StepResults(results, None)
        else:
            try:
                return StepResults(self._results(rows, range(len(rows))), None)
            except UnsupportedModel:
                raise
            except Exception as error:
                first_error = error
            self._isolate(rows, list(range(len(rows))), first_error, results)
        if not any(isinstance(result, BaseException) for result in results.values()):
            raise first_error
        return StepResults(results, first_error)

    @staticmethod
    def decide(request: Request, num_tokens: int, result) -> int | str | None:
        """What a step does with one row's `result` (see `run`): the token it appends, the error it fails the
        request with, or None for a prefill chunk short of the end of the input."""
        if isinstance(result, BaseException):
            return f"request {request.request_id} failed in the model's forward: {result!r}"
        if request.num_pending > num_tokens:
            return None
        if request.params.temperature == 0.0:
            return result.greedy_id
        try:
            return sample(result.logits, request.params, request.generator)
        except Exception as error:  # e.g. torch.multinomial on nan or inf probabilities
            # This request fails alone; the others' rows of the step are applied as usual.
            return f"request {request.request_id} could not sample its next token: {error}"

    def _isolate(self, rows: Rows, indices: list[int], error: Exception, results: dict) -> None:
        """`indices`' forward together raised `error`: run each half alone, down to single rows."""
        if len(indices) == 1:
            results[indices[0]] = error
            return
        half = len(indices) // 2
        for part in (indices[:half], indices[half:]):
            try:
                results.update(self._results([rows[i] for i in part], part))
            except Exception as part_error:
                self._isolate(rows, part, part_error, results)

    def _results(self, rows: Rows, indices) -> dict:
        """One forward over `rows`; {index: `RowResult`}, keyed by `indices`."""
        with torch.inference_mode():
            positions = {
                row: kept for row, (request, n) in enumerate(rows) if (kept := request.prompt_logprob_positions(n))
            }
            prompt_logprobs = {}
            if positions:
                logits, prompt_logits = self.step.forward_with_prompt_logits(rows, positions)
                start = 0
                for row, kept in positions.items():
                    request = rows[row][0]
                    next_ids = torch.tensor(request.prompt_ids[kept.start + 1 : kept.stop + 1], device=logits.device)
                    prompt_logprobs[row] = prompt_token_logprobs(
                        prompt_logits[start : start + len(kept)], next_ids, request.params.prompt_logprobs
                    )
                    start += len(kept)
            else:
                logits = self.forward(rows)
            # Penalties, logit bias and minimum length, for the rows that pick a token and ask for them.
            picking = [request if request.num_pending == num_tokens else None for request, num_tokens in rows]
            if any(request is not None and request.params.processes_logits for request in picking):
                logits = apply_logits_processing(logits, [r or _NO_PROCESSING for r in picking])
            # One device read per forward, not one per row: every row's argmax, and the logits of the rows that
            # sample (their generators live on the CPU), copied to the host together.
            greedy_ids = logits.argmax(-1).tolist()
            sampled = [
                row
                for row, (request, num_tokens) in enumerate(rows)
                if request.params.temperature > 0.0 and request.num_pending == num_tokens
            ]
            host_logits = dict(zip(sampled, logits[sampled].float().cpu())) if sampled else {}
            # Log probabilities of the rows whose requests record them (Request.logprobs), from the same logits.
            recording = [
                row
                for row, request in enumerate(picking)
                if request is not None and request.params.logprobs is not None
            ]
            host_logprobs = (
                dict(zip(recording, torch.log_softmax(logits[recording].float(), dim=-1).cpu())) if recording else {}
            )
        return {
            index: RowResult(
                greedy_ids[row], host_logits.get(row), host_logprobs.get(row), prompt_logprobs.get(row, ())
            )
            for row, index in enumerate(indices)
        }
