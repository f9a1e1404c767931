"""Which request bodies the server takes: malformed ones, and fields it would not apply, get a 400 naming the field.

transformers' handlers accept some OpenAI fields without applying them (logging "Ignoring unsupported fields" at
most), apply others to a `GenerationConfig` the Engine does not read (`frequency_penalty` as `repetition_penalty`,
`logit_bias` as `sequence_bias`), and fail with a 500 and a traceback on bodies they cannot read (no `messages`, a
message without `role`). A client is never told. So one check runs before each handler (`check_body`): the body's
shape for its endpoint, then every field that changes the output and that the Engine does not apply, which is
refused unless it holds its OpenAI default (the value that changes nothing: `suffix=""`, `top_logprobs=0`, ...).
"""

from __future__ import annotations

import functools
import json
import math

from ..errors import InvalidRequest
from .options import EXTENSION_FIELDS, OUTPUT_TEXT_LOGPROBS

CHAT, COMPLETIONS, RESPONSES = "chat.completions", "completions", "responses"

# What each endpoint reads: every field of transformers' request schemas (`_valid_params_class`) is in one of four
# places, and a field in none of them is refused as OpenAI refuses an unknown one ("Unrecognized request argument").
#   READ_FIELDS        the fields the server applies, or checks and refuses where it would not apply the value
#   EXTENSION_FIELDS   vLLM's sampling fields beyond OpenAI's (options.py), on every endpoint
#   NO_EFFECT_FIELDS   fields that change no token of an answer, taken and left alone
#   UNAPPLIED_FIELDS   fields the server does not apply: refused unless they hold a value that changes nothing
READ_FIELDS = {
    CHAT: (
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "stop", "seed", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "logit_bias", "tools", "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs", "generation_config",
    ),
    COMPLETIONS: (
        "model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed", "n",
        "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "echo", "best_of", "generation_config",
    ),
    RESPONSES: (
        "model", "input", "instructions", "stream", "stream_options", "max_output_tokens", "temperature", "top_p",
        "seed", "tools", "parallel_tool_calls", "max_tool_calls", "reasoning", "text", "include", "top_logprobs",
        "generation_config",
    ),
}  # fmt: skip
# The request's bookkeeping at OpenAI (metadata, user, safety_identifier, store, service_tier), its prompt cache's
# settings (the server's prefix cache is its own), a predicted output (a latency hint: OpenAI's answer is the one
# without it) and image options (a text model reads no image): each endpoint's, as transformers' schemas hold them.
NO_EFFECT_FIELDS = {
    CHAT: (
        "metadata", "user", "safety_identifier", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "prediction",
    ),
    COMPLETIONS: ("user",),
    RESPONSES: (
        "metadata", "user", "safety_identifier", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "image",
    ),
}  # fmt: skip
# field -> (the values that change nothing, what it asks for). A field holding another value is refused.
_UNAPPLIED = {
    "response_format": (({"type": "text"},), "structured output"),
    "tool_choice": (("none", "auto"), "a forced tool call"),
    "functions": (([],), "function calling"),
    "function_call": (("none", "auto"), "a forced function call"),
    "audio": ((), "audio output"),
    "modalities": ((["text"],), "output modalities other than text"),
    "previous_response_id": ((), "a stored earlier response"),
    "suffix": (("",), "text after the completion, which the model would write towards (fill-in-the-middle)"),
    "web_search_options": ((), "a web search"),
    "verbosity": (("medium",), "answers longer or shorter than the model's own"),
    "moderation": ((), "moderation of the input and output"),
    "background": ((False,), "a response run in the background, fetched later"),
    "background_options": (({},), "a response run in the background, fetched later"),
    "conversation": ((), "a stored conversation's items before the input"),
    "prompt": ((), "a stored prompt template"),
    "truncation": (("disabled",), "the input's first items dropped to fit the context (a long input is refused)"),
    "context_management": (([],), "the context compacted"),
    "access_programs": (({}, {"cyber": "standard"}), "an access program of OpenAI's"),
}
UNAPPLIED_FIELDS = {
    endpoint: {name: _UNAPPLIED[name] for name in names}
    for endpoint, names in {
        CHAT: (
            "response_format", "tool_choice", "functions", "function_call", "audio", "modalities",
            "web_search_options", "verbosity", "moderation",
        ),
        COMPLETIONS: ("suffix",),
        RESPONSES: (
            "tool_choice", "previous_response_id", "background",
            "background_options", "conversation", "prompt", "truncation", "context_management", "access_programs",
            "moderation",
        ),
    }.items()
}  # fmt: skip
# The Responses API's text settings, and the values of each that change nothing: plain text, the model's own length.
TEXT_NEUTRAL = {"format": ({"type": "text"},), "verbosity": ("medium",)}
TEXT_ASKS_FOR = {"format": "structured output", "verbosity": "answers longer or shorter than the model's own"}
# OpenAI's reasoning efforts (chat's `reasoning_effort`, the Responses API's `reasoning.effort`). The server hands
# one to the chat template as its `reasoning_effort` variable, and refuses it for a template that reads none.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The Responses API's other reasoning settings, and the values of each that change nothing.
REASONING_NEUTRAL = {"summary": (), "generate_summary": (), "mode": ("standard",), "context": ("auto",)}


