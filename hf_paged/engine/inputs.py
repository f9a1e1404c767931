"""What the Engine accepts: the token ids and lengths a model can take (`PromptLimits`), and the arguments of a
`generate()` / `stream()` call spread over its prompts (`spread_over_prompts`). Each error names the allowed values
and the actual ones."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import operator
import warnings
from collections.abc import Sequence

import torch

from ..errors import PositionLimitWarning
from .sampling import SEED_RANGE, SamplingParams

# The keywords `add_request` takes besides the prompt and `max_new_tokens`.
SAMPLING_KEYWORDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "max_new_tokens")


class PromptLimits:
    """A model's vocabulary and position limits, read once from the model.

    Args:
        vocab_size (`int`, *optional*): token ids must be in `[0, vocab_size)` (the input embedding's rows).
        max_positions (`int`, *optional*): the model's `max_position_embeddings`.
        learned_positions (`bool`): the model looks positions up in a table of `max_positions` rows (GPT-2's
            `n_positions`): a position past it cannot run. Otherwise (rotary, ALiBi) it runs, with a warning.
    """

    def __init__(self, vocab_size: int | None, max_positions: int | None, learned_positions: bool = False):
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.learned_positions = learned_positions and max_positions is not None
        self._warned = False

    @classmethod
    def from_model(cls, model) -> PromptLimits:
        config = model.config.get_text_config(decoder=True)
        max_positions = getattr(config, "max_position_embeddings", None)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab_size = getattr(embeddings, "num_embeddings", None) or getattr(config, "vocab_size", None)
        learned = False
        if max_positions is not None and hasattr(model, "modules"):
            # A position table: an embedding other than the tokens' with max_positions rows (OPT adds 2 to them).
            learned = any(
                isinstance(module, torch.nn.Embedding)
                and module is not embeddings
                and max_positions <= module.num_embeddings <= max_positions + 2
                for module in model.modules()
            )
        return cls(vocab_size, max_positions, learned)

    def prompt_error(self, prompt_ids: list[int]) -> str | None:
        """Why the model cannot take `prompt_ids` (a token id outside the vocabulary, more tokens than its learned
        positions), or None."""
        if self.vocab_size is not None:
            for position, token in enumerate(prompt_ids):
                if not 0 <= token < self.vocab_size:
                    return (
                        f"token id {token} at prompt position {position} is outside the model's vocabulary: ids "
                        f"must be in [0, {self.vocab_size})"
                    )
        if self.learned_positions and len(prompt_ids) > self.max_positions:
            return (
                f"a prompt of {len(prompt_ids)} tokens is longer than the model's {self.max_positions} learned "
                f"positions (max_position_embeddings)"
            )
        return None

    def logit_bias_error(self, logit_bias) -> str | None:
        """Why the model cannot take `logit_bias` ((token id, bias) pairs): a token id outside its vocabulary, or
        None."""
        return self.token_ids_error("logit_bias", [token for token, _ in logit_bias])

    def token_ids_error(self, name: str, token_ids) -> str | None:
        """Why the model cannot take the token ids `name` holds (`logit_bias`'s keys, `stop_token_ids`): the first
        one outside its vocabulary, or None."""
        if self.vocab_size is not None:
            for token in token_ids:
                if not 0 <= token < self.vocab_size:
                    return (
                        f"{name} holds token id {token}, outside the model's vocabulary: ids must be in "
                        f"[0, {self.vocab_size})"
                    )
        return None

    def cap_new_tokens(self, num_prompt: int, max_new_tokens: int) -> int:
        """`max_new_tokens`, lowered so that a model with learned positions never feeds a position past its table
        (the request then finishes with "length" there, as vLLM's engine caps a request at `max_model_len`); a
        model with other positions keeps it and warns once per engine, as `generate()` does."""
        if self.max_positions is None:
            return max_new_tokens
        # The last sampled token is never fed back: K/V reach prompt + max_new_tokens - 1 positions.
        if self.learned_positions:
            return min(max_new_tokens, self.max_positions - num_prompt + 1)
        if num_prompt + max_new_tokens - 1 > self.max_positions and not self._warned:
            self._warned = True
            warnings.warn(
                f"a request of {num_prompt} prompt + {max_new_tokens} new tokens goes past the model's "
                f"max_position_embeddings ({self.max_positions}); depending on the model, you may observe "
                "exceptions, performance degradation, or nothing at all",
                PositionLimitWarning,
                stacklevel=3,
            )
        return max_new_tokens


def as_prompt(prompt) -> list[int]:
    """One prompt's token ids as a list of ints: a sequence of integers or a 1-D integer tensor (or array)."""
    if isinstance(prompt, torch.Tensor) or hasattr(prompt, "__array__"):
        ndim, floating = getattr(prompt, "ndim", None), getattr(prompt, "dtype", None)
        if ndim != 1 or (isinstance(prompt, torch.Tensor) and prompt.is_floating_point()):
            raise TypeError(f"a prompt tensor must be 1-D token ids, got {ndim}-D {floating}")
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"a prompt must be a list of token ids (ints), got {type(prompt).__name__} {_short(prompt)}; tokenize "
            "text first"
        )
    tokens = []
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"a prompt's token ids must be ints, got {type(token).__name__} {_short(token)}")
        tokens.append(operator.index(token))
    return tokens


def as_prompts(prompts) -> list[list[int]]:
    """`generate()` / `stream()`'s prompts: a list of prompts (each a list of ints or a 1-D tensor) or a 2-D tensor."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise TypeError(
                f"prompts as a tensor must be 2-D [num_prompts, length], got {prompts.dim()}-D; for one prompt "
                "pass [prompt_ids]"
            )
        return [as_prompt(row) for row in prompts]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a list of prompts, each a list of token ids, got {type(prompts).__name__} "
            f"{_short(prompts)}; tokenize text first"
        )
    if prompts and all(isinstance(token, numbers.Integral) for token in prompts):
        raise TypeError(
            f"prompts must be a list of prompts, each a list of token ids; got one flat list of ints "
            f"{_short(prompts)}: for one prompt pass [{_short(prompts)}]"
        )
    return [as_prompt(prompt) for prompt in prompts]


def spread_over_prompts(num_prompts: int, max_new_tokens, sampling: dict) -> list[dict]:
    """`add_request` keywords per prompt from a call's: each value is one for every prompt or a list of one per
    prompt (`stop_token_ids`: a list of lists). An int `seed` gives prompt i the seed `seed + i`, so prompts of one
    call draw different samples and each reproduces alone (`generate([p], seed=seed + i)`)."""
    check_sampling_keywords(sampling)
    per_prompt = [{} for _ in range(num_prompts)]
    for name, value in {"max_new_tokens": max_new_tokens, **sampling}.items():
        is_list = isinstance(value, (list, tuple)) and not (
            (name == "stop_token_ids" and not any(isinstance(v, (list, tuple)) for v in value))
            or (name == "logit_bias" and _is_bias_pairs(value))
        )
        if is_list:
            if len(value) != num_prompts:
                raise ValueError(
                    f"{name} has {len(value)} entries for {num_prompts} prompts: give one value or one per prompt"
                )
            values = list(value)
        elif name == "seed" and value is not None:
            check_seed(value)
            value = int(value)  # a numpy integer would wrap around at seed + i
            check_seed(value + num_prompts - 1)  # prompt i is seeded with seed + i
            values = [value + index for index in range(num_prompts)]
        else:
            values = [value] * num_prompts
        for kwargs, item in zip(per_prompt, values):
            kwargs[name] = item
    return per_prompt


def check_sampling_keywords(sampling: dict) -> None:
    unknown = [name for name in sampling if name not in SAMPLING_KEYWORDS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, SAMPLING_KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"unknown sampling keyword {name!r}{hint}; the keywords are {', '.join(SAMPLING_KEYWORDS)}")


def _is_bias_pairs(value) -> bool:
    """Whether a `logit_bias` list is one value, (token id, bias) pairs for every prompt, rather than one entry per
    prompt (each a dict or a list of pairs)."""
    return bool(value) and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], numbers.Integral) for pair in value
    )


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int (or, in generate/stream, a list of one per prompt), got {seed!r}")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be a 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}")


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
