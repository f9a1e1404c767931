"""transformers' request handlers, completed with per-request sampling for the Engine.

Each handler is transformers' own with these changes (and `/v1/responses` answers in one JSON body unless asked to
stream, as OpenAI's API does): its request check first refuses, with an HTTP 400 naming the field, a body it cannot
read or a field the Engine would not apply (`fields.check_body`), and also accepts `top_k` and `ignore_eos` (vLLM's
extensions, which load generators such as guidellm send); its generation config carries the request's options
(`options.RequestOptions`), checked first so a bad value is an HTTP 400 naming it; a streamed chat or completion ends
with `data: [DONE]`, as OpenAI's does. The request's `seed` seeds that request alone instead of torch's global
generator. `n` > 1 (chat and completions) runs the request's `n` samples as Engine requests of their own, which
share the prompt's blocks, and answers with one choice per sample (streamed: their chunks interleaved, each with its
choice index). `logprobs` (chat: `logprobs` / `top_logprobs`; completions: `logprobs`) adds each generated token's
log probability and the top alternatives, as the Engine records them, to each choice (streamed: each chunk carries
those of the tokens whose text it brings).
"""

from __future__ import annotations

import asyncio
import codecs
import copy
import dataclasses
import itertools
import json
import logging
import re

from starlette.responses import JSONResponse, StreamingResponse
from tokenizers import Tokenizer
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.utils import build_response_parser
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ..errors import InvalidRequest, ModelNotFound
from .fields import (
    CHAT,
    COMPLETIONS,
    READ_FIELDS,
    RESPONSES,
    check_body,
    is_int,
    is_token_ids,
    normalize_input,
    requested_reasoning_effort,
)
from .manager import recording_submissions
from .options import EXTENSION_FIELDS, OPTIONS_ATTRIBUTE, apply_options, read_options, with_model_defaults
from .parsing import reading_cut_answers, without_tool_calls
from .stream import (
    BYTE_TOKEN,
    PIECE_CONTEXT,
    GeneratedIds,
    LoggedText,
    cleans_up_spaces,
    parsed_content_tokens,
    skipped_ids,
    unfinished_cut,
)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