def known_fields(endpoint: str) -> frozenset[str]:
    """Every field a request body of `endpoint` may hold."""
    fields = (*READ_FIELDS[endpoint], *NO_EFFECT_FIELDS[endpoint], *UNAPPLIED_FIELDS[endpoint])
    return frozenset((*fields, *EXTENSION_FIELDS))


def is_int(value) -> bool:
    """Whether a JSON value is an integer (JSON's true and false are Python bools, which are ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# generation_config (transformers' extension, a JSON object): the keys the Engine applies, and those that change no
# token (output formats, special ids the server reads from the model). Any other key must be a `GenerationConfig`
# setting at its default (one that differs would change the output and is refused), and a key `GenerationConfig` does
# not know is refused too.
# The applied keys, with what each may hold (besides null, which leaves it unset).
APPLIED_GENERATION_VALUES = {
    "max_new_tokens": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "min_new_tokens": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "eos_token_id": (
        lambda v: is_int(v) or (isinstance(v, list) and all(map(is_int, v))),
        "a token id or a list of token ids",
    ),
    "seed": (is_int, "an integer"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "stop_strings": (  # as the top-level stop: "" would end every answer at its first character
        lambda v: (
            (isinstance(v, str) and v != "")
            or (isinstance(v, list) and all(isinstance(item, str) and item != "" for item in v))
        ),
        "a non-empty string or a list of them",
    ),
}
APPLIED_GENERATION_KEYS = frozenset(APPLIED_GENERATION_VALUES)
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

# The values the neutral keys' GenerationConfig takes (another fails in transformers' generate(), after the request
# is taken): key -> (accepts, what it allows).
_TOKEN_ID = (lambda value: is_int(value) and value >= 0, "a token id (an integer >= 0)")
_BOOLEAN = (lambda value: isinstance(value, bool), "true or false")
NEUTRAL_GENERATION_VALUES = {
    "pad_token_id": _TOKEN_ID,
    "bos_token_id": _TOKEN_ID,
    "decoder_start_token_id": _TOKEN_ID,
    "use_cache": _BOOLEAN,
    "output_scores": _BOOLEAN,
    "output_logits": _BOOLEAN,
    "output_attentions": _BOOLEAN,
    "output_hidden_states": _BOOLEAN,
    "return_dict_in_generate": _BOOLEAN,
    "cache_implementation": (
        lambda value: isinstance(value, str) and value in _cache_implementations(),
        "one of transformers' cache implementations (ALL_CACHE_IMPLEMENTATIONS, or paged)",
    ),
}


def _cache_implementations() -> tuple[str, ...]:
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    return (*ALL_CACHE_IMPLEMENTATIONS, "paged")  # as GenerationConfig.validate takes them


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


def neutral_generation_values(key: str) -> list:
    """The values of a `GenerationConfig` setting that change nothing: `GenerationConfig()`'s, and the one it fills in
    later where it leaves it unset (`GENERATION_DEFAULTS`)."""
    return [generation_defaults()[key], *([GENERATION_DEFAULTS[key]] if key in GENERATION_DEFAULTS else [])]


# A model's settings that its requests' max_new_tokens overrides (transformers' handlers give every request one).
STARTUP_NEUTRAL = ("max_length",)


def unapplied_generation_settings(generation_config) -> dict:
    """A model's generation config's settings that its requests would not get: those the Engine does not apply
    (`APPLIED_GENERATION_KEYS`; `repetition_penalty` and `min_new_tokens` apply as the requests' defaults, see
    options.with_model_defaults; `max_length` is `STARTUP_NEUTRAL`) at a value other than the one that changes
    nothing, key -> value."""
    defaults = generation_defaults()
    unapplied = {}
    for key, value in generation_config.to_dict().items():
        if (
            key in APPLIED_GENERATION_KEYS
            or key in NEUTRAL_GENERATION_KEYS
            or key in STARTUP_NEUTRAL
            or key not in defaults
        ):
            continue
        if value in neutral_generation_values(key):
            continue
        unapplied[key] = value
    return unapplied


ROLES = ("system", "developer", "user", "assistant", "tool")
# The content parts a text model reads, per endpoint (the Responses API spells them its own way; its earlier
# responses' output text comes back as `output_text`).
TEXT_PARTS = {CHAT: ("text",), RESPONSES: ("input_text", "output_text", "text")}
# apply_chat_template's own parameters that a request's chat_template_kwargs may set (its other parameters are the
# handlers' to set, or change the prompt without a word: truncation, padding, another template).
TEMPLATE_PARAMETERS_ALLOWED = ("documents",)


@functools.cache
def reserved_template_keywords() -> tuple[str, ...]:
    """Keywords a request's chat_template_kwargs may not hold: `apply_chat_template`'s parameters (but
    `TEMPLATE_PARAMETERS_ALLOWED`) and those the handlers pass it besides (`messages`, `load_audio_from_video`)."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = [
        name
        for name, parameter in parameters.items()
        if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    return (*(n for n in named if n not in TEMPLATE_PARAMETERS_ALLOWED), "messages", "load_audio_from_video")


