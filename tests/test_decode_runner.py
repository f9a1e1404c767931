"""The Engine's decode runner (engine/decode_runner.py) on CPU: persistent buffers, rows padded to batch buckets as
under CUDA graphs, the same tokens as the packed step, no host read inside its forward, and capture and replay with a
stand-in that traces the captured forward (`_TracedGraph`). CUDA graphs themselves are checked in tests/test_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from models import greedy_reference, random_prompts, require_triton_on_cpu, tiny_engine, tiny_model
from torch.fx.experimental.proxy_tensor import make_fx

from hf_paged import BlockPool, Engine
from hf_paged.engine.decode_runner import batch_buckets
from hf_paged.storage import block_hashes

PROMPT_LENGTHS = (5, 11, 3, 17, 8)
NEW_TOKENS = [9, 4, 14, 6, 11]  # past the window of 8 of the sliding models
AOT_EAGER = {"backend": "aot_eager"}


def test_batch_buckets_follow_capture_sizes_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma3", "gpt2", "phi3"])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_steps_through_the_runner_match_generate(name, padded):
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine(name, 64, max_num_seqs=5, max_num_batched_tokens=8)
    engine.runner.pad_to_buckets = padded
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        name, prompts, NEW_TOKENS
    )
    stats = engine.runner.stats
    assert stats.eager_steps > 0 and stats.replayed_steps == 0
    assert (stats.padded_rows > 0) == padded  # 3 rows run as 4 once the short requests finish
    assert pool.num_used_blocks == 0  # the block padding rows wrote to went back after each step


def test_the_padding_block_is_held_before_admission_so_a_full_pool_never_preempts():
    """Three requests whose peaks fill the pool exactly run together: the block padding rows write to (3 rows run as
    4) is taken before they are admitted, so admission counts it, not from under the admitted rows at the first
    padded step (which preempted one)."""
    engine, pool = tiny_engine("llama", 6, max_num_seqs=4)
    engine.runner.pad_to_buckets = True
    prompts = [[1, 2], [5, 6], [9, 10]]  # 2 + 7 new tokens: 8 K/V tokens, 2 blocks each
    assert engine.generate(prompts, max_new_tokens=7, ignore_eos=True) == greedy_reference("llama", prompts, [7] * 3)
    assert engine.stats.num_preemptions == 0 and engine.runner.stats.padded_rows > 0
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("padding_turned_off", [False, True])
def test_a_request_that_needs_every_block_runs_with_the_padding_block_given_back(async_scheduling, padding_turned_off):
    """A request that needs the whole pool alone, queued while the runner holds its padding block, gets that block
    once nothing else runs (it runs unpadded), instead of failing as if a block were held outside the engine: also
    when the others' last tokens are still in flight (asynchronous scheduling sets them aside), and at once when
    padding was turned off meanwhile (as a failed graph capture turns it off)."""
    engine, pool = tiny_engine("llama", 6, max_num_seqs=4, async_scheduling=async_scheduling)
    engine.runner.pad_to_buckets = True
    for first in (1, 5, 9):
        engine.add_request([first, first + 1], max_new_tokens=3, ignore_eos=True)
    engine.step()
    engine.step()  # a padded decode step: 3 rows as 4
    assert engine.runner.holds_padding_block
    if padding_turned_off:
        engine.runner.capture_error, engine.runner.pad_to_buckets = "RuntimeError: a capture failed", False
    prompt = list(range(10, 31))  # 21 prompt + 4 new tokens: 24 K/V tokens, the pool's 6 blocks
    big = engine.add_request(prompt, max_new_tokens=4, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    request = engine.request(big)
    assert request.error is None and request.output_ids == greedy_reference("llama", [prompt], [4])[0]
    assert pool.num_used_blocks == 0


def test_the_padding_block_spares_the_cached_prompt_a_waiting_request_finds():
    """The padding block is taken before admission, so not from the head of the free queue, which holds the least
    recently freed block: the first block of the prompt resubmitted here. It takes a block that caches nothing."""
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=7, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4, enable_prefix_caching=True)
    engine.runner.pad_to_buckets = True
    prompt = list(range(1, 22))  # 21 tokens + 4 new: every block but the padding one; 5 full prompt blocks cached
    first = engine.generate([prompt], max_new_tokens=4, ignore_eos=True)
    hits = engine.scheduler.num_prefix_hit_tokens
    assert engine.generate([prompt], max_new_tokens=4, ignore_eos=True) == first
    assert engine.scheduler.num_prefix_hit_tokens - hits == 20 and pool.num_used_blocks == 0


def test_eager_decode_steps_gather_every_layer_into_two_reused_buffers(monkeypatch):
    """An eager step gathers each layer's K and V into the runner's two grow-only buffers (a fresh output per layer
    cost more in page faults than the copy on CPU), taken once per step and read by every layer; the tokens stay
    generate()'s."""
    import hf_paged.engine.decode_runner as decode_runner

    prompts = random_prompts(PROMPT_LENGTHS)
    engine, _ = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=64)
    outs, selected = [], []
    gather_buffer, index_select = decode_runner.DecodeRunner.gather_buffer, torch.index_select

    def recording(self, name, numel, like):
        out = gather_buffer(self, name, numel, like)
        outs.append(out.data_ptr())
        return out

    run_model, in_runner = decode_runner.DecodeRunner._run_model, []

    def recording_select(rows, dim, index, *, out=None):
        if in_runner:
            selected.append(None if out is None else out.data_ptr())
        return index_select(rows, dim, index, out=out)

    def flagged(self):
        in_runner.append(True)
        try:
            return run_model(self)
        finally:
            in_runner.clear()

    monkeypatch.setattr(decode_runner.DecodeRunner, "gather_buffer", recording)
    monkeypatch.setattr(decode_runner.DecodeRunner, "_run_model", flagged)
    monkeypatch.setattr(decode_runner.torch, "index_select", recording_select)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        "llama", prompts, NEW_TOKENS
    )
    num_layers, eager_steps = engine.pool.layout.num_layers, engine.runner.stats.eager_steps
    assert len(outs) == 2 * eager_steps > 0  # K's and V's buffer, once per step
    assert len(set(outs)) <= 2 * 4  # each grown at most a few times as the rows lengthen
    # Every layer of every eager step gathers K and V into those buffers, and nothing else in the runner's forward.
    assert len(selected) == 2 * num_layers * eager_steps and set(selected) <= set(outs)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_rows_sharing_a_prompt_prefix_read_it_once_with_generates_tokens(name, monkeypatch):
    """Rows whose tables start with the same blocks (a shared system prompt, found in the prefix cache) attend that
    prefix once for all rows (`shared_prefix_attention`) and their own tails after it: the tokens stay generate()'s,
    a model with sliding-window layers beside full ones (gemma3: only its full layers' tables keep the shared blocks)
    and learned positions (gpt2) included; below the runner's thresholds every row's whole context is gathered."""
    import hf_paged.attention.fixed_plan as fixed_plan

    calls = []
    original = fixed_plan.shared_prefix_attention

    def counting(query, prefix_keys, *args, **kwargs):
        calls.append((query.shape[0], prefix_keys.shape[2]))
        return original(query, prefix_keys, *args, **kwargs)

    monkeypatch.setattr(fixed_plan, "shared_prefix_attention", counting)
    system = random_prompts([10], seed=7)[0]
    prompts = [system + tail for tail in random_prompts((3, 6, 1, 9, 4))]
    new_tokens = [9, 4, 14, 6, 11]
    reference = greedy_reference(name, prompts, new_tokens)
    for min_rows, min_tokens, cascades in ((2, 8, True), (8, 256, False)):
        calls.clear()
        engine, pool = tiny_engine(name, 64, max_num_seqs=5, max_num_batched_tokens=64)
        engine.runner.cascade_min_rows, engine.runner.cascade_min_tokens = min_rows, min_tokens
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        assert bool(calls) == cascades
        # The prompt's two whole blocks (8 tokens) are shared, the third (2 system tokens, then each own) is not.
        assert all(prefix_len == 8 and rows >= 2 for rows, prefix_len in calls)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("num_blocks", [11, 64], ids=["preempting", "padded"])
