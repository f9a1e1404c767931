"""CUDA only (skipped without it): the paged path end to end on CUDA models, the part CPU CI cannot run.

Tiny fp32 models on CUDA with the "hf_paged" attention on its default backend ("auto": the Triton kernels on CUDA),
through `generate()` with a `PagedCache` and through the `Engine`, against `generate()` with `DynamicCache` and sdpa
on the same device. Elsewhere the Triton kernels are tested against their reference on CUDA tensors
(tests/test_kernels.py) and, without CUDA, in Triton's interpreter.
"""

import importlib.util

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_paged.attention.kernels.triton_decode as triton_decode
import hf_paged.attention.kernels.triton_prefill as triton_prefill
from hf_paged import PAGED_ATTENTION, BlockPool, Engine, PagedCache
from tests.models import count_decode_launches, random_prompt, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

NEW_TOKENS = 16


def _count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    function = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or function(*a, **k))
    return calls


def _sdpa_reference(name: str, prompts: list[list[int]], new_tokens: list[int], device: str) -> list[list[int]]:
    model = tiny_model(name, "sdpa", device=device)
    return [
        model.generate(
            torch.tensor([prompt], device=device),
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=n,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        for prompt, n in zip(prompts, new_tokens)
    ]


@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral"])
def test_generate_with_a_paged_cache_on_cuda_runs_the_kernels_and_matches_sdpa(name, monkeypatch):
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)  # "auto": Triton on CUDA
    decode_calls = count_decode_launches(monkeypatch)
    prompt = random_prompt(12)[0].tolist()
    (reference,) = _sdpa_reference(name, [prompt], [NEW_TOKENS], "cuda")
    model = tiny_model(name, PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=16)
    assert pool.device.type == "cuda"
    with PagedCache(config=model.config, pool=pool) as cache:
        out = model.generate(
            torch.tensor([prompt], device="cuda"), past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert out[0, len(prompt) :].tolist() == reference
    assert len(decode_calls) == model.config.num_hidden_layers * (NEW_TOKENS - 1)
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_engine_on_cuda_matches_generate_per_request(name, async_scheduling, monkeypatch):
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    # The decode runner's steps reach the kernel through its custom op's implementation, the packed ones through
    # the decode plan: both end in the Triton launcher (under CUDA graphs only while warming up and capturing).
    decode_calls = _count_calls(monkeypatch, triton_decode, "paged_decode_attention_triton")
    prefill_calls = _count_calls(monkeypatch, triton_prefill, "paged_prefill_attention_triton")  # packed chunks
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (5, 40, 17, 3)]
    new_tokens = [12, 6, 20, 9]
    model = tiny_model(name, PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=48, block_size=16)
    # Chunked prefill beside decode rows.
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        name, prompts, new_tokens, "cuda"
    )
    assert decode_calls and prefill_calls and pool.num_used_blocks == 0
    assert (engine.stats.num_async_steps > 0) == async_scheduling


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_engine_with_both_forwards_compiled_on_cuda_matches_generate(name, monkeypatch):
    """`compile_decode` and `compile_prefill` with inductor on CUDA: the steps that prefill run one compiled graph
    (the paged prefill kernel inside `hf_paged::step_attention`), decode steps replay graphs of the compiled forward,
    and the float32 tokens are generate()'s."""
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    prefill_calls = _count_calls(monkeypatch, triton_prefill, "paged_prefill_attention_triton")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (5, 40, 17, 3)]
    new_tokens = [12, 6, 20, 9]
    torch._dynamo.reset()
    model = tiny_model(name, PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=48, block_size=16)
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=32, compile_decode=True, compile_prefill=True)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        name, prompts, new_tokens, "cuda"
    )
    step = engine.step_runner.step
    assert step.compile_error is None and step.num_compiled_steps > 0 and prefill_calls
    assert engine.runner.capture_error is None and engine.runner.stats.replayed_steps > 0
    assert pool.num_used_blocks == 0
    torch._dynamo.reset()


