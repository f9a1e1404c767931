"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    Args:
        max_new_tokens (`int`, defaults to 16): tokens to generate at most.
        temperature (`float`, defaults to 0.0): 0 is greedy (argmax); otherwise logits are divided by it.
        top_k (`int`, defaults to 0): keep the k most likely tokens (0: all).
        top_p (`float`, defaults to 1.0): keep the smallest set whose probability reaches top_p.
        seed (`int`, *optional*): seeds this request's own generator, so its samples do not depend on the batch.
        eos_token_id (`int`, *optional*), stop_token_ids (`tuple[int, ...]`): generating one of these ends the
            request (the token is kept), unless `ignore_eos` (which only ignores `eos_token_id`).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (a number; 0 is greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (an int; 0 keeps every token), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.eos_token_id is not None and not _is_int(self.eos_token_id):
            raise ValueError(f"eos_token_id must be an int or None, got {self.eos_token_id!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(map(_is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    def is_stop(self, token_id: int) -> bool:
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and self.eos_token_id is not None and token_id == self.eos_token_id


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] (float) -> one token id, following `params`."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first token always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