def test_staged_tables_are_every_rows_table_through_preemption_release_and_padding(name, num_blocks):
    """Each step writes only the blocks a row's table gained since its last step in that row; a table that changed
    otherwise (preempted and recomputed, blocks released out of the window, another request in the row, a padding row
    before) is written whole. After every step's fill the staged tables are exactly the rows' tables.

    11 blocks of 4 and a lookahead of 0 steps: requests are admitted that later run out of blocks and are preempted
    (and a full pool leaves padding rows no block); 64 blocks: no preemption, steps padded to 4 rows."""
    prompts = random_prompts((5, 11, 3, 17, 8, 9))
    new_tokens = [14, 9, 20, 6, 11, 16]
    engine, _ = tiny_engine(name, num_blocks, max_num_seqs=4, max_num_batched_tokens=8, decode_reserve_tokens=0)
    runner = engine.runner
    runner.pad_to_buckets, runner.buckets = True, [4]
    fill, checked = runner._fill, []

    def checked_fill(rows, bucket, dummy, full_width, feed=None):
        num_fed = fill(rows, bucket, dummy, full_width, feed)
        width = runner.graph_width
        staged = runner._host[runner._num_fields * runner._max_rows :].view(runner.pool.num_groups, -1, width)
        for row, (request, _) in enumerate(rows):
            for group, table in enumerate(request.block_tables):
                assert staged[group, row, : len(table)].tolist() == table
        checked.append(len(rows))
        return num_fed

    runner._fill = checked_fill
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert len(checked) > 10
    if num_blocks == 11:
        assert engine.stats.num_preemptions > 0
    else:
        assert runner.stats.padded_rows > 0