def check_body(body: dict, endpoint: str) -> None:
    """Raise `InvalidRequest` (HTTP 400, naming the field) for a body of `endpoint` (`CHAT`, `COMPLETIONS` or
    `RESPONSES`) that the server cannot read or would not apply in full."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_text_is_unicode(body, "")
    known = known_fields(endpoint)
    for name in body:
        if name not in known:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name[:60]} (a {endpoint} request's fields: "
                f"{', '.join(sorted(known))})",
                name,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string (the served model's name), got {_short(model)}", "model")
    if endpoint == CHAT:
        _check_messages(body.get("messages"), "messages", TEXT_PARTS[CHAT])
        _check_chat_fields(body)
    elif endpoint == COMPLETIONS:
        _check_prompt(body)
        _check_echo(body)
    elif endpoint == RESPONSES:
        _check_input(body)
        _check_tools(body.get("tools"), RESPONSES)
        _check_include(body.get("include"))
    _check_stream_fields(body)
    _check_tool_limits(body)
    _check_reasoning(body)
    _check_settings(body, "text", TEXT_NEUTRAL, TEXT_ASKS_FOR)
    for name, (neutral, asks_for) in UNAPPLIED_FIELDS[endpoint].items():
        value = body.get(name)
        if value is None or _is_neutral(value, neutral):
            continue
        allowed = " or ".join(json.dumps(v) for v in neutral) if neutral else "null"
        raise InvalidRequest(
            f"{name}={json.dumps(value)} asks for {asks_for}, which hf-paged serve does not do; allowed: {allowed}",
            name,
        )
    _check_generation_config(body.get("generation_config"))


# The Responses API's `include` values (OpenAI's), and what each asks for; the server gives the message text's log
# probabilities (options.OUTPUT_TEXT_LOGPROBS) and refuses the others.
INCLUDE_ASKS_FOR = {
    "file_search_call.results": "a file search's results",
    "web_search_call.results": "a web search's results",
    "web_search_call.action.sources": "a web search's sources",
    "message.input_image.image_url": "the input images' URLs",
    "computer_call_output.output.image_url": "a computer call's screenshots",
    "code_interpreter_call.outputs": "a code interpreter's outputs",
    "reasoning.encrypted_content": "the reasoning, encrypted, to send back in a later request",
}


def _check_include(include) -> None:
    """The Responses API's `include`: a list of OpenAI's values, of which the server gives
    "message.output_text.logprobs" (the others are refused, naming `include`)."""
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise InvalidRequest(f"include must be a list of strings, got {_short(include)}", "include")
    for value in include:
        if value == OUTPUT_TEXT_LOGPROBS:
            continue
        asked = INCLUDE_ASKS_FOR.get(value)
        what = f"asks for {asked}, which hf-paged serve does not give" if asked else "is not one of OpenAI's values"
        raise InvalidRequest(f'include value {_short(value)} {what}; allowed: ["{OUTPUT_TEXT_LOGPROBS}"]', "include")


def _is_neutral(value, neutral: tuple) -> bool:
    # True is not 1 and False is not 0 here: a bool matches only a bool.
    return any(value == allowed and isinstance(value, bool) == isinstance(allowed, bool) for allowed in neutral)


def _check_messages(messages, where: str, part_types: tuple[str, ...]) -> None:
    """Chat messages as transformers' handlers read them (`get_processor_inputs_from_messages`): each a role and a
    content (text, or a list of text parts), an assistant's `tool_calls` in OpenAI's shape."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"{where} must be a non-empty list of messages, got {_short(messages)}", where)
    for index, message in enumerate(messages):
        at = f"{where}[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{at} must be an object with a role and a content, got {_short(message)}", at)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{at}.role must be one of {', '.join(ROLES)}, got {_short(role)}", f"{at}.role")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], f"{at}.tool_calls")
            if message["tool_calls"]:
                continue  # the handlers render the calls, not the content
        content = message.get("content")
        if isinstance(content, str):
            continue
        if isinstance(content, list):
            for number, part in enumerate(content):
                _check_text_part(part, f"{at}.content[{number}]", part_types)
            continue
        raise InvalidRequest(
            f"{at}.content must be a string or a list of content parts, got {_short(content)}", f"{at}.content"
        )


