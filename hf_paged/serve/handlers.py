"""transformers' request handlers, completed with per-request sampling for the Engine.

Each handler is transformers' own with two changes (and `/v1/responses` answers in one JSON body unless asked to
stream, as OpenAI's API does): its request check also accepts `top_k` and `ignore_eos` (vLLM's
extensions, which load generators such as guidellm send), and its generation config carries the request's options
(`options.RequestOptions`), checked first so a bad value is an HTTP 400 naming it. The request's `seed` seeds that
request alone instead of torch's global generator.
"""

from __future__ import annotations

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler

from .options import EXTENSION_FIELDS, apply_options, read_options


class RequestOptionsMixin:
    """Put before a transformers handler class in the bases."""

    def _validate_request(self, body: dict) -> None:
        super()._validate_request({key: value for key, value in body.items() if key not in EXTENSION_FIELDS})

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        options = read_options(body)
        # Without "seed": the handler would reseed torch's global generator, which every unseeded request shares.
        generation_config = super()._build_generation_config(
            {key: value for key, value in body.items() if key != "seed"}, model_generation_config, use_cb=use_cb
        )
        apply_options(generation_config, body, options)
        return generation_config


class PagedChatCompletionHandler(RequestOptionsMixin, ChatCompletionHandler):
    """`/v1/chat/completions`."""


class PagedCompletionHandler(RequestOptionsMixin, CompletionHandler):
    """`/v1/completions`."""


class PagedResponseHandler(RequestOptionsMixin, ResponseHandler):
    """`/v1/responses`. A request that does not set `stream` gets one JSON response, as OpenAI's API says (the
    stock handler streams it)."""

    async def handle_request(self, body: dict, request_id: str):
        return await super().handle_request({"stream": False, **body}, request_id)
