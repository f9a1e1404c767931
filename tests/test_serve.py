"""`hf-paged serve` end to end: the real server in a subprocess on 127.0.0.1, driven with the `openai` client.

One server for the module: a tiny random-weight Llama saved with `save_pretrained`, a word-level tokenizer trained
here on a few sentences (with a chat template), and a pool of 64 blocks of 16 tokens, smaller than the model's
positions so both limits can be hit. Greedy outputs are compared with `generate()` on the same saved model.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai", reason="hf-paged serve needs the `serve` extra")
pytest.importorskip("fastapi", reason="hf-paged serve needs the `serve` extra")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a paged cache keeps the keys and values of every request in blocks",
    "system : you are a helpful assistant who answers in short sentences",
    "user : hello world , what is a block table ?",
    "assistant : it maps the positions of a sequence to blocks of the pool",
    "many requests share one pool and a shared prompt is computed once",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
SYSTEM_PROMPT = " ".join(SENTENCES[:3] * 2)  # about 60 tokens: the prefix every concurrent stream shares
MAX_POSITIONS = 2048
NUM_BLOCKS, BLOCK_SIZE = 64, 16  # the pool holds 1024 tokens of one request
BYTES_PER_BLOCK = 2 * BLOCK_SIZE * 4 * 2 * (2 * 16)  # K and V, float32, 2 layers of 2 kv heads x head_dim 16
STARTUP_TIMEOUT_S = 90


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        SENTENCES, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model_dir: str, port: int, log_path: str):
        self.model_dir, self.port, self.log_path = model_dir, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        """A client for one `asyncio.run` (its connections belong to that event loop)."""
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def metrics_while_streaming(self, prompts: list[str]) -> dict[str, float]:
        """Metrics read while one stream per prompt (no max_tokens, eos ignored) has started, the streams closed after;
        `hf_paged_requests_running` is the most seen at once, read every few milliseconds from the sends on (on a
        busy machine a stream can run to the pool's limit before its client has read every first chunk). The
        requests are sent at once: sent one after the other, the first could grow past what admission keeps for the
        last (a slow client) and the last would wait."""
        peak = {"running": 0.0}

        async def watch(done: asyncio.Event) -> None:
            while not done.is_set():
                metrics = await asyncio.to_thread(self.metrics)
                peak["running"] = max(peak["running"], metrics["hf_paged_requests_running"])
                await asyncio.sleep(0.005)

        async def streaming() -> dict[str, float]:
            done = asyncio.Event()
            watcher = asyncio.ensure_future(watch(done))
            try:
                metrics = await started()
            finally:
                done.set()
                await watcher
            return {**metrics, "hf_paged_requests_running": max(peak["running"], metrics["hf_paged_requests_running"])}

        async def started() -> dict[str, float]:
            client = self.async_client()
            streams = await asyncio.gather(
                *(
                    client.completions.create(
                        model=self.model_dir, prompt=prompt, stream=True, extra_body={"ignore_eos": True}
                    )
                    for prompt in prompts
                )
            )
            try:
                for stream in streams:  # every one has started; none may end before (ignore_eos)
                    await stream.__anext__()
                return self.metrics()
            finally:
                for stream in streams:
                    await stream.close()
                await client.close()

        return asyncio.run(streaming())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return {
            name: float(value)
            for name, value in (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        }

    def wait_idle(self, timeout_s: float = 20) -> dict[str, float]:
        """Metrics once nothing runs and no block is held."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            idle = metrics["hf_paged_requests_running"] == metrics["hf_paged_requests_waiting"] == 0
            if (idle and metrics["hf_paged_kv_blocks_used"] == 0) or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)

    def wait_count(self, name: str, value: float, timeout_s: float = 5) -> dict[str, float]:
        """Metrics once the counter `name` reaches `value` (the Engine thread publishes them after it drains its
        inbox, so a request just cancelled may not be counted yet), then once idle."""
        deadline = time.monotonic() + timeout_s
        while self.metrics()[name] < value and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.wait_idle(timeout_s=timeout_s)

    def log(self) -> str:
        with open(self.log_path) as log:
            return log.read()[-4000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model directory, tokenizer, model) of the served model."""
    model_dir = tmp_path_factory.mktemp("serve_model")
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    tokenizer.save_pretrained(model_dir)
    model.save_pretrained(model_dir)
    return str(model_dir), tokenizer, model


def start_server(model_dir: str, log_path: str, arguments: list[str]) -> tuple[Server, subprocess.Popen]:
    """`hf-paged serve model_dir` in a subprocess on 127.0.0.1, once `/health` answers; stop it with `stop_server`."""
    server = Server(model_dir, free_port(), log_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "hf_paged", "serve", model_dir, "--host", "127.0.0.1", "--port", str(server.port)]
            + ["--block-size", str(BLOCK_SIZE), "--dtype", "float32", "--device", "cpu", *arguments],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if server.get("/health")[0] == 200:
                return server, process
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            pytest.fail(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log()}")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def server(saved, tmp_path_factory, request):
    log_path = str(tmp_path_factory.mktemp("serve_log") / "server.log")
    arguments = ["--max-memory", str(NUM_BLOCKS * BYTES_PER_BLOCK), "--max-num-seqs", "32"]
    server, process = start_server(saved[0], log_path, arguments)
    request.addfinalizer(lambda: stop_server(process))
    return server


def greedy_text(saved, prompt_ids: list[int], max_new_tokens: int) -> str:
    """generate()'s greedy tokens decoded alone (a chat answer's text)."""
    return saved[1].decode(greedy_ids(saved, prompt_ids, max_new_tokens), skip_special_tokens=True)


def greedy_completion(saved, prompt_ids: list[int], max_new_tokens: int) -> str:
    """generate()'s greedy tokens as a completion's text: what they add to the prompt's text, the two decoded together
    (the word-level decoder's space before the first word included)."""
    tokenizer = saved[1]
    before = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    text = tokenizer.decode([*prompt_ids, *greedy_ids(saved, prompt_ids, max_new_tokens)], skip_special_tokens=True)
    assert text.startswith(before)
    return text[len(before) :]


def greedy_ids(saved, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    _, tokenizer, model = saved
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server runs beside this process: one thread each keeps a small machine responsive
    try:
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, attention_mask=None
            )
    finally:
        torch.set_num_threads(num_threads)
    return output[0, len(prompt_ids) :].tolist()


def chat_ids(saved, messages: list[dict]) -> list[int]:
    return saved[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


JSON_HEADERS = {"Content-Type": "application/json"}


def post_json(server, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), JSON_HEADERS)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_metrics_and_health(server):
    assert server.get("/health") == (200, '{"status":"ok"}')
    assert f"hf-paged serve: {server.model_dir} on http://127.0.0.1:{server.port}/v1" in server.log()  # listening
    server.client.completions.create(model=server.model_dir, prompt="metrics after a request", max_tokens=3)
    status, text = server.get("/metrics")
    for name, kind in [
        ("hf_paged_requests_running", "gauge"),
        ("hf_paged_requests_waiting", "gauge"),
        ("hf_paged_kv_blocks_used", "gauge"),
        ("hf_paged_kv_blocks", "gauge"),
        ("hf_paged_prefix_cache_hit_tokens_total", "counter"),
        ("hf_paged_preemptions_total", "counter"),
        ("hf_paged_time_to_first_token_seconds", "histogram"),
        ("hf_paged_inter_token_latency_seconds", "histogram"),
        ("hf_paged_e2e_request_latency_seconds", "histogram"),
        ("hf_paged_request_queue_time_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text
    # `_total` only on counters (Prometheus' naming rule)
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert all(kind == "counter" for name, kind in types.items() if name.endswith("_total"))
    metrics = server.metrics()
    assert metrics["hf_paged_kv_blocks"] == NUM_BLOCKS
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        count = metrics[f"hf_paged_{name}_seconds_count"]
        assert count >= 1 and metrics[f'hf_paged_{name}_seconds_bucket{{le="+Inf"}}'] == count
        assert metrics[f"hf_paged_{name}_seconds_sum"] >= 0
    # 3 tokens: 2 gaps between tokens of that request (and of every earlier one)
    assert metrics["hf_paged_inter_token_latency_seconds_count"] >= 2
    buckets = [value for name, value in metrics.items() if name.startswith("hf_paged_time_to_first_token_seconds_b")]
    assert buckets == sorted(buckets)  # cumulative


def test_greedy_completion_equals_generate(server, saved):
    prompt = "the quick brown fox jumps over"
    expected = greedy_completion(saved, saved[1](prompt)["input_ids"], 12)
    response = server.client.completions.create(model=server.model_dir, prompt=prompt, max_tokens=12, temperature=0)
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 12
    stream = server.client.completions.create(
        model=server.model_dir, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected

    messages = [{"role": "user", "content": "hello world , what is a block table ?"}]
    expected = greedy_text(saved, chat_ids(saved, messages), 10)
    response = server.client.chat.completions.create(
        model=server.model_dir, messages=messages, max_tokens=10, temperature=0
    )
    assert response.choices[0].message.content == expected


def test_responses_api_equals_generate(server, saved):
    """`/v1/responses`: `instructions` become the system message, `input` the user's; greedy text as generate()'s,
    streamed or not."""
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is a block table ?"},
    ]
    expected = greedy_text(saved, chat_ids(saved, messages), 10)
    request = dict(
        model=server.model_dir,
        instructions=messages[0]["content"],
        input=messages[1]["content"],
        max_output_tokens=10,
        temperature=0,
    )
    response = server.client.responses.create(**request)
    assert response.output_text == expected
    assert response.usage.output_tokens == 10 and response.usage.input_tokens == len(chat_ids(saved, messages))
    stream = server.client.responses.create(**request, stream=True)
    deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected
    assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0


def test_a_multi_turn_chat_reuses_its_conversation(server, saved):
    """Each turn sends the whole conversation again: the earlier turns' full blocks come from the prefix cache, and
    every reply is generate()'s on the whole conversation."""
    messages, previous_ids = [{"role": "system", "content": SYSTEM_PROMPT}], []
    for question in ["hello world , what is a block table ?", "what is a paged cache ?", "and a shared prompt ?"]:
        messages.append({"role": "user", "content": question})
        prompt_ids = chat_ids(saved, messages)
        hits_before = server.metrics()["hf_paged_prefix_cache_hit_tokens_total"]
        response = server.client.chat.completions.create(
            model=server.model_dir, messages=messages, max_tokens=8, temperature=0
        )
        reply = response.choices[0].message.content
        assert reply == greedy_text(saved, prompt_ids, 8)
        hits = server.wait_idle()["hf_paged_prefix_cache_hit_tokens_total"] - hits_before
        if previous_ids:  # the previous turn's prompt starts this one: its full blocks are hits
            assert prompt_ids[: len(previous_ids)] == previous_ids
            assert hits >= len(previous_ids) // BLOCK_SIZE * BLOCK_SIZE > 0
        previous_ids = prompt_ids
        messages.append({"role": "assistant", "content": reply})


def test_concurrent_streams_share_the_system_prompt(server, saved):
    questions = [f"{word} what is a block table ?" for word in SENTENCES[0].split() + SENTENCES[1].split()][:20]
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    hits_before = server.metrics()["hf_paged_prefix_cache_hit_tokens_total"]

    async def one(client, messages):
        stream = await client.chat.completions.create(
            model=server.model_dir, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        pieces, reasons = [], []
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                reasons.append(chunk.choices[0].finish_reason)
        return "".join(pieces), reasons[-1]

    async def all_of_them():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, messages) for messages in conversations))

    results = asyncio.run(all_of_them())
    assert len(results) == 20
    for messages, (text, finish_reason) in zip(conversations, results):
        assert finish_reason == "length"
        assert text == greedy_text(saved, chat_ids(saved, messages), 8)
    metrics = server.wait_idle()
    system_blocks = len(chat_ids(saved, conversations[0][:1])) // BLOCK_SIZE
    # every stream but the first takes the system prompt's full blocks from the prefix cache
    assert metrics["hf_paged_prefix_cache_hit_tokens_total"] - hits_before >= 19 * system_blocks * BLOCK_SIZE
    assert metrics["hf_paged_requests_running"] == metrics["hf_paged_kv_blocks_used"] == 0


def test_seeds_reproduce_per_request(server):
    def sample(seed: int) -> str:
        response = server.client.completions.create(
            model=server.model_dir, prompt="many requests share one pool", max_tokens=16, temperature=1.0, seed=seed
        )
        return response.choices[0].text

    alone = sample(7)

    async def beside_others(client):
        async def other(seed):
            return await client.completions.create(
                model=server.model_dir,
                prompt="the lazy dog",
                max_tokens=24,
                temperature=1.0,
                seed=seed,
                extra_body={"top_k": 5},
            )

        others = [asyncio.create_task(other(seed)) for seed in range(4)]
        mine = await client.completions.create(
            model=server.model_dir, prompt="many requests share one pool", max_tokens=16, temperature=1.0, seed=7
        )
        await asyncio.gather(*others)
        return mine.choices[0].text

    async def run():
        async with server.async_client() as client:
            return await beside_others(client)

    assert asyncio.run(run()) == alone
    assert sample(8) != alone


def test_min_p_keeps_the_tokens_as_likely_as_the_most_likely_times_it(server, saved):
    """vLLM's `min_p` (and transformers' `generation_config.min_p`): min_p 1 keeps only the most likely token, so
    sampling at temperature 1 gives the greedy answer; without it the samples differ from it."""
    prompt = "the quick brown fox jumps over"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    expected = greedy_completion(saved, saved[1](prompt)["input_ids"], 12)
    for fields in ({"min_p": 1.0}, {"generation_config": {"min_p": 1.0}}):
        for seed in (1, 2):
            status, answer = post_json(server, "/v1/completions", body | fields | {"seed": seed})
            assert status == 200 and answer["choices"][0]["text"] == expected, (fields, answer)
    texts = {post_json(server, "/v1/completions", body | {"seed": seed})[1]["choices"][0]["text"] for seed in (1, 2)}
    assert texts != {expected}


@pytest.mark.parametrize(
    "kwargs, status, words",
    [
        ({"temperature": -0.5}, 400, "temperature"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"top_p": 0}, 400, "top_p"),
        ({"extra_body": {"top_k": -3}}, 400, "top_k"),
        ({"extra_body": {"min_p": 1.5}}, 400, "min_p"),
        ({"extra_body": {"generation_config": {"min_p": -0.1}}}, 400, "generation_config.min_p"),
        ({"extra_body": {"ignore_eos": "yes"}}, 400, "ignore_eos"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": -4}, 400, "max_tokens"),
        ({"max_tokens": 1021}, 400, "max_tokens"),  # 5 prompt tokens leave 1020 (the last token stores no K/V)
        ({"prompt": "the " * 1100}, 400, "pool"),  # more than the pool holds for one request
        ({"prompt": "the " * (MAX_POSITIONS + 10)}, 400, "max_position_embeddings"),  # more than the model positions
        ({"extra_body": {"no_such_field": 1}}, 400, "Unrecognized request argument supplied: no_such_field"),
        ({"seed": 2**64}, 400, "seed"),
        ({"seed": 2**64, "stream": True}, 400, "seed"),
        ({"seed": 2**64 - 1, "n": 2}, 400, f"the largest seed for n=2 is {2**64 - 2}"),
    ],
)
def test_bad_requests_fail_alone(server, kwargs, status, words):
    request = {"model": server.model_dir, "prompt": "the quick brown fox jumps", "max_tokens": 4} | kwargs
    with pytest.raises(openai.APIStatusError) as raised:
        server.client.completions.create(**request)
    assert raised.value.status_code == status
    error = raised.value.body
    assert words in error["message"] and error["type"] == "invalid_request_error"
    # the server goes on serving
    response = server.client.completions.create(model=server.model_dir, prompt="hello", max_tokens=2)
    assert response.usage.completion_tokens == 2


CHAT_BODY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
TOOL_ARGUMENTS = "messages[0].tool_calls[0].function.arguments"


def chat_with(content, **message) -> dict:
    """A chat body of one message with `content` (an assistant's, with `message`'s fields, when given)."""
    role = "assistant" if message else "user"
    return {"messages": [{"role": role, "content": content, **message}], "max_tokens": 3}


LOOKUP_PARAMETERS = {"type": "object", "properties": {"key": {"type": "string"}}}
LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP_PARAMETERS}}
LOOKUP_TOOL_ITEM = {"type": "function", "name": "lookup", "parameters": LOOKUP_PARAMETERS}  # the Responses API's