def _check_text_part(part, where: str, part_types: tuple[str, ...]) -> None:
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be a content part object, got {_short(part)}", where)
    kind = part.get("type")
    if kind not in part_types:
        raise InvalidRequest(
            f"{where}.type must be {' or '.join(map(repr, part_types))}: hf-paged serve runs a text model, which "
            f"reads no {_short(kind)} part",
            f"{where}.type",
        )
    if not isinstance(part.get("text"), str):
        raise InvalidRequest(f"{where}.text must be a string, got {_short(part.get('text'))}", f"{where}.text")


def _check_tool_calls(tool_calls, where: str) -> None:
    """An assistant message's earlier tool calls: `[{"type": "function", "function": {"name": ..., "arguments":
    "<a JSON object>"}}]` (chat templates read the arguments as a mapping)."""
    if not isinstance(tool_calls, list):
        raise InvalidRequest(f"{where} must be a list of tool calls, got {_short(tool_calls)}", where)
    for index, call in enumerate(tool_calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f'{at} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}, got '
                f"{_short(call)}",
                at,
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            raise InvalidRequest(
                f"{at}.function.arguments must be a JSON object (as text or an object), got "
                f"{_short(function.get('arguments'))}",
                f"{at}.function.arguments",
            )


def _check_chat_fields(body: dict) -> None:
    _check_tools(body.get("tools"), CHAT)
    kwargs = body.get("chat_template_kwargs")
    if "chat_template_kwargs" in body and not isinstance(kwargs, dict):
        raise InvalidRequest(f"chat_template_kwargs must be an object, got {_short(kwargs)}", "chat_template_kwargs")
    taken = [key for key in reserved_template_keywords() if key in (kwargs or {})]
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs.{taken[0]} is a setting of apply_chat_template that the server sets itself or "
            "does not take from a request (the template, truncation, padding, the messages); a request may set the "
            "template's own variables",
            f"chat_template_kwargs.{taken[0]}",
        )
    documents = (kwargs or {}).get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(document, dict) for document in documents)
    ):
        raise InvalidRequest(
            f"chat_template_kwargs.documents must be a list of objects (apply_chat_template's documents), got "
            f"{_short(documents)}",
            "chat_template_kwargs.documents",
        )


# How each endpoint spells a function tool: chat nests its name under "function", the Responses API does not.
FUNCTION_TOOLS = {
    CHAT: '{"type": "function", "function": {"name": ..., ...}}',
    RESPONSES: '{"type": "function", "name": ...}',
}


