"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seed; penalties, logit bias and a
minimum length applied to the logits first (`apply_logits_processing`, batched over the rows that ask for them).
`sample` picks one row's token on the host; `sample_batch` picks every row's on the device (asynchronous
scheduling, for requests without a seed)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

# What torch.Generator.manual_seed takes: a 64-bit integer, signed or not.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    Args:
        max_new_tokens (`int`, defaults to 16): tokens to generate at most.
        temperature (`float`, defaults to 0.0): 0 is greedy (argmax); otherwise logits are divided by it (after
            subtracting their maximum, so a tiny temperature tends to greedy instead of overflowing).
        top_k (`int`, defaults to 0): keep the k most likely tokens (0: all).
        top_p (`float`, defaults to 1.0): keep the smallest set whose probability reaches top_p.
        min_p (`float`, defaults to 0.0): keep the tokens whose probability is at least min_p times the most likely
            one's (0 to 1; 0 keeps all), as transformers' `MinPLogitsWarper` after top-k and top-p (vLLM applies it
            before them, which differs only with top_p below 1: top-p's mass is then counted over fewer tokens).
        seed (`int`, *optional*): seeds this request's own generator, so its samples do not depend on the batch.
        eos_token_id (`int`, *optional*), stop_token_ids (`tuple[int, ...]`): generating one of these ends the
            request (the token is kept), unless `ignore_eos` (which only ignores `eos_token_id`).
        presence_penalty (`float`, defaults to 0.0), frequency_penalty (`float`, defaults to 0.0): OpenAI's
            penalties, subtracted from the logit of each token already generated (once, and once per occurrence).
        repetition_penalty (`float`, defaults to 1.0): transformers' and vLLM's: the logit of each token of the prompt
            or the output is divided by it where positive, multiplied where negative.
        logit_bias (`tuple[tuple[int, float], ...]`): (token id, bias) pairs added to the logits (OpenAI's).
        min_tokens (`int`, defaults to 0): no eos or stop token before this many tokens.
        logprobs (`int`, *optional*): record each generated token's log probability and the `logprobs` most likely
            tokens' (0 to 20; None records nothing) in `Request.logprobs`: the log-softmax of the logits the token is
            chosen from (after penalties and logit bias, before temperature, top-k and top-p), as OpenAI reports.
        prompt_logprobs (`int`, *optional*): record each prompt token's log probability given the tokens before it,
            and the `prompt_logprobs` most likely tokens' there (0 to 20; None records nothing), in
            `Request.prompt_logprobs` (vLLM's `prompt_logprobs`; the first prompt token has none): the log-softmax of
            the model's logits, no penalty or bias applied. Its prompt is computed whole: it takes nothing from the
            prefix cache until they are recorded.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # numpy and other numeric scalars (np.int64, np.float32) are taken as the Python numbers they stand for
        for name in _SCALAR_FIELDS:
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(map(_plain, self.stop_token_ids)))
        if isinstance(self.logit_bias, tuple):
            object.__setattr__(
                self,
                "logit_bias",
                tuple(tuple(map(_plain, pair)) if isinstance(pair, tuple) else pair for pair in self.logit_bias),
            )
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (a number; 0 is greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (an int; 0 keeps every token), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(
                f"seed must be None or a 64-bit int, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}"
            )
        if self.eos_token_id is not None and not _is_int(self.eos_token_id):
            raise ValueError(f"eos_token_id must be an int or None, got {self.eos_token_id!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(map(_is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be a number > 0 (1 changes nothing), got {self.repetition_penalty!r}"
            )
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and _is_int(pair[0])
            and _is_number(pair[1])
            and not math.isnan(pair[1])
            for pair in self.logit_bias
        ):
            raise ValueError(
                f"logit_bias must be a tuple of (token id, bias) pairs, each bias a number (not NaN), got "
                f"{self.logit_bias!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before a token is picked (a penalty, a bias, a minimum length)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def is_stop(self, token_id: int) -> bool:
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and self.eos_token_id is not None and token_id == self.eos_token_id


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


class TokenLogprob(NamedTuple):
    """A generated token's log probability, and the most likely tokens' (token id, log probability), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The `TokenLogprob` of `token` from one row's host log-probabilities ([vocab] float32), with the top `k`."""
    top = torch.topk(logprobs, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprob(float(logprobs[token]), pairs)


# Prompt positions whose log-softmax is taken at once: [rows, vocab] float32 on the device (64 MB at a vocabulary of
# 128k), so that a long prompt chunk's log probabilities do not hold a float32 copy of all its logits.
PROMPT_LOGPROB_ROWS = 128


def prompt_token_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logits [positions, vocab] at prompt positions (on the device) and the prompt token after each ([positions]
    int64) -> each next token's `TokenLogprob` with the top `k`, read to the host once per slice of
    `PROMPT_LOGPROB_ROWS` positions (the log probabilities themselves stay on the device)."""
    entries: list[TokenLogprob] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):
        logprobs = torch.log_softmax(logits[start : start + PROMPT_LOGPROB_ROWS].float(), dim=-1)
        chosen = logprobs.gather(1, next_ids[start : start + PROMPT_LOGPROB_ROWS, None])[:, 0].tolist()
        if k:
            top = torch.topk(logprobs, k)
            tops = [tuple(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist())]
        else:
            tops = [()] * len(chosen)
        entries += [TokenLogprob(value, top) for value, top in zip(chosen, tops)]
    return entries


def apply_logits_processing(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """logits [rows, vocab] of `requests` (each with `params`, `prompt_ids`, `output_ids`) -> the same logits with
    each row's penalties, logit bias and minimum length applied, all rows at once; rows that ask for none come back
    as they were. The tokens seen are gathered once per call, on the logits' device."""
    rows = [row for row, request in enumerate(requests) if request.params.processes_logits]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    logits = logits.clone()
    picked = logits[rows].float()  # [k, vocab]
    params = [requests[row].params for row in rows]

    def column(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    def counts_of(token_ids: list[torch.Tensor]) -> torch.Tensor:
        """[k, vocab]: how often each token occurs in each row's 1-D token ids (one bincount for all rows)."""
        num_rows = len(token_ids)
        tokens = torch.cat(token_ids).to(device)
        if not tokens.numel():
            return torch.zeros(num_rows, vocab, device=device)
        lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
        rows = torch.arange(num_rows, device=device).repeat_interleave(lengths)
        return torch.bincount(rows * vocab + tokens, minlength=num_rows * vocab).view(num_rows, vocab).float()

    outputs = [torch.tensor(requests[row].output_ids, dtype=torch.long) for row in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        # The prompt's ids as a tensor once per request (`Request.prompt_tensor`), not a list read every step.
        seen = counts_of([torch.cat((requests[row].prompt_tensor, output)) for row, output in zip(rows, outputs)]) > 0
        penalty = column([p.repetition_penalty for p in params])
        picked = torch.where(seen, torch.where(picked > 0, picked / penalty, picked * penalty), picked)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = counts_of(outputs)
        picked = picked - column([p.frequency_penalty for p in params]) * counts
        picked = picked - column([p.presence_penalty for p in params]) * (counts > 0)
    biases = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias if 0 <= token < vocab]
    if biases:
        index = torch.tensor([[i, token] for i, token, _ in biases], device=device)
        picked.index_put_(
            (index[:, 0], index[:, 1]), torch.tensor([b for *_, b in biases], device=device), accumulate=True
        )
    banned = [
        (i, token)
        for i, (p, output) in enumerate(zip(params, outputs))
        if len(output) < p.min_tokens
        for token in (*p.stop_token_ids, *(() if p.eos_token_id is None or p.ignore_eos else (p.eos_token_id,)))
        if 0 <= token < vocab
    ]
    if banned:
        index = torch.tensor(banned, device=device)
        picked[index[:, 0], index[:, 1]] = float("-inf")
    logits[rows] = picked.to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] (float) -> one token id, following `params`."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float()
    # Shifted by the maximum before the division, so a tiny temperature gives -inf (not inf - inf = nan) to every
    # token below the maximum: the greedy limit, ties kept
    logits = (logits - logits.max()) / max(params.temperature, _SMALLEST_TEMPERATURE)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first token always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop[0] = False  # a top_p below float32's smallest number compares as 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        # probability below min_p times the largest's: a logit below the largest's (0 here) plus log(min_p)
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] token ids (int64, on the logits' device), each row picked as `sample` picks it:
    argmax for greedy rows; for the others temperature, top-k, top-p and min-p, then one draw, all rows at once and
    without reading anything on the host (an exponential race, `argmax(probs / E)` with `E ~ Exp(1)`, which draws
    each token with its probability). Draws come from the device's global generator: for requests without a seed. A
    sampled row whose probabilities are no distribution (its logits all -inf, or with nan or +inf: `sample` raises
    there) gets -1."""
    greedy = logits.argmax(-1)
    sampled_rows = [row for row, p in enumerate(params) if p.temperature > 0.0]
    if not sampled_rows:
        return greedy
    device, vocab = logits.device, logits.shape[-1]

    def column(values, dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)[:, None]
        return host.to(device)[:, None]

    picked = [params[row] for row in sampled_rows]
    index = column(sampled_rows, torch.long)[:, 0]
    x = logits.index_select(0, index).float()
    temperatures = column([max(p.temperature, _SMALLEST_TEMPERATURE) for p in picked], torch.float32)
    x = (x - x.amax(-1, keepdim=True)) / temperatures  # as in `sample`
    top_k, top_p = any(p.top_k > 0 for p in picked), any(p.top_p < 1.0 for p in picked)
    if top_k or top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # one sort serves both
    if top_k:
        k = column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in picked], torch.long)
        kth = sorted_x.gather(1, k - 1)
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if top_p:
        probs = sorted_x.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first token always stays).
        # A row without top-p beside rows with it: no threshold (float32 sums can reach 1.0 before the last token).
        thresholds = column([p.top_p if p.top_p < 1.0 else math.inf for p in picked], torch.float32)
        drop = probs.cumsum(-1) - probs >= thresholds
        drop[:, 0] = False  # as in `sample`
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0.0 for p in picked):  # as in `sample`: each row's largest logit is 0 here
        floors = column([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in picked], torch.float32)
        x = x.masked_fill(x < floors, float("-inf"))
    probs = x.softmax(-1)
    draws = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    draws = draws.masked_fill(probs.isnan().any(-1), -1)
    return greedy.index_copy(0, index, draws)


# A temperature divides float32 logits: one below float32's smallest normal number would round to 0 there (0 / 0 at
# the maximum). Every temperature below it is the greedy limit alike.
_SMALLEST_TEMPERATURE = torch.finfo(torch.float32).tiny

_SCALAR_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "eos_token_id",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
)


def _plain(value):
    """A numpy (or other) integer as an `int`, a real as a `float`; anything else (bools included) as it is."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