def tool_call(arguments) -> dict:
    return {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/chat/completions", {"n": 129}, "n"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/responses", {"n": 2}, "n"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/responses", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"5": 1000}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"9" * 4301: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"generation_config": '{"num_beams": 4}'}, "generation_config.num_beams"),
        ("/v1/chat/completions", {"generation_config": '{"length_penalty": 2.0}'}, "generation_config.length_penalty"),
        ("/v1/chat/completions", {"generation_config": {"max_length": 100}}, "generation_config.max_length"),
        ("/v1/chat/completions", {"generation_config": {"typical_p": 0.5}}, "generation_config.typical_p"),
        ("/v1/chat/completions", {"generation_config": {"no_such_setting": 1}}, "generation_config.no_such_setting"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"best_of": 2, "n": 3}, "best_of"),
        ("/v1/completions", {"best_of": 129}, "best_of"),
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"best_of": 2, "seed": 2**64 - 1}, "seed"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"n": 1.5}, "n"),
        ("/v1/completions", {"suffix": " END"}, "suffix"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/responses", {"include": ["reasoning.encrypted_content"]}, "include"),
        ("/v1/responses", {"include": ["message.output_text.logprobs", "no.such.output"]}, "include"),
        ("/v1/responses", {"include": "message.output_text.logprobs"}, "include"),
        ("/v1/responses", {"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
        ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0]"),
        ("/v1/chat/completions", {"foo": 1}, "foo"),
        ("/v1/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
        ("/v1/chat/completions", {"moderation": {"model": "omni"}}, "moderation"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/responses", {"reasoning": {"effort": "low"}}, "reasoning.effort"),
        ("/v1/responses", {"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ("/v1/responses", {"reasoning": {"budget": 10}}, "reasoning.budget"),
        ("/v1/responses", {"max_tool_calls": -1}, "max_tool_calls"),
        ("/v1/chat/completions", {"tools": [LOOKUP_TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ("/v1/responses", {"background": True}, "background"),
        ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, "text.format"),
        ("/v1/responses", {"text": {"verbosity": "high"}}, "text.verbosity"),
        ("/v1/responses", {"text": "plain"}, "text"),
        ("/v1/responses", {"conversation": "conv_1"}, "conversation"),
        ("/v1/responses", {"prompt": {"id": "pmpt_1"}}, "prompt"),
        ("/v1/responses", {"truncation": "auto"}, "truncation"),
        ("/v1/responses", {"context_management": [{"type": "compaction"}]}, "context_management"),
        ("/v1/responses", {"access_programs": {"cyber": "daybreak_red"}}, "access_programs"),
    ],
)
def test_fields_the_engine_would_not_apply_are_refused_by_name(server, path, fields, param):
    """Each would change the output as OpenAI's reference says; the server does not (or the value is out of range),
    so it answers 400 naming it (never 200 with the field dropped)."""
    if "responses" in path:
        body = {"input": "hello there", "max_output_tokens": 3} | fields
    else:
        body = (CHAT_BODY if "chat" in path else {"prompt": "hello there", "max_tokens": 3}) | fields
    status, error = post_json(server, path, body)
    assert status == 400, error
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"


def test_n_choices_are_parallel_samples_that_hold_the_prompt_once(server, saved):
    """n=4 on a long prompt: four choices (greedy: four times generate()'s text; seeded sampling: sample i seeded
    with seed + i, so each choice is what n=1 with that seed gives), usage summed, and the prompt's full blocks held
    once while they run (the Engine's parallel samples wait for the first one's prompt blocks, then share them)."""
    prompt = saved[1].decode(saved[1](" ".join(SENTENCES * 8))["input_ids"][: 24 * BLOCK_SIZE + 5])
    prompt_ids = saved[1](prompt)["input_ids"]
    full_blocks = len(prompt_ids) // BLOCK_SIZE
    assert full_blocks >= 20
    new_tokens = 40
    server.wait_idle()
    peak = {"blocks": 0}

    async def watch(done: asyncio.Event):
        while not done.is_set():
            metrics = await asyncio.to_thread(server.metrics)
            peak["blocks"] = max(peak["blocks"], metrics["hf_paged_kv_blocks_used"])
            await asyncio.sleep(0.005)

    async def run():
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        async with server.async_client() as client:
            response = await client.completions.create(
                model=server.model_dir, prompt=prompt, max_tokens=new_tokens, temperature=0, n=4
            )
        done.set()
        await watcher
        return response

    response = asyncio.run(run())
    expected = greedy_completion(saved, prompt_ids, new_tokens)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert all(choice.text == expected and choice.finish_reason == "length" for choice in response.choices)
    assert response.usage.completion_tokens == 4 * new_tokens and response.usage.prompt_tokens == len(prompt_ids)
    # the prompt's full blocks once, and each sample's own for its last prompt tokens and new ones (3 at most); the
    # samples run for new_tokens steps, so that the metrics, read every few milliseconds, see them running
    assert full_blocks <= peak["blocks"] <= full_blocks + 4 * 3, (peak, full_blocks)
    # seeded sampling: choice i is the n=1 answer with seed + i
    body = CHAT_BODY | {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    status, answer = post_json(server, "/v1/chat/completions", body)
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2]
    completion_tokens = 0
    for index, choice in enumerate(answer["choices"]):
        status, alone = post_json(server, "/v1/chat/completions", body | {"n": 1, "seed": 7 + index})
        assert choice["message"]["content"] == alone["choices"][0]["message"]["content"]
        completion_tokens += alone["usage"]["completion_tokens"]
    assert answer["usage"]["completion_tokens"] == completion_tokens
    assert len({choice["message"]["content"] for choice in answer["choices"]}) > 1  # three seeds, not one
    assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0


def test_logprobs_are_the_models_log_probabilities_of_each_generated_token(server, saved):
    """Greedy, so each token is the most likely one: its log probability is the top alternative's, and equals the
    log-softmax of the saved model's logits at that position."""
    _, tokenizer, model = saved
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    status, answer = post_json(server, "/v1/chat/completions", body)
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    prompt_ids = chat_ids(saved, messages)
    generated = tokenizer(answer["choices"][0]["message"]["content"], add_special_tokens=False)["input_ids"]
    assert len(content) == answer["usage"]["completion_tokens"] == 5
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + generated[:5]])).logits[0, len(prompt_ids) - 1 :]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for position, entry in enumerate(content[: len(generated)]):
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["logprob"] == pytest.approx(expected[position].max().item(), abs=1e-3)
        assert bytes(entry["bytes"]).decode() == entry["token"]
    assert "".join(entry["token"] for entry in content) == answer["choices"][0]["message"]["content"]
    status, answer = post_json(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "logprobs": 2})
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(
        len(top) <= 2 and max(top.values()) == pytest.approx(lp)
        for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"])
    )
    # each token's text is what it adds to the answer (the word-level decoder puts spaces between words)
    assert "".join(logprobs["tokens"]) == answer["choices"][0]["text"]
    offsets = [sum(map(len, logprobs["tokens"][:i])) for i in range(4)]
    assert logprobs["text_offset"] == offsets
    text = answer["choices"][0]["text"]
    assert all(text[offset:].startswith(token) for offset, token in zip(offsets, logprobs["tokens"]))


def test_logprobs_of_an_answer_cut_at_a_stop_string(server):
    """A stop string ends the answer before the Engine request does: its tokens' log probabilities are still there,
    one per token of the answer."""
    status, free = post_json(server, "/v1/completions", {"prompt": "a paged cache", "max_tokens": 8, "logprobs": 1})
    assert status == 200, free
    tokens = free["choices"][0]["logprobs"]["tokens"]
    stop = next((t for t in tokens[2:] if t.strip()), None)
    if stop is None:
        pytest.skip("no visible token to stop at")
    body = {"prompt": "a paged cache", "max_tokens": 8, "logprobs": 1, "stop": stop.strip()}
    status, cut = post_json(server, "/v1/completions", body)
    assert status == 200, cut
    logprobs = cut["choices"][0]["logprobs"]
    assert 0 < len(logprobs["token_logprobs"]) <= len(tokens)
    # the last token's text is cut where the stop string starts: the texts add up to the answer
    assert "".join(logprobs["tokens"]) == cut["choices"][0]["text"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body | {"stream": True}), JSON_HEADERS)
    events = connection.getresponse().read().decode().split("\n\n")
    connection.close()
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    streamed_tokens = [t for choice in streamed if choice.get("logprobs") for t in choice["logprobs"]["tokens"]]
    assert "".join(streamed_tokens) == "".join(choice["text"] for choice in streamed) == cut["choices"][0]["text"]
    assert logprobs["token_logprobs"] == pytest.approx(
        free["choices"][0]["logprobs"]["token_logprobs"][: len(logprobs["token_logprobs"])], abs=1e-5
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_logprobs_equal_the_answer_in_one_body(server, path):
    """Each chunk carries the log probabilities of the tokens whose text it brings: over the stream, every generated
    token's once, equal to the non-streamed answer's (greedy), completions' text offsets pointing at each token's
    text in the answer."""
    chat = "chat" in path
    body = {"max_tokens": 7, "temperature": 0} | (
        {"messages": [{"role": "user", "content": "hello there"}], "logprobs": True, "top_logprobs": 2}
        if chat
        else {"prompt": "a paged cache", "logprobs": 2}
    )
    status, answer = post_json(server, path, body)
    assert status == 200, answer
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", path, json.dumps(body | {"stream": True}), JSON_HEADERS)
    events = connection.getresponse().read().decode().split("\n\n")
    connection.close()
    streamed = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    pieces = [c["choices"][0]["logprobs"] for c in streamed if c["choices"] and c["choices"][0].get("logprobs")]
    expected = answer["choices"][0]["logprobs"]
    if chat:
        got = [entry for piece in pieces for entry in piece["content"]]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in expected["content"]], abs=1e-5)
        assert [e["token"] for e in got] == [e["token"] for e in expected["content"]]
        assert [len(e["top_logprobs"]) for e in got] == [2] * answer["usage"]["completion_tokens"]
    else:
        got = [lp for piece in pieces for lp in piece["token_logprobs"]]
        assert got == pytest.approx(expected["token_logprobs"], abs=1e-5)
        assert [t for piece in pieces for t in piece["tokens"]] == expected["tokens"]
        assert [o for piece in pieces for o in piece["text_offset"]] == expected["text_offset"]
        text = answer["choices"][0]["text"]
        assert [text[o:] for o in expected["text_offset"]] == [
            "".join(expected["tokens"][i:]) for i in range(len(expected["tokens"]))
        ]


