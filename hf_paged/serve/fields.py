"""Which request bodies the server takes: malformed ones, and fields it would not apply, get a 400 naming the field.

transformers' handlers accept some OpenAI fields without applying them (logging "Ignoring unsupported fields" at
most), apply others to a `GenerationConfig` the Engine does not read (`frequency_penalty` as `repetition_penalty`,
`logit_bias` as `sequence_bias`), and fail with a 500 and a traceback on bodies they cannot read (no `messages`, a
message without `role`). A client is never told. So one check runs before each handler (`check_body`): the body's
shape for its endpoint, then every field that changes the output and that the Engine does not apply, which is
refused unless it holds its OpenAI default (the value that changes nothing: `best_of=1`, `echo=false`, ...).
"""

from __future__ import annotations

import functools
import json

from ..errors import InvalidRequest

CHAT, COMPLETIONS, RESPONSES = "chat.completions", "completions", "responses"

# field -> (the values that change nothing, what it asks for). A field holding another value is refused.
UNAPPLIED_FIELDS = {
    "best_of": ((1,), "the best of several completions"),
    "echo": ((False,), "the prompt echoed in the completion"),
    "response_format": (({"type": "text"},), "structured output"),
    "tool_choice": (("none", "auto"), "a forced tool call"),
    "functions": (([],), "function calling"),
    "function_call": (("none", "auto"), "a forced function call"),
    "audio": ((), "audio output"),
    "modalities": ((["text"],), "output modalities other than text"),
    "previous_response_id": ((), "a stored earlier response"),
    "text": (({"format": {"type": "text"}},), "structured output"),
}
RESPONSES_UNAPPLIED = {
    "n": ((1,), "several choices per request"),
    "top_logprobs": ((0,), "log probabilities of the most likely tokens"),
}
# generation_config (transformers' extension, a JSON object): the keys the Engine applies, and those that change no
# token (output formats, special ids the server reads from the model). Any other key must be a `GenerationConfig`
# setting at its default (one that differs would change the output and is refused), and a key `GenerationConfig` does
# not know is refused too.
APPLIED_GENERATION_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "do_sample",
    "eos_token_id",
    "seed",
    "repetition_penalty",
    "min_new_tokens",
    "stop_strings",
}
NEUTRAL_GENERATION_KEYS = {
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "use_cache",
    "cache_implementation",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "transformers_version",
    "_from_model_config",
}

# The value of each setting that changes nothing, where GenerationConfig() leaves it unset (None) and fills it later.
GENERATION_DEFAULTS = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": None,
    "min_length": 0,
    "typical_p": 1.0,
    "min_p": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "guidance_scale": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
}


@functools.cache
def generation_defaults() -> dict:
    """`GenerationConfig()`'s settings: what each key of a request's generation_config may hold unless applied."""
    from transformers import GenerationConfig

    return GenerationConfig().to_dict()


ROLES = ("system", "developer", "user", "assistant", "tool")


def check_body(body: dict, endpoint: str) -> None:
    """Raise `InvalidRequest` (HTTP 400, naming the field) for a body of `endpoint` (`CHAT`, `COMPLETIONS` or
    `RESPONSES`) that the server cannot read or would not apply in full."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if endpoint == CHAT:
        _check_messages(body)
    elif endpoint == COMPLETIONS:
        _check_prompt(body)
    elif endpoint == RESPONSES:
        _check_input(body)
    # Chat and completions serve `n` choices and log probabilities (handlers.py); the Responses API refuses them.
    unapplied = {**UNAPPLIED_FIELDS, **RESPONSES_UNAPPLIED} if endpoint == RESPONSES else None
    for name, (neutral, asks_for) in (unapplied or UNAPPLIED_FIELDS).items():
        value = body.get(name)
        if value is None or _is_neutral(value, neutral):
            continue
        allowed = " or ".join(json.dumps(v) for v in neutral) if neutral else "null"
        raise InvalidRequest(
            f"{name}={json.dumps(value)} asks for {asks_for}, which hf-paged serve does not do; allowed: {allowed}",
            name,
        )
    _check_generation_config(body.get("generation_config"))


def _is_neutral(value, neutral: tuple) -> bool:
    # True is not 1 and False is not 0 here: a bool matches only a bool.
    return any(value == allowed and isinstance(value, bool) == isinstance(allowed, bool) for allowed in neutral)


def _check_messages(body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"messages must be a non-empty list of messages, got {_short(messages)}", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object with a role and a content, got {_short(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(role)}", f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content):
            continue
        raise InvalidRequest(
            f"{where}.content must be a string or a list of content parts, got {_short(content)}", f"{where}.content"
        )


def _check_prompt(body: dict) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
        return
    raise InvalidRequest(f"prompt must be a non-empty string (one prompt per request), got {_short(prompt)}", "prompt")


def _check_input(body: dict) -> None:
    value = body.get("input")
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return
    raise InvalidRequest(f"input must be a non-empty string or a list of input items, got {_short(value)}", "input")


def _check_generation_config(value) -> None:
    if value is None:
        return
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"generation_config must be a JSON object: {error}", "generation_config") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"generation_config must be a JSON object, got {_short(value)}", "generation_config")
    defaults = generation_defaults()
    for key, setting in value.items():
        if key in APPLIED_GENERATION_KEYS or key in NEUTRAL_GENERATION_KEYS:
            continue
        if key not in defaults:
            raise InvalidRequest(
                f"generation_config.{key} is not a generation setting (transformers' GenerationConfig has no such "
                "field)",
                f"generation_config.{key}",
            )
        neutral = [defaults[key], *([GENERATION_DEFAULTS[key]] if key in GENERATION_DEFAULTS else [])]
        if setting in neutral:
            continue
        raise InvalidRequest(
            f"generation_config.{key}={_short(setting)} is not applied by hf-paged serve; allowed: "
            f"{' or '.join(dict.fromkeys(map(json.dumps, neutral)))}",
            f"generation_config.{key}",
        )


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