def test_the_engines_runner_is_the_one_its_steps_use():
    """`engine.runner` is read from the packed step (one reference, so it cannot point elsewhere than what runs)."""
    engine, _ = tiny_engine("llama", 64, max_num_seqs=4)
    assert engine.runner is not None and engine.runner is engine.step_runner.step.runner
    with pytest.raises(AttributeError):
        engine.runner = None


def test_sampled_rows_through_the_runner_repeat_with_their_seeds():
    prompts = random_prompts(PROMPT_LENGTHS)
    runs = []
    for padded in (False, True):
        engine, _ = tiny_engine("llama", 64, max_num_seqs=5)
        engine.runner.pad_to_buckets = padded
        runs.append(engine.generate(prompts, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True))
    assert runs[0] == runs[1]


def test_a_step_padded_with_no_padding_block_runs_its_rows_alone():
    """Padding rows need a block of their own, which the runner takes only while no request runs: without one (a
    pool full then), padded steps run their rows alone, and no block is taken mid-run."""
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4)
    engine.runner.pad_to_buckets = True
    prompts = random_prompts((5, 11, 3))
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=4)
    engine.step()  # the prefill of all three
    engine.runner.release()  # as if the pool had been full before the step
    taken = pool.allocator.allocate(pool.allocator.num_free_blocks)
    before = engine.runner.stats.padded_rows
    engine.step()  # 3 decode rows, bucket 4, no block for the fourth
    pool.allocator.free(taken)
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.stats.padded_rows == before and not engine.runner.holds_padding_block
    outputs = [engine.request(request_id).output_ids for request_id in range(3)]
    assert outputs == greedy_reference("llama", prompts, [4, 4, 4])


def test_the_runner_forward_reads_no_device_value_on_the_host(monkeypatch):
    """What a CUDA graph captures (the model's forward over the runner's buffers) never calls .item(), .tolist(),
    .cpu() or bool() on a tensor."""
    engine, pool = tiny_engine("gemma3", 64, max_num_seqs=4)
    prompts = random_prompts((5, 11, 3))
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=6)
    engine.step()
    rows = [(request, 1) for request in engine.scheduler.running]
    runner = engine.runner
    runner._fill(rows, 4, pool.allocator.allocate(1)[0], full_width=True)

    def sync(*args, **kwargs):
        raise AssertionError("a host sync inside the runner's forward")

    for method in ("item", "tolist", "cpu", "__bool__"):
        monkeypatch.setattr(torch.Tensor, method, sync)
    with torch.inference_mode():
        logits = runner._run_model()
    monkeypatch.undo()
    assert logits.shape == (4, tiny_model("gemma3").config.vocab_size)


