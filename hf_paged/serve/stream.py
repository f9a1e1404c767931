"""One request's way back from the Engine thread to its HTTP handler.

The Engine thread hands each step's new tokens to the request's `RequestStream` on the event loop
(`loop.call_soon_threadsafe(stream.deliver, ...)`); the stream decodes them (tokenizers' `DecodeStream`, one token at
a time), applies the request's stop strings, and feeds the handler: an `asyncio.Queue` of text pieces ending in None
for a streaming request, a future of the generated ids for the others. It is also the handler's streamer:
`total_tokens`, and `cancel()` when the client goes away.

Stop strings: text that might be the start of a stop string is held back until the next tokens show it is not; when
one appears, the text before it is sent, the stream ends, and the Engine request is aborted (so the stop string and
what follows are never sent).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import re
import time
from collections.abc import Callable

from tokenizers.decoders import DecodeStream
from transformers.cli.serving.utils import ReasoningText, _StreamError, response_events_to_chunks

from ..errors import InvalidRequest

logger = logging.getLogger(__name__)

# Tokens before a piece that its decode is taken after: enough for a tokenizer's merges and spaces at the boundary.
PIECE_CONTEXT = 8
# What a decode ends with where its last token ends inside a UTF-8 character.
REPLACEMENT = "\ufffd"
# A ByteFallback tokenizer's byte token (SentencePiece's spelling of a byte outside its vocabulary).
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def overlaps(start: int, end: int, first: int, last: int) -> bool:
    """Whether a token whose text is [start, end) of a text belongs to the part [first, last) of it: its text overlaps
    the part, or it adds no text (a byte that begins a character, a special token skipped) where the part starts or
    inside it."""
    return (start < last and end > first) if start < end else first <= start < last or start == first == last


def unfinished_cut(text: str) -> str:
    """`text` without the U+FFFD a decode ends with where its last bytes begin a character: one from a lossy UTF-8
    decode of an unfinished sequence, up to three from a ByteFallback decoder, one per byte (any before them are the
    answer's)."""
    cut = len(text[-3:]) - len(text[-3:].rstrip(REPLACEMENT))  # up to 3: the bytes an unfinished character has
    return text[: len(text) - cut]  # a ByteFallback decoder spells each unfinished byte as one


def cleans_up_spaces(tokenizer) -> bool:
    """Whether a transformers tokenizer's decode cleans up spaces after its Rust decoder's (" ," -> ",",
    `clean_up_tokenization_spaces`; transformers skips it for a BPE model unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return forced or backend is None or type(backend.model).__name__ != "BPE"


def parsed_position(position: int, answer_ends: list[int], parsed_ends: list[int]) -> int:
    """Where `position` of an answer's text (special tokens skipped) is in the text a response parser reads (special
    tokens kept), token i's texts ending at `answer_ends[i]` and `parsed_ends[i]` of them: as far into the token
    whose answer text holds it as it is into that text (the special tokens before the token kept, up to the token's
    end)."""
    index = bisect.bisect_right(answer_ends, position)  # the first token whose answer text ends past it
    if index == len(answer_ends):
        return parsed_ends[-1] if parsed_ends else 0
    answer_start, parsed_start = (answer_ends[index - 1], parsed_ends[index - 1]) if index else (0, 0)
    return min(parsed_start + position - answer_start, parsed_ends[index])


def skipped_ids(tokenizer) -> frozenset[int]:
    """The special token ids a decode with `skip_special_tokens=True` leaves out (a transformers tokenizer's, or a
    `tokenizers.Tokenizer`'s special added tokens)."""
    if hasattr(tokenizer, "all_special_ids"):
        return frozenset(tokenizer.all_special_ids)
    return frozenset(index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special)


class GeneratedIds(list):
    """Generated token ids (what transformers' handlers take), with the `TokenLogprob` of each when the request asked
    for log probabilities (`logprobs`, else empty), and the tokens before them that their text is decoded after
    (`previous`: a streamed piece's, the request's tokens before it; an answer that continues its prompt's text, the
    prompt's last ones, see `RequestStream`). A streamed piece's also carry where their text starts in the answer
    (`text_offset`); once the answer has ended, where its text ends (`text_end`: the tokens' texts are cut there, at a
    stop string). A whole answer's also carry why it ended (`finish_reason`: the Engine's "stop" or "length", "stop"
    for a stop string), and where a stop string cut it, its text with special tokens cut there (`parse_text`).

    An answer that echoes its prompt with log probabilities (completions' `echo` with `logprobs`) starts with the
    prompt's tokens (`prompt_ids`) and their `TokenLogprob`s (`prompt_logprobs`, entry i prompt token i + 1's: the
    first has none), carried by the whole answer or its first streamed piece, with the string the answer starts
    with when the prompt was one (`prompt_text`); its offsets then count the prompt's text (that string, else its ids
    decoded) before the generated text."""

    def __init__(
        self,
        token_ids,
        logprobs=(),
        previous=(),
        text_offset: int = 0,
        text_end: int | None = None,
        finish_reason: str | None = None,
        prompt_ids=(),
        prompt_logprobs: list | None = None,
        prompt_text: str | None = None,
        parse_text: str | None = None,
    ):
        super().__init__(token_ids)
        self.logprobs = list(logprobs)
        self.finish_reason = finish_reason
        self.previous, self.text_offset = list(previous), text_offset
        self.text_end = text_end  # where the answer's text ends (a stop string cut it), when known
        self.prompt_ids, self.prompt_logprobs = list(prompt_ids), prompt_logprobs
        self.prompt_text = prompt_text  # the string prompt the answer starts with (else its ids decoded)
        # A whole answer a stop string cut: its text with special tokens, cut there, which a response parser reads
        # (`parsing.reading_cut_answers`) instead of decoding the ids again.
        self.parse_text = parse_text


# The last characters of a text cleaned up as transformers' `clean_up_tokenization` does that text still to come may
# change: its patterns span at most 4 characters (" n't", " 've"), and one replacement may make another (" ' " then
# " n't": ".! n ' t" -> ".!n't"), which the fifth covers.
CLEAN_UP_HOLD = 5


class IncrementalText:
    """The text each token adds to an answer's: tokenizers' `DecodeStream` after the tokens `prefix` ("" while a
    character is unfinished), and once it cannot continue (a ByteFallback run of bytes that begin no character changes
    the text before it, which tokenizers refuses) what the whole answer's decode (`whole`, of every token so far,
    without an unfinished character at its end) has grown past the text so far. `chars`: the text's length so far.

    `clean_up` (*optional*): the clean-up a transformers tokenizer's decode applies after its Rust decoder's
    (`clean_up_tokenization`: " ," -> ","), applied to the Rust decoder's text so far, whose last `CLEAN_UP_HOLD`
    characters wait for the text after them (`rest` gives them once the answer has ended); `whole` is such a decode
    already."""

    def __init__(
        self,
        tokenizer,
        prefix: list[int],
        skip_special_tokens: bool,
        whole: Callable[[list[int]], str],
        clean_up: Callable[[str], str] | None = None,
    ):
        self._tokenizer, self._whole, self._clean_up = tokenizer, whole, clean_up
        self._decoder: DecodeStream | None = DecodeStream(prefix, skip_special_tokens=skip_special_tokens)
        self._raw = ""  # with clean_up: the Rust decoder's text so far
        self.chars = 0

    def step(self, token_ids: list[int]) -> str:
        """The text the last of `token_ids` (every token of the answer so far) adds."""
        if self._decoder is not None:
            try:
                piece = self._decoder.step(self._tokenizer, token_ids[-1]) or ""
            except Exception:  # tokenizers raises a bare Exception ("Invalid prefix encountered while decoding")
                self._decoder = None
            else:
                if self._clean_up is None:
                    self.chars += len(piece)
                    return piece
                self._raw += piece
        return self._past(self._text(token_ids), hold=self._clean_up is not None)

    def rest(self, token_ids: list[int]) -> str:
        """The text held back for a clean-up, once the answer (`token_ids`) has ended ("" without a clean-up)."""
        return self._past(self._text(token_ids), hold=False) if self._clean_up is not None else ""

    def _text(self, token_ids: list[int]) -> str:
        if self._decoder is not None:
            return self._clean_up(self._raw)
        return unfinished_cut(self._whole(token_ids))

    def _past(self, text: str, hold: bool) -> str:
        """What `text`, the text so far (its last `CLEAN_UP_HOLD` characters held back with `hold`), has grown past
        the text given."""
        end = len(text) - CLEAN_UP_HOLD if hold else len(text)
        piece = text[self.chars : end]
        self.chars = max(self.chars, end)
        return piece


class ContentTokens:
    """Which tokens' text makes up the message content a response parser finds in an answer: the tokens' texts are
    spans of the text fed to the parser (`fed`; `token_ends`: its length after each token), and each piece the
    parser gives (its `region_chunk` events: content, reasoning, a tool call's raw text) is found there after the
    pieces before it (the markers between them are never given). A content piece takes the tokens not taken yet
    whose text overlaps it; a token whose text runs on past another piece is left to the content after it."""

    def __init__(self):
        self.fed = ""
        self.token_ends: list[int] = []
        self.next_token = 0  # the first token no piece has passed
        self._placed = 0  # where the last piece found ends in `fed`
        self._clean = (0, 0)  # (_placed, next_token) after the last piece that was not a tool call's raw text

    @property
    def placed(self) -> int:
        """Where the last piece found ends in the text fed."""
        return self._placed

    def rewind(self, start: int) -> None:
        """Go back to just after the last piece that was not a tool call's raw text, or to `start` in the text fed
        where that is later (the text after the last tool call read): the answer is read again from there without
        its tool calls (`parsing`), and a tool call's text is content."""
        self._placed, self.next_token = self._clean
        if start > self._placed:
            self._placed = start
            while self.next_token < len(self.token_ends) and self.token_ends[self.next_token] <= start:
                self.next_token += 1

    def parsed(self, events: list) -> list[list[int]]:
        """The tokens of each content piece among the parser's `events` (one list per piece that
        `response_events_to_chunks` makes a content item of), the other pieces passed over."""
        pieces = []
        for event in events:
            text = event.get("text") if event.get("type") == "region_chunk" else None
            if not text:
                continue
            content = event.get("field") == "content" and not event.get("dirty")
            taken = self.place(text, content)
            if not event.get("dirty"):
                self._clean = (self._placed, self.next_token)
            if content:
                pieces.append(taken)
        return pieces

    def place(self, piece: str, content: bool) -> list[int]:
        """Find `piece` in the text fed, after the pieces before it; a content piece's tokens (none where the parser
        changed the text, so that it is not found)."""
        start = self.fed.find(piece, self._placed)
        taken = []
        if start < 0:
            return taken
        end = self._placed = start + len(piece)
        while self.next_token < len(self.token_ends):
            index = self.next_token
            token_start, token_end = self.token_ends[index - 1] if index else 0, self.token_ends[index]
            if token_start >= end or (not content and token_end > end):
                break
            if content and overlaps(token_start, token_end, start, end):
                taken.append(index)
            self.next_token += 1
        return taken


def parsed_content_tokens(
    tokenizer, parser, token_ids: list[int], parse_text: str | None = None
) -> tuple[list[tuple[list[int], str]], list[int]]:
    """Per content region `parser` (a fresh `ResponseParser`) finds in `token_ids` (content, then a tool call, then
    content again: two), the indices of the tokens whose text makes it up, and its text: the one-body answer's; and
    of an answer a stop string cut, the content's tokens whose text the cut shortened (the stop string's) and, where
    the answer ended in its content, every token after its last piece: the tail, whose tokens the regions then leave
    out. The tokens' texts are fed to the parser one token at a time and its pieces placed among them
    (`ContentTokens`), as a stream of them is; of a cut answer only its text up to the cut (`parse_text`:
    `RequestStream.parse_text`'s), as a stream's parser reads it."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    content, regions = ContentTokens(), []  # the tokens' texts as the parser reads them: special tokens kept
    text = IncrementalText(backend, [], False, lambda ids: backend.decode(ids, skip_special_tokens=False))
    field = answer_field(parser.initial_events)  # the field of the parser's last piece of text
    cut = len(token_ids)  # the first token whose text the cut shortened

    def place(events: list) -> None:
        nonlocal field
        for event in events:
            if event.get("type") == "region_chunk" and event.get("text"):
                field = event.get("field")
            pieces = content.parsed([event])  # a content piece's tokens; reasoning, a tool call's text passed over
            if event.get("field") != "content":
                continue
            if event.get("type") == "region_open" or not regions:
                regions.append(([], ""))
            if pieces:
                indices, region_text = regions[-1]
                regions[-1] = (indices + pieces[0], region_text + event["text"])

    for index in range(len(token_ids)):
        piece = text.step(token_ids[: index + 1])
        if parse_text is not None and len(content.fed) + len(piece) > len(parse_text):  # text past the cut
            piece, cut = piece[: max(len(parse_text) - len(content.fed), 0)], min(cut, index)
        content.fed += piece
        content.token_ends.append(len(content.fed))
        try:
            place(parser.feed(piece))
        except (ValueError, RuntimeError):  # a structured region it cannot read (a tool call's JSON): no more
            return regions, []
    try:
        place(parser.finalize()[1])
    except (ValueError, RuntimeError):  # an answer cut inside a structured region
        return regions, []
    if parse_text is None:
        return regions, []
    tail = [index for index in regions[-1][0] if index >= cut] if regions else []
    if tail:
        regions[-1] = ([index for index in regions[-1][0] if index < cut], regions[-1][1])
    if field == "content":
        tail += range(content.next_token, len(token_ids))
    return regions, tail


def answer_field(initial_events: list) -> str:
    """The field a response parser writes an answer's text to before the answer's first piece: the one the prompt's
    prefill left open (a `<think>` the chat template wrote: the reasoning), else the content (where the text outside
    every region goes in transformers' response templates)."""
    field = "content"
    for event in initial_events:
        if event.get("type") == "region_open":
            field = event.get("field")
        elif event.get("type") == "region_close":
            field = "content"
    return field


def _past(sent: str, text: str) -> tuple[str, str]:
    """`text` (a piece of a reading of an answer) past the part of it that `sent` (the text of its kind sent so far
    from another reading) covers, and what of `sent` is left: where one continues the other, else matched without
    whitespace (a parser holds whitespace back at other places when it reads the text in other pieces); from where
    they differ, `text` is new."""
    if sent.startswith(text):
        return "", sent[len(text) :]
    if text.startswith(sent):
        return text[len(sent) :], ""
    i = j = 0
    while i < len(text) and j < len(sent):
        if sent[j].isspace():
            j += 1
        elif text[i].isspace():
            i += 1
        elif text[i] == sent[j]:
            i, j = i + 1, j + 1
        else:
            return text[i:], ""
    while j < len(sent) and sent[j].isspace():  # whitespace sent at the end: the same text's, where it has some
        j += 1
        if i < len(text) and text[i].isspace():
            i += 1
    return text[i:], sent[j:]


class LoggedText(str):
    """A streamed piece of text carrying the log probabilities of the tokens it brings (`generated`, a
    `GeneratedIds`), and the tokenizer that spells them; the handler adds them to the piece's chunk."""

    def __new__(cls, text: str, generated: GeneratedIds, tokenizer):
        piece = super().__new__(cls, text)
        piece.generated, piece.tokenizer = generated, tokenizer
        return piece


class LoggedReasoningText(LoggedText, ReasoningText):
    """A streamed piece of reasoning text (a chat answer's `reasoning_content`) carrying the log probabilities of
    the tokens it brings, as `LoggedText`."""


class RequestStream:
    """Args:
    loop: the event loop of the handler awaiting this request.
    prompt_ids (`list[int]`), max_new_tokens (`int`), sampling (`dict`): what the Engine runs
        (`Engine.add_request(prompt_ids, max_new_tokens, **sampling)`).
    tokenizer: the Rust tokenizer (`tokenizers.Tokenizer`), for incremental decoding.
    logprob_tokenizer (*optional*): the tokenizer the streamed log probabilities' token texts are spelled with (the
        handler's, which decodes the answer in one body: a transformers tokenizer may clean up spaces after the
        Rust one); default `tokenizer`.
    decode (`Callable[[list[int]], str]`): the whole-output decode a non-streaming answer uses (the handler's).
    stop_strings (`tuple[str, ...]`): text that ends the request; neither it nor what follows is sent.
    response_parser (*optional*): transformers' `ResponseParser` for streaming, as the handler built it.
    tool_call_fallback (`parsing.ToolCallFallback`, *optional*): how the answer is read on once `response_parser`
        cannot read a tool call in it (no JSON, or cut by `max_new_tokens`): the text fed so far (from the answer's
        start, or from the end of the last tool call read: its close marker) is read again by a parser whose template
        parses no tool calls, and what that gives past the reasoning and content already sent goes on, in its order.
        The call's text stays in the content, as in the answer in one body (where the tool calls before it are
        content too). Without it such an answer ends with an error (or, cut inside the call, without its text).
    streaming (`bool`): queue text pieces (True) or resolve `result` with the generated ids (False).
    on_cancel (`Callable[[RequestStream], None]`): stops the Engine request (a client gone, a stop string seen).
    generation_config (*optional*): the handler's config of the request. The handlers name the finish reason from
        the token count alone ("length" once `max_new_tokens` tokens came); a request that a stop token, eos or stop
        string ended on its last allowed token raises the config's `max_new_tokens` past that count when it ends, so
        its answer says "stop", as the Engine does.
    echoed_prompt (`str`, *optional*): the string prompt an answer with its prompt's log probabilities starts with
        (echo; token ids are decoded instead), whose length the offsets of its tokens' texts count.
    prompt_only (`bool`): the answer is the prompt alone (completions' `max_tokens` 0 with `echo`): the tokens the
        Engine request generates are left out, and it ends with "length" (with the prompt's log probabilities, when
        it records them).
    continues_prompt (`bool`): the text continues the prompt's (completions): it is decoded after the prompt's last
        `PIECE_CONTEXT` tokens that the decode keeps, so a token that spells its leading space inside it
        (SentencePiece's "▁Paris") or a word-level decoder's space before a word keeps it, as in the prompt and its
        answer decoded together (OpenAI's and vLLM's completions: " Paris" after "The capital of France is").
        Decoded alone, the first token would lose it. Not where those tokens' text ends inside a character (token
        ids cut in one): the text is then decoded alone.
    content_logprobs (`bool`): a stream (the Responses API's) whose log probabilities go with its content pieces:
        each content piece (a `response.output_text.delta`: what the parser gives as content, or every piece without
        a parser) takes the tokens whose text overlaps where the piece is in the text fed to the parser
        (`content_logprobs_queue`, one `GeneratedIds` per piece, in order; the tokens after the last piece, whose
        text is empty, in `content_logprobs_tail` once it has ended: without a parser, or where a stop string cut
        the content's last tokens away); the tokens of reasoning, tool calls and the markers around them go with
        none.
    """

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: dict,
        tokenizer,
        decode: Callable[[list[int]], str],
        stop_strings: tuple[str, ...],
        response_parser=None,
        tool_call_fallback=None,
        streaming: bool,
        on_cancel: Callable[[RequestStream], None],
        generation_config=None,
        prompt_only: bool = False,
        echoed_prompt: str | None = None,
        logprob_tokenizer=None,
        continues_prompt: bool = False,
        content_logprobs: bool = False,
    ):
        self.prompt_ids, self.max_new_tokens, self.sampling = prompt_ids, max_new_tokens, sampling
        self.streaming, self.prompt_only = streaming, prompt_only
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result: asyncio.Future = loop.create_future()
        self.token_ids: list[int] = []
        self.logprobs: list = []  # the TokenLogprobs of the tokens delivered (when the request asked for them)
        # The prompt tokens' TokenLogprobs (entry i: token i + 1's), delivered with the first tokens, when the request
        # records them (`sampling["prompt_logprobs"]`: an answer that echoes its prompt with log probabilities).
        self.prompt_logprobs: list | None = None
        self.total_tokens = 0
        # When the server took the request, and (Engine thread only) its queue time and last token's time.
        self.created = time.perf_counter()
        self.queue_time: float | None = None
        self.last_token_time: float | None = None
        # Read and written on the Engine thread only: the Engine's request id, and how many of its tokens went out.
        self.engine_id: int | None = None
        self.num_sent = 0
        self.stopped = False  # a stop string ended it
        self.finish_reason: str | None = None  # the Engine's ("stop", "length"), "stop" for a stop string
        self._generation_config = generation_config
        self._tokenizer, self._decode = tokenizer, decode
        self.logprob_tokenizer = tokenizer if logprob_tokenizer is None else logprob_tokenizer
        self._skipped = skipped_ids(self.logprob_tokenizer)
        # The prompt's last tokens the text is decoded after (continues_prompt), and their text.
        self.text_after: list[int] = []
        self._text_before = ""
        if continues_prompt and not cleans_up_spaces(self.logprob_tokenizer):
            self.text_after = self._text_context(prompt_ids)
            self._text_before = decode(self.text_after) if self.text_after else ""
            if self._text_before.endswith(REPLACEMENT):  # they end inside a character: the text is decoded alone
                self.text_after, self._text_before = [], ""
        clean_up = self.logprob_tokenizer.clean_up_tokenization if cleans_up_spaces(self.logprob_tokenizer) else None
        # A parsed stream decodes the text its parser reads: with special tokens (their markers).
        whole = self.decode_text if response_parser is None else self._parsed_decode
        self._text = IncrementalText(tokenizer, self.text_after, response_parser is None, whole, clean_up)
        self._stops = stop_strings
        # A parsed stream with stop strings finds them in the answer's text, without special tokens, as one body does
        # (`parse_text`): that text decoded beside, and its length after each token, which with the parser's text's
        # (`_token_ends`) places a stop string found in it in the text the parser reads (`parsed_position`).
        self._answer: IncrementalText | None = None
        if response_parser is not None and stop_strings and streaming:
            self._answer = IncrementalText(tokenizer, [], True, self.decode_text, clean_up)
        self._answer_text = ""
        self._answer_ends: list[int] = []
        self._answer_searched = 0  # the answer's text searched for stop strings so far
        self._min_answer_chars = 0  # the length of the answer's text of the first min_tokens tokens
        self._hold = max((len(stop) for stop in stop_strings), default=1) - 1
        self._parser, self._fallback = response_parser, tool_call_fallback
        # The parsed reasoning and content queued since the last tool call read, and where in the text fed the text
        # after that call starts (after its close marker; 0 before one): where `_parsed` reads again from.
        self._parsed_sent = {"reasoning": "", "content": ""}
        self._after_call = 0
        # the field of the parser's last piece of text (before the first, the one the prompt's prefill left open)
        self._last_field = answer_field(response_parser.initial_events) if response_parser is not None else None
        # content_logprobs: the content pieces' tokens, each piece's a GeneratedIds (read by the handler, in order),
        # found where each piece's text is among the tokens' (`ContentTokens`).
        self.content_logprobs = content_logprobs and streaming and sampling.get("logprobs") is not None
        self.content_logprobs_queue: collections.deque[GeneratedIds] = collections.deque()
        self.content_logprobs_tail: GeneratedIds | None = None  # without a parser: the tokens after the last piece
        self._content = ContentTokens()
        self._pending = ""  # decoded text not sent yet
        # A stream with stop strings and log probabilities or a parser: the decoded text's length after each token.
        # Text held back for a possible stop string is held from a token's start, so that a chunk brings whole
        # tokens' texts (a token whose text a stop string then cuts is sent cut, with the answer's end).
        self._token_ends: list[int] | None = (
            []
            if streaming and stop_strings and (sampling.get("logprobs") is not None or self._answer is not None)
            else None
        )
        self._unsent_logprobs: tuple[list, list] = ([], [])  # tokens and their TokenLogprobs not sent yet (stream)
        # The last PIECE_CONTEXT tokens whose TokenLogprobs went out that the answer's decode keeps (not the special
        # tokens it skips), which the next ones' texts are decoded after (stream); first the prompt's the text
        # continues.
        self._context: list[int] = list(self.text_after)
        # The length of the text of the tokens whose TokenLogprobs went out (stream; `_decoded_chars`: of all so far).
        self._logged_chars = 0
        self._min_chars = 0  # the length of the text of the first min_tokens tokens (a stop string ends after it)
        # The echoed prompt's text, before the generated text in the answer (the offsets of its tokens count it).
        self.echoed_prompt, self.echo_chars = echoed_prompt, 0
        if sampling.get("prompt_logprobs") is not None:
            self.echo_chars = len(echoed_prompt if echoed_prompt is not None else decode(prompt_ids))
        self._prompt_sent = False  # its TokenLogprobs went out with the first piece (stream)
        self._text_end: int | None = None  # the answer's length, once it has ended
        self._sent = ""  # text sent so far (plain text streams)
        self._closed = False
        self._on_cancel = on_cancel
        if self._parser is not None:
            self._queue_parsed(self._parser.initial_events)

    def _text_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last `PIECE_CONTEXT` tokens that the decode keeps, up to its last byte token (a ByteFallback
        tokenizer's `<0x0A>`: its decoder joins the bytes of a run, so bytes the answer starts with would change how
        the prompt's last ones decode)."""
        kept = [t for t in prompt_ids if t not in self._skipped][-PIECE_CONTEXT:]
        while kept and BYTE_TOKEN.fullmatch(self._tokenizer.id_to_token(kept[-1]) or ""):
            kept.pop()
        return kept

    @property
    def _decoded_chars(self) -> int:
        """The length of the text decoded so far (stream, or a request with stop strings)."""
        return self._text.chars

    def cancel(self) -> None:
        """The client went away: stop the Engine request (its blocks go back to the pool)."""
        if not self._closed:
            self._closed = True
            self.result.cancel()
            self._on_cancel(self)

    def deliver(
        self,
        token_ids: list[int],
        finished: bool,
        error: str | None = None,
        invalid: bool = False,
        logprobs: list | None = None,
        finish_reason: str | None = None,
        prompt_logprobs: list | None = None,
    ) -> None:
        """New tokens of the request, whether it has finished (`finish_reason`: the Engine's), and why it failed
        (`invalid`: it could never run); `logprobs`: their TokenLogprobs, when the request records them (a stream
        sends each with the first piece of text emitted at or after its token); `prompt_logprobs`: the prompt
        tokens', with its first tokens, when it records them.

        A failure to decode or parse them (a tokenizer's or parser's exception) ends the request with an error, in
        its stream or its result, and stops its Engine request: the handler never waits on a request that cannot
        go on."""
        running = not (finished or self._closed)  # its Engine request runs on
        try:
            self._receive(token_ids, finished, error, invalid, logprobs, finish_reason, prompt_logprobs)
        except Exception as failure:
            logger.exception("a request's tokens could not be decoded")
            self._fail(f"the answer could not be decoded: {failure!r}", invalid=False)
            if running:
                self._on_cancel(self)

    def _receive(
        self,
        token_ids: list[int],
        finished: bool,
        error: str | None,
        invalid: bool,
        logprobs: list | None,
        finish_reason: str | None,
        prompt_logprobs: list | None,
    ) -> None:
        if self._closed:
            return
        if self.prompt_only:
            token_ids, logprobs = [], None if logprobs is None else []
            finish_reason = "length"
        if finished:
            self.finish_reason = finish_reason
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        unsent = logprobs is not None and self.streaming and not self.content_logprobs
        for position, token_id in enumerate(token_ids):
            if unsent and position < len(logprobs):
                self._unsent_logprobs[0].append(token_id)
                self._unsent_logprobs[1].append(logprobs[position])
            self.token_ids.append(token_id)
            self.total_tokens += 1
            if self.streaming or self._stops:
                piece = self._text.step(self.token_ids)
                self._pending += piece
                if self._token_ends is not None:
                    self._token_ends.append(self._decoded_chars)
                if self.content_logprobs:
                    self._content.token_ends.append(self._decoded_chars)
                if self._answer is not None:
                    self._answer_text += self._answer.step(self.token_ids)
                    self._answer_ends.append(self._answer.chars)
                if len(self.token_ids) == self.sampling.get("min_tokens", 0):
                    self._min_chars = self._decoded_chars
                    self._min_answer_chars = len(self._answer_text)
            # No stop string before min_tokens (vLLM's rule): the sampler keeps stop tokens out until then too.
            if self._stops_allowed() and self._cut_at_stop():
                self.stopped, self.finish_reason = True, "stop"
                # The tokens delivered after this one (several come at once when the Engine ran ahead) are not the
                # answer's: neither are their log probabilities.
                del self.logprobs[len(self.token_ids) :]
                self._finish()
                self._on_cancel(self)  # the Engine request runs on otherwise
                return
            if not self.streaming:
                self._pending = self._pending[
                    max(len(self._pending) - self._hold, 0) :
                ]  # all a stop string can start in
        if error is not None:
            self._fail(error, invalid)
        elif finished:
            if (self.streaming or self._stops) and self._rest() and self._stops_allowed() and self._cut_at_stop():
                self.stopped, self.finish_reason = True, "stop"
            self._finish()
        elif self.streaming:
            cut = max(len(self._pending) - self._hold, 0)
            pending_start = self._decoded_chars - len(self._pending)
            if self._answer is not None:
                # up to the end of the tokens whose answer text ends before a stop string still to come can start
                safe = bisect.bisect_left(self._answer_ends, len(self._answer_text) - self._hold)
                cut = max((self._token_ends[safe - 1] if safe else 0) - pending_start, 0)
            elif self._token_ends is not None and cut < len(self._pending):
                # back to the start of the token the held text starts in
                fits = bisect.bisect_right(self._token_ends, pending_start + cut)  # tokens whose text ends by then
                boundary = self._token_ends[fits - 1] if fits else 0
                cut = max(boundary - pending_start, 0)
            text, self._pending = self._pending[:cut], self._pending[cut:]
            self._emit(text)

    def _stops_allowed(self) -> bool:
        return bool(self._stops) and len(self.token_ids) > self.sampling.get("min_tokens", 0)

    def _rest(self) -> bool:
        """Take in the text a clean-up held back (`IncrementalText.rest`) once the answer has ended: the last
        token's; whether there was some."""
        rest = self._text.rest(self.token_ids)
        if rest:
            self._pending += rest
            for ends in (self._token_ends, self._content.token_ends if self.content_logprobs else None):
                if ends:
                    ends[-1] = self._decoded_chars
        if self._answer is not None:
            answer_rest = self._answer.rest(self.token_ids)
            if answer_rest:
                self._answer_text += answer_rest
                self._answer_ends[-1] = self._answer.chars
                return True
        return bool(rest)

    def _cut_at_stop(self) -> bool:
        """Whether a stop string has appeared in the text not sent yet, ending after the text of the first
        `min_tokens` tokens (as `_final_text` finds it, however the tokens came); the text from it on is dropped."""
        pending_start = self._decoded_chars - len(self._pending)  # where the text not sent yet starts
        if self._answer is not None:  # found in the answer's text, cut where it is in the text the parser reads
            text, searched = self._answer_text, self._answer_searched
            self._answer_searched = len(text)
            starts = (max(searched, self._min_answer_chars) - len(stop) + 1 for stop in self._stops)
            found = [i for i in (text.find(stop, max(start, 0)) for stop, start in zip(self._stops, starts)) if i >= 0]
            if found:
                cut = parsed_position(min(found), self._answer_ends, self._token_ends)
                self._pending = self._pending[: max(cut - pending_start, 0)]
            return bool(found)
        positions = [
            i
            for i in (
                self._pending.find(stop, max(self._min_chars - pending_start - len(stop) + 1, 0))
                for stop in self._stops
            )
            if i >= 0
        ]
        if positions:
            self._pending = self._pending[: min(positions)]
        return bool(positions)

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._parser is None:
            if self.content_logprobs:  # no parser: every piece is the message's content
                self._content.fed += text
                self._queue_content(self._content.place(text, content=True))
            self.queue.put_nowait(text if self.content_logprobs else self._logged(text))
            self._sent += text
        else:
            self._content.fed += text
            self._queue_parsed(self._parsed(text))

    def _parsed(self, text: str | None) -> list:
        """The parser's events for `text` (None: the answer's end). Where it cannot read a tool call, the text fed
        since the last tool call it read (all of it before one) is read again by `tool_call_fallback`'s parser, which
        reads the rest: the events are then the reasoning and content that reading gives past those queued since
        (`_continued`)."""
        try:
            return self._parser.feed(text) if text is not None else self._parser.finalize()[1]
        except ValueError:
            if self._fallback is None:
                raise
            parser, self._fallback = self._fallback.parser(self._after_call == 0), None
            logger.warning("an answer's tool call could not be parsed; its text stays in the answer's content")
            self._parser = parser
            events = [*parser.initial_events, *parser.feed(self._content.fed[self._after_call :])]
            if text is None:
                events += parser.finalize()[1]
            self._content.rewind(self._after_call)
            return self._continued(events)

    def _continued(self, events: list) -> list:
        """`region_chunk` events of the reasoning and the content of `events`, in their order, without the text of
        each kind queued already (`_parsed_sent`, which they go on from; `_past`)."""
        sent, continued = dict(self._parsed_sent), []
        for item in response_events_to_chunks(events):
            if not isinstance(item, str):
                continue
            kind = "reasoning" if isinstance(item, ReasoningText) else "content"
            rest, sent[kind] = _past(sent[kind], item)
            if rest:
                field = "reasoning_content" if kind == "reasoning" else "content"
                continued.append({"type": "region_chunk", "field": field, "text": rest, "dirty": False})
        return continued

    def _queue_parsed(self, events: list) -> None:
        """The parser's `events` as queue items; with `content_logprobs`, each content piece's tokens queued beside."""
        logged = self.content_logprobs  # with content_logprobs the handler reads the queue beside, not the items
        for event in events:
            if event.get("type") == "region_chunk" and event.get("text"):
                self._last_field = event.get("field")
            for taken in self._content.parsed([event]):  # where each piece is in the text fed (`_parsed` reads on)
                if self.content_logprobs:
                    self._queue_content(taken)
            if event.get("type") == "region_close" and event.get("field") == "tool_calls":
                self._read_call()
            for item in response_events_to_chunks([event]):
                if isinstance(item, str):
                    self._parsed_sent["reasoning" if isinstance(item, ReasoningText) else "content"] += item
                if not logged and isinstance(item, str) and (self._unsent_logprobs[0] or self._prompt_unsent):
                    # the first text piece since the last one carries the tokens delivered until now (a tool call's
                    # tokens go with the next piece of text, or the stream's last chunk)
                    kind = LoggedReasoningText if isinstance(item, ReasoningText) else LoggedText
                    item, logged = self._logged(item, kind), True
                self.queue.put_nowait(item)

    def _read_call(self) -> None:
        """A tool call read: the text after it (from its close marker's end, after its text placed in the text fed)
        is where `_parsed` would read again from, and nothing after it has been sent."""
        self._parsed_sent = {"reasoning": "", "content": ""}
        fed, close = self._content.fed, self._fallback.call_close if self._fallback is not None else None
        found = close.search(fed, self._content.placed) if close is not None else None
        self._after_call = found.end() if found else len(fed)

    def _queue_content(self, indices: list[int]) -> None:
        """Queue a content piece's tokens (`indices` of the tokens delivered), with the tokens before them that their
        texts are decoded after."""
        indices = [index for index in indices if index < len(self.logprobs)]
        first = indices[0] if indices else self._content.next_token
        self.content_logprobs_queue.append(
            GeneratedIds(
                [self.token_ids[i] for i in indices],
                [self.logprobs[i] for i in indices],
                previous=self.token_ids[max(first - 4 * PIECE_CONTEXT, 0) : first],
                **self._final_ends(first),
            )
        )

    def _final_ends(self, first: int) -> dict:
        """`GeneratedIds` keywords that end the texts of the tokens from index `first` on where the answer ends (cut
        at a stop string, or inside a character: its U+FFFD, as in one body), for the pieces of a stream that has
        ended, read by a response parser or giving its message's pieces: its offsets count the text fed to the
        parser (special tokens kept), the tokens' texts are the answer's (skipped), so both ends are taken from the
        answer decoded. None while it runs (a plain stream's `_logged` has its own ends)."""
        if not self._closed or (self._parser is None and not self.content_logprobs):
            return {}
        return dict(text_offset=len(self.decode_text(self.token_ids[:first])), text_end=len(self._final_text()))

    def _final_text(self, decode: Callable[[list[int]], str] | None = None) -> str:
        """The whole output decoded at once (by `decode`, default `decode_text`), cut where a stop string ended the
        request: at the first one that ends after the text of its first `min_tokens` tokens (before them none counts,
        as `deliver` checks them)."""
        decode = self.decode_text if decode is None else decode
        text = decode(self.token_ids)
        if not self.stopped:
            return text
        min_tokens = self.sampling.get("min_tokens", 0)
        # the text of the first min_tokens tokens, without a character the next ones complete (as `_min_chars`)
        allowed = len(unfinished_cut(decode(self.token_ids[:min_tokens]))) if min_tokens else 0
        positions = [i for i in (text.find(stop, max(allowed - len(stop) + 1, 0)) for stop in self._stops) if i >= 0]
        return text[: min(positions)] if positions else text

    def parse_text(self) -> str | None:
        """What a response parser reads of an answer a stop string cut: its text with special tokens (as a stream's
        parser is fed), cut where the stop string is in the answer's text (without them, where it was found), as a
        parsed stream cuts it (`parsed_position`); None for one no stop string cut."""
        if not self.stopped:
            return None
        ids, position = self.token_ids, len(self._final_text())

        def answer_end(count: int) -> int:  # the answer's text's length after the first `count` tokens
            return len(unfinished_cut(self.decode_text(ids[:count])))

        def parsed_end(count: int) -> int:  # the parser's text's
            return len(unfinished_cut(self._parsed_decode(ids[:count])))

        # the first token whose answer text ends past the stop string's start (the lengths grow with the tokens)
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if answer_end(middle + 1) > position else (middle + 1, high)
        text = self._parsed_decode(ids)
        if low == len(ids):
            return text
        answer_ends, parsed_ends = [answer_end(low), answer_end(low + 1)], [parsed_end(low), parsed_end(low + 1)]
        return text[: parsed_position(position, answer_ends, parsed_ends)]

    def _parsed_decode(self, token_ids: list[int]) -> str:
        """The text of generated `token_ids` with special tokens, as a response parser reads it."""
        return self.logprob_tokenizer.decode(token_ids, skip_special_tokens=False)

    def decode_text(self, token_ids: list[int]) -> str:
        """The text of generated `token_ids` as the answer has it: decoded whole, after the prompt's last tokens where
        it continues the prompt (`continues_prompt`; alone where that decode does not start with theirs)."""
        if not self.text_after:
            return self._decode(token_ids)
        text = self._decode([*self.text_after, *token_ids])
        if text.startswith(self._text_before):
            return text[len(self._text_before) :]
        return self._decode(token_ids)

    def _finish(self) -> None:
        self._closed = True
        config = self._generation_config
        if self.finish_reason == "stop" and config is not None and config.max_new_tokens is not None:
            config.max_new_tokens = max(config.max_new_tokens, self.total_tokens + 1)  # see the class docstring
        if not self.streaming:
            if not self.result.done():
                self.result.set_result(self._final_text())
            return
        if self._parser is None:
            # The incremental decoder holds back a character whose bytes have not all come (a token that ends inside
            # one); the whole decode shows what the non-streamed answer ends with, so the stream ends the same.
            text = self._final_text()
            if text.startswith(self._sent):
                self._pending = text[len(self._sent) :]
            self._text_end = len(self._sent) + len(self._pending)
        self._emit(self._pending)
        self._pending = ""
        if self.content_logprobs and self._parser is None and self._content.next_token < len(self.logprobs):
            # tokens after the last piece whose text is empty (a special token): the message's too, with no delta
            self._queue_content(list(range(self._content.next_token, len(self.logprobs))))
            self.content_logprobs_tail = self.content_logprobs_queue.pop()
        if (self._unsent_logprobs[0] or self._prompt_unsent) and self._parser is None:
            # tokens whose text was empty (or only the prompt's, answered alone): a chunk of their own
            self.queue.put_nowait(self._logged(""))
        if self._parser is not None:
            try:
                events = self._parsed(None)
            except (ValueError, RuntimeError):  # stopped inside a structured region (a tool call cut by max_tokens)
                events = []
            self._queue_parsed(events)
            if self.content_logprobs and self.stopped and self._content.next_token < len(self.logprobs):
                # a stop string cut the text of the last tokens away: where the answer ended in its content, they are
                # the message's, with no delta (one body reads them as content, their text empty)
                if self._last_field == "content":
                    self._queue_content(list(range(self._content.next_token, len(self.logprobs))))
                    self.content_logprobs_tail = self.content_logprobs_queue.pop()
            if self._unsent_logprobs[0]:
                # tokens after the last piece of text (a tool call, the answer's end markers): a chunk of their own
                self.queue.put_nowait(self._logged(""))
        self.queue.put_nowait(None)

    def _logged(self, text: str, kind: type[LoggedText] = LoggedText) -> str:
        """`text`, carrying the log probabilities of the tokens not sent yet (a `kind`: `LoggedText`, or
        `LoggedReasoningText` for a parsed answer's reasoning) when there are some."""
        token_ids, logprobs = self._unsent_logprobs
        start, rest = len(self.token_ids) - len(token_ids), ([], [])  # the first one's index; those left unsent
        if self._token_ends is not None and not self._closed:
            # only the tokens whose text is sent (not those of the text held for a possible stop string)
            sent = max(bisect.bisect_right(self._token_ends, self._decoded_chars - len(self._pending)) - start, 0)
            token_ids, logprobs, rest = token_ids[:sent], logprobs[:sent], (token_ids[sent:], logprobs[sent:])
        if not (token_ids or self._prompt_unsent):
            return text
        self._unsent_logprobs = rest
        # Where their text starts in the answer: the length of the text of the tokens before them, which were every
        # token delivered at the last call (a piece goes out after its tokens are decoded).
        first = self._prompt_unsent
        self._prompt_sent = True
        ends = dict(
            text_offset=self.echo_chars + self._logged_chars,
            text_end=None if self._text_end is None else self.echo_chars + self._text_end,
        )
        generated = GeneratedIds(
            token_ids,
            logprobs,
            previous=self._context,
            **(ends | self._final_ends(start)),
            **(self.prompt_fields() if first else {}),
        )
        self._context = [*self._context, *(t for t in token_ids if t not in self._skipped)][-PIECE_CONTEXT:]
        if rest[0]:  # the text of the tokens logged ends where the first one left starts
            self._logged_chars = self._token_ends[start + len(token_ids) - 1] if token_ids else self._logged_chars
        else:
            self._logged_chars = self._decoded_chars
        return kind(text, generated, self.logprob_tokenizer)

    def prompt_fields(self) -> dict:
        """The `GeneratedIds` keywords of the prompt an answer echoes with its log probabilities, once they have come
        (none before, or where the request records none)."""
        if self.prompt_logprobs is None:
            return {}
        return dict(prompt_ids=self.prompt_ids, prompt_logprobs=self.prompt_logprobs, prompt_text=self.echoed_prompt)

    @property
    def _prompt_unsent(self) -> bool:
        """Whether the prompt's log probabilities have come and are still to go out (stream)."""
        return self.prompt_logprobs is not None and not self._prompt_sent

    def _fail(self, error: str, invalid: bool) -> None:
        self._closed = True
        if self.streaming:
            self.queue.put_nowait(_StreamError(error))
        elif not self.result.done():
            self.result.set_exception(InvalidRequest(error) if invalid else RuntimeError(error))