def test_a_warmed_up_compiled_engine_compiles_nothing_in_its_first_requests(monkeypatch):
    """`warm_up` (what `hf-paged serve` runs at startup on CUDA): both forwards compiled and the graphs captured
    before the first requests, which then compile no graph and get generate()'s tokens."""
    from torch._dynamo.utils import counters

    from hf_paged.engine.warm_up import warm_up

    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=256, block_size=16)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=128, compile_decode=True, compile_prefill=True)
    assert warm_up(engine) > 0 and engine.stats.num_steps == 0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2 and engine.step_runner.step.num_compiled_steps > 0  # both forwards
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (9, 130, 40)]
    new_tokens = [7, 5, 9]
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        "llama", prompts, new_tokens, "cuda"
    )
    assert counters["stats"]["unique_graphs"] == graphs and engine.runner.compile_error is None
    assert engine.step_runner.step.compile_error is None and pool.num_used_blocks == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_graphs_are_captured_again_when_a_row_outgrows_the_table_width(compiled, monkeypatch):
    """A row that grows towards 17 blocks doubles the graphs' table width of 16 once it is halfway there (W holds up
    to twice the longest row): the graphs are captured again (into a memory pool of their own), the steps after it
    are replayed, and the tokens stay generate()'s; a compiled decode forward serves both widths with one graph."""
    from torch._dynamo.utils import counters

    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (7, 5)]
    new_tokens = [60, 12]  # the first row ends at 67 tokens: 17 blocks of 4
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=48, block_size=4)
    engine = Engine(model, pool, max_num_seqs=4, compile_decode=compiled)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        "llama", prompts, new_tokens, "cuda"
    )
    runner = engine.runner
    assert runner.capture_error is None, runner.capture_error
    assert {width for _, width, _ in runner.stats.captures} == {16, 32}
    assert runner.stats.replayed_steps > 0 and pool.num_used_blocks == 0
    if compiled:
        assert runner.compiled and runner.compile_error is None
        assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_launch_on_the_tensors_gpu_not_the_current_one(monkeypatch):
    """A model on cuda:1 from a process whose current device is cuda:0: Triton launches on the current device
    unless told otherwise, which would hand it another GPU's pointers."""
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    from hf_paged.attention.kernels import triton_store

    store_calls = _count_calls(monkeypatch, triton_store, "store_kv_triton")
    assert torch.cuda.current_device() == 0
    prompts = [random_prompt(9)[0].tolist(), random_prompt(20, seed=1)[0].tolist()]
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda:1")
    engine = Engine(model, BlockPool.for_model(model, num_blocks=32, block_size=16), max_num_seqs=2)
    assert engine.generate(prompts, max_new_tokens=8, ignore_eos=True) == _sdpa_reference(
        "llama", prompts, [8, 8], "cuda:1"
    )
    pool = BlockPool.for_model(model, num_blocks=32, block_size=16)
    with PagedCache(config=model.config, pool=pool) as cache:
        model.generate(torch.tensor([prompts[0]], device="cuda:1"), past_key_values=cache, max_new_tokens=4)
    assert store_calls


@pytest.mark.parametrize("attn", ["sdpa", PAGED_ATTENTION])
def test_compiled_generate_on_cuda_replays_cuda_graphs_with_static_cache_tokens(attn, monkeypatch):
    """generate() compiles a PagedCache(max_cache_len) by itself on CUDA (inductor, CUDA graphs): the graphs are not
    skipped (the pool and the step buffers are static inputs), and the tokens equal StaticCache's in float32."""
    from torch._dynamo.utils import counters

    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    model = tiny_model("llama", attn, device="cuda")
    input_ids = random_prompt(12).cuda()
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    try:
        torch._dynamo.reset()
        static = model.generate(input_ids, cache=StaticCache(config=model.config, max_cache_len=48), **options)
        torch._dynamo.reset()
        counters.clear()
        pool = BlockPool.for_model(model, num_blocks=16, block_size=16)
        with PagedCache(config=model.config, pool=pool, max_cache_len=48) as cache:
            paged = model.generate(input_ids, cache=cache, **options)
    finally:
        for attribute in ("_compiled_call", "_last_compile_config"):
            model.__dict__.pop(attribute, None)
    assert torch.equal(paged, static)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    assert pool.num_used_blocks == 0


def test_a_replayed_compiled_decode_step_does_not_sync(monkeypatch):
    """The compiled decode forward (CUDA graphs replayed) makes no host synchronization."""
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda")
    cache = PagedCache(config=model.config, max_cache_len=64)
    input_ids = random_prompt(12).cuda()
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        model(input_ids, cache=cache)
        token = input_ids[:, -1:]
        for step in range(4):  # the first calls compile and record; later ones replay
            cache.reserve(1)
            position_ids = torch.full((1, 1), 12 + step, device="cuda")
            if step == 3:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                logits = forward(input_ids=token, position_ids=position_ids, cache=cache).logits
            finally:
                torch.cuda.set_sync_debug_mode(0)
            token = logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == 16