def test_cuda_graphs_need_a_cuda_pool_and_other_models_stay_packed():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a pool on a CUDA device"):
        Engine(model, pool, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be None, True or False"):
        Engine(model, pool, cuda_graphs="yes")
    engine = Engine(model, pool)
    assert engine.runner is not None and not engine.runner.cuda_graphs and engine.runner_reason is None


class _FakeStream:
    def wait_stream(self, stream) -> None: ...


class _TracedGraph:
    """A CUDA graph stand-in that keeps what a graph keeps: capturing records the forward's ATen ops on the tensors
    they touch (`make_fx` on real tensors: the runner's buffers, the pool and the weights, by reference), with every
    value the host read during the capture (a shape, a Python int worked out from the rows, a tensor's `.item()`)
    frozen into it; replaying runs those ops again into the captured output. A forward that depends on anything but
    the buffers' contents gives other tokens on replay."""

    capturing: list[_TracedGraph] = []

    def __init__(self):
        self.ops = self.output = None

    def replay(self) -> None:
        self.output.copy_(self.ops())

    @classmethod
    @contextlib.contextmanager
    def capture(cls, graph, pool=None, stream=None):
        cls.capturing.append(graph)
        try:
            yield
        finally:
            cls.capturing.pop()


def _trace_when_capturing(run_model):
    def run():
        if not _TracedGraph.capturing:
            return run_model()
        graph = _TracedGraph.capturing[-1]
        graph.ops = make_fx(lambda: run_model(), tracing_mode="real")()
        graph.output = graph.ops()
        return graph.output

    return run


def _runner_with_traced_graphs(monkeypatch, name: str):
    """`(engine, pool)`: the tiny `name` Engine whose decode runner captures and replays `_TracedGraph`s, padded to
    its buckets, with the rest of the CUDA API it calls stood in for."""
    for attribute, value in {
        "CUDAGraph": _TracedGraph,
        "graph": _TracedGraph.capture,
        "is_current_stream_capturing": lambda: bool(_TracedGraph.capturing),
        "Stream": lambda device=None: _FakeStream(),
        "stream": lambda stream: contextlib.nullcontext(),
        "current_stream": lambda device=None: _FakeStream(),
        "graph_pool_handle": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "device": lambda device: contextlib.nullcontext(),
        "set_stream": lambda stream: None,
        "synchronize": lambda device=None: None,
    }.items():
        monkeypatch.setattr(torch.cuda, attribute, value)
    engine, pool = tiny_engine(name, 64, max_num_seqs=5, max_num_batched_tokens=16)
    runner = engine.runner
    runner.cuda_graphs = runner.pad_to_buckets = True
    monkeypatch.setattr(runner, "_run_model", _trace_when_capturing(runner._run_model))
    return engine, pool


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma3", "gpt2", "phi3"])
def test_graph_replays_on_cpu_with_a_traced_stand_in_for_cuda_graphs(name, monkeypatch):
    """Capture per bucket, replay, full-width tables as wide as the rows will grow, padding in a block taken per busy
    period: every decode step replayed from a trace of the ops its capture ran, and the same tokens as per-request
    generate(), every block back in the pool."""
    prompts = random_prompts((60, 11, 3, 17, 8))  # the first outgrows 16 blocks of 4 tokens
    engine, pool = _runner_with_traced_graphs(monkeypatch, name)
    runner = engine.runner
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
        name, prompts, NEW_TOKENS
    )
    stats = runner.stats
    assert runner.capture_error is None
    assert stats.eager_steps == 0 and stats.replayed_steps > 0 and stats.padded_rows > 0
    # The 60-token prompt's row holds 16 blocks of 4 at its first decode step and will hold 18 (9 new tokens): the
    # tables are 32 wide from the first capture, never captured again at 16 then 32. Mistral's tables (every layer
    # on its window of 8) hold a few blocks only.
    width = 16 if name == "mistral" else 32
    assert {width for _, width, _ in stats.captures} == {width}
    assert runner.graph_width == width and runner.tables[0].shape[1] == width
    assert pool.num_used_blocks == 0


