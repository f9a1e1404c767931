"""What a request asks of the sampler, read from its JSON body and checked before it runs.

transformers' handlers turn a request body into a `GenerationConfig` (`BaseHandler._build_generation_config`): they
apply temperature, top_p, max_tokens and stop, and reseed torch's global generator for `seed`. `RequestOptions` carries
what that config has no field for (the request's own seed, `ignore_eos`, whether `max_tokens` was given), and
`engine_sampling` turns config and options into `Engine.add_request` keywords.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..engine.inputs import check_seed
from ..engine.sampling import MAX_LOGPROBS
from ..errors import InvalidRequest

# Request fields beyond the OpenAI schema that the server accepts (vLLM's names).
EXTENSION_FIELDS = ("top_k", "min_p", "ignore_eos", "repetition_penalty", "min_tokens", "stop_token_ids")
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# The GenerationConfig attribute `RequestOptions` rides on from the handler to the manager.
OPTIONS_ATTRIBUTE = "hf_paged_options"


MAX_CHOICES = 128  # OpenAI's limit on `n`


@dataclass(frozen=True)
class RequestOptions:
    seed: int | None = None
    n: int = 1  # choices: parallel samples of the prompt, each an Engine request (sample i seeded with seed + i)
    # Completions' best_of: samples drawn (n of them answered, those of the highest mean log probability per token).
    best_of: int = 1
    logprobs: int | None = None  # None: none; k: each token's log probability and the top k (SamplingParams)
    # Completions' echo with logprobs: the prompt tokens' log probabilities and top k too (SamplingParams'
    # prompt_logprobs), which the answer's logprobs start with.
    prompt_logprobs: int | None = None
    echoed_prompt: str | None = None  # a string prompt the answer starts with (echo); token ids are decoded instead
    # Completions' max_tokens 0 with echo: the answer is the prompt alone (scored, with logprobs); its Engine request
    # generates one token, which the answer leaves out.
    prompt_only: bool = False
    # Completions: the answer's text continues the prompt's, decoded after its last tokens (a SentencePiece token's
    # leading space, which a decode of the generated tokens alone drops, is kept, as OpenAI's and vLLM's completions
    # give it); a chat answer's text is decoded alone, as transformers' server decodes it.
    continues_prompt: bool = False
    # The Responses API: the log probabilities go with the message text's pieces (each `response.output_text.delta`
    # the tokens its text came from), not with the answer's tokens in order.
    content_logprobs: bool = False
    ignore_eos: bool = False
    max_tokens_given: bool = False  # the request named its max_tokens (else the server fits it to the prompt)
    prompt_field: str | None = None  # where the prompt is in the request, for errors about its length
    max_tokens_field: str = "max_tokens"  # the field that names max_tokens in the request, for errors about it
    # Applied to the logits by the Engine's sampler (SamplingParams): OpenAI's penalties and logit bias, vLLM's
    # repetition_penalty / min_tokens / stop_token_ids (or transformers' generation_config.repetition_penalty and
    # min_new_tokens).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # The end-of-sequence ids of the request's own generation_config (the model's are not checked): the server
    # refuses one outside the model's vocabulary, as it refuses such stop_token_ids.
    requested_eos_ids: tuple[int, ...] = ()


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
    return value


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions' logprobs


# The Responses API's `include` value that asks for the message text's log probabilities.
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"


def _logprobs(body: dict, chat: bool, responses: bool = False) -> int | None:
    """How many top log probabilities per token the request asks for (None: no log probabilities): chat's
    `logprobs` (true / false) and `top_logprobs` (0-20), completions' `logprobs` (0-5), the Responses API's
    `include: ["message.output_text.logprobs"]` and `top_logprobs` (0-20)."""
    if chat:
        if responses:  # fields.check_body has checked `include`
            wanted = OUTPUT_TEXT_LOGPROBS in (body.get("include") or ())
            asked_by = f'include: ["{OUTPUT_TEXT_LOGPROBS}"]'
        else:
            wanted, asked_by = body.get("logprobs"), "logprobs: true"
            if wanted is not None and not isinstance(wanted, bool):
                raise InvalidRequest(f"logprobs must be true or false, got {wanted!r}", "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top and not wanted:
            raise InvalidRequest(f"top_logprobs needs {asked_by}", "top_logprobs")
        count = (top or 0) if wanted else None
    else:
        count = _int(body, "logprobs")
        if count is not None and not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {count}", "logprobs"
            )
    return count


def read_options(body: dict, chat: bool = True, responses: bool = False) -> RequestOptions:
    """Check a request body's sampling fields; raise `InvalidRequest` naming the first bad one and its allowed
    values. `chat`: a chat or Responses API body (else a completions one), `responses`: a Responses API one, for the
    fields they spell differently (logprobs)."""
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise InvalidRequest(f"top_k must be >= -1 (-1 and 0 keep every token), got {top_k}", "top_k")
    min_p = _number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise InvalidRequest(f"min_p must be in [0, 1] (0 keeps every token), got {min_p}", "min_p")
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {n}", "n")
    n = n or 1
    best_of = None if chat else _int(body, "best_of")
    if best_of is not None and not n <= best_of <= MAX_CHOICES:
        raise InvalidRequest(f"best_of must be an integer in [n, {MAX_CHOICES}] (n is {n}), got {best_of}", "best_of")
    best_of = best_of or n
    if best_of > n and body.get("stream"):
        raise InvalidRequest(
            f"best_of above n is answered in one body (the best are known once every sample has ended), so it "
            f"cannot be streamed; allowed with stream: best_of null or {n} (n)",
            "best_of",
        )
    seed = _int(body, "seed")
    generation = _generation_config(body)
    seed_field = "seed"
    if seed is None and generation.get("seed") is not None:  # transformers' generation_config.seed
        seed, seed_field = generation["seed"], "generation_config.seed"
    if seed is not None:
        try:
            check_seed(seed)
        except ValueError as error:
            raise InvalidRequest(str(error), seed_field) from None
        samples, count = ("n", n) if best_of == n else ("best_of", best_of)
        try:
            check_seed(seed + count - 1)  # sample i is seeded with seed + i
        except ValueError:
            raise InvalidRequest(
                f"seed {seed} with {samples}={count}: sample i is seeded with seed + i, and seed + {count - 1} is past "
                f"the 64-bit range; the largest seed for {samples}={count} is {2**64 - count}",
                seed_field,
            ) from None
    echo = not chat and body.get("echo") is True
    for name in MAX_TOKENS_FIELDS:
        value = _int(body, name)
        if value == 0 and name == "max_tokens" and not chat:
            if not echo:
                raise InvalidRequest("max_tokens must be >= 1, or 0 with echo: true (the prompt alone), got 0", name)
        elif value is not None and value < 1:
            raise InvalidRequest(f"{name} must be >= 1, got {value}", name)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", name)
        penalties[name] = value or 0.0
    repetition_penalty = _number(body, "repetition_penalty")
    repetition_field = "repetition_penalty"
    if repetition_penalty is None and generation.get("repetition_penalty") is not None:
        repetition_penalty, repetition_field = generation["repetition_penalty"], "generation_config.repetition_penalty"
    if repetition_penalty is None:  # null, as not given
        repetition_penalty = 1.0
    if (
        not isinstance(repetition_penalty, int | float)
        or isinstance(repetition_penalty, bool)
        or repetition_penalty <= 0
    ):
        raise InvalidRequest(f"{repetition_field} must be a number > 0, got {repetition_penalty!r}", repetition_field)
    min_tokens, min_tokens_field = _int(body, "min_tokens"), "min_tokens"
    if min_tokens is None and generation.get("min_new_tokens") is not None:
        min_tokens, min_tokens_field = generation["min_new_tokens"], "generation_config.min_new_tokens"
    if min_tokens is None:  # null, as not given
        min_tokens = 0
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
        raise InvalidRequest(f"{min_tokens_field} must be an integer >= 0, got {min_tokens!r}", min_tokens_field)
    # The field that names max_tokens in the request (its first one given), and its value.
    max_tokens_field = next((name for name in MAX_TOKENS_FIELDS if body.get(name) is not None), None)
    max_tokens = body[max_tokens_field] if max_tokens_field is not None else generation.get("max_new_tokens")
    if max_tokens_field is None and max_tokens is not None:
        max_tokens_field = "generation_config.max_new_tokens"
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"{min_tokens_field} ({min_tokens}) must be at most {max_tokens_field} ({max_tokens})", min_tokens_field
        )
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids
    ):
        raise InvalidRequest(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}", "stop_token_ids")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    logprobs = _logprobs(body, chat, responses)
    return RequestOptions(
        seed=seed,
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        echoed_prompt=body["prompt"] if echo and isinstance(body.get("prompt"), str) else None,
        prompt_only=echo and body.get("max_tokens") == 0,
        continues_prompt=not chat,
        content_logprobs=responses,
        ignore_eos=ignore_eos,
        max_tokens_given=max_tokens_field is not None,
        prompt_field=next((name for name in ("messages", "prompt", "input") if name in body), None),
        max_tokens_field=max_tokens_field or "max_tokens",
        repetition_penalty=float(repetition_penalty),
        logit_bias=_logit_bias(body),
        min_tokens=min_tokens,
        stop_token_ids=tuple(stop_token_ids),
        requested_eos_ids=_eos_ids(generation.get("eos_token_id")),
        **penalties,
    )


def _generation_config(body: dict) -> dict:
    """transformers' `generation_config` field (a JSON object or its text; fields.check_body has checked it)."""
    value = body.get("generation_config")
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