def test_best_of_answers_the_n_samples_of_the_highest_mean_logprob(server):
    """Completions' `best_of=4, n=2`: four samples (sample i seeded with seed + i, as n=4 draws them), answered by the
    two of the highest mean log probability per token, best first; usage counts all four; logprobs shown only when
    asked; best_of = n streams as n does."""
    body = {"prompt": "a paged cache", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    status, drawn = post_json(server, "/v1/completions", body | {"n": 4, "logprobs": 0})
    assert status == 200, drawn
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["tokens"]) for c in drawn["choices"]]
    order = sorted(range(4), key=lambda index: -means[index])
    status, answer = post_json(server, "/v1/completions", body | {"n": 2, "best_of": 4})
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert [c["text"] for c in answer["choices"]] == [drawn["choices"][i]["text"] for i in order[:2]]
    assert all("logprobs" not in c or c["logprobs"] is None for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == drawn["usage"]["completion_tokens"]
    status, shown = post_json(server, "/v1/completions", body | {"best_of": 4, "logprobs": 1})
    assert status == 200 and len(shown["choices"]) == 1, shown
    assert shown["choices"][0]["text"] == drawn["choices"][order[0]]["text"]
    assert shown["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        drawn["choices"][order[0]]["logprobs"]["token_logprobs"], abs=1e-5
    )
    streamed = [""] * 2
    for event in events_of(server, "/v1/completions", body | {"n": 2, "best_of": 2}):
        for choice in event.get("choices") or []:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [c["text"] for c in drawn["choices"][:2]]
    assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0


def test_the_fields_the_server_applies_are_not_logged_as_ignored():
    """transformers' completions handler logs `best_of`, `echo`, `logprobs`, `n`, ... as unsupported fields it
    ignores; the server applies them, so its handlers log only those it takes and leaves alone (`user`)."""
    from transformers.cli.serving.completion import CompletionHandler

    from hf_paged.serve.handlers import PagedCompletionHandler

    assert {"best_of", "echo", "logprobs", "n"} <= CompletionHandler._unused_fields
    logged = PagedCompletionHandler.__new__(PagedCompletionHandler)._unused_fields
    assert "user" in logged and not logged & {"best_of", "echo", "logprobs", "n", "presence_penalty", "stream_options"}


def test_n_choices_stream_interleaved_with_their_index(server, saved):
    messages = [{"role": "user", "content": "hello there"}]
    stream = server.client.chat.completions.create(
        model=server.model_dir,
        messages=messages,
        max_tokens=6,
        temperature=0,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        usage = chunk.usage or usage
    expected = greedy_text(saved, chat_ids(saved, messages), 6)
    assert texts == {0: expected, 1: expected, 2: expected} and reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 18 and usage.total_tokens == usage.prompt_tokens + 18


def test_fields_at_their_openai_defaults_are_accepted(server):
    neutral_generation = {"num_beams": 1, "length_penalty": 1.0, "pad_token_id": 0, "output_scores": True}
    neutral_generation |= {"repetition_penalty": None, "cache_implementation": "dynamic"}
    status, body = post_json(server, "/v1/chat/completions", CHAT_BODY | {"generation_config": neutral_generation})
    assert status == 200, body
    neutral = {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    status, body = post_json(server, "/v1/chat/completions", CHAT_BODY | neutral | {"temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, body = post_json(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_fields_that_change_no_token_are_accepted(server):
    """OpenAI's bookkeeping fields, and the unapplied ones at the value that changes nothing, answer 200; without
    tools a limit on tool calls changes nothing either (tool_choice "none")."""
    status, body = post_json(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": "u"})
    assert status == 200, body
    status, body = post_json(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "store": True})
    assert status == 400 and body["error"]["param"] == "store"  # not a completions field
    bookkeeping = {"store": True, "metadata": {"k": "v"}, "user": "u", "service_tier": "auto", "prompt_cache_key": "p"}
    chat = {"verbosity": "medium", "parallel_tool_calls": False, "tool_choice": "none"}
    chat |= {"prediction": {"type": "content", "content": "hi"}}
    status, body = post_json(server, "/v1/chat/completions", CHAT_BODY | bookkeeping | chat)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    responses = {
        "background": False,
        "truncation": "disabled",
        "context_management": [],
        "access_programs": {"cyber": "standard"},
        "reasoning": {"summary": None, "mode": "standard"},
        "max_tool_calls": 2,
        "safety_identifier": "s",
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
    }
    request = {"input": "hello there", "max_output_tokens": 3} | bookkeeping | responses
    status, body = post_json(server, "/v1/responses", request)
    assert status == 200 and body["usage"]["output_tokens"] == 3, body
    # max_tool_calls limits OpenAI's built-in tools' calls, which the server refuses: with function tools, nothing.
    tools = {"tools": [LOOKUP_TOOL_ITEM], "max_tool_calls": 1, "parallel_tool_calls": False}
    status, body = post_json(server, "/v1/responses", request | tools)
    assert status == 200 and body["max_tool_calls"] == 1 and body["parallel_tool_calls"] is False, body
    # null is a field not given (transformers' Response takes no null parallel_tool_calls: a 500, an empty stream)
    nulls = {"parallel_tool_calls": None, "tools": None, "instructions": None, "temperature": None}
    status, body = post_json(server, "/v1/responses", request | nulls)
    assert status == 200 and body["parallel_tool_calls"] is True, body
    events = events_of(server, "/v1/responses", request | nulls)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"


def test_every_field_of_transformers_request_schemas_is_read_refused_or_left_alone():
    """The field ledger (fields.py) against transformers' request schemas: each field there is one the server reads,
    refuses at a value it would not apply, or knows changes no token; beyond them the server knows vLLM's sampling
    extensions only (which it takes out before the schema's check: another field would be its 422)."""
    from transformers.cli.serving.chat_completion import TransformersCompletionCreateParamsStreaming
    from transformers.cli.serving.completion import TransformersTextCompletionCreateParams
    from transformers.cli.serving.response import TransformersResponseCreateParamsStreaming

    from hf_paged.serve.fields import CHAT, COMPLETIONS, RESPONSES, known_fields
    from hf_paged.serve.options import EXTENSION_FIELDS

    schemas = {
        CHAT: TransformersCompletionCreateParamsStreaming,
        COMPLETIONS: TransformersTextCompletionCreateParams,
        RESPONSES: TransformersResponseCreateParamsStreaming,
    }
    for endpoint, schema in schemas.items():
        assert known_fields(endpoint) == set(schema.__annotations__) | set(EXTENSION_FIELDS), endpoint


def test_a_chat_template_reading_a_reasoning_effort_gets_the_requests(saved, tmp_path):
    """In process, a model whose chat template reads `reasoning_effort`: chat's `reasoning_effort` and the Responses
    API's `reasoning.effort` reach it (the prompt is the template's with that effort: the same greedy answer and
    prompt length as generate() on it); a value that is not an effort is refused."""
    from fastapi.testclient import TestClient

    from hf_paged.serve.app import ServeConfig, build_app

    tokenizer, model = make_tokenizer(), saved[2]
    tokenizer.chat_template = (
        "{% if reasoning_effort %}<s> system : {{ reasoning_effort }} </s> {% endif %}" + CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hello there"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, reasoning_effort="high"
    )["input_ids"]
    assert len(ids) > len(chat_ids(saved, messages))
    expected = greedy_text(saved, ids, 4)
    app, manager = build_app(
        ServeConfig(model=str(tmp_path), max_memory=str(NUM_BLOCKS * BYTES_PER_BLOCK), dtype="float32")
    )
    try:
        client = TestClient(app)
        chat = {"messages": messages, "max_tokens": 4, "temperature": 0, "reasoning_effort": "high"}
        answer = client.post("/v1/chat/completions", json=chat).json()
        assert answer["choices"][0]["message"]["content"] == expected
        assert answer["usage"]["prompt_tokens"] == len(ids)
        request = {"input": "hello there", "max_output_tokens": 4, "temperature": 0, "reasoning": {"effort": "high"}}
        response = client.post("/v1/responses", json=request).json()
        assert response["output"][0]["content"][0]["text"] == expected
        assert response["usage"]["input_tokens"] == len(ids)
        refused = client.post("/v1/chat/completions", json=chat | {"reasoning_effort": "extreme"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    finally:
        manager.stop()


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece's spelling as Llama 2 and Mistral tokenize (Metaspace, a decoder that strips the first space):
    a word's token spells its leading space ("▁fox"), which a decode of that token alone drops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>"], vocab_size=200, show_progress=False)
    spm.train_from_iterator(SENTENCES * 3, trainer)
    bos = ("<s>", spm.token_to_id("<s>"))
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_a_completion_continues_its_prompts_text_with_a_sentencepiece_tokenizer(tmp_path):
    """OpenAI's and vLLM's completions: the text continues the prompt's, so a SentencePiece token's leading space is
    kept (" fox" after "the quick brown", where the token decoded alone gives "fox"): the prompt's text and the
    answer's add up to the two decoded together, in one body, streamed, echoed and in the log probabilities' texts
    and offsets. A chat answer is decoded alone, as transformers' server decodes it."""
    from fastapi.testclient import TestClient

    from hf_paged.serve.app import ServeConfig, build_app

    tokenizer = sentencepiece_tokenizer()
    fox = tokenizer.convert_tokens_to_ids("\u2581fox")
    assert fox != tokenizer.unk_token_id and tokenizer.decode([fox]) == "fox"
    tokenizer.save_pretrained(tmp_path)
    make_model(len(tokenizer)).save_pretrained(tmp_path)
    prompt = "the quick brown"
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id  # a special token the decode skips
    # every token is "▁fox": the answer is generate()'s with the bias, whatever the weights
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": {str(fox): 100}, "ignore_eos": True}
    expected = tokenizer.decode([*prompt_ids, fox, fox, fox], skip_special_tokens=True)[len(prompt) :]
    assert expected == " fox fox fox"
    app, manager = build_app(
        ServeConfig(model=str(tmp_path), max_memory=str(NUM_BLOCKS * BYTES_PER_BLOCK), dtype="float32")
    )
    try:
        client = TestClient(app)
        for fields in ({}, {"prompt": prompt_ids}):  # a string, or its token ids
            answer = client.post("/v1/completions", json=body | fields).json()
            assert answer["choices"][0]["text"] == expected, answer
            events = client.post("/v1/completions", json=body | fields | {"stream": True}).text.split("\n\n")
            chunks = [json.loads(event.removeprefix("data: ")) for event in events if event.startswith("data: {")]
            assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == expected
        echoed = client.post("/v1/completions", json=body | {"echo": True, "logprobs": 0}).json()["choices"][0]
        assert echoed["text"] == prompt + expected
        logprobs = echoed["logprobs"]
        assert logprobs["tokens"][-3:] == [" fox"] * 3 and "".join(logprobs["tokens"]) == echoed["text"]
        assert logprobs["text_offset"][-3:] == [len(prompt), len(prompt) + 4, len(prompt) + 8]
        streamed = client.post("/v1/completions", json=body | {"logprobs": 0, "stream": True}).text.split("\n\n")
        tokens = [
            token
            for event in streamed
            if event.startswith("data: {")
            for choice in json.loads(event.removeprefix("data: "))["choices"]
            for token in (choice.get("logprobs") or {}).get("tokens", [])  # (the last chunk has none)
        ]
        assert tokens == [" fox"] * 3
        chat = {key: value for key, value in body.items() if key != "prompt"}
        chat["messages"] = [{"role": "user", "content": prompt}]
        answer = client.post("/v1/chat/completions", json=chat).json()
        assert answer["choices"][0]["message"]["content"] == "fox fox fox", answer
    finally:
        manager.stop()


def request_stream(loop, tokenizer, prompt_ids: list[int], handler=None, **options):
    """A `RequestStream` outside a server: `tokenizer` the Rust tokenizer it decodes with incrementally (a transformers
    tokenizer: its Rust one, and itself the handler's), `handler` the handler's (default `tokenizer`) that decodes the
    whole answer and spells log probabilities; `options` the stream's other keywords (defaults: a stream, no sampling
    options, no stop string, 64 tokens at most)."""
    from hf_paged.serve.stream import RequestStream

    if handler is None and isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer, handler = tokenizer.backend_tokenizer, tokenizer
    handler = tokenizer if handler is None else handler
    keywords = dict(
        max_new_tokens=64,
        sampling={},
        decode=lambda ids: handler.decode(ids, skip_special_tokens=True),
        stop_strings=(),
        streaming=True,
        on_cancel=lambda stream: None,
        logprob_tokenizer=handler,
    )
    return RequestStream(loop=loop, prompt_ids=prompt_ids, tokenizer=tokenizer, **(keywords | options))


def byte_fallback_tokenizer():
    """SentencePiece's ByteFallback spelling (Llama 2, Mistral): a character outside the vocabulary is its UTF-8 bytes
    as tokens <0x00> to <0xFF>, which the decoder joins in runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}, "\u2581the": 257, "\u2581fox": 258}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    spm.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return spm


def continued_texts(tokenizer, handler_tokenizer, prompt: list[int], generated: list[int]):
    """A completion's (text, token texts) of `generated` after `prompt`, in one body and streamed one token a step."""
    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs
    from hf_paged.serve.stream import GeneratedIds

    answers = []
    loop = asyncio.new_event_loop()
    try:
        for streaming in (False, True):
            stream = request_stream(
                loop,
                tokenizer,
                prompt,
                handler_tokenizer,
                sampling={"logprobs": 0},
                streaming=streaming,
                continues_prompt=True,
            )
            for index, token in enumerate(generated):
                stream.deliver([token], index == len(generated) - 1, logprobs=[TokenLogprob(-1.0, ())])
            if streaming:
                pieces = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())][:-1]
                rows = [_completion_logprobs(piece.tokenizer, piece.generated)["tokens"] for piece in pieces]
                tokens = [token for piece_tokens in rows for token in piece_tokens]
                answers.append(("".join(pieces), tokens))
            else:
                text = loop.run_until_complete(stream.result)
                generated_ids = GeneratedIds(stream.token_ids, stream.logprobs, previous=stream.text_after)
                answers.append((text, _completion_logprobs(handler_tokenizer, generated_ids)["tokens"]))
    finally:
        loop.close()
    return answers


def test_a_completion_after_byte_tokens_continues_the_text_before_them():
    """ByteFallback prompts: token ids cut inside a character give no text to continue (the completion is decoded
    alone); a prompt ending in the bytes of a whole character (a newline's <0x0A>) is continued after the tokens
    before them (the decoder joins a run of bytes, so the answer's would change how those decode); a byte that begins
    no character after the prompt's does not stop the stream. In one body and streamed alike, the token texts adding
    up to the text."""
    spm = byte_fallback_tokenizer()
    byte = {i: 1 + i for i in range(256)}
    the, fox = 257, 258
    cut = [the, *(byte[b] for b in "😀".encode()[:2])]
    cases = [
        (cut, [*(byte[b] for b in "😀".encode()[2:]), fox], None),  # decoded alone
        ([the, byte[0x0A]], [*(byte[b] for b in "😃".encode()), fox], ["", "", "", "😃", " fox"]),
        ([byte[0x0A]], [byte[0xF9], fox], None),
    ]
    # bytes that begin no character in the answer (tokenizers' incremental decoder refuses them): the text after
    # them still comes, from the whole answer's decode
    (_, _), (streamed, _) = continued_texts(spm, spm, [the], [byte[0x41], byte[0xE2], fox, fox])
    assert streamed.endswith(" fox fox"), streamed
    assert spm.decode(cut).endswith("\ufffd")
    for prompt, generated, expected in cases:
        (text, tokens), (streamed, streamed_tokens) = continued_texts(spm, spm, prompt, generated)
        assert text == streamed and tokens == streamed_tokens and "".join(tokens) == text, (prompt, text, streamed)
        if expected is None:  # no text before the answer's: its ids decoded alone
            assert text == spm.decode(generated), text
        else:
            assert tokens == expected


def test_a_stop_string_inside_the_min_tokens_text_does_not_count_however_the_tokens_come():
    """vLLM's rule, as the answer in one body applies it: a stop string counts only where it ends after the text of
    the first `min_tokens` tokens, also when the Engine delivers several tokens at once to a stream."""

    tokenizer = make_tokenizer()
    generated = tokenizer("world quick dog world", add_special_tokens=False)["input_ids"]
    texts = []
    loop = asyncio.new_event_loop()
    try:
        for streaming, groups in ((False, [1, 1, 1, 1]), (True, [1, 1, 1, 1]), (True, [3, 1]), (True, [4])):
            stream = request_stream(
                loop,
                tokenizer,
                [tokenizer.bos_token_id],
                sampling={"min_tokens": 1},
                stop_strings=("wor",),
                streaming=streaming,
            )
            start = 0
            for size in groups:
                stream.deliver(generated[start : start + size], start + size == len(generated))
                start += size
            if streaming:
                texts.append("".join(stream.queue.get_nowait() for _ in range(stream.queue.qsize() - 1)))
            else:
                texts.append(loop.run_until_complete(stream.result))
            assert stream.stopped
    finally:
        loop.close()
    assert texts == ["world quick dog "] * 4, texts


def test_a_decode_that_fails_ends_its_request_with_an_error():
    """A tokenizer or parser that raises on a request's tokens ends that request with an error (the stream's error
    event, the answer's exception) and stops its Engine request, instead of leaving its handler waiting."""
    from transformers.cli.serving.utils import _StreamError

    class Broken:
        initial_events = []

        @staticmethod
        def feed(text):
            raise ValueError("no parse")

    tokenizer = make_tokenizer()
    words = tokenizer("the quick fox", add_special_tokens=False)["input_ids"]
    loop = asyncio.new_event_loop()
    try:
        for streaming in (True, False):
            cancelled = []
            stream = request_stream(
                loop,
                tokenizer,
                [tokenizer.bos_token_id],
                decode=tokenizer.decode if streaming else Broken.feed,
                response_parser=Broken() if streaming else None,
                streaming=streaming,
                on_cancel=cancelled.append,
            )
            stream.deliver(words[:1], False)
            if not streaming:
                stream.deliver(words[1:], True)  # its one-body decode raises
                with pytest.raises(RuntimeError, match="could not be decoded.*no parse"):
                    loop.run_until_complete(stream.result)
                assert cancelled == []  # it had finished
            else:
                error = stream.queue.get_nowait()
                assert isinstance(error, _StreamError) and "no parse" in error.msg and cancelled == [stream]
                stream.deliver(words[1:], True)  # later tokens are dropped
                assert stream.queue.empty()
        # a failure in the answer's end, where a stop string ended it while its Engine request runs on
        for streaming in (True, False):
            cancelled = []
            stream = request_stream(
                loop, tokenizer, [tokenizer.bos_token_id], decode=Broken.feed,
                stop_strings=("quick",), streaming=streaming, on_cancel=cancelled.append,
            )  # fmt: skip
            stream.deliver(words, False)
            assert cancelled == [stream] and stream._closed
    finally:
        loop.close()


def test_a_stop_string_completed_after_min_tokens_ends_the_answer_in_one_body_and_streamed():
    """The first `min_tokens` tokens end inside a character that the next ones complete (a ByteFallback "€" over
    three byte tokens): a stop string made of that character ends after them, so it counts, in one body as in the
    stream, and neither sends it."""
    spm = byte_fallback_tokenizer()
    handler = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>")
    euro = [spm.token_to_id(f"<0x{byte:02X}>") for byte in "€".encode()]
    generated = [spm.token_to_id("\u2581fox"), *euro, spm.token_to_id("\u2581the")]
    texts = []
    loop = asyncio.new_event_loop()
    try:
        for streaming in (False, True):
            stream = request_stream(
                loop, spm, [spm.token_to_id("\u2581the")], handler, sampling={"min_tokens": 2}, stop_strings=("€",),
                streaming=streaming,
            )  # fmt: skip
            for index, token in enumerate(generated):
                stream.deliver([token], index == len(generated) - 1)
            if streaming:
                texts.append("".join(item for item in iter(stream.queue.get_nowait, None)))
            else:
                texts.append(loop.run_until_complete(stream.result))
            assert stream.stopped and len(stream.token_ids) == 4
    finally:
        loop.close()
    assert texts == ["fox", "fox"], texts


def cleaning_up_wordpiece(corpus: str) -> tuple:
    """A WordPiece tokenizer trained on `corpus` whose Rust decoder does not clean up spaces, and the transformers
    tokenizer over it that does (`clean_up_tokenization_spaces`, as BERT's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]"])
    wordpiece.train_from_iterator([corpus] * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    return wordpiece, tokenizer


def test_a_completion_is_decoded_alone_where_the_tokenizer_cleans_up_spaces():
    """A transformers tokenizer that cleans up spaces after its decoder (WordPiece's " '" -> "'") would join the
    completion to the prompt's last word in one body and not in the stream (the Rust decoder does not clean up): its
    completions are decoded alone, the same in one body and streamed."""
    wordpiece, tokenizer = cleaning_up_wordpiece("hello ' quote world")
    prompt, generated = wordpiece.encode("hello").ids, wordpiece.encode("' quote").ids
    assert tokenizer.decode(prompt + generated) == "hello'quote"  # cleaned up
    (text, tokens), (streamed, streamed_tokens) = continued_texts(wordpiece, tokenizer, prompt, generated)
    assert text == streamed == tokenizer.decode(generated) == "' quote" and tokens == streamed_tokens == ["'", " quote"]


def events_of(server, path: str, body: dict) -> list[dict]:
    """The JSON events of `body` streamed from `path`."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body | {"stream": True}), JSON_HEADERS)
        events = connection.getresponse().read().decode().split("\n\n")
    finally:
        connection.close()
    return [json.loads(event.removeprefix("data: ")) for event in events if event.startswith("data: {")]


def response_text(response: dict) -> str:
    """A Responses API body's output text (what the openai client's `output_text` gives)."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def test_responses_log_probabilities_are_the_message_texts(server, saved):
    """The Responses API's `include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's
    `output_text` part carries each token's text (adding up to the part's), log probability, UTF-8 bytes and top
    alternatives, the same as chat's for the same messages; streamed, each `response.output_text.delta` carries
    those of its own text's tokens, and the done events and the last response all of them; top_logprobs without
    the include is refused naming it."""
    messages = [{"role": "user", "content": "hello world , what is a block table ?"}]
    body = {
        "input": messages[0]["content"],
        "max_output_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    status, response = post_json(server, "/v1/responses", body)
    assert status == 200, response
    part = response["output"][0]["content"][0]
    entries = part["logprobs"]
    assert len(entries) == 6 and "".join(entry["token"] for entry in entries) == part["text"]
    assert all(entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2 for entry in entries)
    chat = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}
    status, answer = post_json(server, "/v1/chat/completions", chat | {"top_logprobs": 2})
    assert status == 200, answer
    assert entries == answer["choices"][0]["logprobs"]["content"]  # the same model, tokens and alternatives

    events = events_of(server, "/v1/responses", body)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert deltas and all("".join(e["token"] for e in delta["logprobs"]) == delta["delta"] for delta in deltas)
    without_bytes = [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]],
        }
        for e in entries
    ]
    streamed = [e for delta in deltas for e in delta["logprobs"]]
    # a token whose text is empty (a special token) after the last delta comes in the done events only
    assert streamed == without_bytes[: len(streamed)] and all(e["token"] == "" for e in without_bytes[len(streamed) :])
    done = next(event for event in events if event["type"] == "response.output_text.done")
    assert done["logprobs"] == entries
    last = events[-1]["response"]
    assert last["output"][0]["content"][0]["logprobs"] == entries
    status, plain = post_json(server, "/v1/responses", {key: v for key, v in body.items() if key != "top_logprobs"})
    assert status == 200 and [e["top_logprobs"] for e in plain["output"][0]["content"][0]["logprobs"]] == [[]] * 6
    status, error = post_json(server, "/v1/responses", {key: v for key, v in body.items() if key != "include"})
    assert status == 400 and error["error"]["param"] == "top_logprobs", error


LOOKUP_CALL = '{"name": "lookup", "arguments": {"key": "Paris"}}'


@pytest.mark.parametrize(
    "answer, content",
    [
        ("<think> the lazy dog </think> the quick brown fox", [5, 6, 7, 8]),
        (f"Paris <tool_call> {LOOKUP_CALL} </tool_call>", [0]),  # the call's arguments repeat the content
        (f"<tool_call> {LOOKUP_CALL} </tool_call> Paris", [3]),
        (f"<tool_call> {LOOKUP_CALL} </tool_call>", []),
    ],
)
def test_responses_log_probabilities_are_the_parsed_contents_tokens(answer, content):
    """A parsed answer (Qwen 3's response template: reasoning in <think> ... </think>, tool calls in <tool_call> ...
    </tool_call>): the message text's log probabilities are those of its own tokens, streamed (each content piece's)
    and in one body (the parser run over the tokens as a stream would feed it), none of the reasoning's, the tool
    calls' (whose arguments may repeat the content's text) or their markers'."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS, ResponseParser

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.stream import parsed_content_tokens

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", LOOKUP_CALL, "Paris"])
    template = next(t for kinds, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in kinds)
    ids = tokenizer.encode(answer, add_special_tokens=False)
    records = [TokenLogprob(-1.0 - index, ()) for index in range(len(ids))]
    loop = asyncio.new_event_loop()
    try:
        stream = request_stream(
            loop,
            tokenizer,
            [tokenizer.bos_token_id],
            sampling={"logprobs": 0},
            response_parser=ResponseParser(template, prefix=""),
            content_logprobs=True,
        )
        for index, token in enumerate(ids):
            stream.deliver([token], index == len(ids) - 1, logprobs=[records[index]])
        items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    finally:
        loop.close()
    pieces = [item for item in items if type(item) is str]  # content (reasoning comes as ReasoningText)
    queued = list(stream.content_logprobs_queue)
    assert len(queued) == len(pieces)
    assert [r.logprob for piece in queued for r in piece.logprobs] == [records[i].logprob for i in content]
    regions, tail = parsed_content_tokens(tokenizer, ResponseParser(template, prefix=""), ids)
    assert [index for indices, _ in regions for index in indices] == content and tail == []


def test_a_parsed_chat_stream_sends_each_tokens_log_probability_with_the_text_it_brings():
    """A chat answer the response parser reads (Qwen 3's template): each `reasoning_content` and `content` chunk
    carries the log probabilities of the tokens delivered since the last chunk of text (so the reasoning's come with
    the reasoning, not all at the end), a tool call's tokens go with the next text or the last chunk's empty
    content, and over the stream every token's comes once, in order, as the answer in one body has them."""
    from transformers.cli.serving.utils import ReasoningText, ToolCall

    from hf_paged.serve.handlers import PagedChatCompletionHandler
    from hf_paged.serve.stream import LoggedText

    tokenizer = parsed_tokenizer()
    answer = f"<think> hello there </think> Paris <tool_call> {LOOKUP_CALL} </tool_call>"
    ids = tokenizer.encode(answer, add_special_tokens=False)
    items, stream = parsed_stream_items(tokenizer, answer, sampling={"logprobs": 0})
    records = stream.logprobs
    assert items[-1] is None and any(isinstance(item, ToolCall) for item in items)
    logged = [item for item in items if isinstance(item, LoggedText)]
    assert [r.logprob for item in logged for r in item.generated.logprobs] == [-1.0 - i for i in range(len(ids))]
    reasoning = [item for item in logged if isinstance(item, ReasoningText)]
    assert reasoning and "".join(reasoning).strip().startswith("hello")
    first_content = next(item for item in logged if not isinstance(item, ReasoningText) and item)
    assert first_content.generated.logprobs[-1] is records[ids.index(tokenizer.convert_tokens_to_ids("Paris"))]
    assert logged[-1] == "" and len(logged[-1].generated.logprobs) > 1  # the tool call's tokens, at the end

    handler = object.__new__(PagedChatCompletionHandler)
    chunk = json.loads(handler._build_chunk_sse("id", model="m", reasoning_content=reasoning[0]).removeprefix("data: "))
    entries = chunk["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in entries] == [r.logprob for r in reasoning[0].generated.logprobs]
    assert chunk["choices"][0]["delta"]["reasoning_content"] == reasoning[0]


def test_one_body_responses_log_probabilities_are_those_of_its_parsed_text():
    """transformers' one-body parse keeps the last content region of an answer that writes content, a tool call,
    then content again, and strips the content: the message's log probabilities are then that region's tokens,
    without the whitespace-only tokens at its ends (the "\n\n" after a reasoning's close), so they add up to the
    message's text."""
    from hf_paged.serve.handlers import _answered_content, _stripped

    regions = [([0], "Hi"), ([4, 5], " after call")]
    assert _answered_content(regions, "after call") == [4, 5]
    assert _answered_content(regions, "Hi after call") == [0, 4, 5]
    assert _answered_content(regions[:1], "Hi") == [0]
    rows = [("\n\n", None, []), ("Checking", None, []), (" Paris", None, []), (" ", None, [])]
    assert [piece for piece, _, _ in _stripped(rows, "Checking Paris")] == ["Checking", " Paris"]
    assert [piece for piece, _, _ in _stripped(rows, "Checking Paris", end=False)] == ["Checking", " Paris", " "]
    assert _stripped(rows, "\n\nChecking Paris ") == rows


def test_responses_log_probabilities_of_answers_a_stop_string_cuts_are_the_same_streamed_and_in_one_body():
    """Random parsed answers (reasoning and content, special tokens, markers) cut by a random stop string taken from
    their text, streamed in pieces of 1-100 tokens and in one body: the message's log probabilities are the same
    tokens where both give the message the same text. One body reads the answer's text only up to the cut, as the
    stream's parser does, and keeps the stop string's tokens (their text cut away, whitespace before the stop
    included) where the answer ended in its content, as the stream does, also where the cut came before the
    parser's first piece of text."""
    import random
    import types

    from transformers.cli.serving.utils import ReasoningText, build_response_parser

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _logprob_rows, parsed_content_rows
    from hf_paged.serve.stream import GeneratedIds

    tokenizer, rng = parsed_tokenizer(), random.Random(0)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    words = ["the", "quick", "lazy", "dog", "fox", "over", "jumps", "<s>", "</s>", "<pad>", "<think>", "</think>", ","]
    compared = cut_before_any_piece = 0
    for _ in range(150):
        answer = [rng.choice(words) for _ in range(rng.randint(1, 10))]
        if rng.random() < 0.6:
            answer = ["<think>", *answer[: len(answer) // 2], "</think>", *answer[len(answer) // 2 :]]
        ids = tokenizer.encode(" ".join(answer), add_special_tokens=False)
        text = tokenizer.decode(ids, skip_special_tokens=rng.random() < 0.7)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 8)]
        options = dict(sampling={"logprobs": 0}, stop_strings=(stop,))
        sizes = (rng.choice([1, 2, 3, 100]),)
        items, stream = parsed_stream_items(tokenizer, " ".join(answer), sizes, content_logprobs=True, **options)
        pieces = [*stream.content_logprobs_queue, *filter(None, [stream.content_logprobs_tail])]
        streamed = [round(-record.logprob - 1) for piece in pieces for record in piece.logprobs]
        loop = asyncio.new_event_loop()
        one = request_stream(loop, tokenizer, [], streaming=False, **options)
        for index, token in enumerate(ids):
            one.deliver([token], index == len(ids) - 1, logprobs=[TokenLogprob(-1.0 - index, ())])
            if one.stopped:
                break
        loop.run_until_complete(one.result)
        loop.close()
        generated = GeneratedIds(
            one.token_ids, one.logprobs, text_end=len(one._final_text()), parse_text=one.parse_text()
        )
        read = generated.parse_text if one.stopped else tokenizer.decode(ids, skip_special_tokens=False)
        content = tokenizer.parse_response(read, prefix="").get("content") or ""
        streamed_text = "".join(i for i in items if isinstance(i, str) and not isinstance(i, ReasoningText))
        if streamed_text.strip() != content.strip():  # one body keeps the last of two content regions only
            continue
        rows = _logprob_rows(tokenizer, generated)
        parser = build_response_parser(tokenizer, model, [])
        kept = parsed_content_rows(tokenizer, parser, generated, rows, content)
        assert [round(-row[1].logprob - 1) for row in kept] == streamed, (answer, stop, sizes)
        compared += 1
        cut_before_any_piece += not streamed_text and bool(streamed)
    assert compared > 120 and cut_before_any_piece > 0


def test_a_response_cut_by_max_output_tokens_is_incomplete(server, saved):
    """As OpenAI's API says it: a response that max_output_tokens cut has status "incomplete" with
    incomplete_details.reason "max_output_tokens" (its message "incomplete" too), in one body and streamed (which
    ends with `response.incomplete`); one the model ended (here a stop token) is "completed"."""
    request = {"input": "hello there", "max_output_tokens": 3, "temperature": 0}
    status, cut = post_json(server, "/v1/responses", request)
    assert status == 200 and cut["status"] == "incomplete", cut
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"} and cut["output"][0]["status"] == "incomplete"
    events = events_of(server, "/v1/responses", request)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert "response.completed" not in {event["type"] for event in events}
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == response_text(cut)

    first = saved[1](response_text(cut).split()[0], add_special_tokens=False)["input_ids"][0]
    status, ended = post_json(server, "/v1/responses", request | {"stop_token_ids": [first]})
    assert status == 200 and ended["status"] == "completed" and ended.get("incomplete_details") is None, ended
    assert ended["usage"]["output_tokens"] == 1
    events = events_of(server, "/v1/responses", request | {"stop_token_ids": [first]})
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"


def test_a_response_echoes_the_requests_settings(server):
    """As OpenAI's: a response (in one body, and each streamed event's) carries the request's tools, tool_choice,
    parallel_tool_calls (true when not given), instructions, max_output_tokens, temperature and metadata."""
    request = {
        "input": "hello there",
        "instructions": "answer in short sentences",
        "tools": [LOOKUP_TOOL_ITEM],
        "tool_choice": "auto",
        "max_output_tokens": 3,
        "temperature": 0.5,
        "metadata": {"k": "v"},
    }
    status, response = post_json(server, "/v1/responses", request)
    assert status == 200, response
    for answer in [response] + [e["response"] for e in events_of(server, "/v1/responses", request) if "response" in e]:
        assert {name: answer.get(name) for name in request if name != "input"} == {
            name: value for name, value in request.items() if name != "input"
        }
        assert answer["parallel_tool_calls"] is True and answer["truncation"] == "disabled"


def test_tool_choice_none_leaves_a_tool_call_in_the_text(server, saved):
    """`tool_choice: "none"`: the answer's tool calls are not parsed, so a tool call the model writes stays in its
    text, as vLLM leaves it without a tool parser; the processor is a copy whose response template (the
    tokenizer's, or the one for the model's type) lacks `tool_calls`, the server's own unchanged. Over HTTP, with
    tools (which stay in the prompt) the answer is generate()'s, and a response echoes tool_choice "none"."""
    import copy as copying
    import types

    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS, parse_assistant_message

    from hf_paged.serve.handlers import without_tool_calls

    tokenizer = copying.deepcopy(saved[1])
    call = '{"name": "lookup", "arguments": {"key": "a"}}'
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", call, "<|im_end|>"])
    answer = tokenizer.encode(f"the quick <tool_call> {call} </tool_call> <|im_end|>", add_special_tokens=False)
    qwen = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen2"))  # a type with a tool parser
    llama = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))  # one without
    content, _, calls = parse_assistant_message(tokenizer, qwen, answer, [])
    assert content == "the quick" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"key": "a"}')]
    unparsed = without_tool_calls(tokenizer, qwen)
    assert type(unparsed) is type(tokenizer) and unparsed is not tokenizer
    content, _, calls = parse_assistant_message(unparsed, qwen, answer, [])
    assert content == f"the quick <tool_call> {call} </tool_call>" and calls is None
    assert getattr(tokenizer, "response_template", None) is None  # the server's tokenizer as it was
    assert without_tool_calls(tokenizer, llama) is tokenizer  # no template: no tool call is ever parsed
    tokenizer.response_template = copying.deepcopy(
        next(t for k, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen2" in k)
    )
    assert "tool_calls" not in without_tool_calls(tokenizer, llama).response_template["fields"]
    assert "tool_calls" in tokenizer.response_template["fields"]

    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "tools": [LOOKUP_TOOL], "tool_choice": "none", "max_tokens": 5, "temperature": 0}
    status, answer = post_json(server, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == greedy_text(saved, chat_ids(saved, messages), 5)
    request = {"input": "hello there", "tools": [LOOKUP_TOOL_ITEM], "tool_choice": "none", "max_output_tokens": 3}
    status, response = post_json(server, "/v1/responses", request)
    assert status == 200 and response["tool_choice"] == "none" and response["tools"] == [LOOKUP_TOOL_ITEM], response


BAD_CALL = '{"name": "lookup", "arguments": {bad'  # a tool call that is no JSON


def parsed_tokenizer() -> PreTrainedTokenizerFast:
    """The test tokenizer with Qwen 3's response template (reasoning in <think> ... </think>, tool calls in
    <tool_call> ... </tool_call>), anchored at the test chat template's generation prompt, and those markers and two
    tool calls' texts as tokens."""
    import copy as copying

    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", LOOKUP_CALL, BAD_CALL, "Paris"])
    template = next(t for kinds, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in kinds)
    # where the answer starts in the prompt's text: CHAT_TEMPLATE's generation prompt (Qwen's <|im_start|>assistant)
    tokenizer.response_template = {**copying.deepcopy(template), "start_anchor": "assistant :"}
    return tokenizer


def parsed_stream_items(tokenizer, answer: str, sizes=(1,), **options) -> tuple[list, object]:
    """The queue items of `answer`'s tokens streamed (`sizes[i % len(sizes)]` tokens at the i-th delivery) through a
    `RequestStream` with the tokenizer's response parser and its fallback without tool calls, as the server builds
    them, with the log probability -1 - i for token i where `options` has a `sampling`; and the stream."""
    import types

    from transformers.cli.serving.utils import build_response_parser

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.parsing import tool_call_fallback

    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    prompt = []  # a parser's prefix without Qwen 3's anchor would be read as the answer's start
    ids = tokenizer.encode(answer, add_special_tokens=False)
    loop = asyncio.new_event_loop()
    try:
        stream = request_stream(
            loop,
            tokenizer,
            prompt,
            response_parser=build_response_parser(tokenizer, model, prompt),
            tool_call_fallback=tool_call_fallback(tokenizer, model, prompt),
            **options,
        )
        start, delivery = 0, 0
        while start < len(ids):
            end = min(start + sizes[delivery % len(sizes)], len(ids))
            logprobs = None if "sampling" not in options else [TokenLogprob(-1.0 - i, ()) for i in range(start, end)]
            stream.deliver(ids[start:end], end == len(ids), logprobs=logprobs)
            start, delivery = end, delivery + 1
        return [stream.queue.get_nowait() for _ in range(stream.queue.qsize())], stream
    finally:
        loop.close()


def test_a_tool_call_that_is_no_json_stays_in_the_streamed_content():
    """As vLLM's tool parsers read it: a tool call the response parser cannot read (no JSON) leaves the stream going
    on with its text in the content, after the reasoning and content already sent and without repeating them, then
    the text after it; the content is the one-body answer's read without tool calls. A tool call read before it
    stays a tool call (the content goes on from the text after it). Without the fallback the stream ends with an
    error."""
    import types

    from transformers.cli.serving.utils import ReasoningText, ToolCall, _StreamError, parse_assistant_message

    from hf_paged.serve.parsing import without_tool_calls

    tokenizer = parsed_tokenizer()
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    answer = f"the quick <tool_call> {BAD_CALL} </tool_call> the fox"
    items, _ = parsed_stream_items(tokenizer, answer)
    assert items[-1] is None and not any(isinstance(item, (ToolCall, _StreamError)) for item in items)
    content = "".join(item for item in items if type(item) is str)
    ids = tokenizer.encode(answer, add_special_tokens=False)
    one_body = parse_assistant_message(without_tool_calls(tokenizer, model), model, ids, [])
    assert content.strip() == one_body[0] == f"the quick <tool_call> {BAD_CALL} </tool_call> the fox"
    with pytest.raises(ValueError):
        parse_assistant_message(tokenizer, model, ids, [])

    items, _ = parsed_stream_items(tokenizer, f"<think> the fox </think> the quick <tool_call> {BAD_CALL}")
    assert "".join(item for item in items if isinstance(item, ReasoningText)).strip() == "the fox"
    assert "".join(item for item in items if type(item) is str).strip() == f"the quick <tool_call> {BAD_CALL}"

    items, _ = parsed_stream_items(tokenizer, f"the <tool_call> {LOOKUP_CALL} </tool_call> fox <tool_call> {BAD_CALL}")
    assert [(c.name, c.arguments) for c in items if isinstance(c, ToolCall)] == [("lookup", '{"key": "Paris"}')]
    assert " ".join("".join(item for item in items if type(item) is str).split()) == f"the fox <tool_call> {BAD_CALL}"

    loop = asyncio.new_event_loop()
    try:  # the parser alone: the stream ends with the parser's error
        stream = request_stream(loop, tokenizer, [2], response_parser=_parser_of(tokenizer))
        for token in ids:
            stream.deliver([token], False)
        assert any(isinstance(item, _StreamError) for item in list(stream.queue._queue))
    finally:
        loop.close()


@pytest.mark.parametrize("stop, last_texts", [("og", [" lazy", " d"]), ("azy d", [" l", ""])])
@pytest.mark.parametrize("kind", ["plain", "parsed", "content", "parsed content"])
def test_a_stream_cut_at_a_stop_string_ends_its_log_probabilities_as_one_body(kind, stop, last_texts):
    """The Engine may run several steps ahead of a stream's deliveries, so one delivery can hold a stop string's token
    and tokens after it. Those are not the answer's: the stream's log probabilities end at the stop string's token,
    as in one body and as when the tokens come one by one (a chat stream, parsed or not; the Responses API's message
    pieces, which failed the stream there). The token's text ends where the stop string starts inside it, as in one
    body, a parsed stream's and a message piece's too; a stop string that starts inside a token and ends in the next
    holds that token's text back whole (with its log probability), so no chunk sent it uncut."""
    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _logprob_rows
    from hf_paged.serve.stream import GeneratedIds, LoggedText

    tokenizer = parsed_tokenizer()
    answer = "<think> the quick </think> the lazy dog jumps over the fox"
    options = dict(sampling={"logprobs": 0}, stop_strings=(stop,), content_logprobs=kind.endswith("content"))
    kept = tokenizer.encode("<think> the quick </think> the lazy dog", add_special_tokens=False)
    for sizes in ((1,), (3,), (100,)):
        if kind.startswith("parsed"):
            items, stream = parsed_stream_items(tokenizer, answer, sizes=sizes, **options)
        else:
            ids, loop = tokenizer.encode(answer, add_special_tokens=False), asyncio.new_event_loop()
            stream, start = request_stream(loop, tokenizer, [], **options), 0
            while start < len(ids) and not stream.stopped:
                end = min(start + sizes[0], len(ids))
                logprobs = [TokenLogprob(-1.0 - i, ()) for i in range(start, end)]
                stream.deliver(ids[start:end], end == len(ids), logprobs=logprobs)
                start = end
            items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
            loop.close()
        assert items[-1] is None and all(isinstance(item, str) for item in items[:-1]), (sizes, items)
        assert stream.stopped and stream.token_ids == kept
        one_body = GeneratedIds(stream.token_ids, stream.logprobs, text_offset=0, text_end=len(stream._final_text()))
        texts = [row[0] for row in _logprob_rows(tokenizer, one_body)]
        assert texts[-2:] == last_texts
        tokens, records = kept, [-1.0 - i for i in range(len(kept))]
        if kind == "parsed content":  # the message's pieces: the content after the reasoning
            texts, tokens, records = texts[-3:], tokens[-3:], records[-3:]
        if kind.endswith("content"):
            pieces = [*stream.content_logprobs_queue, *filter(None, [stream.content_logprobs_tail])]
            logged = [(t, record) for piece in pieces for t, record in zip(piece, piece.logprobs)]
        else:
            pieces = [item.generated for item in items if isinstance(item, LoggedText)]
            logged = [(t, record) for generated in pieces for t, record in zip(generated, generated.logprobs)]
        assert [row[0] for piece in pieces for row in _logprob_rows(tokenizer, piece)] == texts, sizes
        assert [t for t, _ in logged] == tokens, sizes
        assert [record.logprob for _, record in logged] == records, sizes


@pytest.mark.parametrize("stop", ["the lazy", "he l", "the"])
@pytest.mark.parametrize("size", [1, 2])
def test_a_stop_string_that_starts_in_the_first_token_ends_a_stream_with_log_probabilities(stop, size):
    """Text held back for a stop string from the start of the answer's first token: the stream ends where one body
    does, with the same text and tokens."""
    from hf_paged.engine.sampling import TokenLogprob

    tokenizer = make_tokenizer()
    ids = tokenizer.encode("the lazy dog", add_special_tokens=False)
    loop = asyncio.new_event_loop()
    answers = []
    for streaming in (False, True):
        stream, start = (
            request_stream(loop, tokenizer, [], sampling={"logprobs": 0}, stop_strings=(stop,), streaming=streaming),
            0,
        )
        while start < len(ids) and not stream.stopped:
            end = min(start + size, len(ids))
            stream.deliver(ids[start:end], end == len(ids), logprobs=[TokenLogprob(-1.0, ())] * (end - start))
            start = end
        if streaming:
            items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
            assert items[-1] is None
            answers.append(("".join(items[:-1]), stream.token_ids, stream.stopped))
        else:
            answers.append((loop.run_until_complete(stream.result), stream.token_ids, stream.stopped))
    loop.close()
    assert answers[0] == answers[1] and answers[0][2]
    assert stop not in answers[0][0] and len(answers[0][1]) < len(ids)


def test_a_responses_stream_cut_inside_a_character_gives_its_last_token_the_replacement_character():
    """max_tokens ends an answer inside a character's UTF-8 bytes: the Responses stream's last delta is U+FFFD, and
    its token's text too, as in one body (a token of a character not complete adds nothing but at the end)."""
    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _logprob_rows
    from hf_paged.serve.stream import GeneratedIds

    spm = byte_fallback_tokenizer()
    ids = [spm.token_to_id("\u2581fox"), spm.token_to_id("<0xE2>")]
    records = [TokenLogprob(-1.0, ()), TokenLogprob(-2.0, ())]
    loop = asyncio.new_event_loop()
    stream = request_stream(loop, spm, [], sampling={"logprobs": 0}, content_logprobs=True)
    for index, token in enumerate(ids):
        stream.deliver([token], index == 1, logprobs=[records[index]], finish_reason="length")
    items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    loop.close()
    streamed = [row[0] for piece in stream.content_logprobs_queue for row in _logprob_rows(spm, piece)]
    one_body = GeneratedIds(ids, records, text_end=len("fox\ufffd"))
    assert items == ["fox", "\ufffd", None]
    assert streamed == [row[0] for row in _logprob_rows(spm, one_body)] == ["fox", "\ufffd"]


def test_a_stream_reads_on_past_tool_calls_it_cannot_read_in_random_answers():
    """Random answers of words, reasoning, tool calls that are JSON, that are not, and cut ones, and stray markers,
    delivered one to several tokens at a time: the stream never errs, sends each word once (as content or
    reasoning), never sends a tool call both as a call and as content, and with no call sent is the whole text read
    at once (with tool calls, or without where they cannot be read); a chat stream's log probabilities are every
    token's once, in order; the Responses API's go with the content deltas, one entry each, each token at most once,
    a word's token with the delta that has the word."""
    import random

    from transformers.cli.serving.utils import (
        ReasoningText,
        ResponseParser,
        ToolCall,
        _StreamError,
        response_events_to_chunks,
    )

    from hf_paged.serve.stream import LoggedText

    tokenizer = parsed_tokenizer()
    unparsed = {**tokenizer.response_template, "fields": dict(tokenizer.response_template["fields"])}
    del unparsed["fields"]["tool_calls"]

    def read_at_once(text: str) -> tuple[str, str]:
        for template in (tokenizer.response_template, unparsed):
            parser = ResponseParser(template, prefix="")
            try:
                items = response_events_to_chunks(parser.feed(text) + parser.finalize()[1])
            except ValueError:
                continue
            kinds = [(isinstance(item, ReasoningText), item) for item in items if isinstance(item, str)]
            return "".join(t for r, t in kinds if not r), "".join(t for r, t in kinds if r)
        raise AssertionError(text)

    words = ["quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paged", "cache", "keeps", "keys", "values"]
    segments = [["W"], ["<think>", "W", "</think>"], ["<tool_call>", LOOKUP_CALL, "</tool_call>"]]
    segments += [["<tool_call>", BAD_CALL, "</tool_call>"], ["<tool_call>", BAD_CALL], ["<tool_call>", LOOKUP_CALL]]
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>", LOOKUP_CALL, BAD_CALL]
    rng = random.Random(0)
    for _ in range(300):
        left, parts = iter(rng.sample(words, len(words))), []
        for _ in range(rng.randint(1, 6)):
            segment = [rng.choice(markers)] if rng.random() < 0.25 else rng.choice(segments)
            parts += [next(left) if part == "W" else part for part in segment]
        answer = " ".join(parts)
        ids = tokenizer.encode(answer, add_special_tokens=False)
        sizes = rng.choice([[1], [2], [3], [len(ids)], [rng.randint(1, 4) for _ in range(5)]])
        items, _ = parsed_stream_items(tokenizer, answer, sizes, sampling={"logprobs": 0})
        assert not any(isinstance(item, _StreamError) for item in items), answer
        content = "".join(item for item in items if isinstance(item, str) and not isinstance(item, ReasoningText))
        reasoning = "".join(item for item in items if isinstance(item, ReasoningText))
        logged = [r.logprob for item in items if isinstance(item, LoggedText) for r in item.generated.logprobs]
        assert logged == [-1.0 - i for i in range(len(ids))], (answer, sizes)
        for word in set(parts) & set(words):
            assert (content.split() + reasoning.split()).count(word) == 1, (answer, sizes, content, reasoning)
        calls = [item for item in items if isinstance(item, ToolCall)]
        assert content.count(LOOKUP_CALL) + len(calls) <= answer.count(LOOKUP_CALL), (answer, sizes, content)
        if not calls:
            assert [t.split() for t in (content, reasoning)] == [t.split() for t in read_at_once(answer)], answer

        items, stream = parsed_stream_items(tokenizer, answer, sizes, sampling={"logprobs": 0}, content_logprobs=True)
        deltas = [item for item in items if isinstance(item, str) and not isinstance(item, ReasoningText)]
        assert len(stream.content_logprobs_queue) == len(deltas), (answer, sizes)
        taken = [[round(-r.logprob - 1) for r in piece.logprobs] for piece in stream.content_logprobs_queue]
        flat = [index for piece in taken for index in piece]
        assert flat == sorted(set(flat)), (answer, sizes, taken)
        for delta, indices in zip(deltas, taken):
            for word in set(delta.split()) & set(words):
                assert tokenizer.convert_tokens_to_ids(word) in [ids[i] for i in indices], (answer, sizes, delta)


def _parser_of(tokenizer):
    from transformers.cli.serving.utils import ResponseParser

    return ResponseParser(tokenizer.response_template, prefix="")


def test_the_log_probabilities_of_a_tool_call_read_as_content_go_with_it():
    """The Responses API's streamed log probabilities (`content_logprobs`) of an answer whose tool call is read as
    content: the call's tokens are the content's too, so every token's comes with a content piece; and a chat
    stream's (each chunk's) add up to every token once."""
    from hf_paged.serve.stream import LoggedText

    tokenizer = parsed_tokenizer()
    answer = f"the quick <tool_call> {BAD_CALL} </tool_call> the fox"
    count = len(tokenizer.encode(answer, add_special_tokens=False))
    _, stream = parsed_stream_items(tokenizer, answer, sampling={"logprobs": 0}, content_logprobs=True)
    queued = [r.logprob for piece in stream.content_logprobs_queue for r in piece.logprobs]
    assert queued == [-1.0 - index for index in range(count)]
    items, _ = parsed_stream_items(tokenizer, answer, sampling={"logprobs": 0})
    logged = [r.logprob for item in items if isinstance(item, LoggedText) for r in item.generated.logprobs]
    assert logged == [-1.0 - index for index in range(count)]


@pytest.fixture(scope="module")
def parsed_server(tmp_path_factory, request):
    """(server, tokenizer) of a model whose tokenizer reads answers with Qwen 3's response template
    (`parsed_tokenizer`)."""
    model_dir = tmp_path_factory.mktemp("parsed_model")
    tokenizer = parsed_tokenizer()
    tokenizer.save_pretrained(model_dir)
    make_model(len(tokenizer)).save_pretrained(model_dir)
    log_path = str(tmp_path_factory.mktemp("parsed_log") / "server.log")
    arguments = ["--max-memory", str(NUM_BLOCKS * BYTES_PER_BLOCK), "--max-num-seqs", "8"]
    server, process = start_server(str(model_dir), log_path, arguments)
    request.addfinalizer(lambda: stop_server(process))
    return server, tokenizer


def test_an_answer_cut_inside_a_tool_call_keeps_its_text_over_http(parsed_server):
    """A model that writes a tool call `max_tokens` cuts (here logit_bias keeps it writing <tool_call>): the
    response parser cannot read the call, and the answer is its text as content, with no tool call and finish reason
    "length" (as vLLM's tool parsers answer), in one body (where it was a server error) and streamed (the same
    content, where the call's text was dropped)."""
    server, tokenizer = parsed_server
    opener = tokenizer.convert_tokens_to_ids("<tool_call>")
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logit_bias": {str(opener): 100}}
    status, answer = post_json(server, "/v1/chat/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["message"]["content"].split() == ["<tool_call>"] * 4 and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "length"
    streamed = events_of(server, "/v1/chat/completions", body)
    assert not any("error" in event for event in streamed), streamed
    deltas = [event["choices"][0]["delta"] for event in streamed if event.get("choices")]
    assert "".join(delta.get("content") or "" for delta in deltas).strip() == choice["message"]["content"]
    assert not any(delta.get("tool_calls") for delta in deltas)
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_response_whose_tool_call_is_no_json_answers_its_text_with_its_log_probabilities():
    """The Responses API in one body, over an answer whose tool call is no JSON: the message is its text (the call's
    included), with no function call, and with `include: ["message.output_text.logprobs"]` the log probabilities of
    the tokens making up that text, the call's included; the answer is generated once."""
    import types

    from transformers import GenerationConfig

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import PagedResponseHandler
    from hf_paged.serve.options import OPTIONS_ATTRIBUTE, RequestOptions
    from hf_paged.serve.stream import GeneratedIds

    tokenizer = parsed_tokenizer()
    ids = tokenizer.encode(f"the quick <tool_call> {BAD_CALL} </tool_call>", add_special_tokens=False)
    records = [TokenLogprob(-1.0 - index, ()) for index in range(len(ids))]
    calls = []

    class Manager:
        async def generate_non_streaming(self, *args, **kwargs):
            calls.append(args)
            generated = GeneratedIds(ids, records, finish_reason="stop")
            return tokenizer.decode(ids, skip_special_tokens=True), 3, generated

    config = GenerationConfig(max_new_tokens=16)
    setattr(config, OPTIONS_ATTRIBUTE, RequestOptions(logprobs=0, content_logprobs=True))
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    handler = object.__new__(PagedResponseHandler)
    body = {"input": "hello there", "include": ["message.output_text.logprobs"]}
    answer = asyncio.run(
        handler._non_streaming("id", model, tokenizer, "m", body, {"input_ids": []}, config, Manager())
    )
    response = json.loads(answer.body)
    assert len(calls) == 1 and [item["type"] for item in response["output"]] == ["message"]
    part = response["output"][0]["content"][0]
    assert part["text"] == f"the quick <tool_call> {BAD_CALL} </tool_call>"
    assert [entry["logprob"] for entry in part["logprobs"]] == [record.logprob for record in records]


def test_a_parsed_answer_cut_at_a_stop_string_is_cut_in_one_body_as_streamed(parsed_server):
    """An answer the response parser reads, cut at a stop string: in one body (chat and the Responses API) its
    content ends where the stop string starts, as streamed (transformers' handlers parse the answer's ids, whose
    decode runs past it)."""
    server, _tokenizer = parsed_server
    messages = [{"role": "user", "content": "quick keeps"}]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    status, whole = post_json(server, "/v1/chat/completions", body)
    assert status == 200, whole
    text = whole["choices"][0]["message"]["content"]
    words = text.split()
    assert len(set(words)) > 2, text  # enough to cut inside
    stop = next(word for word in words[1:] if word != words[0])
    expected = text[: text.index(stop)].strip()
    status, cut = post_json(server, "/v1/chat/completions", body | {"stop": [stop]})
    assert status == 200, cut
    assert cut["choices"][0]["message"]["content"] == expected and cut["choices"][0]["finish_reason"] == "stop"
    streamed = events_of(server, "/v1/chat/completions", body | {"stop": [stop]})
    deltas = [event["choices"][0]["delta"] for event in streamed if event.get("choices")]
    assert "".join(delta.get("content") or "" for delta in deltas).strip() == expected

    request = {"input": "quick keeps", "max_output_tokens": 12, "temperature": 0}
    config = json.dumps({"stop_strings": [stop], "max_new_tokens": 12})
    status, response = post_json(server, "/v1/responses", request | {"generation_config": config})
    assert status == 200, response
    assert response_text(response) == expected
    # its message's log probabilities: the same tokens in one body as streamed, the stop string's last
    logged = request | {"generation_config": config, "include": ["message.output_text.logprobs"], "top_logprobs": 0}
    status, response = post_json(server, "/v1/responses", logged)
    assert status == 200, response
    entries = [(entry["token"], entry["logprob"]) for entry in response["output"][-1]["content"][0]["logprobs"]]
    done = next(e for e in events_of(server, "/v1/responses", logged) if e["type"] == "response.output_text.done")
    assert entries and [(entry["token"], entry["logprob"]) for entry in done["logprobs"]] == entries
    assert "".join(token for token, _ in entries).strip() == expected


def test_parallel_tool_calls_false_keeps_the_first_tool_call_of_each_choice():
    """Chat's `parallel_tool_calls: false`, as vLLM holds it: an answer keeps each choice's first tool call, in one
    body and streamed (where each call comes whole in a chunk of its own, index >= 1 for the later ones)."""
    from hf_paged.serve.handlers import _first_tool_call_only, _first_tool_call_streamed

    calls = [{**tool_call("{}"), "id": f"call_{i}"} for i in range(3)]
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": calls}}, {"index": 1}]}
    kept = _first_tool_call_only(answer)["choices"]
    assert kept[0]["message"]["tool_calls"] == calls[:1] and kept[1] == {"index": 1}

    def chunk(choice: int, delta: dict) -> str:
        return f"data: {json.dumps({'choices': [{'index': choice, 'delta': delta}]})}\n\n"

    sent = [chunk(0, {"role": "assistant"}), chunk(0, {"tool_calls": [{**calls[0], "index": 0}]})]
    sent += [
        chunk(1, {"tool_calls": [{**calls[0], "index": 0}]}) + chunk(0, {"tool_calls": [{**calls[1], "index": 1}]})
    ]
    sent += [chunk(0, {"tool_calls": [{**calls[2], "index": 2}]}), chunk(0, {}), "data: [DONE]\n\n"]

    async def received() -> list[str]:
        async def chunks():
            for piece in sent:
                yield piece

        return [piece async for piece in _first_tool_call_streamed(chunks())]

    got = "".join(asyncio.run(received()))
    assert got == "".join([sent[0], sent[1], chunk(1, {"tool_calls": [{**calls[0], "index": 0}]}), sent[4], sent[5]])


def test_parallel_tool_calls_false_keeps_the_first_function_call_of_a_response():
    """The Responses API's `parallel_tool_calls: false`, as chat's: the response's first function call only, in one
    body and streamed (the later calls' events dropped: added, arguments done, done; the last event's output too),
    the events after them numbered without gaps (sequence_number, and output_index of a later item)."""
    from hf_paged.serve.handlers import _as_requested, _Recorder, _response_events

    calls = [{"type": "function_call", "id": f"fc_{i}", "call_id": f"fc_{i}", "name": "lookup"} for i in range(3)]
    message = {"type": "message", "id": "msg_0", "status": "completed", "content": []}
    body = {"input": "hi", "tools": [LOOKUP_TOOL_ITEM], "parallel_tool_calls": False}
    answer = _as_requested({"status": "completed", "output": [message, *calls]}, body)
    assert answer["output"] == [message, calls[0]] and answer["parallel_tool_calls"] is False
    assert _as_requested({"output": [message, *calls]}, body | {"parallel_tool_calls": True})["output"] == [
        message,
        *calls,
    ]

    numbers = itertools.count()

    def event(kind: str, **fields) -> str:
        return f"data: {json.dumps({'type': kind, 'sequence_number': next(numbers), **fields})}\n\n"

    def item_events(item: dict, index: int) -> str:
        return (
            event("response.output_item.added", item=item, output_index=index)
            + event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments="{}")
            + event("response.output_item.done", item=item, output_index=index)
        )

    later = {**calls[2], "type": "reasoning", "id": "rs_0"}  # an item after a dropped call
    sent = [event("response.created", response={"output": []})]
    sent += [item_events(item, index) for index, item in enumerate([*calls, later])]
    sent += [event("response.completed", response={"status": "completed", "output": [message, *calls, later]})]

    async def received() -> list[dict]:
        async def chunks():
            for piece in sent:
                yield piece

        recorder = _Recorder(None)
        return [piece async for piece in _response_events(chunks(), recorder, body)]

    got = [json.loads(e.removeprefix("data: ")) for e in "".join(asyncio.run(received())).split("\n\n") if e]
    item_kinds = ["response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in got] == ["response.created", *item_kinds, *item_kinds, "response.completed"]
    assert got[1]["item"]["id"] == "fc_0" and got[4]["item"]["id"] == "rs_0"
    assert got[-1]["response"]["output"] == [message, calls[0], later]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e.get("output_index") for e in got[1:-1]] == [0, 0, 0, 1, 1, 1]


def test_a_responses_input_of_items_continues_a_tool_call(server, saved):
    """An earlier response's function call and its output, sent back as the input's first items (no role), are read
    as the assistant's tool call and the tool's message (transformers' handler read them as one user message's
    content parts, and refused them): the answer is generate()'s on that conversation."""
    items = [
        {"type": "function_call", "call_id": "call_0", "name": "lookup", "arguments": '{"key": "a"}'},
        {"type": "function_call_output", "call_id": "call_0", "output": "a block table"},
        {"role": "user", "content": "hello there"},
    ]
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [tool_call('{"key": "a"}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": "a block table"},
        {"role": "user", "content": "hello there"},
    ]
    request = {"input": items, "tools": [LOOKUP_TOOL_ITEM], "max_output_tokens": 4, "temperature": 0}
    status, response = post_json(server, "/v1/responses", request)
    assert status == 200, response
    assert response["usage"]["input_tokens"] == len(chat_ids(saved, messages))
    assert response_text(response) == greedy_text(saved, chat_ids(saved, messages), 4)


def test_penalties_and_logit_bias_change_the_output(server, saved):
    """OpenAI's penalties and logit bias, and transformers' generation_config.repetition_penalty, reach the Engine's
    sampler: each changes greedy output as its definition says."""
    prompt = "the quick brown fox jumps over the lazy dog and the quick brown fox"

    def words(**fields) -> list[str]:
        body = {"model": server.model_dir, "prompt": prompt, "max_tokens": 24, "temperature": 0} | fields
        status, answer = post_json(server, "/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["text"].split()

    plain = words()
    assert words(frequency_penalty=2.0) != plain and words(presence_penalty=2.0) != plain
    assert words(generation_config=json.dumps({"repetition_penalty": 2.0})) != plain
    fox = saved[1].convert_tokens_to_ids("fox")
    assert set(words(logit_bias={str(fox): 100})) == {"fox"}


@pytest.mark.parametrize(
    "fields, param, bad",
    [
        (lambda vocab: {"logit_bias": {str(vocab): 5}}, "logit_bias", lambda vocab: vocab),
        (lambda vocab: {"stop_token_ids": [3, vocab + 7]}, "stop_token_ids", lambda vocab: vocab + 7),
        (
            lambda vocab: {"generation_config": {"eos_token_id": [vocab]}},
            "generation_config.eos_token_id",
            lambda vocab: vocab,
        ),
        (
            lambda vocab: {"generation_config": json.dumps({"eos_token_id": -1})},
            "generation_config.eos_token_id",
            lambda vocab: -1,
        ),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(server, saved, fields, param, bad):
    """A token id the request names (logit_bias, stop_token_ids, its generation_config's eos_token_id) that the model
    cannot produce is a 400 naming the field, the id and the allowed range, in one body and before a stream starts
    (as vLLM refuses an out-of-vocabulary logit_bias); an id inside the vocabulary is taken."""
    vocab = saved[2].config.vocab_size
    body = {"model": server.model_dir, "prompt": "the quick brown fox", "max_tokens": 2, "temperature": 0}
    for stream in (False, True):
        status, answer = post_json(server, "/v1/completions", body | fields(vocab) | {"stream": stream})
        assert status == 400 and answer["error"]["param"] == param, answer
        message = answer["error"]["message"]
        assert f"{param} holds token id {bad(vocab)}," in message and f"[0, {vocab})" in message, message
    status, answer = post_json(server, "/v1/completions", body | {"stop_token_ids": [vocab - 1]})
    assert status == 200, answer


def test_generation_config_as_text_or_object_keeps_the_models_eos_and_its_max_new_tokens(server):
    import types

    from transformers import GenerationConfig

    from hf_paged.serve.handlers import PagedCompletionHandler
    from hf_paged.serve.options import engine_sampling

    state = types.SimpleNamespace(_compile=False)  # what the handler reads of the server's generation state
    handler = PagedCompletionHandler(model_manager=None, generation_state=state, served_model_name="m")
    model_config = GenerationConfig(eos_token_id=[3, 4], max_new_tokens=1024)
    for value in ({"top_k": 50}, json.dumps({"top_k": 50})):
        config = handler._build_generation_config({"prompt": "hi", "generation_config": value}, model_config)
        sampling = engine_sampling(config)
        assert config.top_k == 50 and sampling["eos_token_id"] == 3 and sampling["stop_token_ids"] == (4,)
    # over HTTP: an object, and max_new_tokens inside it, are what the request asks for
    body = {"model": server.model_dir, "prompt": "the quick brown fox", "temperature": 0}
    status, answer = post_json(server, "/v1/completions", body | {"generation_config": {"max_new_tokens": 4}})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    status, answer = post_json(server, "/v1/completions", body | {"stream": True, "logit_bias": {"99999": 5}})
    assert status == 400 and answer["error"]["param"] == "logit_bias"
    status, answer = post_json(server, "/v1/audio/transcriptions", {})
    assert status == 400 and "text model" in answer["error"]["message"]


def test_the_models_repetition_penalty_and_min_new_tokens_apply_unless_the_request_sets_them():
    """A model whose generation config sets `repetition_penalty` (Qwen2.5's 1.05) or `min_new_tokens`: its requests
    get them, as generate() with that config and vLLM's defaults from it do, unless the request sets its own (its
    field, or a `generation_config`, which replaces the model's whole); a setting the Engine does not apply is one
    the server warns of when it starts."""
    import types

    from transformers import GenerationConfig

    from hf_paged.serve.handlers import PagedChatCompletionHandler
    from hf_paged.serve.options import engine_sampling

    state = types.SimpleNamespace(_compile=False)
    handler = PagedChatCompletionHandler(model_manager=None, generation_state=state, served_model_name="m")
    model_config = GenerationConfig(repetition_penalty=1.05, min_new_tokens=2, eos_token_id=3)
    base = {"messages": [{"role": "user", "content": "hi"}]}

    def sampling(body):
        return engine_sampling(handler._build_generation_config(base | body, model_config))

    assert (sampling({})["repetition_penalty"], sampling({})["min_tokens"]) == (1.05, 2)
    assert sampling({"repetition_penalty": 1.0})["repetition_penalty"] == 1.0
    assert sampling({"frequency_penalty": 0.5})["repetition_penalty"] == 1.05  # OpenAI's penalty is another one
    assert sampling({"min_tokens": 0})["min_tokens"] == 0
    replaced = sampling({"generation_config": {"temperature": 0.5}})
    assert (replaced["repetition_penalty"], replaced["min_tokens"]) == (1.0, 0)
    # what the server warns of at start: a setting of the model's the requests would not get
    from hf_paged.serve.fields import unapplied_generation_settings

    assert unapplied_generation_settings(model_config) == {}
    beams = GenerationConfig(num_beams=4, no_repeat_ngram_size=3, top_k=20, min_p=0.05, pad_token_id=0, max_length=4096)
    assert unapplied_generation_settings(beams) == {"num_beams": 4, "no_repeat_ngram_size": 3}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": "hello", "max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hello"}], "max_tokens": 3}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 7}], "max_tokens": 3},
            "messages[0].content",
        ),
        ("/v1/chat/completions", CHAT_BODY | {"generation_config": "{not json"}, "generation_config"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/responses", {"max_output_tokens": 3}, "input"),
        # bodies transformers' handlers fail on with a 500, or whose parts they drop without a word
        ("/v1/chat/completions", chat_with([{"type": "text"}]), "messages[0].content[0].text"),
        ("/v1/chat/completions", chat_with([{"type": "text", "text": 5}]), "messages[0].content[0].text"),
        ("/v1/chat/completions", chat_with([IMAGE_PART]), "messages[0].content[0].type"),
        ("/v1/chat/completions", chat_with([{"type": "foo"}]), "messages[0].content[0].type"),
        ("/v1/chat/completions", chat_with("hi", tool_calls="call it"), "messages[0].tool_calls"),
        ("/v1/chat/completions", chat_with("", tool_calls=[tool_call("{no json")]), TOOL_ARGUMENTS),
        ("/v1/chat/completions", chat_with("", tool_calls=[tool_call(None)]), TOOL_ARGUMENTS),
        ("/v1/chat/completions", chat_with("", tool_calls=[5]), "messages[0].tool_calls[0]"),
        ("/v1/chat/completions", CHAT_BODY | {"tools": "all of them"}, "tools"),
        ("/v1/chat/completions", CHAT_BODY | {"tools": [5]}, "tools[0]"),
        ("/v1/chat/completions", CHAT_BODY | {"chat_template_kwargs": None}, "chat_template_kwargs"),
        ("/v1/chat/completions", CHAT_BODY | {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"tokenize": False}},
            "chat_template_kwargs.tokenize",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"generation_config": {"max_new_tokens": -1}},
            "generation_config.max_new_tokens",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"generation_config": {"max_new_tokens": "5"}},
            "generation_config.max_new_tokens",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"generation_config": {"stop_strings": 5}},
            "generation_config.stop_strings",
        ),
        (  # as the top-level stop: "" would end the answer at its first character
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 3, "generation_config": {"stop_strings": [""]}},
            "generation_config.stop_strings",
        ),
        (
            "/v1/responses",
            {"input": "hi", "max_output_tokens": 3, "generation_config": {"stop_strings": ""}},
            "generation_config.stop_strings",
        ),
        ("/v1/chat/completions", chat_with("hi \ud800"), "messages[0].content"),
        ("/v1/completions", {"prompt": "hi \ud800", "max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": "false"}, "stream"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream_options": {}}, "stream_options"),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            "/v1/responses",
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": []}]},
            "tools[0].parameters",
        ),
        ("/v1/responses", {"input": [{"type": "input_text"}], "max_output_tokens": 3}, "input"),
        ("/v1/responses", {"input": [{"text": "hi"}], "max_output_tokens": 3}, "input"),
        ("/v1/responses", {"input": "hi", "instructions": 5, "max_output_tokens": 3}, "instructions"),
        ("/v1/responses", {"input": "hi", "parallel_tool_calls": 2, "max_output_tokens": 3}, "parallel_tool_calls"),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"continue_final_message": True}},
            "chat_template_kwargs.continue_final_message",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"truncation": True, "max_length": 2}},
            "chat_template_kwargs.truncation",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"chat_template": "{% for %}"}},
            "chat_template_kwargs.chat_template",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs.messages",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 3, "generation_config": {"seed": 2**70}},
            "generation_config.seed",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logit_bias": {"5_0": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 50}, "min_tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 2, "generation_config": {"min_new_tokens": 50}},
            "generation_config.min_new_tokens",
        ),
        ("/v1/completions", {"prompt": [["hi"]], "max_tokens": 2}, "prompt"),  # a list in the list of one prompt
        ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [5, True], "max_tokens": 2}, "prompt"),  # JSON's true is no token id
        ("/v1/completions", {"prompt": [5, -1], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "\ud800x": 1}, None),  # a field's name
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": {"id": "m"}}, "model"),
        ("/v1/chat/completions", CHAT_BODY | {"model": 5}, "model"),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"documents": 5}},
            "chat_template_kwargs.documents",
        ),
        (
            "/v1/chat/completions",
            CHAT_BODY | {"chat_template_kwargs": {"documents": [5]}},
            "chat_template_kwargs.documents",
        ),
        (
            "/v1/responses",
            {"input": "hi", "generation_config": {"cache_implementation": 21}},
            "generation_config.cache_implementation",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "generation_config": {"pad_token_id": [0]}},
            "generation_config.pad_token_id",
        ),
        ("/v1/completions", {"prompt": "hi", "generation_config": {"use_cache": "no"}}, "generation_config.use_cache"),
        (
            "/v1/completions",
            {"prompt": "hi", "generation_config": {"repetition_penalty": -1}},
            "generation_config.repetition_penalty",
        ),
    ],
)
def test_malformed_bodies_get_400_and_the_connection_keeps_working(server, path, body, param):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    # (a lone surrogate is spelled as JSON's escape, which json.dumps would double)
    text = json.dumps(body).replace("\\\\ud800", "\\ud800")
    try:
        for _ in range(2):  # the same keep-alive connection, twice
            connection.request("POST", path, text, {"Content-Type": "application/json"})
            response = connection.getresponse()
            error = json.loads(response.read())
            assert response.status == 400 and error["error"]["param"] == param, error
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), JSON_HEADERS)
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2
    finally:
        connection.close()
    assert "Traceback" not in server.log()