def _check_tools(tools, endpoint: str) -> None:
    """A list of function tools, as `endpoint` spells them (the Responses API's built-in tools, web or file search,
    are OpenAI's to run)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools must be a list of tools, got {_short(tools)}", "tools")
    for index, tool in enumerate(tools):
        if not _is_function_tool(tool, endpoint):
            raise InvalidRequest(
                f"tools[{index}] must be a function tool ({FUNCTION_TOOLS[endpoint]}): hf-paged serve runs no "
                f"built-in tool, got {_short(tool)}",
                f"tools[{index}]",
            )
        parameters = (tool["function"] if endpoint == CHAT else tool).get("parameters")
        if parameters is not None and not isinstance(parameters, dict):  # OpenAI's rule: a JSON Schema object
            where = f"tools[{index}].function.parameters" if endpoint == CHAT else f"tools[{index}].parameters"
            raise InvalidRequest(f"{where} must be a JSON Schema object, got {_short(parameters)}", where)


def _is_function_tool(tool, endpoint: str) -> bool:
    if not isinstance(tool, dict):
        return False
    if endpoint == RESPONSES and tool.get("type") != "function":
        return False
    named = tool.get("function") if endpoint == CHAT else tool
    return isinstance(named, dict) and isinstance(named.get("name"), str)


def _check_tool_limits(body: dict) -> None:
    """`parallel_tool_calls` (true by default) limits the tool calls of an answer: `false` keeps an answer's first
    tool call (handlers.py, as vLLM does); `tool_choice="none"` parses none (parsing.py, `without_tool_calls`). The
    Responses API's `max_tool_calls` limits calls of OpenAI's built-in tools, which the server refuses
    (`_check_tools`): with function tools it changes nothing."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            f"parallel_tool_calls must be true or false, got {_short(parallel)}", "parallel_tool_calls"
        )
    most = body.get("max_tool_calls")
    if most is not None and (not is_int(most) or most < 0):
        raise InvalidRequest(f"max_tool_calls must be an integer >= 0, got {_short(most)}", "max_tool_calls")


def _check_reasoning(body: dict) -> None:
    """Chat's `reasoning_effort` and the Responses API's `reasoning` ({"effort": ...}; its other settings at the
    values that change nothing). Whether the model's chat template reads an effort is the handler's check
    (`requested_reasoning_effort`)."""
    _check_effort(body.get("reasoning_effort"), "reasoning_effort")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        _check_effort(reasoning.get("effort"), "reasoning.effort")
    _check_settings(body, "reasoning", {"effort": None, **REASONING_NEUTRAL}, {})


def _check_effort(effort, field: str) -> None:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"{field} must be one of {', '.join(REASONING_EFFORTS)}, got {_short(effort)}", field)


def _check_settings(body: dict, field: str, neutral: dict, asks_for: dict) -> None:
    """An object field of settings (`reasoning`, `text`): each key one of `neutral`'s, holding null or a value that
    changes nothing (`neutral[key]`; None: any value, checked elsewhere); `asks_for[key]`: what another value asks
    for."""
    settings = body.get(field)
    if settings is None:
        return
    if not isinstance(settings, dict):
        raise InvalidRequest(f"{field} must be an object, got {_short(settings)}", field)
    for key, value in settings.items():
        if key not in neutral:
            raise InvalidRequest(
                f"{field}.{key} is not a {field} setting (allowed: {', '.join(neutral)})", f"{field}.{key}"
            )
        if value is not None and neutral[key] is not None and not _is_neutral(value, neutral[key]):
            allowed = " or ".join(json.dumps(v) for v in (*neutral[key], None))
            raise InvalidRequest(
                f"{field}.{key}={_short(value)} asks for {asks_for.get(key, 'a setting')}, which hf-paged serve does "
                f"not apply; allowed: {allowed}",
                f"{field}.{key}",
            )


def requested_reasoning_effort(body: dict) -> str | None:
    """The reasoning effort a checked body asks for (chat's `reasoning_effort`, the Responses API's
    `reasoning.effort`), or None."""
    reasoning = body.get("reasoning")
    return body.get("reasoning_effort") or (reasoning.get("effort") if isinstance(reasoning, dict) else None)


def _check_stream_fields(body: dict) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {_short(stream)}", "stream")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise InvalidRequest(f"stream_options must be an object, got {_short(options)}", "stream_options")
    if stream is not True:  # OpenAI's rule, and vLLM's
        raise InvalidRequest("stream_options is only allowed with stream: true; allowed here: null", "stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise InvalidRequest(
            f"stream_options.include_usage must be true or false, got {_short(usage)}", "stream_options.include_usage"
        )


