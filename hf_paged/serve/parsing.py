"""How an answer's text is read into content, reasoning and tool calls (transformers' response parser), and how it is
read when its tool calls cannot be.

A model may write a tool call that is no JSON (small models often do, and `max_tokens` may cut one). transformers'
parser then raises, which would fail the whole answer. As vLLM's tool parsers do, the answer is read again without
its tool calls (`without_tool_calls`): the call's text stays in the message content, with no tool call and finish
reason "stop" or "length", in one body and streamed (`ToolCallFallback`: the text after the last tool call read is
read again, and the content streamed so far is continued, not repeated).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers.cli.serving.utils import build_response_parser, get_response_template


def without_tool_calls(processor, model):
    """The processor an answer to `tool_choice: "none"` is read with: its tool calls are not parsed, so a tool call
    the model writes stays in the answer's text, as vLLM leaves it without a tool parser (OpenAI's model writes none).

    transformers' handlers parse an answer with the tokenizer's response template (or the one for the model's type);
    this is a shallow copy of the processor (and of its tokenizer: the same vocabulary and backend) whose template
    lacks the `tool_calls` field, or `processor` itself where its template parses no tool calls. The tools stay in
    the prompt, as OpenAI keeps them in the model's context."""
    template = get_response_template(processor, model)
    if _tool_calls_field(template) is None:
        return processor
    unparsed = copy.deepcopy(template)
    del unparsed["fields"]["tool_calls"]
    tokenizer = copy.copy(getattr(processor, "tokenizer", processor))
    tokenizer.response_template = unparsed
    return _with_tokenizer(processor, tokenizer)


def _tool_calls_field(template: dict | None) -> dict | None:
    """A response template's `tool_calls` field; None where it parses no tool calls (or there is no template)."""
    return None if template is None else template.get("fields", {}).get("tool_calls")


def reading_cut_answers(processor):
    """A shallow copy of `processor` (and of its tokenizer) whose tokenizer's `parse_response` reads an answer a
    stop string cut (a `GeneratedIds` with `parse_text`) as cut, where transformers' handlers hand it the answer's
    ids, whose decode runs past the stop string; other answers as the tokenizer reads them."""
    tokenizer = copy.copy(getattr(processor, "tokenizer", processor))
    parse = tokenizer.parse_response

    def parse_response(response, *args, **kwargs):
        text = getattr(response, "parse_text", None)
        return parse(response if text is None else text, *args, **kwargs)

    tokenizer.parse_response = parse_response
    return _with_tokenizer(processor, tokenizer)


def _with_tokenizer(processor, tokenizer):
    """`tokenizer` (a changed copy of the processor's) where the processor is its tokenizer, else a shallow copy of
    the processor holding it."""
    if getattr(processor, "tokenizer", processor) is processor:
        return tokenizer
    processor = copy.copy(processor)
    processor.tokenizer = tokenizer
    return processor


@dataclass(frozen=True)
class ToolCallFallback:
    """How a stream reads on once its parser cannot read a tool call (`RequestStream(tool_call_fallback=)`).

    Args:
        parser (`Callable[[bool], ResponseParser]`): a streaming parser of `without_tool_calls`' template, given
            `from_start` (True: it reads the answer from its start, the prompt its prefix; False: the text after a
            tool call read, with no prefix).
        call_close (`re.Pattern`, *optional*): a tool call's close marker in the template (`close` or
            `close_pattern`), which the text after a call starts after; None where the template names none."""

    parser: Callable[[bool], object]
    call_close: re.Pattern | None


def tool_call_fallback(processor, model, input_ids) -> ToolCallFallback | None:
    """The `ToolCallFallback` of an answer to the prompt `input_ids` that `processor` reads; None where its template
    parses no tool calls (nothing is left to fall back to). The processor without tool calls is made only when a
    stream falls back."""
    field = _tool_calls_field(get_response_template(processor, model))
    if field is None:
        return None
    close = field.get("close_pattern") or (re.escape(field["close"]) if field.get("close") else None)

    def parser(from_start: bool):
        return build_response_parser(without_tool_calls(processor, model), model, input_ids if from_start else [])

    return ToolCallFallback(parser=parser, call_close=re.compile(close) if close else None)