def test_streamed_text_equals_the_answer_in_one_body(server):
    """Greedy chats streamed and not: the same text to the last character (a token that ends inside a multi-byte
    character is held back by the incremental decoder; the stream's end gives it as the whole decode does)."""

    async def both(client, index: int) -> tuple[str, str]:
        request = dict(
            model=server.model_dir,
            messages=[{"role": "user", "content": f"tell me about {SENTENCES[index % len(SENTENCES)]}"}],
            max_tokens=9 + index % 5,
            temperature=0,
        )
        whole = (await client.chat.completions.create(**request)).choices[0].message.content
        pieces = []
        async for chunk in await client.chat.completions.create(**request, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        return whole, "".join(pieces)

    async def run():
        async with server.async_client() as client:
            return await asyncio.gather(*(both(client, index) for index in range(16)))

    for whole, streamed in asyncio.run(run()):
        assert streamed == whole


def test_a_stream_ending_inside_a_character_ends_as_the_whole_decode():
    """Byte-level tokens: the last token is the first byte of "é". The incremental decoder holds it back; the stream's
    end sends what the whole decode shows for it, so streamed and non-streamed text end alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(["hi"], trainers.BpeTrainer(initial_alphabet=alphabet, show_progress=False))
    token_ids = tokenizer.encode("hi é").ids[:-1]  # "é" is two byte tokens: stop after the first
    whole = tokenizer.decode(token_ids)
    loop = asyncio.new_event_loop()
    try:
        stream = request_stream(loop, tokenizer, [1], decode=tokenizer.decode)
        stream.deliver(token_ids, finished=True)
        pieces = []
        while (piece := stream.queue.get_nowait()) is not None:
            pieces.append(piece)
    finally:
        loop.close()
    assert whole.endswith("\ufffd") and "".join(pieces) == whole


def test_streams_end_with_done(server):
    for path, body in [
        ("/v1/chat/completions", CHAT_BODY | {"stream": True}),
        ("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "stream": True}),
    ]:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            connection.request("POST", path, json.dumps(body), JSON_HEADERS)
            response = connection.getresponse()
            events = [line for line in response.read().decode().split("\n\n") if line.strip()]
        finally:
            connection.close()
        assert response.status == 200
        assert events[-1] == "data: [DONE]" and all(event != "data: [DONE]" for event in events[:-1])


def test_ignore_eos_and_stop(server, saved):
    prompt = "the quick brown fox jumps over"
    full = greedy_completion(saved, saved[1](prompt)["input_ids"], 12)
    stop = full.split()[3]
    response = server.client.completions.create(
        model=server.model_dir,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].text == full[: full.index(stop)]
    stream = server.client.completions.create(
        model=server.model_dir, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == full[: full.index(stop)]


def answer_and_stream(server, body: dict) -> tuple[dict, str, str | None]:
    """/v1/completions' answer to `body` in one JSON body, and the text and finish reason of the same streamed."""
    status, answer = post_json(server, "/v1/completions", body)
    assert status == 200, answer
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body | {"stream": True}), JSON_HEADERS)
        events = connection.getresponse().read().decode().split("\n\n")
    finally:
        connection.close()
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    reasons = [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]
    return answer, "".join(choice.get("text", "") for choice in choices), (reasons or [None])[-1]