def test_each_width_captures_into_a_memory_pool_of_its_own_with_two_streams_made_once(monkeypatch):
    """Graphs of a new table width go into a new memory pool (capturing again into a pool whose graphs are all gone
    trips the CUDA caching allocator), and every capture and warm-up runs on the runner's two streams."""
    engine, _ = _runner_with_traced_graphs(monkeypatch, "llama")
    pools, streams = [], []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: streams.append(_FakeStream()) or streams[-1])
    capture = _TracedGraph.capture

    def recording(graph, pool=None, stream=None):
        pools.append((engine.runner.graph_width, pool, stream))
        return capture(graph, pool, stream)

    monkeypatch.setattr(torch.cuda, "graph", recording)
    prompts = random_prompts((60, 11, 3, 17, 8))  # the first outgrows 16 blocks of 4 tokens
    # The short prompts decode first (16 wide); the long one arrives later, and the tables double for it.
    ids = [
        engine.add_request(prompt, max_new_tokens=n, ignore_eos=True) for prompt, n in zip(prompts[1:], NEW_TOKENS[1:])
    ]
    for _ in range(4):
        engine.step()
    ids.insert(0, engine.add_request(prompts[0], max_new_tokens=NEW_TOKENS[0], ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.request(request_id).output_ids for request_id in ids]
    assert outputs == greedy_reference("llama", prompts, NEW_TOKENS)
    by_width = {width: {id(pool) for w, pool, _ in pools if w == width} for width, _, _ in pools}
    assert set(by_width) == {16, 32} and all(len(ids) == 1 for ids in by_width.values())
    assert by_width[16] != by_width[32]
    assert len(streams) == 2 and {id(stream) for _, _, stream in pools} == {id(engine.runner._capture_stream)}


def test_a_failed_capture_runs_eager_steps_without_padding_rows(monkeypatch):
    """A forward that cannot be captured: the error is kept, the steps run eagerly with the same tokens, and no
    padding rows are run from then on (they only serve graphs)."""
    engine, pool = _runner_with_traced_graphs(monkeypatch, "llama")
    runner = engine.runner

    @contextlib.contextmanager
    def failing(graph, pool=None, stream=None):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing)
    prompts = random_prompts((11, 3, 17))  # 3 rows: a bucket of 4 would pad one
    assert engine.generate(prompts, max_new_tokens=[9, 4, 14], ignore_eos=True) == greedy_reference(
        "llama", prompts, [9, 4, 14]
    )
    assert runner.capture_error == "RuntimeError: operation not permitted when stream is capturing"
    assert runner.stats.replayed_steps == 0 and runner.stats.eager_steps > 0
    assert not runner.pad_to_buckets and runner.stats.padded_rows == 0
    assert pool.num_used_blocks == 0


def test_the_staging_copies_are_contiguous_and_carry_every_step(monkeypatch):
    """With a host staging tensor apart from the buffers (as on CUDA: pinned memory), each step's values and tables
    reach the buffers in copies that are contiguous on both sides (a strided one goes through a pageable host copy
    on CUDA, which blocks the host), and the tokens are per-request generate()'s."""
    engine, _ = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=16)
    runner = engine.runner
    runner._host = runner._device.clone()  # the staging tensor, apart, with its per-row values' view
    runner._host_fields = runner._host[: runner._num_fields * runner._max_rows].view(runner._num_fields, -1)
    copies, filling = [], [False]
    copy_, fill = torch.Tensor.copy_, runner._fill

    def recording_copy(self, src, non_blocking=False):
        if filling[0]:
            copies.append((self.is_contiguous(), src.is_contiguous(), self.data_ptr() == src.data_ptr()))
        return copy_(self, src, non_blocking)

    def recording_fill(*args, **kwargs):
        filling[0] = True
        try:
            return fill(*args, **kwargs)
        finally:
            filling[0] = False

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    monkeypatch.setattr(runner, "_fill", recording_fill)
    prompts = random_prompts((11, 3, 17, 8))  # tables within the first width: the staging tensor stays apart
    assert engine.generate(prompts, max_new_tokens=[9, 4, 14, 6], ignore_eos=True) == greedy_reference(
        "llama", prompts, [9, 4, 14, 6]
    )
    assert runner.stats.eager_steps > 0 and runner._host is not runner._device
    assert copies and all(copy == (True, True, False) for copy in copies)


def test_graphs_are_captured_again_when_a_growable_pool_grows(monkeypatch):
    """A growable pool that grows between steps replaces its K/V tensors: the graphs captured on the old ones are
    dropped and captured again, and a request prefilled after the growth decodes its own tokens."""
    for attribute, value in {"CUDAGraph": _TracedGraph, "graph": _TracedGraph.capture}.items():
        monkeypatch.setattr(torch.cuda, attribute, value)
    _runner_with_traced_graphs(monkeypatch, "llama")  # the CUDA stand-ins
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=24, block_size=4)
    pool.growable = True  # as a PagedCache's private pool
    engine = Engine(model, pool, max_num_seqs=5, max_num_batched_tokens=16)
    runner = engine.runner
    runner.cuda_graphs = runner.pad_to_buckets = True
    monkeypatch.setattr(runner, "_run_model", _trace_when_capturing(runner._run_model))
    prompts, new_tokens = random_prompts((11, 3, 17)), [5, 16, 9]
    # Two rows (a bucket of 2, captured), then the first ends and a request prefilled after the growth joins the
    # second: two rows again, the bucket captured before.
    first = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts[:2], new_tokens)]
    for _ in range(4):
        engine.step()
    assert runner.stats.replayed_steps > 0
    num_captures = len(runner.stats.captures)
    pool.grow(16)
    last = engine.add_request(prompts[2], max_new_tokens=new_tokens[2], ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.request(request_id).output_ids for request_id in [*first, last]]
    assert outputs == greedy_reference("llama", prompts, new_tokens)
    assert 2 in [bucket for bucket, _, _ in runner.stats.captures[num_captures:]]  # captured again
    assert runner.capture_error is None