class RequestOptionsMixin:
    """Put before a transformers handler class in the bases; `endpoint` names what the body must hold.
    `served_model_name`: the one model name requests may ask for (another gets 404 `model_not_found`)."""

    endpoint: str

    def __init__(self, *args, served_model_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.served_model_name = served_model_name

    def _resolve_model(self, body: dict):
        """The model and processor, once the body's fields are checked; a reasoning effort the request asks for
        goes to the chat template (`body` is the handler's own copy, which it reads the template's variables
        from next)."""
        requested = body.get("model")
        if requested is not None and requested != self.served_model_name:
            raise ModelNotFound(requested, self.served_model_name)
        _model_id, model, processor = super()._resolve_model({**body, "model": None})
        effort = requested_reasoning_effort(body)
        if effort is not None:
            field = "reasoning_effort" if "reasoning_effort" in body else "reasoning.effort"
            if not _template_reads(processor, TEMPLATE_REASONING_EFFORT):
                raise InvalidRequest(
                    f"{field}={json.dumps(effort)} asks for a reasoning effort, and this model's chat template reads "
                    f"none (no {TEMPLATE_REASONING_EFFORT} variable); allowed: null",
                    field,
                )
            kwargs = body.get("chat_template_kwargs") or {}
            body["chat_template_kwargs"] = {**kwargs, TEMPLATE_REASONING_EFFORT: effort}
        if body.get("tool_choice") == "none":
            processor = without_tool_calls(processor, model)
        return self.served_model_name, model, processor  # answers name the model as the request did

    async def handle_request(self, body: dict, request_id: str):
        if isinstance(body, dict):
            body = dict(body)  # the handler's copy (`_resolve_model` adds the template's variables to it)
        prompts = _prompts(body) if self.endpoint == COMPLETIONS else None
        if prompts is not None and len(prompts) == 1:
            body["prompt"] = prompts[0]  # OpenAI's list of prompts, of one (the handler takes one prompt)
        # Every Engine request submitted for this HTTP request: cancelled if the handler fails, or if its stream's
        # response ends, the body started or not (`ClosingStreamingResponse`).
        with recording_submissions() as submitted:
            try:
                if prompts is not None and len(prompts) > 1:
                    response = await self._each_prompt(body, prompts, request_id)
                else:
                    response = await super().handle_request(body, request_id)
            except BaseException:
                for stream in submitted:
                    stream.cancel()
                raise
        one_call = self.endpoint == CHAT and isinstance(body, dict) and body.get("parallel_tool_calls") is False
        if not isinstance(response, StreamingResponse):
            if one_call and isinstance(response, JSONResponse) and response.status_code == 200:
                return JSONResponse(_first_tool_call_only(json.loads(response.body)))
            return response
        chunks = response.body_iterator
        if one_call:
            chunks = _first_tool_call_streamed(chunks)
        # Chat and completions streams end with [DONE], as OpenAI's do (a Responses stream ends with its
        # response.completed event instead).
        if self.endpoint != RESPONSES and response.media_type == "text/event-stream":
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = _ending_with_done(_usage_as_asked(chunks, include_usage))
        return ClosingStreamingResponse.like(response, chunks, submitted)

    async def _each_prompt(self, body: dict, prompts: list, request_id: str):
        """A completions request of several prompts (OpenAI's list of prompts), each run as a request of its own,
        at once, answered as one: prompt i's choices (`n` each) are choices i * n to i * n + n - 1, as vLLM orders
        them, and the usage adds up every prompt's tokens. A prompt that is refused refuses the request (the error
        names it: `prompt[i]`), and the others stop."""
        handle = super().handle_request
        n = body.get("n") if is_int(body.get("n")) else 1  # another n is refused by the first prompt's request
        bodies = [{**body, "prompt": prompt} for prompt in prompts]
        if body.get("stream"):  # each returns once its Engine request is in, before any token
            # a prompt refused cancels the earlier prompts' Engine requests (`handle_request`)
            responses = [await _naming_prompt(index, handle(one, request_id)) for index, one in enumerate(bodies)]
            streams = [response.body_iterator for response in responses]
            return StreamingResponse(_merged_streams(streams, n, one_prompt=False), media_type="text/event-stream")
        tasks = [asyncio.ensure_future(_naming_prompt(i, handle(one, request_id))) for i, one in enumerate(bodies)]
        try:
            responses = await asyncio.gather(*tasks)
        except BaseException:  # one prompt refused or failed, or the client left: the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        failed = [r for r in responses if not (isinstance(r, JSONResponse) and r.status_code == 200)]
        if failed:  # a prompt's error answered in a body of its own: the request's answer
            return failed[0]
        answers = [json.loads(response.body) for response in responses]
        merged = answers[0]
        merged["choices"] = [
            {**choice, "index": index * n + choice["index"]}
            for index, answer in enumerate(answers)
            for choice in answer["choices"]
        ]
        if merged.get("usage"):
            merged["usage"] = {
                key: sum(answer["usage"][key] for answer in answers)
                for key in ("prompt_tokens", "completion_tokens", "total_tokens")
            }
        return JSONResponse(merged, media_type="application/json")

    @property
    def _unused_fields(self) -> set[str]:
        """The fields transformers' handler logs as ignored, less those the server applies (`echo`, `n`, ...)."""
        return set(super()._unused_fields) - set(READ_FIELDS[self.endpoint])

    def _validate_request(self, body: dict) -> None:
        check_body(body, self.endpoint)
        super()._validate_request({key: value for key, value in body.items() if key not in EXTENSION_FIELDS})

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        options = read_options(body, chat=self.endpoint != COMPLETIONS, responses=self.endpoint == RESPONSES)
        options = with_model_defaults(options, body, model_generation_config)
        # Without "seed": the handler would reseed torch's global generator, which every unseeded request shares.
        handler_body = {key: value for key, value in body.items() if key != "seed"}
        if isinstance(handler_body.get("generation_config"), dict):  # the handler reads it as JSON text
            handler_body["generation_config"] = json.dumps(handler_body["generation_config"])
        generation_config = super()._build_generation_config(handler_body, model_generation_config, use_cb=use_cb)
        if generation_config.eos_token_id is None:  # a request's generation_config replaces the model's whole
            generation_config.eos_token_id = model_generation_config.eos_token_id
        apply_options(generation_config, body, options)
        return generation_config


# The chat template variable a reasoning effort goes to (gpt-oss's template reads it, as vLLM passes it).
TEMPLATE_REASONING_EFFORT = "reasoning_effort"


def _template_reads(processor, variable: str) -> bool:
    """Whether the processor's chat template (or one of its named templates) names `variable`."""
    template = getattr(processor, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(source, str) and re.search(rf"\b{variable}\b", source) for source in sources)


class ChoicesMixin:
    """`n` > 1 for chat and completions (put before the transformers handler in the bases): the request's `n`
    samples, each an Engine request of its own (the Engine shares the prompt's blocks among them: parallel samples
    wait for the blocks the first one computes, then reuse them), merged into one answer whose choice i is sample i,
    seeded with seed + i. Completions' `best_of` draws that many samples (seeded so) and answers the `n` of the
    highest mean log probability per token, best first, its usage counting every sample's tokens."""

    async def _non_streaming(
        self, request_id, model, processor, model_id, inputs, gen_config, gen_manager, *args, **kwargs
    ):
        samples = _samples(gen_config)
        options = getattr(gen_config, OPTIONS_ATTRIBUTE, None)
        top = None if options is None else options.logprobs
        super_run = super()._non_streaming

        async def run(request_id, model, processor, model_id, inputs, config, recorder, *args, **kwargs):
            def answer(reader, manager):
                return super_run(request_id, model, reader, model_id, inputs, config, manager, *args, **kwargs)

            if self.endpoint != CHAT:  # completions parse nothing
                return await answer(processor, recorder)
            return (await read_unparsed_on_failure(processor, model, recorder, answer))[0]

        if len(samples) == 1 and top is None:
            recorder = _Recorder(gen_manager)
            return await run(request_id, model, processor, model_id, inputs, gen_config, recorder, *args, **kwargs)

        async def one(config) -> tuple[dict, float]:
            recorder = _Recorder(gen_manager)
            response = await run(request_id, model, processor, model_id, inputs, config, recorder, *args, **kwargs)
            body = json.loads(response.body)
            if top is not None:  # the log probabilities of the tokens it generated (GeneratedIds)
                tokenizer = getattr(processor, "tokenizer", processor)
                describe = _chat_logprobs if self.endpoint == CHAT else _completion_logprobs
                body["choices"][0]["logprobs"] = describe(tokenizer, recorder.generated)
            return body, _mean_logprob(recorder.generated) if len(samples) > options.n else 0.0

        tasks = [asyncio.ensure_future(one(config)) for config in samples]
        try:
            ranked = await asyncio.gather(*tasks)
        except BaseException:  # one sample failed, or the client left: the others' Engine requests stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        bodies = [body for body, _ in ranked]
        # best_of: the n samples of the highest mean log probability per token, best first (all of them for n)
        best = sorted(range(len(ranked)), key=lambda index: -ranked[index][1])[: options.n]
        merged = dict(bodies[0])
        merged["choices"] = [{**bodies[sample]["choices"][0], "index": index} for index, sample in enumerate(best)]
        if merged.get("usage"):  # every sample's tokens, as each was generated
            completion_tokens = sum(body["usage"]["completion_tokens"] for body in bodies)
            merged["usage"] = {
                **merged["usage"],
                "completion_tokens": completion_tokens,
                "total_tokens": merged["usage"]["prompt_tokens"] + completion_tokens,
            }
        return JSONResponse(merged, media_type="application/json")

    def _build_chunk_sse(self, *args, **kwargs) -> str:
        """transformers' chunk, with the log probabilities its piece of text carries (a `LoggedText`: a request that
        asked for them) in its choice's `logprobs`."""
        sse = super()._build_chunk_sse(*args, **kwargs)
        piece = kwargs.get("content", kwargs.get("text", kwargs.get("reasoning_content")))
        if not isinstance(piece, LoggedText):
            return sse
        data = json.loads(sse.removeprefix("data: "))
        describe = _chat_logprobs if self.endpoint == CHAT else _completion_logprobs
        data["choices"][0]["logprobs"] = describe(piece.tokenizer, piece.generated)
        return f"data: {json.dumps(data)}\n\n"

    def _streaming(self, request_id, model, processor, model_id, inputs, gen_config, gen_manager, *args, **kwargs):
        samples = _samples(gen_config)
        run = super()._streaming
        if len(samples) == 1:
            return run(request_id, model, processor, model_id, inputs, gen_config, gen_manager, *args, **kwargs)
        streams = [
            run(request_id, model, processor, model_id, inputs, config, gen_manager, *args, **kwargs).body_iterator
            for config in samples
        ]
        return StreamingResponse(_merged_streams(streams), media_type="text/event-stream")


class _Recorder:
    """The generation manager as a handler sees it, keeping what the request it runs generated: its ids, with their
    log probabilities and finish reason (`generated`), or its stream (`stream`, a `RequestStream`). Asked again for
    a request's answer in one body (`answer`: the text, the prompt's length and `generated`), it gives the same
    answer without generating (the answer read again: `read_unparsed_on_failure`)."""

    def __init__(self, manager):
        self._manager, self.generated, self.stream, self.answer = manager, None, None, None

    async def generate_non_streaming(self, *args, **kwargs):
        if self.answer is None:
            self.answer = await self._manager.generate_non_streaming(*args, **kwargs)
        self.generated = self.answer[2]
        return self.answer

    def generate_streaming(self, *args, **kwargs):
        queue, self.stream = self._manager.generate_streaming(*args, **kwargs)
        return queue, self.stream

    def __getattr__(self, name: str):
        return getattr(self._manager, name)


async def read_unparsed_on_failure(processor, model, recorder: _Recorder, answer):
    """`(await answer(processor, recorder), processor)`: a transformers handler's answer in one body, of the request
    `recorder` runs, and the processor it was read with; an answer a stop string cut is read as cut
    (`reading_cut_answers`). Where the answer's tool calls cannot be read (the response parser's ValueError after the
    request generated: a call that is no JSON, or one `max_tokens` cut), the same tokens are answered again with
    `without_tool_calls(processor, model)`: the call's text stays in the message content, with no tool call, as
    vLLM's tool parsers leave it (`parsing`)."""
    try:
        return await answer(reading_cut_answers(processor), recorder), processor
    except ValueError:
        unparsed = without_tool_calls(processor, model)
        if recorder.answer is None or unparsed is processor:  # not the parse of a tool call that failed
            raise
        logger.warning("an answer's tool call could not be parsed; its text stays in the answer's content")
        return await answer(reading_cut_answers(unparsed), recorder), unparsed


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)  # as the answer's text is decoded