def test_a_stop_string_before_min_tokens_does_not_count(server, saved):
    """vLLM's rule: no stop string ends a request before `min_tokens` tokens; the answer in one body is cut where the
    stream was, at the first stop string that ends after them."""
    prompt = "the quick brown fox"
    full = greedy_completion(saved, saved[1](prompt)["input_ids"], 8)
    first = full.split()[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": first, "min_tokens": 2}
    answer, streamed, _ = answer_and_stream(server, body)
    end = full.index(first) + len(first)  # the first word's end: the first token's text
    rest = full[end:]
    expected = full[: end + rest.index(first)] if first in rest else full
    assert answer["choices"][0]["text"] == streamed == expected


def test_a_stop_on_the_last_allowed_token_finishes_with_stop(server, saved):
    """The handlers name the finish reason from the token count; a stop string or stop token that ends the request on
    its last allowed token is still "stop", as the Engine's reason, in one body and streamed."""
    _, tokenizer, _ = saved
    prompt = "the quick brown fox"
    full_ids = greedy_ids(saved, tokenizer(prompt)["input_ids"], 5)
    last = tokenizer.decode(full_ids[4:5])
    if last in tokenizer.decode(full_ids[:4]):
        pytest.skip("the fifth token's text comes earlier too")
    base = {"prompt": prompt, "max_tokens": 5, "temperature": 0}
    for extra in ({"stop": last}, {"stop_token_ids": [full_ids[4]]}):
        answer, _, streamed_reason = answer_and_stream(server, base | extra)
        assert answer["choices"][0]["finish_reason"] == streamed_reason == "stop", extra
        assert answer["usage"]["completion_tokens"] == 5
    answer, _, streamed_reason = answer_and_stream(server, base)
    assert answer["choices"][0]["finish_reason"] == streamed_reason == "length"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"generation_config": {"max_new_tokens": 5000}}, "generation_config.max_new_tokens"),
    ],
)
def test_a_max_tokens_past_the_room_left_is_named_as_the_request_named_it(server, fields, param):
    status, error = post_json(server, "/v1/chat/completions", {"messages": CHAT_BODY["messages"]} | fields)
    assert status == 400 and error["error"]["param"] == param and param in error["error"]["message"], error


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_a_stream_carries_its_usage_only_when_asked(server, include_usage):
    """OpenAI's rule: with `stream_options.include_usage`, one last chunk with no choices and the usage; otherwise no
    chunk has a usage."""
    body = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0, "stream": True}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
        events = [e for e in connection.getresponse().read().decode().split("\n\n") if e.strip()]
    finally:
        connection.close()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    with_usage = [chunk for chunk in chunks if chunk.get("usage")]
    if include_usage:
        assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert with_usage == [] and chunks[-1]["choices"][0]["finish_reason"] == "length"