def _eos_ids(value) -> tuple[int, ...]:
    """generation_config.eos_token_id (fields.check_body has checked it: null, an id or a list of them) as ids."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (token id, bias) pairs."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias must map token ids to biases, got {value!r}", "logit_bias")
    pairs = []
    for token, bias in value.items():
        # int() would take " 5" or "5_0", and refuses more than 4300 digits
        if not (isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 20):
            raise InvalidRequest(
                f"logit_bias keys must be token ids (up to 20 digits), got {token[:40]!r}", "logit_bias"
            )
        token_id = int(token)
        valid = isinstance(bias, int | float) and not isinstance(bias, bool) and -100 <= bias <= 100
        if token_id < 0 or not valid:
            raise InvalidRequest(
                f"logit_bias must map token ids to biases in [-100, 100], got {token!r}: {bias!r}", "logit_bias"
            )
        pairs.append((token_id, float(bias)))
    return tuple(pairs)


def with_model_defaults(options: RequestOptions, body: dict, model_generation_config) -> RequestOptions:
    """`options` with the model's generation config's `repetition_penalty` and `min_new_tokens` where the request sets
    neither (its own field, or its `generation_config`, which replaces the model's whole as transformers' handlers
    take it): what `generate()` with the model's config applies, and vLLM with the model's generation config."""
    if body.get("generation_config") is not None:
        return options
    defaults = {}
    penalty = getattr(model_generation_config, "repetition_penalty", None)
    if body.get("repetition_penalty") is None and penalty is not None:
        defaults["repetition_penalty"] = float(penalty)
    min_new_tokens = getattr(model_generation_config, "min_new_tokens", None)
    if body.get("min_tokens") is None and min_new_tokens:
        defaults["min_tokens"] = int(min_new_tokens)
    return dataclasses.replace(options, **defaults) if defaults else options


def apply_options(generation_config, body: dict, options: RequestOptions) -> None:
    """Complete the handler's `GenerationConfig` with what it leaves out: a temperature above 0 samples (the
    handler only turns sampling off at 0), top_k, min_p, and the options themselves."""
    if body.get("temperature") is not None:
        generation_config.do_sample = body["temperature"] > 0
    if body.get("top_k") is not None:
        generation_config.top_k = max(body["top_k"], 0)
    if body.get("min_p") is not None:
        generation_config.min_p = float(body["min_p"])
    setattr(generation_config, OPTIONS_ATTRIBUTE, options)


def engine_sampling(generation_config) -> dict:
    """`Engine.add_request` sampling keywords for a request's `GenerationConfig`: greedy unless it samples (a request
    with a temperature above 0, or a model whose generation config samples by default)."""
    options = getattr(generation_config, OPTIONS_ATTRIBUTE, None) or RequestOptions()
    temperature = generation_config.temperature if generation_config.temperature is not None else 1.0
    sampling = bool(generation_config.do_sample) and temperature > 0
    eos = generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return {
        "temperature": float(temperature) if sampling else 0.0,
        "top_k": int(generation_config.top_k or 0) if sampling else 0,
        "top_p": float(generation_config.top_p or 1.0) if sampling else 1.0,
        "min_p": float(generation_config.min_p or 0.0) if sampling else 0.0,
        "seed": options.seed,
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "stop_token_ids": (() if options.ignore_eos else tuple(eos_ids[1:])) + options.stop_token_ids,
        "ignore_eos": options.ignore_eos,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repetition_penalty,
        "logit_bias": options.logit_bias,
        "min_tokens": options.min_tokens,
        "logprobs": options.logprobs,
        "prompt_logprobs": options.prompt_logprobs,
    }


def stop_strings(generation_config) -> tuple[str, ...]:
    stops = getattr(generation_config, "stop_strings", None)
    if not stops:
        return ()
    return (stops,) if isinstance(stops, str) else tuple(stops)