def test_the_traced_stand_in_catches_a_value_frozen_at_capture(monkeypatch):
    """The stand-in above is strict: a runner that sized its step from the capture's rows (the keys of the padding
    rows, not the full width) replays other tokens."""
    prompts = random_prompts((60, 11, 3, 17, 8))
    engine, _ = _runner_with_traced_graphs(monkeypatch, "llama")
    runner = engine.runner
    fill = runner._fill
    monkeypatch.setattr(
        runner, "_fill", lambda rows, bucket, dummy, full_width, feed=None: fill(rows, bucket, dummy, False, feed)
    )
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert runner.stats.replayed_steps > 0
    assert outputs != greedy_reference("llama", prompts, NEW_TOKENS)


@pytest.mark.parametrize("padded", [False, True])
def test_padding_rows_evict_at_most_one_cached_prefix_block(padded):
    """The padding rows' block is taken once per busy period (before its first admission), not once a step: a step
    that took and freed one would cycle the free queue and evict a cached prefix block every step."""
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=40, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4, enable_prefix_caching=True)
    engine.runner.pad_to_buckets = padded
    prompts = random_prompts((24, 24, 24, 24))
    engine.generate(prompts, max_new_tokens=2, ignore_eos=True)
    hashes = [block_hash for prompt in prompts for block_hash in block_hashes(prompt, 4)]

    def num_cached():
        return sum(block is not None for block in pool.allocator.peek_blocks(hashes))

    assert num_cached() == 24
    engine.generate(random_prompts((3, 5, 6), seed=7), max_new_tokens=30, ignore_eos=True)  # 3 rows, bucket 4
    kept = num_cached()
    # The three requests take 12 blocks from the head of the free queue (every one of them cached). Padded, each of
    # the two busy periods held one block more (one that cached nothing, which the requests would have taken before
    # a cached one): two cached blocks more in all, whatever the number of steps.
    assert kept == (10 if padded else 12)
    assert (engine.runner.stats.padded_rows > 0) == padded
    assert pool.num_used_blocks == 0


def test_a_forward_leaves_no_step_behind_on_the_reused_placeholders():
    """Each layer's placeholders are reused from forward to forward and carry the layer's plan, which is unbound when
    the forward ends: no step (nor the gather buffers it views) outlives the forward, and a plan used after it
    raises instead of reading another step's rows."""
    from hf_paged.attention.plan import plan_of

    prompts = random_prompts(PROMPT_LENGTHS)
    engine, _ = tiny_engine("llama", 64, max_num_seqs=5, max_num_batched_tokens=64)
    engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    cache = engine.runner._cache
    made = [entry for entry in cache.placeholders if entry is not None]
    assert len(made) == engine.pool.layout.num_layers and not cache.groups
    plans = [plan_of(placeholder) for _, placeholders in made for placeholder in placeholders]
    assert all(plan is not None and plan.step is None and plan.block_tables is None for plan in plans)
    assert len({id(plan) for plan in plans}) == engine.pool.layout.num_layers  # one per layer, K's and V's
    module = engine.model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="after its forward ended"):
        plans[0].attend(module, torch.zeros(1, 4, 1, 16), None)