def token_pieces(tokenizer, token_ids: list[int], previous: list[int] = (), ended: bool = False) -> list[str]:
    """The text each of `token_ids` adds to an answer after `previous`, as the logprobs entries spell them (`ended`:
    the answer ends with them)."""
    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _logprob_rows
    from hf_paged.serve.stream import GeneratedIds

    text_end = len(tokenizer.decode([*previous, *token_ids], skip_special_tokens=True)) if ended else None
    generated = GeneratedIds(token_ids, [TokenLogprob(-1.0, ())] * len(token_ids), list(previous), text_end=text_end)
    return [piece for piece, _, _ in _logprob_rows(tokenizer, generated)]


def test_logprob_texts_are_decoded_in_one_call_as_the_answer_is():
    """The tokens' texts are decoded in one call of the Rust tokenizer, except for a tokenizer that cleans up
    spaces after it (transformers' `clean_up_tokenization_spaces`, a WordPiece-era setting): decoded as its answer
    is, one by one."""
    from hf_paged.serve.handlers import _decode_all

    tokenizer = make_tokenizer()
    sequences = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in SENTENCES[3:5]] + [[2, 5, 3]]
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    assert _decode_all(tokenizer, sequences) == _decode_all(tokenizer._tokenizer, sequences) == expected
    tokenizer.clean_up_tokenization_spaces = True
    cleaned = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    assert cleaned != expected  # " ," and " ?" lose their spaces
    assert _decode_all(tokenizer, sequences) == cleaned


def test_logprob_texts_decode_one_by_one_for_a_tokenizer_that_decodes_its_own_way():
    """A tokenizer class that overrides `_decode` (as CPM's does) decodes the texts itself; a BPE tokenizer that sets
    `clean_up_tokenization_spaces` (which transformers skips for BPE) decodes them in one call."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hf_paged.serve.handlers import _batch_decodes_alike, _decode_all

    class Joined(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).replace(" ", "")

    joined = Joined(tokenizer_object=make_tokenizer()._tokenizer)
    sequences = [joined(text, add_special_tokens=False)["input_ids"] for text in SENTENCES[:2]]
    assert not _batch_decodes_alike(joined)
    assert _decode_all(joined, sequences) == [joined.decode(ids, skip_special_tokens=True) for ids in sequences]
    assert " " not in _decode_all(joined, sequences)[0]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=80, show_progress=False))
    cleaning = PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=True)
    sequences = [cleaning(text)["input_ids"] for text in SENTENCES[3:5]]
    assert _batch_decodes_alike(cleaning)
    assert _decode_all(cleaning, sequences) == [cleaning.decode(ids, skip_special_tokens=True) for ids in sequences]


def test_an_echoed_prompt_that_ends_inside_a_character_keeps_its_last_text():
    """Token ids that end inside a UTF-8 character (byte-level BPE): the echoed text (the ids decoded) ends with
    U+FFFD, and so does the prompt's last token's text, so the texts add up to the answer and the generated tokens'
    offsets point at theirs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs
    from hf_paged.serve.stream import GeneratedIds

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(["plain words"], trainers.BpeTrainer(vocab_size=280, initial_alphabet=alphabet))
    ids = tokenizer.encode("café au lait").ids
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt, new = ids[:cut], ids[cut : cut + 3]
    echo, completion = tokenizer.decode(prompt), tokenizer.decode(new)
    record = TokenLogprob(-1.0, ())
    generated = GeneratedIds(
        new,
        [record] * len(new),
        text_offset=len(echo),
        text_end=len(echo) + len(completion),
        prompt_ids=prompt,
        prompt_logprobs=[record] * (len(prompt) - 1),
    )
    logprobs = _completion_logprobs(tokenizer, generated)
    text = echo + completion
    assert "".join(logprobs["tokens"]) == text and logprobs["tokens"][len(prompt) - 1].endswith("\ufffd")
    assert all(text[o:].startswith(t) for o, t in zip(logprobs["text_offset"], logprobs["tokens"]))