def _four_requests_on_cuda():
    """An Engine with its CUDA defaults (graphs, asynchronous scheduling) on the tiny llama, four prompts and their
    new tokens."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (5, 9, 7, 3)]
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=48, block_size=16)
    return Engine(model, pool, max_num_seqs=4), prompts, [12, 14, 10, 16]


def test_a_replayed_engine_decode_step_does_not_sync(monkeypatch):
    """The Engine's decode runner under CUDA graphs: once a bucket's graph is captured, a step's fill (pinned
    staging, non-blocking copies), replay and logits make no host synchronization; the tokens stay generate()'s."""
    import hf_paged.engine.decode_runner as decode_runner

    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    forward, checked = decode_runner.DecodeRunner.forward, []

    def checking(runner, rows, feed=None):
        bucket = next(b for b in runner.buckets if b >= len(rows))
        if bucket not in runner._graphs or runner.graph_width < max(len(r.block_tables[0]) for r, _ in rows):
            return forward(runner, rows, feed)  # a capture, or a width that outgrows the graphs: not a plain replay
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = forward(runner, rows, feed)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked.append(len(rows))
        return logits

    monkeypatch.setattr(decode_runner.DecodeRunner, "forward", checking)
    engine, prompts, new_tokens = _four_requests_on_cuda()
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        "llama", prompts, new_tokens, "cuda"
    )
    assert checked and engine.runner.stats.replayed_steps >= len(checked)


def test_an_asynchronous_launch_does_not_sync(monkeypatch):
    """Asynchronous scheduling on CUDA: launching a replayed decode step (fill, the tokens in flight fed on the
    device, replay, argmax or a draw on the device, the copy to pinned memory) makes no host synchronization; only
    reading the tokens waits, for that step's copy. The greedy tokens stay generate()'s."""
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    launch, checked, errors = Engine._launch, [], []

    def checking(engine, requests, inflight):
        runner = engine.runner
        bucket = next(b for b in runner.buckets if b >= len(requests))
        if inflight is None or bucket not in runner._graphs:
            return launch(engine, requests, inflight)
        if runner.graph_width < max(len(r.block_tables[0]) for r in requests):
            return launch(engine, requests, inflight)
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = launch(engine, requests, inflight)
        except Exception as error:  # the step runs its rows again synchronously: keep what raised
            errors.append(error)
            raise
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked.append(len(requests))
        return launched

    monkeypatch.setattr(Engine, "_launch", checking)
    engine, prompts, new_tokens = _four_requests_on_cuda()
    assert engine.async_scheduling and engine.runner.cuda_graphs  # the defaults on CUDA
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == _sdpa_reference(
        "llama", prompts, new_tokens, "cuda"
    )
    assert checked and not errors and engine.stats.num_failed_launches == 0
    assert engine.stats.num_async_steps >= len(checked)
    # Rows that sample without a seed draw on the device (temperature, top-k, top-p): no sync either.
    checked.clear()
    sampled = engine.generate(
        prompts, max_new_tokens=new_tokens, ignore_eos=True, temperature=[0.0, 0.8, 1.2, 0.7], top_k=20, top_p=0.9
    )
    assert checked and not errors and [len(tokens) for tokens in sampled] == new_tokens
    assert all(0 <= token < engine.model.config.vocab_size for tokens in sampled for token in tokens)


def test_engine_prompt_logprobs_on_cuda_are_one_forwards_log_softmax(monkeypatch):
    """`prompt_logprobs` on CUDA (the Triton kernels, decode graphs on by default): rows that record them run the
    eager packed forward, in chunks beside decode rows, and record the log-softmax of one forward over the prompt;
    every row's tokens are those of a run without them."""
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (37, 5, 21)]
    model = tiny_model("llama", PAGED_ATTENTION, device="cuda")
    pool = BlockPool.for_model(model, num_blocks=48, block_size=16)
    engine = Engine(model, pool, max_num_seqs=3, max_num_batched_tokens=16)
    plain = engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    request_ids = [
        engine.add_request(prompt, max_new_tokens=6, ignore_eos=True, **({} if i == 1 else {"prompt_logprobs": 2}))
        for i, prompt in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    finished = {request.request_id: request for request in engine.pop_finished()}
    reference = tiny_model("llama", "sdpa", device="cuda")
    for index, request_id in enumerate(request_ids):
        request = finished[request_id]
        assert request.output_ids == plain[index]
        if index == 1:
            assert request.prompt_logprobs == []
            continue
        prompt = request.prompt_ids
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt], device="cuda")).logits[0, :-1].float()
        expected = torch.log_softmax(logits, dim=-1).cpu()
        scored = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert [entry.logprob for entry in request.prompt_logprobs] == pytest.approx(scored, abs=1e-3)
        best = torch.topk(expected, 2).indices.tolist()
        assert [[token for token, _ in entry.top] for entry in request.prompt_logprobs] == best
    assert pool.num_used_blocks == 0
