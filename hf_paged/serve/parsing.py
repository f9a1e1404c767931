"""How an answer's text is read into content, reasoning and tool calls (transformers' response parser), and how it is
read when its tool calls cannot be.

A model may write a tool call that is no JSON (small models often do, and `max_tokens` may cut one). transformers'
parser then raises, which would fail the whole answer. As vLLM's tool parsers do, the answer is read again without
its tool calls (`without_tool_calls`): the call's text stays in the message content, with no tool call and finish
reason "stop" or "length", in one body and streamed (where the content streamed so far is continued, not repeated).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from transformers.cli.serving.utils import build_response_parser, get_response_template


def without_tool_calls(processor, model):
    """The processor an answer to `tool_choice: "none"` is read with: its tool calls are not parsed, so a tool call
    the model writes stays in the answer's text, as vLLM leaves it without a tool parser (OpenAI's model writes none).

    transformers' handlers parse an answer with the tokenizer's response template (or the one for the model's type);
    this is a shallow copy of the processor (and of its tokenizer: the same vocabulary and backend) whose template
    lacks the `tool_calls` field, or `processor` itself where its template parses no tool calls. The tools stay in
    the prompt, as OpenAI keeps them in the model's context."""
    template = get_response_template(processor, model)
    if template is None or "tool_calls" not in template.get("fields", {}):
        return processor
    unparsed = copy.deepcopy(template)
    del unparsed["fields"]["tool_calls"]
    tokenizer = copy.copy(getattr(processor, "tokenizer", processor))
    tokenizer.response_template = unparsed
    if getattr(processor, "tokenizer", processor) is processor:
        return tokenizer
    processor = copy.copy(processor)
    processor.tokenizer = tokenizer
    return processor


def unparsed_tool_calls_parser(processor, model, input_ids) -> Callable[[], object] | None:
    """What builds the streaming parser an answer is read with once its tool calls cannot be (a `ResponseParser` of
    `without_tool_calls(processor, model)`'s template, with the prompt `input_ids` as its prefix); None where the
    processor's template parses no tool calls (nothing is left to fall back to)."""
    unparsed = without_tool_calls(processor, model)
    if unparsed is processor:
        return None
    return lambda: build_response_parser(unparsed, model, input_ids)