def test_a_string_prompts_token_texts_are_those_of_its_ids():
    """Byte-level BPE spells an emoji or a CJK character in several tokens, all of one span of the string: the
    string's pieces give the character to the token that completes it, as its ids decoded do, so a prompt has the
    same token texts sent as a string or as ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs
    from hf_paged.serve.stream import GeneratedIds

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    record = TokenLogprob(-1.0, ())
    for text in ("a😀 the quick", "好 天气 fox", "the  quick"):
        ids = tokenizer.encode(text).ids
        tokens = {}
        for prompt_text in (text, None):
            generated = GeneratedIds([], [], prompt_ids=ids, prompt_logprobs=[record] * (len(ids) - 1))
            generated.prompt_text = prompt_text
            tokens[prompt_text] = _completion_logprobs(tokenizer, generated)["tokens"]
        assert tokens[text] == tokens[None] and "".join(tokens[text]) == text, tokens


def test_logprob_texts_of_byte_fallback_tokens_add_up():
    """A ByteFallback decoder (Llama 2, Mistral, Gemma: a character outside the vocabulary as <0x..> byte tokens)
    ends a decode inside a character with one U+FFFD per byte: the texts give the character to the token that
    completes it, and add up to the answer, also where characters of bytes follow each other ("😀😃", "日本") or a
    newline's byte (the decoder joins a run of bytes, so a run ending inside a character decodes to U+FFFD whole)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs
    from hf_paged.serve.stream import GeneratedIds

    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}}  # byte tokens: plain vocabulary entries
    for piece in ("\u2581", "t", "h", "e", "f", "o", "x", "\u2581t", "\u2581th", "\u2581the"):
        vocab.setdefault(piece, len(vocab))
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>"])
    ids = tokenizer.encode("😀 the fox").ids
    assert len([i for i in ids if tokenizer.id_to_token(i).startswith("<0x")]) == 4  # the emoji's bytes
    generated = GeneratedIds(ids, [TokenLogprob(-1.0, ())] * len(ids))
    tokens = _completion_logprobs(tokenizer, generated)["tokens"]
    assert "".join(tokens) == tokenizer.decode(ids) and tokens[:5] == ["", "", "", "", "😀"], tokens  # "▁", 4 bytes
    ids = tokenizer.encode("😀😃 the 日本\n😀 fox").ids
    generated = GeneratedIds(ids, [TokenLogprob(-1.0, ())] * len(ids))
    tokens = _completion_logprobs(tokenizer, generated)["tokens"]
    assert "".join(tokens) == tokenizer.decode(ids) == "😀😃 the 日本\n😀 fox", tokens
    assert tokens[1:9] == ["", "", "", "😀", "", "", "", "😃"], tokens  # each emoji with its last byte