def test_a_backend_that_cannot_run_raises_a_fresh_error_each_step(monkeypatch):
    """The resolved backends are memoized per device and environment (read-only); a setting that cannot run there
    raises a new error at each attention call, not one object whose traceback grows with every raise."""
    from hf_paged.attention.fixed_plan import FixedDecodePlan
    from hf_paged.attention.kernels.dispatch import resolve_backends
    from hf_paged.attention.plan import BACKEND_ATTR

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backends = resolve_backends(torch.device("cpu"))
    assert resolve_backends(torch.device("cpu")) is backends
    with pytest.raises(TypeError):
        backends["torch"] = "triton"
    module = torch.nn.Module()
    setattr(module, BACKEND_ATTR, "triton")  # Triton on CPU tensors without TRITON_INTERPRET
    plan = FixedDecodePlan(None, None, None, None, gather=None, backends=backends)
    errors = []
    for _ in range(2):
        with pytest.raises(ValueError, match="triton") as raised:
            plan.attend(module, torch.zeros(1, 2, 1, 4), None)
        errors.append(raised.value)
    assert errors[0] is not errors[1] and errors[0].args == errors[1].args


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_a_layer_gathered_and_attended_a_few_rows_at_a_time_gives_generates_tokens(name, monkeypatch):
    """On CPU a step whose keys and values of one layer pass `chunk_min_bytes` gathers and attends them a chunk of
    rows at a time (each chunk still in cache when attended): rows are independent, so the tokens are generate()'s;
    under the threshold the step gathers every row at once."""
    import hf_paged.engine.runner_cache as runner_cache

    chunks = []
    gather_rows = runner_cache.GroupStep.gather_rows

    def recording(self, layer, first, end):
        chunks.append(end - first)
        return gather_rows(self, layer, first, end)

    monkeypatch.setattr(runner_cache.GroupStep, "gather_rows", recording)
    prompts = random_prompts(PROMPT_LENGTHS)
    reference = greedy_reference(name, prompts, NEW_TOKENS)
    for chunk_bytes, chunk_min_bytes in ((1, 0), (4 << 20, 12 << 20)):
        chunks.clear()
        engine, _ = tiny_engine(name, 64, max_num_seqs=5, max_num_batched_tokens=64)
        engine.runner.chunk_bytes, engine.runner.chunk_min_bytes = chunk_bytes, chunk_min_bytes
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == reference
        assert bool(chunks) == (chunk_min_bytes == 0)
        assert set(chunks) <= {1}  # a chunk of 1 byte's worth: one row at a time


def test_replayed_steps_with_waiting_admission_give_generates_tokens(monkeypatch):
    """Graphs replayed (the traced stand-in) and admission tried every 3 decode-only steps while more requests wait
    than the pool holds: every request's tokens are generate()'s, nothing is preempted, every block comes back."""
    engine, pool = _runner_with_traced_graphs(monkeypatch, "llama")
    engine.scheduler.max_waiting_steps = 3
    tries = []
    admit = engine.scheduler.admission.admit
    monkeypatch.setattr(engine.scheduler.admission, "admit", lambda *args: tries.append(1) or admit(*args))
    prompts = random_prompts((5, 11, 3, 17, 8, 9, 13, 6))
    new_tokens = [9, 4, 14, 6, 11, 7, 5, 12]
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert engine.runner.stats.replayed_steps > 0 and engine.stats.num_preemptions == 0
    assert pool.num_used_blocks == 0 and len(tries) < engine.stats.num_steps  # some steps did not try


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_runner_forward_traces_into_one_graph_and_compiles_to_the_same_logits(monkeypatch, backend):
    """torch.compile sees the model's whole forward on the runner's cache as one graph (its store and decode kernel
    as the custom ops of kernels/ops.py on the Triton path), and compiled (aot_eager) it gives the eager logits."""
    if backend == "triton":
        require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", backend)
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4)
    for prompt in random_prompts((5, 11, 3)):
        engine.add_request(prompt, max_new_tokens=6)
    engine.step()
    runner = engine.runner
    assert runner.store == backend
    rows = [(request, 1) for request in engine.scheduler.running]
    runner._fill(rows, 4, pool.allocator.allocate(1)[0], full_width=True)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        eager = runner._run_model().clone()
        # the model's forward compiled whole (fullgraph: a graph break raises), the runner's bookkeeping around it
        runner.compile_forward({"backend": "aot_eager"})
        compiled = runner._run_model()
    assert runner.compile_error is None and runner.compiled  # no eager fallback
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma3"])  # gemma3: two layer groups, the second table after the first
def test_a_compiled_decode_forward_is_one_graph_for_every_bucket(monkeypatch, name):
    """Rows padded to buckets as under CUDA graphs, 12 requests finishing one by one, then rows past the table's
    width: every bucket (2 to 16; one row runs as two) and both widths are one traced graph, the batch and the width
    dynamic sizes, the buffers read at full width, no shared-prefix split; the tokens are generate()'s."""
    from torch._dynamo.utils import counters

    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    torch._dynamo.reset()
    counters.clear()
    engine, pool = tiny_engine(name, 128, max_num_seqs=16, max_num_batched_tokens=64, compile_decode=AOT_EAGER)
    runner = engine.runner
    runner.pad_to_buckets = True
    assert runner.buckets == [2, 4, 8, 16]
    num_requests = 12 if name == "llama" else 5  # every bucket once; gemma3 is here for its second table
    prompts = random_prompts(tuple(range(3, 3 + num_requests)))
    new_tokens = list(range(2, 2 + num_requests))
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert counters["stats"]["unique_graphs"] == 1 and runner.compile_error is None
    assert runner.stats.padded_rows > 0 and pool.num_used_blocks == 0
    # Rows past 16 blocks double the table width: W is a dynamic size too, so the same graph serves them.
    assert runner.graph_width == 16
    prompts = random_prompts((70, 9))
    assert engine.generate(prompts, max_new_tokens=[5, 3], ignore_eos=True) == greedy_reference(name, prompts, [5, 3])
    assert runner.graph_width == 32 and counters["stats"]["unique_graphs"] == 1 and runner.compile_error is None
    torch._dynamo.reset()


