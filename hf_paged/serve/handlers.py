"""transformers' request handlers, completed with per-request sampling for the Engine.

Each handler is transformers' own with these changes (and `/v1/responses` answers in one JSON body unless asked to
stream, as OpenAI's API does): its request check first refuses, with an HTTP 400 naming the field, a body it cannot
read or a field the Engine would not apply (`fields.check_body`), and also accepts `top_k` and `ignore_eos` (vLLM's
extensions, which load generators such as guidellm send); its generation config carries the request's options
(`options.RequestOptions`), checked first so a bad value is an HTTP 400 naming it; a streamed chat or completion ends
with `data: [DONE]`, as OpenAI's does. The request's `seed` seeds that request alone instead of torch's global
generator.
"""

from __future__ import annotations

import json

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler

from ..errors import ModelNotFound
from .fields import CHAT, COMPLETIONS, RESPONSES, check_body
from .options import EXTENSION_FIELDS, apply_options, read_options

DONE = "data: [DONE]\n\n"


class RequestOptionsMixin:
    """Put before a transformers handler class in the bases; `endpoint` names what the body must hold.
    `served_model_name`: the one model name requests may ask for (another gets 404 `model_not_found`)."""

    endpoint: str

    def __init__(self, *args, served_model_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.served_model_name = served_model_name

    def _resolve_model(self, body: dict):
        requested = body.get("model")
        if requested is not None and requested != self.served_model_name:
            raise ModelNotFound(requested, self.served_model_name)
        _model_id, model, processor = super()._resolve_model({**body, "model": None})
        return self.served_model_name, model, processor  # answers name the model as the request did

    async def handle_request(self, body: dict, request_id: str):
        response = await super().handle_request(body, request_id)
        # Chat and completions streams end with [DONE], as OpenAI's do (a Responses stream ends with its
        # response.completed event instead).
        if self.endpoint != RESPONSES and getattr(response, "media_type", None) == "text/event-stream":
            response.body_iterator = _ending_with_done(response.body_iterator)
        return response

    def _validate_request(self, body: dict) -> None:
        check_body(body, self.endpoint)
        super()._validate_request({key: value for key, value in body.items() if key not in EXTENSION_FIELDS})

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        options = read_options(body)
        # Without "seed": the handler would reseed torch's global generator, which every unseeded request shares.
        handler_body = {key: value for key, value in body.items() if key != "seed"}
        if isinstance(handler_body.get("generation_config"), dict):  # the handler reads it as JSON text
            handler_body["generation_config"] = json.dumps(handler_body["generation_config"])
        generation_config = super()._build_generation_config(handler_body, model_generation_config, use_cb=use_cb)
        if generation_config.eos_token_id is None:  # a request's generation_config replaces the model's whole
            generation_config.eos_token_id = model_generation_config.eos_token_id
        apply_options(generation_config, body, options)
        return generation_config


async def _ending_with_done(chunks):
    async for chunk in chunks:
        yield chunk
    yield DONE


class PagedChatCompletionHandler(RequestOptionsMixin, ChatCompletionHandler):
    """`/v1/chat/completions`."""

    endpoint = CHAT


class PagedCompletionHandler(RequestOptionsMixin, CompletionHandler):
    """`/v1/completions`."""

    endpoint = COMPLETIONS


class PagedResponseHandler(RequestOptionsMixin, ResponseHandler):
    """`/v1/responses`. A request that does not set `stream` gets one JSON response, as OpenAI's API says (the
    stock handler streams it)."""

    endpoint = RESPONSES

    async def handle_request(self, body: dict, request_id: str):
        return await super().handle_request({"stream": False, **body}, request_id)