def test_streamed_logprob_texts_are_spelled_as_the_answer_in_one_body():
    """A WordPiece tokenizer whose transformers wrapper cleans up spaces after its Rust decoder (" ," -> ","): the
    streamed pieces' token texts are spelled with the handler's tokenizer, as the answer in one body and its echoed
    prompt are, so they add up to the echoed text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    wordpiece.train_from_iterator(["hello , world . it ' s nice !"] * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    prompt, new = tokenizer("hello , world .")["input_ids"], tokenizer("nice !", add_special_tokens=False)["input_ids"]
    echo = tokenizer.decode(prompt, skip_special_tokens=True)
    assert echo != wordpiece.decode(prompt)  # the clean-up changes it
    loop = asyncio.new_event_loop()
    try:
        stream = request_stream(loop, wordpiece, prompt, tokenizer, sampling={"logprobs": 0, "prompt_logprobs": 0})
        record = TokenLogprob(-1.0, ())
        stream.deliver(new, True, logprobs=[record] * len(new), prompt_logprobs=[record] * (len(prompt) - 1))
        first = stream.queue.get_nowait()
    finally:
        loop.close()
    tokens = _completion_logprobs(first.tokenizer, first.generated)["tokens"]
    assert "".join(tokens[: len(prompt)]) == echo, tokens


def test_logprob_tokens_add_up_to_the_text_with_a_sentencepiece_tokenizer():
    """Metaspace (SentencePiece's spelling, as Llama 2, Mistral and Gemma tokenize): a token decoded alone loses its
    leading space; decoded after the tokens before it, each token's text adds up to the answer, a skipped special
    token adding nothing, also for a piece that starts mid-answer (a streamed chunk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(special_tokens=["<unk>", "<s>"], vocab_size=60, show_progress=False)
    tokenizer.train_from_iterator([SENTENCES[0]] * 3, trainer)
    ids = tokenizer.encode("the quick brown fox jumps").ids
    ids = ids[:3] + [tokenizer.token_to_id("<s>")] + ids[3:]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(tokenizer.decode([i]) for i in ids) != text  # alone, the spaces are lost
    pieces = token_pieces(tokenizer, ids)
    assert "".join(pieces) == text and pieces[3] == ""
    assert "".join(pieces[4:]) == "".join(token_pieces(tokenizer, ids[4:], ids[:4]))


def test_logprob_texts_add_up_after_a_run_of_special_tokens():
    """A word-level decoder puts a space between words, and a decode with skip_special_tokens leaves special tokens
    out: a word after more special tokens than the context a token is decoded after keeps its space, in one answer
    and in a streamed chunk that starts after them."""
    tokenizer = make_tokenizer()
    words = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    specials = [tokenizer.pad_token_id, tokenizer.eos_token_id] * 6
    ids = [*words[:2], *specials, *words[2:]]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "the quick brown fox"
    assert "".join(token_pieces(tokenizer, ids, ended=True)) == text
    split = 2 + len(specials)
    assert "".join(token_pieces(tokenizer, ids[:split]) + token_pieces(tokenizer, ids[split:], ids[:split])) == text


def test_a_character_split_over_tokens_is_the_text_of_the_token_that_completes_it():
    """Byte-level BPE (GPT-2's, Llama 3's): a character of several UTF-8 bytes can span tokens, and a decode that
    ends inside one ends with U+FFFD. The token that completes the character adds it whole, the tokens before it add
    "", so the texts add up to the answer (each decoded with U+FFFD they would not); an answer that ends inside a
    character ends with what its decode ends with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}  # bytes only: é and 🦊 span tokens
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = "café 🦊 ok"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode()) and tokenizer.decode(ids[:4]).endswith("\ufffd")
    pieces = token_pieces(tokenizer, ids, ended=True)
    assert "".join(pieces) == text and pieces[3:5] == ["", "é"] and pieces[6:10] == ["", "", "", "🦊"]
    for split in range(1, len(ids)):  # a streamed chunk starting anywhere, the first inside a character too
        assert "".join(token_pieces(tokenizer, ids[:split]) + token_pieces(tokenizer, ids[split:], ids[:split])) == text
    cut = ids[:8]  # ends two bytes into the fox
    assert "".join(token_pieces(tokenizer, cut, ended=True)) == tokenizer.decode(cut)
    # U+FFFD in the answer (three bytes each, or bytes that begin no character, as a sampled model may give): each
    # is its own text, held back one token at most, however many in a row (more than the 8 tokens decoded before).
    stray = tokenizer.encode("é").ids[1]  # a continuation byte alone
    for answer in (tokenizer.encode("a" + "\ufffd" * 3 + "b").ids, [ids[0], *[stray] * 10, ids[1]]):
        assert "".join(token_pieces(tokenizer, answer, ended=True)) == tokenizer.decode(answer)


def test_generation_config_seed_seeds_the_request(server):
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    texts = []
    for fields in ({"generation_config": {"seed": 1}}, {"generation_config": {"seed": 1}}, {"seed": 1}):
        status, answer = post_json(server, "/v1/completions", body | fields)
        assert status == 200, answer
        texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]


def test_a_list_of_one_prompt_is_that_prompt(server):
    body = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    status, alone = post_json(server, "/v1/completions", body)
    status_list, listed = post_json(server, "/v1/completions", body | {"prompt": [body["prompt"]]})
    assert status == status_list == 200, listed
    assert listed["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_prompt_of_token_ids_runs_as_given(server, saved):
    """OpenAI's and vLLM's completions prompt of token ids (or a list of one such list): those ids run as they are,
    without the tokenizer, in one body and streamed, and the answer is generate()'s on them; an id past the model's
    vocabulary is refused naming prompt."""
    prompt_ids = saved[1]("the quick brown fox")["input_ids"]
    expected = greedy_completion(saved, prompt_ids, 5)
    body = {"max_tokens": 5, "temperature": 0}
    for prompt in (prompt_ids, [prompt_ids]):
        status, answer = post_json(server, "/v1/completions", body | {"prompt": prompt})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected and answer["usage"]["prompt_tokens"] == len(prompt_ids)
    events = events_of(server, "/v1/completions", body | {"prompt": prompt_ids})
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == expected
    vocab_size = saved[2].config.vocab_size
    status, answer = post_json(server, "/v1/completions", body | {"prompt": [*prompt_ids, vocab_size]})
    assert status == 400 and answer["error"]["param"] == "prompt" and str(vocab_size) in answer["error"]["message"]


def test_several_prompts_are_answered_as_one_request(server, saved):
    """OpenAI's list of prompts (strings or token ids): each runs as a request of its own, at once; prompt i's `n`
    choices are choices i * n to i * n + n - 1 (vLLM's order), each generate()'s, in one body and streamed, and the
    usage adds up every prompt's tokens. A refused prompt refuses the request naming it, and the prompts before it,
    whose streams never started, stop at once."""
    tokenizer = saved[1]
    texts = ["the quick brown fox", "a paged cache keeps", "hello world"]
    prompts = [texts[0], tokenizer(texts[1])["input_ids"], texts[2]]
    prompt_ids = [tokenizer(text)["input_ids"] for text in texts]
    expected = [greedy_completion(saved, ids, 4) for ids in prompt_ids for _ in range(2)]
    usage = {"prompt_tokens": sum(map(len, prompt_ids)), "completion_tokens": 4 * 6}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, answer = post_json(server, "/v1/completions", body)
    assert status == 200, answer
    assert [choice["index"] for choice in answer["choices"]] == list(range(6))
    assert [choice["text"] for choice in answer["choices"]] == expected and answer["usage"] == usage
    events = events_of(server, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    streamed = [""] * 6
    for event in events:
        for choice in event.get("choices") or []:
            streamed[choice["index"]] += choice["text"]
    assert streamed == expected and events[-1]["usage"] == usage

    aborted = server.metrics()["hf_paged_requests_aborted_total"]
    refused = {"prompt": [texts[0], texts[1], [5, saved[2].config.vocab_size]], "max_tokens": 500, "ignore_eos": True}
    status, answer = post_json(server, "/v1/completions", refused | {"stream": True})
    assert status == 400 and answer["error"]["param"] == "prompt[2]", answer
    metrics = server.wait_count("hf_paged_requests_aborted_total", aborted + 2)
    assert metrics["hf_paged_requests_running"] == 0 and metrics["hf_paged_kv_blocks_used"] == 0
    assert metrics["hf_paged_requests_aborted_total"] == aborted + 2
    status, answer = post_json(server, "/v1/completions", refused | {"prompt": [texts[0], ""]})
    assert status == 400 and answer["error"]["param"] == "prompt[1]", answer
    status, answer = post_json(server, "/v1/completions", {"prompt": ["", "a"], "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "prompt[0]", answer
    assert answer["error"]["message"].startswith("prompt[0] must be a non-empty string"), answer


def test_echo_starts_each_completion_with_its_prompt(server, saved):
    """`echo: true`: each choice's text is its prompt's (the string, or the token ids decoded) and then generate()'s,
    in one body and streamed, for several prompts and samples."""
    tokenizer = saved[1]
    texts = ["the quick brown fox", "a paged cache keeps"]
    prompts = [texts[0], tokenizer(texts[1])["input_ids"]]
    completions = [greedy_completion(saved, tokenizer(text)["input_ids"], 3) for text in texts]
    expected = [texts[0] + completions[0]] * 2 + [tokenizer.decode(prompts[1]) + completions[1]] * 2
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "echo": True}
    status, answer = post_json(server, "/v1/completions", body)
    assert status == 200, answer
    assert [choice["text"] for choice in answer["choices"]] == expected
    assert answer["usage"]["completion_tokens"] <= 12
    streamed = [""] * 4
    for event in events_of(server, "/v1/completions", body):
        for choice in event.get("choices") or []:
            streamed[choice["index"]] += choice["text"]
    assert streamed == expected
    status, answer = post_json(server, "/v1/completions", {"prompt": texts[0], "echo": True, "max_tokens": 2})
    assert status == 200 and answer["choices"][0]["text"].startswith(texts[0]), answer
    status, answer = post_json(server, "/v1/completions", {"prompt": texts[0], "max_tokens": 2, "echo": 1})
    assert status == 400 and answer["error"]["param"] == "echo", answer


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, saved):
    """lm-eval's loglikelihood request (token ids, `echo: true, logprobs: 1, max_tokens: 1`): the answer's logprobs
    start with the prompt's tokens, the first one's null, each other's the log-softmax of the saved model's logits
    at the position before it; then the generated token's, as without echo. The tokens' texts add up to the echoed
    text and their offsets point into it; streamed, the first chunk carries the prompt's, and the chunks add up to
    the answer in one body. A string prompt (its tokenization's ids) and a second prompt get theirs too."""
    _, tokenizer, model = saved
    text = "the quick brown fox jumps over"
    prompt = tokenizer(text)["input_ids"]
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    status, answer = post_json(server, "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    scored = [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(scored, abs=1e-3)
    best = [expected[i - 1].max().item() for i in range(1, len(prompt))]
    assert [max(top.values()) for top in logprobs["top_logprobs"][1:]] == pytest.approx(
        best + [logprobs["token_logprobs"][-1]], abs=1e-3
    )
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert choice["text"].startswith(tokenizer.decode(prompt, skip_special_tokens=True))
    assert all(choice["text"][o:].startswith(t) for o, t in zip(logprobs["text_offset"], logprobs["tokens"]))
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(prompt) + 1)]
    status, plain = post_json(server, "/v1/completions", body | {"echo": False})
    assert status == 200, plain
    assert plain["choices"][0]["logprobs"]["tokens"] == logprobs["tokens"][-1:]
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"][-1:])
    chunks = [c["choices"][0] for c in events_of(server, "/v1/completions", body | {"max_tokens": 3}) if c["choices"]]
    status, longer = post_json(server, "/v1/completions", body | {"max_tokens": 3})
    assert status == 200, longer
    pieces = [chunk["logprobs"] for chunk in chunks if chunk.get("logprobs")]
    assert len(pieces[0]["tokens"]) > len(prompt)  # the prompt's, with the first generated token's
    for field in ("tokens", "text_offset"):
        assert [v for piece in pieces for v in piece[field]] == longer["choices"][0]["logprobs"][field]
    streamed = [v for piece in pieces for v in piece["token_logprobs"]]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(longer["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert "".join(chunk["text"] for chunk in chunks) == longer["choices"][0]["text"]
    status, both = post_json(server, "/v1/completions", body | {"prompt": [text, prompt[2:]], "logprobs": 0})
    assert status == 200, both
    for choice, ids in zip(both["choices"], (prompt, prompt[2:])):  # the string's ids are its tokenization's
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1 and choice["logprobs"]["top_logprobs"][1] == {}
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert both["choices"][0]["logprobs"]["token_logprobs"][1:-1] == pytest.approx(scored, abs=1e-3)
    # strings that their ids do not decode back to (a special token's text, spaces, an unknown word): the answer
    # starts with the string, its tokens' texts are the spans of it they cover, and every offset points at its text
    for string in ("<s> " + text, "the  quick,brown", "zzz unknownword fox "):
        for stream in (False, True):
            request = body | {"prompt": string, "max_tokens": 2}
            if stream:
                chunks = [c["choices"][0] for c in events_of(server, "/v1/completions", request) if c["choices"]]
                answer = "".join(chunk["text"] for chunk in chunks)
                pieces = [chunk["logprobs"] for chunk in chunks if chunk.get("logprobs")]
                scored = {field: [v for piece in pieces for v in piece[field]] for field in ("tokens", "text_offset")}
            else:
                status, one = post_json(server, "/v1/completions", request)
                assert status == 200, one
                answer, scored = one["choices"][0]["text"], one["choices"][0]["logprobs"]
            assert answer.startswith(string) and "".join(scored["tokens"]) == answer, (string, scored)
            assert all(answer[o:].startswith(t) for o, t in zip(scored["text_offset"], scored["tokens"]))
            assert len(scored["tokens"]) == len(tokenizer(string)["input_ids"]) + 2
    # lm-eval's is_greedy: a continuation the model would have generated scores each token as its top one, exactly
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, len(prompt) :].tolist()
    status, scoring = post_json(server, "/v1/completions", body | {"prompt": prompt + greedy})
    assert status == 200, scoring
    scores = scoring["choices"][0]["logprobs"]
    context = slice(len(prompt), len(prompt) + len(greedy))
    assert [max(top.values()) for top in scores["top_logprobs"][context]] == scores["token_logprobs"][context]
    assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0


def test_max_tokens_0_with_echo_answers_the_prompt_alone(server, saved):
    """`max_tokens: 0` with `echo` (OpenAI's way to score a prompt): the answer is the prompt, with its tokens' log
    probabilities when asked (those of the answer with one token more, without that token), 0 completion tokens,
    finish reason "length", in one body and streamed; without echo, 0 is refused naming max_tokens."""
    tokenizer = saved[1]
    prompt = tokenizer("a paged cache keeps the keys")["input_ids"]
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    status, answer = post_json(server, "/v1/completions", body)
    assert status == 200, answer
    status, longer = post_json(server, "/v1/completions", body | {"max_tokens": 1})
    assert status == 200, longer
    text = tokenizer.decode(prompt, skip_special_tokens=True)
    choice, logprobs = answer["choices"][0], answer["choices"][0]["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
    expected = {field: values[: len(prompt)] for field, values in longer["choices"][0]["logprobs"].items()}
    assert logprobs["tokens"] == expected["tokens"] and logprobs["text_offset"] == expected["text_offset"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected["token_logprobs"][1:], abs=1e-5)
    chunks = [c["choices"][0] for c in events_of(server, "/v1/completions", body) if c["choices"]]
    assert "".join(chunk["text"] for chunk in chunks) == text and chunks[-1]["finish_reason"] == "length"
    pieces = [chunk["logprobs"] for chunk in chunks if chunk.get("logprobs")]
    assert len(pieces) == 1 and pieces[0]["tokens"] == logprobs["tokens"]
    status, plain = post_json(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0})
    assert status == 200 and plain["choices"][0]["text"] == text and "logprobs" not in plain["choices"][0], plain
    assert plain["usage"]["completion_tokens"] == 0
    status, refused = post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert status == 400 and refused["error"]["param"] == "max_tokens" and "echo" in refused["error"]["message"]
    assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0


def test_a_disconnect_while_a_chunk_is_sent_closes_the_stream_at_once():
    """A client gone while a chunk is being sent (the app's `send` raises, the body generator is suspended at its
    yield): the response closes the generator then, so its handler cancels the Engine request without waiting for
    garbage collection."""
    import gc

    from starlette.requests import ClientDisconnect
    from starlette.responses import StreamingResponse

    from hf_paged.serve.handlers import ClosingStreamingResponse, _ending_with_done

    closed = []

    async def body():
        try:
            for index in range(100):
                yield f"data: {index}\n\n"
        finally:
            closed.append(True)

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            raise OSError("the client went away")

    async def receive():
        await asyncio.sleep(3600)

    async def closed_once_sent(response) -> bool:
        """Whether the body generator has been closed when the response returns (the event loop still runs: at its
        end `asyncio.run` closes every async generator left)."""
        closed.clear()
        with pytest.raises(ClientDisconnect):  # starlette's name for the OSError of `send`
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return bool(closed)

    gc.disable()  # no collection may close it instead
    try:
        stock = StreamingResponse(_ending_with_done(body()), media_type="text/event-stream")
        assert not asyncio.run(closed_once_sent(stock))  # starlette's own response leaves it suspended
        closing = ClosingStreamingResponse.like(stock, _ending_with_done(body()))
        assert asyncio.run(closed_once_sent(closing))
        assert closing.media_type == "text/event-stream" and closing.raw_headers == stock.raw_headers
    finally:
        gc.enable()


class _Submitted:
    """A `RequestStream` as a response sees it: cancelled or not."""

    cancelled = 0

    def cancel(self):
        self.cancelled += 1


@pytest.mark.parametrize("spec_version", ["2.4", "2.3"])
def test_a_response_whose_body_never_started_cancels_its_engine_requests(spec_version):
    """A client gone before a stream's body started (its first `send` never returned; under ASGI 2.3 starlette's
    disconnect listener ends the response before the body's task runs): the body generator runs no code, so only
    the response can cancel the Engine requests the handler submitted."""
    from starlette.responses import StreamingResponse

    from hf_paged.serve.handlers import ClosingStreamingResponse

    started = []

    async def body():
        started.append(True)
        yield "data: 0\n\n"

    async def send(message):
        await asyncio.sleep(3600)  # the client never reads the headers

    async def receive():
        if spec_version == "2.3":
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def cancelled_before_the_body(response):
        task = asyncio.ensure_future(response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    streams = [_Submitted(), _Submitted()]
    stock = StreamingResponse(body(), media_type="text/event-stream")
    response = ClosingStreamingResponse.like(stock, body(), streams)
    asyncio.run(cancelled_before_the_body(response))
    assert not started
    assert [stream.cancelled for stream in streams] == [1, 1]


def test_a_handler_hands_its_response_every_engine_request_it_submitted():
    """The handler records each Engine request it submits (`recording_submissions`, in the tasks it starts too): a
    stream's response gets them all to cancel, and a handler that fails cancels those already in."""
    from starlette.responses import StreamingResponse

    from hf_paged.serve import manager
    from hf_paged.serve.fields import CHAT
    from hf_paged.serve.handlers import ClosingStreamingResponse, RequestOptionsMixin

    async def submit() -> _Submitted:
        stream = _Submitted()
        manager._SUBMITTED.get().append(stream)  # as EngineManager.generate_streaming records it
        return stream

    class Stock:
        def __init__(self, fail: bool):
            self.fail = fail

        async def handle_request(self, body, request_id):
            self.made = [await submit(), await asyncio.ensure_future(submit())]
            if self.fail:
                raise RuntimeError("a later sample was refused")

            async def events():
                yield "data: {}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    class Handler(RequestOptionsMixin, Stock):
        endpoint = CHAT

    handler = Handler(False, served_model_name="m")
    response = asyncio.run(handler.handle_request({"stream": True}, "r"))
    assert isinstance(response, ClosingStreamingResponse) and list(response.streams) == handler.made
    assert [stream.cancelled for stream in handler.made] == [0, 0]

    failing = Handler(True, served_model_name="m")
    with pytest.raises(RuntimeError):
        asyncio.run(failing.handle_request({"stream": True}, "r"))
    assert [stream.cancelled for stream in failing.made] == [1, 1]


def test_disconnect_frees_its_blocks(server):
    before = server.wait_idle()
    # streaming: the client reads a few events and goes away
    stream = server.client.completions.create(
        model=server.model_dir, prompt="a paged cache keeps the keys", max_tokens=1000, temperature=0, stream=True
    )
    for _, _chunk in zip(range(3), stream):
        pass
    assert server.metrics()["hf_paged_kv_blocks_used"] > 0
    stream.close()
    after = server.wait_idle()
    assert after["hf_paged_requests_running"] == after["hf_paged_kv_blocks_used"] == 0
    assert after["hf_paged_requests_aborted_total"] == before["hf_paged_requests_aborted_total"] + 1

    # non-streaming: the client sends the request and closes its connection before the answer
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = {"model": server.model_dir, "prompt": "a paged cache keeps the keys", "max_tokens": 1000}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while server.metrics()["hf_paged_kv_blocks_used"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    after = server.wait_idle()
    assert after["hf_paged_requests_running"] == after["hf_paged_kv_blocks_used"] == 0
    assert after["hf_paged_requests_aborted_total"] == before["hf_paged_requests_aborted_total"] + 2
    assert after["hf_paged_generation_tokens_total"] - before["hf_paged_generation_tokens_total"] < 2000


def test_a_client_leaving_an_n_choices_request_aborts_every_sample(server):
    before = server.wait_idle()
    stream = server.client.completions.create(
        model=server.model_dir, prompt="a paged cache keeps the keys", max_tokens=1000, temperature=0, n=3, stream=True
    )
    for _, _chunk in zip(range(6), stream):
        pass
    assert server.metrics()["hf_paged_kv_blocks_used"] > 0
    stream.close()
    after = server.wait_idle()
    assert after["hf_paged_requests_running"] == after["hf_paged_kv_blocks_used"] == 0
    assert after["hf_paged_requests_aborted_total"] == before["hf_paged_requests_aborted_total"] + 3
    status, _ = post_json(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 2})  # still serving
    assert status == 200


def test_requests_without_max_tokens_run_at_once_and_the_model_is_pinned(server):
    """Without max_tokens a request may run to the pool's and the model's limits (about 1,000 tokens here), but
    admission reserves only --decode-reserve-tokens (256) of growth for it: three such streams run together in a pool
    of 1,024 tokens, where reserving each one's whole room would run one at a time."""
    before = server.wait_idle()
    running = server.metrics_while_streaming([f"stream {i} of three" for i in range(3)])["hf_paged_requests_running"]
    assert running == 3
    after = server.wait_idle()
    # Each ended once: aborted when its client went away, or finished at the pool's limit if it got there first (a
    # fast step on an idle machine can run one to ~1,000 tokens before the server notices the disconnect).
    ended = ("hf_paged_requests_aborted_total", "hf_paged_requests_finished_total")
    assert sum(after[name] - before[name] for name in ended) == 3
    assert after["hf_paged_kv_blocks_used"] == before["hf_paged_kv_blocks_used"]
    for path in ("/load_model", "/reset"):
        status, error = post_json(server, path, {"model": "gpt2"})
        assert status == 400 and "start another server" in error["error"]["message"]


def test_sixteen_streams_without_max_tokens_all_run_at_once_in_a_341_block_pool(saved, tmp_path):
    """The pool of a 64 MiB server on a small model: 341 blocks of 16 tokens. Sixteen streams without max_tokens may
    each run to the model's position limit (2,048 here); admission reserves --decode-reserve-tokens (256) of growth
    for each, so all sixteen run together (about 17 blocks each), where reserving each one's whole room would run
    two."""
    arguments = ["--max-memory", str(341 * BYTES_PER_BLOCK)]
    server, process = start_server(saved[0], str(tmp_path / "server.log"), arguments)
    try:
        assert server.metrics()["hf_paged_kv_blocks"] == 341

        metrics = server.metrics_while_streaming([f"stream {i} of sixteen" for i in range(16)])
        running, waiting = metrics["hf_paged_requests_running"], metrics["hf_paged_requests_waiting"]
        assert (running, waiting) == (16, 0)
        assert server.wait_idle()["hf_paged_kv_blocks_used"] == 0
    finally:
        stop_server(process)


def test_an_api_key_a_served_name_and_a_length_limit(saved):
    """In process (the app without a listening socket): /v1/ answers 401 without the key; requests name the model by
    --served-model-name (another name: 404 model_not_found); --max-model-len bounds prompt and output together."""
    from fastapi.testclient import TestClient

    from hf_paged.serve.app import ServeConfig, build_app

    model_dir = saved[0]
    config = ServeConfig(
        model=model_dir,
        max_memory=str(NUM_BLOCKS * BYTES_PER_BLOCK),
        dtype="float32",
        api_key="k",
        served_model_name="tiny",
        max_model_len=12,
    )
    app, manager = build_app(config)
    try:
        client = TestClient(app)
        key = {"Authorization": "Bearer k"}
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 401
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_request_error"
        right = client.post("/v1/completions", json=body, headers=key)
        assert right.status_code == 200 and right.json()["usage"]["completion_tokens"] == 2
        assert right.json()["model"] == "tiny"
        assert client.get("/health").status_code == 200  # outside /v1/: no key needed
        assert [m["id"] for m in client.get("/v1/models", headers=key).json()["data"]] == ["tiny"]
        other = client.post("/v1/completions", json=body | {"model": model_dir}, headers=key)
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        too_long = client.post("/v1/completions", json=body | {"max_tokens": 20}, headers=key)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        unbounded = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello"}, headers=key)
        assert unbounded.json()["usage"]["total_tokens"] <= 12
        # a prompt of every position: scored alone (max_tokens 0 with echo), never generated after
        full = {"model": "tiny", "prompt": [5, 6, 7] * 4, "echo": True, "logprobs": 1, "max_tokens": 0}
        scored = client.post("/v1/completions", json=full, headers=key)
        assert scored.status_code == 200 and len(scored.json()["choices"][0]["logprobs"]["tokens"]) == 12
        past = client.post("/v1/completions", json=full | {"max_tokens": 1}, headers=key)
        assert past.status_code == 400 and past.json()["error"]["param"] == "prompt"
    finally:
        manager.stop()


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["/no/such/directory"], "no model directory at '/no/such/directory'"),
        (["{model}", "--device", "cuda:7"], "--device cuda:7: this machine has"),
        (["{model}", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["{model}", "--device", "cpu", "--compile"], "--compile needs a CUDA device (its compiled forwards run"),
    ],
)
def test_the_command_line_says_what_is_wrong_in_one_line(saved, arguments, words):
    arguments = [argument.format(model=saved[0]) for argument in arguments]
    result = subprocess.run(
        [sys.executable, "-m", "hf_paged", "serve", *arguments], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr


def test_an_unknown_model_name_is_404(server):
    status, error = post_json(server, "/v1/completions", {"model": "gpt-4o", "prompt": "hello", "max_tokens": 2})
    assert status == 404 and error["error"]["code"] == "model_not_found" and error["error"]["param"] == "model"
    status, models = 200, json.loads(server.get("/v1/models")[1])
    assert [model["id"] for model in models["data"]] == [server.model_dir]


def test_the_manager_forgets_what_it_has_handed_back(saved):
    """In process: the Engine thread hands each request's tokens back and the Engine forgets it; the prefix cache
    and the counters carry on."""
    from transformers import GenerationConfig

    from hf_paged import BlockPool, Engine
    from hf_paged.serve.limits import RequestLimits
    from hf_paged.serve.manager import EngineManager

    tokenizer = saved[1]
    model = make_model(len(tokenizer))  # its own copy: the Engine switches a model's attention implementation
    pool = BlockPool.for_model(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4)
    manager = EngineManager(engine, RequestLimits.for_engine(engine))
    prompt_ids = tokenizer(" ".join(SENTENCES[:3]))["input_ids"]
    num_full_blocks = len(prompt_ids) // BLOCK_SIZE

    async def ask() -> list[int]:
        config = GenerationConfig(max_new_tokens=4, do_sample=False)
        _text, num_prompt_tokens, token_ids = await manager.generate_non_streaming(
            model, tokenizer, {"input_ids": prompt_ids}, config, "request"
        )
        assert num_prompt_tokens == len(prompt_ids)
        return token_ids

    def holds(engine, request_id: int) -> bool:
        try:
            engine.request(request_id)
        except ValueError:
            return False
        return True

    try:
        outputs = [asyncio.run(ask()) for _ in range(4)]
        assert all(output == outputs[0] and len(output) == 4 for output in outputs)
        assert not any(holds(manager.engine, request_id) for request_id in range(4))  # handed back, forgotten
        deadline = time.monotonic() + 10
        while manager.metrics.num_finished < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the Engine thread publishes its metrics just after it answers
        metrics = manager.metrics
        assert metrics.num_finished == 4 and metrics.generation_tokens == 16
        assert metrics.prefix_hit_tokens == 3 * num_full_blocks * BLOCK_SIZE  # requests 2 to 4 reuse the prompt's
        assert metrics.num_used_blocks == metrics.num_running == metrics.num_waiting == 0
    finally:
        manager.stop()


def test_a_missing_serving_seam_fails_at_startup(monkeypatch):
    from hf_paged.errors import ServeUnavailable
    from hf_paged.serve import compat

    compat.check_seams()  # the installed transformers has every seam
    seams = {**compat.SEAMS, "transformers.cli.serving.utils": {"GenerationState": ("get_engine",)}}
    monkeypatch.setattr(compat, "SEAMS", seams)
    with pytest.raises(ServeUnavailable, match=r"transformers>=5\.23,<5\.25.*GenerationState\.get_engine"):
        compat.check_seams()


def test_a_failing_step_is_retried_then_fails_only_the_requests_in_flight(saved, monkeypatch):
    """In process: a step the Engine cannot pin on one request is tried again; `MAX_FAILED_STEPS` in a row fail the
    requests in flight, and the Engine thread serves the next request."""
    from transformers import GenerationConfig

    from hf_paged import BlockPool, Engine
    from hf_paged.serve.limits import RequestLimits
    from hf_paged.serve.manager import EngineManager

    tokenizer = saved[1]
    model = make_model(len(tokenizer))
    pool = BlockPool.for_model(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4)
    failures = {"left": 0}
    step = engine.step

    def flaky_step():
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(engine, "step", flaky_step)
    manager = EngineManager(engine, RequestLimits.for_engine(engine))
    prompt_ids = tokenizer(SENTENCES[0])["input_ids"]

    async def ask():
        return await manager.generate_non_streaming(
            model, tokenizer, {"input_ids": prompt_ids}, GenerationConfig(max_new_tokens=4, do_sample=False), "r"
        )

    try:
        expected = asyncio.run(ask())[2]
        failures["left"] = EngineManager.MAX_FAILED_STEPS - 1
        assert asyncio.run(ask())[2] == expected  # retried: the same tokens
        failures["left"] = EngineManager.MAX_FAILED_STEPS
        with pytest.raises(Exception, match="device lost"):
            asyncio.run(ask())
        assert manager.is_alive()
        assert asyncio.run(ask())[2] == expected
        deadline = time.monotonic() + 10
        while manager.metrics.num_finished < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the Engine thread publishes its metrics just after it answers
        assert manager.metrics.num_failed == 1 and manager.metrics.num_finished == 3
        assert engine.num_running == engine.num_waiting == pool.num_used_blocks == 0
    finally:
        manager.stop()


def test_the_startup_heap_is_frozen_out_of_full_collections():
    """`hf-paged serve` freezes what is alive once it has started (torch, transformers, the model): a full
    collection then walks only what came after, so it no longer pauses the streams for the whole heap."""
    import gc

    from hf_paged.serve.cli import freeze_startup_heap

    before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        # what other threads free meanwhile leaves the frozen generation, and nothing joins it but by freeze()
        assert frozen >= before // 2 and 0 < gc.get_freeze_count() <= frozen
        assert len(gc.get_objects()) < before // 10  # what a full collection still walks
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_a_stream_of_a_tokenizer_that_cleans_up_spaces_gives_its_one_body_text():
    """transformers' clean-up after a WordPiece decoder (" ," -> ",", " ' " -> "'") changes text that a later token
    completes ("don", " '", " t" -> "don't"): a stream holds back the last characters the clean-up may still change,
    so what it sends, one token or several at a time, with a stop string or without, is the one body's text."""
    wordpiece, tokenizer = cleaning_up_wordpiece("hello ' quote world , don ' t it ' s . ? !")
    prompt, ids = wordpiece.encode("hello").ids, wordpiece.encode("hello , world . don ' t ! it ' s ?").ids
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole == "hello, world. don't! it's?" != wordpiece.decode(ids)
    stop = "t! i"
    cases = [(True, (), [1] * len(ids)), (True, (), [3, 4, len(ids)]), (True, (stop,), [1] * len(ids))]
    cases += [(True, (stop,), [2, 5, len(ids)]), (False, (stop,), [1] * len(ids)), (False, (), [len(ids)])]
    loop = asyncio.new_event_loop()
    try:
        for streaming, stops, groups in cases:
            stream = request_stream(loop, tokenizer, prompt, stop_strings=stops, streaming=streaming)
            start = 0
            for size in groups:
                last = start + size >= len(ids)
                stream.deliver(ids[start : start + size], last, finish_reason="length" if last else None)
                start += size
                if stream.stopped:
                    break
            if streaming:
                text = "".join(stream.queue.get_nowait() for _ in range(stream.queue.qsize() - 1))
            else:
                text = loop.run_until_complete(stream.result)
            expected = whole[: whole.index(stop)] if stops else whole
            assert text == expected, (streaming, stops, groups, text)
            assert stream.finish_reason == ("stop" if stops else "length"), stream.finish_reason
    finally:
        loop.close()


@pytest.mark.parametrize("stop, kept", [("<s>", None), ("the lazy", 7), ("s> lazy", None), ("dog", 8)])
@pytest.mark.parametrize("size", [1, 3])
def test_a_parsed_stream_finds_stop_strings_in_the_answers_text_as_one_body(stop, kept, size):
    """A parsed stream's parser reads the answer with its special tokens; its stop strings are found in the answer's
    text without them, as in one body: a special token's text is no stop string, one between the words of a stop
    string does not hide it, and the text the parser reads is cut where the stop string starts, as one body's parser
    reads it (`parse_text`)."""
    from transformers.cli.serving.utils import ReasoningText

    tokenizer = parsed_tokenizer()
    answer = "<think> the quick </think> the <s> lazy dog jumps over the fox"
    ids = tokenizer.encode(answer, add_special_tokens=False)
    items, stream = parsed_stream_items(tokenizer, answer, sizes=(size,), stop_strings=(stop,))
    loop = asyncio.new_event_loop()
    try:
        one = request_stream(loop, tokenizer, [], stop_strings=(stop,), streaming=False)
        one.deliver(ids, True, finish_reason="length")
        loop.run_until_complete(one.result)
    finally:
        loop.close()
    # the tokens up to the one the stop string ends in ("the <s> lazy": 7), all where it is none
    assert (stream.stopped, stream.token_ids) == (one.stopped, one.token_ids) == (kept is not None, ids[:kept])
    read = one.parse_text() if one.stopped else tokenizer.decode(ids, skip_special_tokens=False)
    parsed = tokenizer.parse_response(read, prefix="")
    reasoning = "".join(item for item in items if isinstance(item, ReasoningText))
    content = "".join(item for item in items[:-1] if not isinstance(item, ReasoningText))
    assert (reasoning.strip(), content.strip()) == (parsed["reasoning_content"], parsed.get("content") or "")
    assert stop not in tokenizer.decode(tokenizer.encode(content, add_special_tokens=False), skip_special_tokens=True)