def test_a_decode_forward_that_fails_compiled_runs_eagerly(monkeypatch, caplog):
    """Where the compiled forward raises and the eager one does not, the step takes the eager logits and the runner
    runs eagerly from then on, saying why."""
    import logging

    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, compile_decode=AOT_EAGER)
    runner = engine.runner

    def failing(**kwargs):
        raise AssertionError("an assertion inside the compiler")

    runner._forward = failing
    prompts = random_prompts(PROMPT_LENGTHS[:3])
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine.decode_runner"):
        got = engine.generate(prompts, max_new_tokens=NEW_TOKENS[:3], ignore_eos=True)
    assert got == greedy_reference("llama", prompts, NEW_TOKENS[:3])
    assert runner.compile_error == "AssertionError: an assertion inside the compiler" and not runner.compiled
    assert runner._forward is runner.model and runner.stats.eager_steps > 0
    assert runner.buckets == [1, 2, 4]  # one row runs unpadded again
    assert sum("their compiled forward failed" in record.message for record in caplog.records) == 1
    assert pool.num_used_blocks == 0


def test_a_decode_forward_that_fails_eagerly_too_keeps_the_compiled_forward(monkeypatch):
    """A forward that raises compiled and eagerly alike is the rows' failure, not the compiler's: the error reaches
    the step, and the runner stays compiled."""
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, compile_decode=AOT_EAGER)
    runner = engine.runner
    runner.pad_to_buckets = True
    prompts = random_prompts(PROMPT_LENGTHS[:2])
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=4)
    engine.step()  # the prompts

    def failing(**kwargs):
        raise RuntimeError("the rows fail eagerly too")

    monkeypatch.setattr(runner, "_forward", failing)
    monkeypatch.setattr(runner, "model", failing)
    with pytest.raises(RuntimeError, match="the rows fail eagerly too"):
        runner.forward([(request, 1) for request in engine.scheduler.running])
    assert runner.compiled and runner.compile_error is None and runner._forward is failing


def test_an_engine_with_its_decode_forward_compiled_gives_generates_tokens(monkeypatch):
    """`compile_decode`: decode-only steps run the model compiled whole (aot_eager here; inductor by default) on the
    Triton kernels, with generate()'s tokens; a bad value or an Engine without them is refused by name."""
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    prompts = random_prompts((5, 11, 3, 17))
    new_tokens = [9, 4, 14, 6]
    torch._dynamo.reset()
    engine, pool = tiny_engine("llama", 64, max_num_seqs=4, compile_decode={"backend": "aot_eager"})
    assert engine.runner._forward is not engine.runner.model
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert engine.runner.stats.eager_steps > 0 and pool.num_used_blocks == 0
    torch._dynamo.reset()
    with pytest.raises(
        ValueError, match="compile_decode must be True, False or a dict of torch.compile keywords, got 'yes'"
    ):
        tiny_engine("llama", 8, compile_decode="yes")
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "torch")
    with pytest.raises(ValueError, match="compile_decode needs the Triton kernels .* with the 'torch' backend"):
        tiny_engine("llama", 8, compile_decode=True)