def _check_text_is_unicode(value, where: str) -> None:
    """Every string of the body can be UTF-8 (JSON's escapes can spell a lone surrogate, which no tokenizer takes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidRequest(
                f"{where or 'the body'} is not valid Unicode text ({error.reason} at character {error.start})",
                where or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text_is_unicode(key, where)  # a field's name: the object holding it
            _check_text_is_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text_is_unicode(item, f"{where}[{index}]")


def _check_prompt(body: dict) -> None:
    """The prompt, as OpenAI's completions take it: a non-empty string or list of token ids, or a list of them (the
    handler runs each of several as a request of its own; whether each id is in the model's vocabulary is its
    check too, `PromptMixin`)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and all(isinstance(one, str | list) for one in prompt)
    prompts = prompt if several else [prompt]  # else one prompt (a string, or token ids)
    for index, one in enumerate(prompts):
        if not ((isinstance(one, str) and one) or is_token_ids(one)):
            where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
            raise InvalidRequest(
                f"{where} must be a non-empty string or list of token ids (prompt: one of them, or a list of "
                f"them), got {_short(one)}",
                where,
            )


def _check_echo(body: dict) -> None:
    """`echo`: the completion's text starts with the prompt's (handlers.py, `PromptMixin`), and with `logprobs` its
    log probabilities start with the prompt tokens' (the Engine's `prompt_logprobs`; the first token's null)."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequest(f"echo must be true or false, got {_short(echo)}", "echo")


def is_token_ids(value) -> bool:
    """Whether a prompt is a non-empty list of token ids (integers >= 0)."""
    return isinstance(value, list) and bool(value) and all(is_int(token) and token >= 0 for token in value)


def _check_input(body: dict) -> None:
    """The Responses API's input, read as transformers' handler reads it (`ResponseHandler._normalize_input`), then
    checked as chat messages; `instructions` a string."""
    value = body.get("input")
    if not (isinstance(value, str) and value) and not (
        isinstance(value, list) and value and all(isinstance(item, dict) for item in value)
    ):
        raise InvalidRequest(f"input must be a non-empty string or a list of input items, got {_short(value)}", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest(f"instructions must be a string, got {_short(instructions)}", "instructions")
    try:
        messages = normalize_input({"input": value})
    except Exception as error:  # a KeyError for a field an item lacks, transformers' HTTPException for a type
        detail = f"an item lacks the field {error}" if isinstance(error, KeyError) else getattr(error, "detail", error)
        raise InvalidRequest(f"input cannot be read as messages: {detail}", "input") from None
    try:
        _check_messages(messages, "messages", TEXT_PARTS[RESPONSES])
    except InvalidRequest as error:  # the messages' positions are not the items': the field is `input`
        raise InvalidRequest(f"input, read as chat messages: {error.message}", "input") from None


# The Responses API's input items that transformers' handler turns into messages (`_normalize_response_items`).
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def normalize_input(body: dict) -> list[dict]:
    """The Responses API's input (and instructions) as chat messages, as transformers' handler reads them
    (`ResponseHandler._normalize_input`), but for a list that starts with an item (a tool call or its output, a
    reasoning item, as an earlier response's output gives them): the handler reads a list whose first entry has no
    role as one user message's content parts, and refuses those."""
    from transformers.cli.serving.response import ResponseHandler

    items = body.get("input")
    first = items[0] if isinstance(items, list) and items else None
    if not (isinstance(first, dict) and "role" not in first and first.get("type") in INPUT_ITEM_TYPES):
        return ResponseHandler._normalize_input(body)
    messages = ResponseHandler._normalize_response_items(items)
    instructions = body.get("instructions")
    if instructions:  # as the handler puts them: a system message first
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = instructions
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages


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
        if key in APPLIED_GENERATION_KEYS:
            accepts, allowed = APPLIED_GENERATION_VALUES[key]
            if setting is not None and not accepts(setting):
                raise InvalidRequest(
                    f"generation_config.{key} must be {allowed}, got {_short(setting)}", f"generation_config.{key}"
                )
            continue
        if key in NEUTRAL_GENERATION_KEYS:
            accepts, allowed = NEUTRAL_GENERATION_VALUES.get(key, (None, None))
            if setting is not None and accepts is not None and not accepts(setting):
                raise InvalidRequest(
                    f"generation_config.{key} must be {allowed}, got {_short(setting)}", f"generation_config.{key}"
                )
            continue
        if key not in defaults:
            raise InvalidRequest(
                f"generation_config.{key} is not a generation setting (transformers' GenerationConfig has no such "
                "field)",
                f"generation_config.{key}",
            )
        neutral = neutral_generation_values(key)
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