def _added(text: str, longer: str, final: bool) -> str:
    """The text a token adds: `longer` (the decode with it) past `text` (the decode before it). A character whose
    bytes span several tokens is added whole by the token that completes it (a token ending inside one adds ""), so
    the tokens' texts add up to the answer; the answer's last token keeps what it ends with (`final`). None where
    `longer` does not continue `text` (a decoder that changed the text before)."""
    before, after = unfinished_cut(text), longer if final else unfinished_cut(longer)
    return after[len(before) :] if after.startswith(before) else None


def _byte_piece(tokenizer, context: list[int], token_id: int, final: bool) -> str | None:
    """The text a ByteFallback byte token (`<0xE6>`) adds after the tokens `context`: what its byte completes of the
    character the byte tokens before it began (a character whole, or "" inside one). Not from decodes of the run of
    bytes: the decoder joins a run's bytes, and a run that ends inside a character decodes to U+FFFD whole, so the
    decode before such a byte ("日" then the first byte of "本") is not where the decode with it starts. None for a
    token that is no byte, and where the bytes are no UTF-8 or the answer ends inside a character (`final`): the
    decodes' U+FFFD spell those."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)

    def byte(token: int) -> int | None:
        spelling = backend.id_to_token(token) or ""
        return int(spelling[3:5], 16) if BYTE_TOKEN.fullmatch(spelling) else None

    value = byte(token_id)
    if value is None:
        return None
    before = []  # the bytes of the run before it that its character may have begun with: at most 3
    for previous in reversed(context[-3:]):
        if (previous_value := byte(previous)) is None:
            break
        before.insert(0, previous_value)
    while before and before[0] & 0xC0 == 0x80:  # a continuation byte: of a character before this one's
        before.pop(0)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(bytes(before))
        return decoder.decode(bytes([value]), final=final)
    except UnicodeDecodeError:
        return None


def _decode_all(tokenizer, sequences: list[list[int]]) -> list[str]:
    """`_decode` of each sequence, in one call of the Rust tokenizer's `decode_batch` where that decodes as
    `_decode` does (`_batch_decodes_alike`), else one by one."""
    if _batch_decodes_alike(tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        return backend.decode_batch(sequences, skip_special_tokens=True)
    return [_decode(tokenizer, sequence) for sequence in sequences]


def _batch_decodes_alike(tokenizer) -> bool:
    """Whether the Rust tokenizer decodes as `_decode` does: a `tokenizers.Tokenizer`, or a transformers tokenizer
    whose class decodes with it unchanged (not one that overrides `decode` or `_decode`, as CPM's does) and cleans
    up no spaces after it (`clean_up_tokenization_spaces`, which transformers skips for a BPE model unless forced)."""
    if isinstance(tokenizer, Tokenizer):
        return True
    kind = type(tokenizer)
    if not (
        isinstance(tokenizer, TokenizersBackend)
        and kind._decode is TokenizersBackend._decode
        and kind.decode is PreTrainedTokenizerBase.decode
    ):
        return False
    return not cleans_up_spaces(tokenizer)


def _logprob_rows(tokenizer, generated):
    """Per generated token with a log probability: (its piece, its TokenLogprob, [(alternative's text, log
    probability)]). A token's piece is the text it adds to the decoded text after the tokens before it (decoded
    together over the last `PIECE_CONTEXT` of them, then told apart), so the pieces add up to the answer's text: a
    token decoded alone loses the space a SentencePiece tokenizer spells inside it, or the space a word-level decoder
    puts between words. A special token the answer skips adds nothing."""
    records = generated.logprobs[: len(generated)]
    text_end = getattr(generated, "text_end", None)
    # A stop string cut the answer: each token's text up to its end.
    room = None if text_end is None else text_end - getattr(generated, "text_offset", 0)
    return _rows(tokenizer, list(generated[: len(records)]), records, getattr(generated, "previous", ()), room)


def _prompt_rows(tokenizer, generated):
    """The rows (as `_logprob_rows`') of the prompt an answer echoes with log probabilities, when it carries them
    (`GeneratedIds.prompt_logprobs`): its first token's TokenLogprob and alternatives None (nothing comes before
    it)."""
    if getattr(generated, "prompt_logprobs", None) is None:
        return []
    text = getattr(generated, "prompt_text", None)
    pieces = None if text is None else _string_pieces(tokenizer, text, generated.prompt_ids)
    records = [None, *generated.prompt_logprobs]
    return _rows(tokenizer, generated.prompt_ids, records, (), None, ended=True, pieces=pieces)


def _string_pieces(tokenizer, text: str, token_ids: list[int]) -> list[str] | None:
    """The pieces of a string prompt that its tokens cover, from the tokenizer's offsets: token i's runs from where
    token i - 1's ends to the end of its own span or the start of the next token's, whichever is first (the first
    from the string's start, the last to its end), so they add up to the string as given, spaces and a special
    token's text included (its ids decoded would lose them). None where the Rust tokenizer's encoding of the string
    is not `token_ids`."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        return None
    encoding = backend.encode(text, add_special_tokens=True)
    if encoding.ids != list(token_ids):
        encoding = backend.encode(text, add_special_tokens=False)
        if encoding.ids != list(token_ids):
            return None
    # A token's piece ends where its span ends or the next token of the string starts, whichever is first: of the
    # tokens sharing one span (a character's bytes, a prepended "▁") the last one gets it, as `_added` gives a
    # character to the token that completes it. A post-processor's token (sequence id None) spans nothing.
    offsets, sequences = encoding.offsets, encoding.sequence_ids
    next_starts, following = [len(text)] * len(offsets), len(text)
    for index in reversed(range(len(offsets))):
        next_starts[index] = following
        if sequences[index] is not None:
            following = offsets[index][0]
    bounds = [0]
    for (_, end), next_start in zip(offsets[:-1], next_starts):
        bounds.append(min(max(bounds[-1], min(end, next_start)), len(text)))
    bounds.append(len(text))
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def _rows(
    tokenizer,
    token_ids: list[int],
    records: list,
    previous,
    room: int | None,
    ended: bool = False,
    pieces: list[str] | None = None,
) -> list:
    """`_logprob_rows` of `token_ids` (with their TokenLogprobs `records`, None for one without) after the tokens
    `previous`, their texts cut after `room` characters (None: not cut); the last keeps what its decode ends with
    where the text ends with them (`ended`, or cut: a U+FFFD where they end inside a character). `pieces`: the
    tokens' texts where they are known (a string prompt's), else decoded."""
    skipped = skipped_ids(tokenizer)
    # The last PIECE_CONTEXT tokens before each that the answer's decode keeps (a run of special tokens, which it
    # skips, would leave no context, and a word-level decoder's space before the next word would be lost).
    context = [token for token in previous if token not in skipped][-PIECE_CONTEXT:]
    contexts = []
    for index in range(min(len(token_ids), len(records))):
        if index and token_ids[index - 1] not in skipped:
            context = [*context[1 - PIECE_CONTEXT :], token_ids[index - 1]]
        contexts.append(context)
    n = len(contexts)
    # Each context decoded, then with its token (unless its text is known), then with each alternative: in one call.
    with_tokens = [] if pieces is not None else [c + [t] for c, t in zip(contexts, token_ids)]
    alternatives = [(i, t) for i, record in enumerate(records[:n]) if record is not None for t, _ in record.top]
    texts = _decode_all(tokenizer, contexts + with_tokens + [contexts[i] + [t] for i, t in alternatives])
    before, with_token = texts[:n], texts[n : n + len(with_tokens)]
    with_alternative = iter(texts[n + len(with_tokens) :])
    final_index = n - 1 if room is not None or ended else None
    rows = []
    for index, (token_id, record) in enumerate(zip(token_ids, records)):
        if pieces is not None:
            piece = pieces[index]
        else:
            piece = _byte_piece(tokenizer, contexts[index], token_id, final=index == final_index)
            if piece is None:
                piece = _added(before[index], with_token[index], final=index == final_index)
        if piece is None:
            piece = _decode(tokenizer, [token_id])
        if room is not None:
            piece = piece[: max(room, 0)]
            room -= len(piece)
        top = None
        if record is not None:
            # the text each alternative would have added, or its own spelling where that is nothing (a special
            # token), so alternatives stay apart
            top = [
                (_added(before[index], next(with_alternative), final=True) or _spelling(tokenizer, t), lp)
                for t, lp in record.top
            ]
        rows.append((piece, record, top))
    return rows


def _spelling(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(tokenizer, generated) -> dict:
    """OpenAI's chat `logprobs` object: per generated token, its text (the pieces add up to the answer), log
    probability, UTF-8 bytes and the top alternatives."""
    content = [
        {**_token_entry(piece, record.logprob), "top_logprobs": [_token_entry(text, lp) for text, lp in top]}
        for piece, record, top in _logprob_rows(tokenizer, generated)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(tokenizer, generated) -> dict:
    """OpenAI's completions `logprobs` object: the generated tokens' texts (adding up to the completion), log
    probabilities, top alternatives ({text: log probability}) and character offsets in the completion. An answer
    that echoes its prompt starts with the prompt's tokens (the first one's log probability and alternatives null),
    its offsets counted from the prompt's start."""
    prompt, rows = _prompt_rows(tokenizer, generated), _logprob_rows(tokenizer, generated)
    offset = getattr(generated, "text_offset", 0)
    pieces = [piece for piece, _, _ in rows]
    prompt_offsets = itertools.accumulate((len(piece) for piece, _, _ in prompt), initial=0)
    offsets = itertools.accumulate((len(piece) for piece in pieces), initial=offset)
    return {
        "tokens": [piece for piece, _, _ in prompt] + pieces,
        "token_logprobs": [None if record is None else record.logprob for _, record, _ in prompt + rows],
        "top_logprobs": [None if top is None else dict(top) for _, _, top in prompt + rows],
        "text_offset": list(prompt_offsets)[: len(prompt)] + list(offsets)[: len(pieces)],
    }


def _samples(gen_config) -> list:
    """One generation config per sample of the request (its `best_of`, else its `n`): itself for one, else copies
    whose options carry one sample and its seed; samples ranked for best_of record their tokens' log probabilities
    (the answer shows them only where the request asked)."""
    options = getattr(gen_config, OPTIONS_ATTRIBUTE, None)
    if options is None or options.best_of == options.n == 1:
        return [gen_config]
    logprobs = options.logprobs if options.best_of == options.n or options.logprobs is not None else 0
    samples = []
    for index in range(options.best_of):
        config = copy.deepcopy(gen_config)
        seed = None if options.seed is None else options.seed + index
        one = dataclasses.replace(options, n=1, best_of=1, seed=seed, logprobs=logprobs)
        setattr(config, OPTIONS_ATTRIBUTE, one)
        samples.append(config)
    return samples


def _mean_logprob(generated) -> float:
    """The mean log probability per token of an answer's tokens (best_of ranks samples by it; 0 for none)."""
    records = generated.logprobs[: len(generated)]
    return sum(record.logprob for record in records) / len(records) if records else 0.0


def _prompts(body) -> list | None:
    """A completions body's prompts where it gives a list of them (strings or lists of token ids), else None (one
    prompt, or a body the request check refuses)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_ids(p) for p in prompt):
        return prompt
    return None


async def _naming_prompt(index: int, handling):
    """`await handling`, where an error naming `prompt` names `prompt[index]`, in its param and its message's
    words: one of several prompts."""
    try:
        return await handling
    except InvalidRequest as error:
        if error.param == "prompt":
            error.param = f"prompt[{index}]"
            error.message = re.sub(r"\bprompt\b(?!\[)", error.param, error.message, count=1)
            error.args = (error.message,)
        raise


async def _merged_streams(streams: list, choices_per_stream: int = 1, one_prompt: bool = True):
    """The SSE chunks of several streams as one stream: stream i's choice j is choice i * `choices_per_stream` + j
    (one-choice streams: choice i), and the usage the streams end with comes once, summed, in a last chunk with no
    choices (as OpenAI's `n` streams end; the prompt's tokens counted once where every stream ran it,
    `one_prompt`). A client that goes away closes every stream (each aborts its Engine request)."""
    queue: asyncio.Queue = asyncio.Queue()
    usage: dict = {}

    async def pump(index: int, stream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        last = None
        remaining = len(streams)
        while remaining:
            index, chunk = await queue.get()
            if chunk is None:
                remaining -= 1
                continue
            for event in chunk.split("\n\n"):
                if not event.startswith("data: "):
                    continue
                data = _event_data(event)
                # an error event (transformers' are not always valid JSON): as it came
                if data is None or "choices" not in data:
                    yield event + "\n\n"
                    continue
                for choice in data["choices"]:
                    choice["index"] = index * choices_per_stream + (choice.get("index") or 0)
                for key, value in (data.pop("usage", None) or {}).items():
                    if isinstance(value, int):  # token counts
                        same = one_prompt and key == "prompt_tokens"  # the samples of one prompt: counted once
                        usage[key] = value if same else usage.get(key, 0) + value
                last = data
                if not data["choices"]:  # a stream's own usage chunk (one of several choices): counted above
                    continue
                yield f"data: {json.dumps(data)}\n\n"
        if usage and last is not None:
            usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            yield f"data: {json.dumps({**last, 'choices': [], 'usage': usage})}\n\n"
    finally:
        # A client gone, or the end: a stream still running is cancelled where it waits (its handler then cancels
        # its Engine request), and each is closed once no task runs it.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _first_tool_call_only(answer: dict) -> dict:
    """A chat answer to `parallel_tool_calls: false`: each choice's first tool call only, as vLLM keeps it (the
    model is not held to one, so the calls after it are dropped)."""
    choices = []
    for choice in answer.get("choices") or []:
        message = choice.get("message") or {}
        if len(message.get("tool_calls") or []) > 1:
            choice = {**choice, "message": {**message, "tool_calls": message["tool_calls"][:1]}}
        choices.append(choice)
    return {**answer, "choices": choices}


async def _first_tool_call_streamed(chunks):
    """A chat stream's answer to `parallel_tool_calls: false`: the chunks of each choice's tool calls after its first
    (delta `tool_calls` index >= 1; transformers' handler sends each call whole in one chunk) are dropped."""

    def kept(event: str, data: dict | None) -> str:
        choices = (data or {}).get("choices") or []
        calls = [call for choice in choices for call in (choice.get("delta") or {}).get("tool_calls") or []]
        return "" if calls and all(call.get("index", 0) >= 1 for call in calls) else event

    try:
        async for chunk in chunks:
            if events := _each_event(chunk, kept):
                yield events
    finally:
        await chunks.aclose()


async def _usage_as_asked(chunks, include_usage: bool):
    """A chat or completions stream's usage as OpenAI's API sends it: only with `stream_options.include_usage`, in a
    chunk of its own with no choices after the last one (transformers' handlers put it on the last choice chunk,
    asked or not)."""
    last, usage = None, None

    def without_usage(event: str, data: dict | None) -> str:
        nonlocal last, usage
        if data is None or "usage" not in data:
            return event
        usage = data.pop("usage") or usage
        last = data
        return f"data: {json.dumps(data)}" if data.get("choices") else ""  # "": a chunk that only carried the usage

    try:
        async for chunk in chunks:
            if events := _each_event(chunk, without_usage):
                yield events
        if include_usage and usage is not None and last is not None:
            yield f"data: {json.dumps({**last, 'choices': [], 'usage': usage})}\n\n"
    finally:
        await chunks.aclose()


def _event_data(event: str) -> dict | None:
    """An SSE event's JSON object, or None (an error event that is not JSON, a [DONE])."""
    if not event.startswith("data: {"):
        return None
    try:
        data = json.loads(event.removeprefix("data: "))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _each_event(chunk: str, rewrite) -> str:
    """A chunk of SSE events, each as `rewrite(event, data)` gives it (`data`: `_event_data(event)`; "" drops the
    event)."""
    events = (rewrite(event, _event_data(event)) for event in chunk.split("\n\n") if event)
    return "".join(f"{event}\n\n" for event in events if event)


async def _ending_with_done(chunks):
    try:
        async for chunk in chunks:
            yield chunk
        yield DONE
    finally:
        await chunks.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that closes its body iterator and cancels its Engine requests (`streams`, each a
    `RequestStream`) however the response ends.

    Starlette's leaves a body generator that a client's disconnect interrupted in `send()` (not inside the
    generator) suspended at its `yield`, closed only when garbage collection finds it; until then the handler's
    `streamer.cancel()` does not run, and the Engine request goes on to its last token. Closing it raises
    GeneratorExit there at once. A body that never started (the client gone before the response's first `send`
    returned, or before starlette ran the body's task) runs no code when closed, so its Engine requests are cancelled
    here; cancelling one that has finished does nothing."""

    streams: tuple = ()

    @classmethod
    def like(cls, response: StreamingResponse, body_iterator, streams: list = ()) -> ClosingStreamingResponse:
        closing = cls(body_iterator, status_code=response.status_code, background=response.background)
        closing.media_type, closing.raw_headers = response.media_type, response.raw_headers
        closing.streams = tuple(streams)
        return closing

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            try:
                if close is not None:
                    await close()
            finally:
                for stream in self.streams:
                    stream.cancel()


class PagedChatCompletionHandler(RequestOptionsMixin, ChoicesMixin, ChatCompletionHandler):
    """`/v1/chat/completions`."""

    endpoint = CHAT


class PromptMixin:
    """A completions prompt as OpenAI's and vLLM's take it (put before `CompletionHandler` in the bases): token ids
    (`prompt: [1, 2, 3]`) run as they are, without the tokenizer (no special token added; an id past the model's
    vocabulary, its input embeddings' rows, is refused with 400 naming `prompt`), a string is the stock handler's;
    `echo: true` starts each choice's text with the prompt's (the string, or the ids decoded as the completion is),
    in one body and in each choice's first streamed chunk."""

    async def handle_request(self, body: dict, request_id: str):
        if not isinstance(body, dict):
            return await super().handle_request(body, request_id)
        prompt = body.get("prompt")
        if is_token_ids(prompt):
            response, prompt = await self._token_prompt(body, request_id)
        else:
            response = await super().handle_request(body, request_id)
        return _echoed(response, prompt) if body.get("echo") else response

    async def _token_prompt(self, body: dict, request_id: str):
        """transformers' CompletionHandler.handle_request with the ids for its tokenization of a string; with the
        prompt's text."""
        self._validate_request(body)
        model_id, model, processor = self._resolve_model(body)
        vocab_size = model.get_input_embeddings().num_embeddings
        prompt_ids = body["prompt"]
        if max(prompt_ids) >= vocab_size:
            raise InvalidRequest(
                f"prompt holds token id {max(prompt_ids)}, past this model's vocabulary of {vocab_size} ids (0 to "
                f"{vocab_size - 1})",
                "prompt",
            )
        modality = self.model_manager.get_model_modality(model, processor=processor)
        use_cb = self.generation_state.use_continuous_batching(model, modality)
        gen_manager = self.generation_state.get_manager(model_id, use_cb=use_cb)
        inputs = {"input_ids": list(prompt_ids), "attention_mask": [1] * len(prompt_ids)}
        gen_config = self._build_generation_config(body, model.generation_config, use_cb=use_cb)
        if use_cb:
            gen_manager.init_cb(model, gen_config)
        suffix = body.get("suffix")
        text = _decode(getattr(processor, "tokenizer", processor), prompt_ids) if body.get("echo") else None
        if body.get("stream"):
            response = self._streaming(request_id, model, processor, model_id, inputs, gen_config, gen_manager, suffix)
        else:
            response = await self._non_streaming(
                request_id, model, processor, model_id, inputs, gen_config, gen_manager, suffix
            )
        return response, text


def _echoed(response, prompt: str):
    """A completions answer with `prompt` before each choice's text (`echo`): in one body, or in the first chunk of
    each choice of a stream."""
    if isinstance(response, JSONResponse) and response.status_code == 200:
        answer = json.loads(response.body)
        answer["choices"] = [{**choice, "text": prompt + choice["text"]} for choice in answer["choices"]]
        return JSONResponse(answer, media_type="application/json")
    if not isinstance(response, StreamingResponse):
        return response
    seen: set[int] = set()

    def first_with_prompt(event: str, data: dict | None) -> str:
        if data is None or not data.get("choices"):
            return event
        for choice in data["choices"]:
            if choice.get("index", 0) not in seen and isinstance(choice.get("text"), str):
                seen.add(choice.get("index", 0))
                choice["text"] = prompt + choice["text"]
        return f"data: {json.dumps(data)}"

    async def chunks(inner):
        try:
            async for chunk in inner:
                yield _each_event(chunk, first_with_prompt)
        finally:
            await inner.aclose()

    return StreamingResponse(chunks(response.body_iterator), media_type=response.media_type)


class PagedCompletionHandler(RequestOptionsMixin, ChoicesMixin, PromptMixin, CompletionHandler):
    """`/v1/completions`."""

    endpoint = COMPLETIONS


class PagedResponseHandler(RequestOptionsMixin, ResponseHandler):
    """`/v1/responses`. A request that does not set `stream` gets one JSON response, as OpenAI's API says (the
    stock handler streams it). `include: ["message.output_text.logprobs"]` (with `top_logprobs`, 0-20) gives the
    message text's log probabilities: its `output_text` part's `logprobs` (OpenAI's entries: `token`, `logprob`,
    `bytes`, `top_logprobs`), and streamed each `response.output_text.delta`'s, of the tokens its text came from."""

    endpoint = RESPONSES
    _normalize_input = staticmethod(normalize_input)

    async def handle_request(self, body: dict, request_id: str):
        if isinstance(body, dict):  # a null field is one not given, as OpenAI reads it (the handler's defaults)
            body = {"stream": False, **{name: value for name, value in body.items() if value is not None}}
        return await super().handle_request(body, request_id)

    async def _non_streaming(self, request_id, model, processor, model_id, body, inputs, gen_config, gen_manager, **kw):
        recorder = _Recorder(gen_manager)

        def answer(reader, manager):
            return super(PagedResponseHandler, self)._non_streaming(
                request_id, model, reader, model_id, body, inputs, gen_config, manager, **kw
            )

        response, processor = await read_unparsed_on_failure(processor, model, recorder, answer)
        answer = _as_requested(json.loads(response.body), body)
        options = getattr(gen_config, OPTIONS_ATTRIBUTE, None)
        if options is not None and options.logprobs is not None:
            tokenizer = getattr(processor, "tokenizer", processor)
            rows = _logprob_rows(tokenizer, recorder.generated)
            parser = build_response_parser(processor, model, inputs["input_ids"], tools=kw.get("tools"))
            if parser is not None:  # the tokens of the content the parser finds, as a stream would place them
                rows = parsed_content_rows(tokenizer, parser, recorder.generated, rows, _message_text(answer))
            answer["output"] = _with_logprobs(answer.get("output") or [], rows)
        return JSONResponse(_incomplete(answer) if recorder.generated.finish_reason == "length" else answer)

    def _streaming(self, request_id, model, processor, model_id, body, inputs, gen_config, gen_manager, **kw):
        recorder = _Recorder(gen_manager)
        response = super()._streaming(request_id, model, processor, model_id, body, inputs, gen_config, recorder, **kw)
        events = _response_events(response.body_iterator, recorder, body)
        return StreamingResponse(events, media_type=response.media_type)


# The request's settings a response echoes, as OpenAI's does (transformers' says tools [], tool_choice "auto" and
# parallel_tool_calls false whatever the request gave), and what each is when the request gives none.
ECHOED_FIELDS = {
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "metadata": None,
    "parallel_tool_calls": True,
    "reasoning": None,
    "temperature": None,
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "truncation": "disabled",
}


def _as_requested(response: dict, body: dict) -> dict:
    """A Responses API response (any event's `response`) with the request's settings (`ECHOED_FIELDS`)."""
    echoed = {name: body[name] if body.get(name) is not None else default for name, default in ECHOED_FIELDS.items()}
    answer = {**response, **{name: value for name, value in echoed.items() if value is not None}}
    if body.get("parallel_tool_calls") is False and isinstance(answer.get("output"), list):
        answer["output"] = _first_function_call_only(answer["output"])
    return answer


def _first_function_call_only(items: list) -> list:
    """A response's output items under `parallel_tool_calls: false`: its first function call only, as chat's
    (`_first_tool_call_only`)."""
    calls = itertools.count()
    return [item for item in items if not (_is_function_call(item) and next(calls) >= 1)]


def _is_function_call(item) -> bool:
    return isinstance(item, dict) and item.get("type") == "function_call"


# Why a response cut short is "incomplete" (OpenAI's `incomplete_details.reason`): the Engine's finish reason
# "length" is max_output_tokens reached, or the model's context (max_output_tokens was fitted to it).
INCOMPLETE_REASON = "max_output_tokens"


def _incomplete(response: dict) -> dict:
    """A Responses API response cut by max_output_tokens, as OpenAI's says it: status "incomplete" with
    `incomplete_details`, its message "incomplete" too (its tool calls, whole when parsed, stay "completed")."""
    output = [_incomplete_item(item) for item in response.get("output") or []]
    return {**response, "status": "incomplete", "incomplete_details": {"reason": INCOMPLETE_REASON}, "output": output}


def _incomplete_item(item: dict) -> dict:
    return {**item, "status": "incomplete"} if item.get("type") == "message" else item


def parsed_content_rows(tokenizer, parser, generated: GeneratedIds, rows: list, text: str) -> list:
    """The `rows` (`_logprob_rows`' of the whole answer `generated`) of a one-body response's message `text`, the
    content `parser` (a fresh `ResponseParser`) reads in the answer: its regions' tokens (`parsed_content_tokens`,
    `_answered_content`), without whitespace at the ends that transformers' parse strips from the text, then the tail
    of an answer a stop string cut (the stop string's tokens, kept whole with the text before them, as a stream
    sends them)."""
    regions, tail = parsed_content_tokens(tokenizer, parser, list(generated), generated.parse_text)
    kept = set(_answered_content(regions, text))
    content_rows = [row for index, row in enumerate(rows) if index in kept]
    stopped = generated.parse_text is not None
    return _stripped(content_rows, text, end=not stopped) + [rows[index] for index in tail]


def _answered_content(regions: list[tuple[list[int], str]], text: str) -> list[int]:
    """The tokens of the content regions (`parsed_content_tokens`') that a one-body response's message `text` is: all
    of them, or the last one's where the text is that region's alone (transformers' parse of a content, a tool call,
    then content again keeps the last)."""
    text, whole = text.strip(), "".join(region_text for _, region_text in regions).strip()
    if len(regions) > 1 and regions[-1][1].strip() == text != whole:
        return regions[-1][0]
    return [index for indices, _ in regions for index in indices]


def _message_text(answer: dict) -> str:
    """A Responses API body's message text (its output_text parts')."""
    return "".join(
        part.get("text") or ""
        for item in answer.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


def _stripped(rows: list, text: str, end: bool = True) -> list:
    """`rows` without those of whitespace alone at either end (at its start only, unless `end`) where `text` has none
    there (transformers strips a parsed content: the "\n\n" after a reasoning's close)."""
    start, stop = 0, len(rows)
    while start < stop and rows[start][0].isspace() and not text[:1].isspace():
        start += 1
    while end and stop > start and rows[stop - 1][0].isspace() and not text[-1:].isspace():
        stop -= 1
    return rows[start:stop]


def _with_logprobs(output: list, rows: list) -> list:
    """A Responses API output's message items with their `output_text` parts' log probabilities, the `rows`
    (`_logprob_rows`') of the message's text (a message closed and opened again around a tool call holds the whole
    text again, as transformers' stream builder gives it)."""
    return [
        {**item, "content": [_part_with_logprobs(part, rows) for part in item["content"]]}
        if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), list)
        else item
        for item in output
    ]


def _part_with_logprobs(part, rows: list):
    if not isinstance(part, dict) or part.get("type") != "output_text":
        return part
    return {**part, "logprobs": [_response_logprob(row) for row in rows]}


def _response_logprob(row, with_bytes: bool = True) -> dict:
    """A Responses API log probability entry of a row (`_logprob_rows`'): an `output_text` part's, with each text's
    UTF-8 `bytes`, or a `response.output_text.delta`'s, without."""

    def entry(text: str, logprob: float) -> dict:
        return _token_entry(text, logprob) if with_bytes else {"token": text, "logprob": logprob}

    piece, record, top = row
    return {**entry(piece, record.logprob), "top_logprobs": [entry(text, lp) for text, lp in top]}


async def _response_events(chunks, recorder: _Recorder, body: dict):
    """A Responses API stream, each event's `response` with the request's settings (`_as_requested`); where
    max_output_tokens cut the request, its message's `response.output_item.done` says "incomplete" and it ends with
    `response.incomplete` (transformers' says `response.completed` whatever ended it). The finish reason is known
    before those last events, which follow the request's end. Under `parallel_tool_calls: false` the events of the
    function calls after the first are dropped (each call's events name its item id), and the events after them
    numbered on without gaps: each `sequence_number` less the events dropped before it, each `output_index` less
    the items dropped before that index."""
    one_call, calls, dropped = body.get("parallel_tool_calls") is False, 0, set()
    dropped_events, dropped_indices = 0, []  # the events dropped so far; the output indices of the items dropped
    given = []  # the log probability rows the message's text deltas have carried (content_logprobs)

    def as_asked(event: str, data: dict | None) -> str:
        nonlocal calls, dropped_events
        if data is None:
            return event
        if recorder.stream is not None and recorder.stream.content_logprobs:
            data = with_logprobs(data, recorder.stream)
        item = data.get("item")
        if one_call and data.get("type") == "response.output_item.added" and _is_function_call(item):
            calls += 1
            if calls > 1:
                dropped.add(item.get("id"))
                if is_int(data.get("output_index")):
                    dropped_indices.append(data["output_index"])
        if dropped and (data.get("item_id") in dropped or (_is_function_call(item) and item.get("id") in dropped)):
            dropped_events += 1
            return ""
        if dropped_events and is_int(data.get("sequence_number")):
            data = {**data, "sequence_number": data["sequence_number"] - dropped_events}
        if dropped_indices and is_int(data.get("output_index")):
            index = data["output_index"]
            data = {**data, "output_index": index - sum(gone < index for gone in dropped_indices)}
        if isinstance(data.get("response"), dict):
            data = {**data, "response": _as_requested(data["response"], body)}
        stream = recorder.stream
        if stream is not None and stream.finish_reason == "length":
            if data.get("type") == "response.completed":
                data = {**data, "type": "response.incomplete", "response": _incomplete(data["response"])}
            elif data.get("type") == "response.output_item.done":
                data = {**data, "item": _incomplete_item(data["item"])}
        return f"data: {json.dumps(data)}"

    def with_logprobs(data: dict, stream) -> dict:
        """The event with the message text's log probabilities: a delta's, those of the tokens its text came from
        (the stream's `content_logprobs_queue`, one entry per delta, in order); the text's, part's, item's and
        response's once done, all the deltas' so far (and the stream's tail, tokens of no text after them)."""
        kind = data.get("type")
        if kind == "response.output_text.delta":
            queued = stream.content_logprobs_queue
            rows = _logprob_rows(stream.logprob_tokenizer, queued.popleft() if queued else GeneratedIds([]))
            given.extend(rows)
            return {**data, "logprobs": [_response_logprob(row, with_bytes=False) for row in rows]}
        if kind == "response.output_text.done":
            if stream.content_logprobs_tail is not None:  # tokens after the last delta's, with empty text
                given.extend(_logprob_rows(stream.logprob_tokenizer, stream.content_logprobs_tail))
                stream.content_logprobs_tail = None
            return {**data, "logprobs": [_response_logprob(row) for row in given]}
        if kind in ("response.content_part.added", "response.content_part.done"):  # an added part has no text yet
            return {**data, "part": _part_with_logprobs(data.get("part"), given if kind.endswith("done") else [])}
        if kind in ("response.output_item.added", "response.output_item.done"):
            rows = given if kind.endswith("done") else []
            return {**data, "item": _with_logprobs([data.get("item")], rows)[0]}
        response = data.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            return {**data, "response": {**response, "output": _with_logprobs(response["output"], given)}}
        return data

    try:
        async for chunk in chunks:
            yield _each_event(chunk, as_asked)
    finally:
        await chunks.aclose()
