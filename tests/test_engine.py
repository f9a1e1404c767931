"""Engine: continuous batching on one pool gives each request what generate() with DynamicCache gives it."""

import pytest
import torch

from hf_paged import BlockPool, Engine, KVLayout, RequestFailed, SamplingParams
from hf_paged.engine import Request, Scheduler
from hf_paged.storage import block_hashes
from tests import zoo
from tests.models import greedy_reference, random_prompts, require_triton_on_cpu, tiny_engine, tiny_model

NEW_TOKENS = [8, 12, 5, 10, 7]


PROMPT_LENGTHS = (5, 17, 9, 30, 3)


@pytest.mark.parametrize(
    "num_blocks, max_num_batched_tokens, decode_reserve_tokens",
    [(64, 512, None), (64, 8, None), (12, 512, 0), (12, 512, None)],
    # no growth reserve: admission outruns the pool; the default lookahead fits the tight pool without preempting
    ids=["ample", "chunked-prefill", "preempting", "tight-lookahead"],
)
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_output_equals_generate_per_request(name, num_blocks, max_num_batched_tokens, decode_reserve_tokens):
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine(
        name,
        num_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_reserve_tokens=decode_reserve_tokens,
    )
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert outputs == greedy_reference(name, prompts, NEW_TOKENS)
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
    stats = engine.stats
    assert stats.peak_running <= 4 and stats.mean_running > 1
    if decode_reserve_tokens == 0:
        # 5 requests of up to 10 blocks each in 12 blocks: someone must be recomputed (mistral's sliding group
        # gives back blocks out of its window of 8, so it may fit).
        assert stats.num_preemptions > 0 or name == "mistral"
        if stats.num_preemptions:  # a preempted request's recomputation is prefill work, not decoding
            assert stats.prefill_tokens > sum(map(len, prompts)) - stats.prefix_hit_tokens
    else:
        assert stats.num_preemptions == 0
        assert stats.prefill_tokens == sum(map(len, prompts))
        assert stats.decode_tokens == sum(NEW_TOKENS) - len(prompts)


@pytest.mark.parametrize("name", ["llama", "gemma3"])  # gemma3: a sliding group whose tables start late
def test_ragged_decode_through_the_triton_kernel(monkeypatch, name):

    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    batch_sizes = []
    import hf_paged.attention.kernels.triton_decode as triton_decode

    kernel = triton_decode.paged_decode_attention_triton
    monkeypatch.setattr(
        triton_decode,
        "paged_decode_attention_triton",
        lambda query, *a, **k: batch_sizes.append(query.shape[0]) or kernel(query, *a, **k),
    )
    prompts = random_prompts((5, 11, 3))
    engine, pool = tiny_engine(name, 32, max_num_seqs=3)
    new_tokens = [4, 12, 6]  # past the window of 8 for gemma3's sliding layers
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert pool.num_used_blocks == 0
    assert batch_sizes and max(batch_sizes) == 3  # rows of lengths 6, 12 and 4 went through one kernel call


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])  # full, every layer sliding, sliding tables late
def test_prefill_chunks_through_the_paged_prefill_kernel(monkeypatch, name):
    """With the Triton backend every step's prefill chunks go through one launch of the paged prefill kernel per
    layer (chunks over cached tokens, several packed in a step, beside decode rows): generate()'s tokens. Every
    tensor it is handed starts on 16 bytes, whatever the number of decode rows before the chunks: Triton compiles a
    variant per pointer alignment, which on a GPU would be a compile in the middle of a run."""
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    chunks, misaligned, decode_rows = [], [], set()
    import hf_paged.attention.kernels.triton_prefill as triton_prefill

    kernel = triton_prefill.paged_prefill_attention_triton

    def recording(query, k, v, tables, cu_seqlens_q, seq_lens, **kw):
        chunks.append(len(cu_seqlens_q) - 1)
        tensors = [query, k, v, tables, cu_seqlens_q, seq_lens, *(t for t in kw.values() if torch.is_tensor(t))]
        misaligned.extend(t.shape for t in tensors if t.data_ptr() % 16)
        decode_rows.add(len(engine.scheduler.running) - len(seq_lens))
        return kernel(query, k, v, tables, cu_seqlens_q, seq_lens, **kw)

    monkeypatch.setattr(triton_prefill, "paged_prefill_attention_triton", recording)
    prompts = random_prompts((13, 22, 5))
    engine, pool = tiny_engine(name, 64, max_num_seqs=3, max_num_batched_tokens=10)
    new_tokens = [5, 12, 6]  # past the window of 8 of the sliding layers
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert pool.num_used_blocks == 0
    assert chunks and max(chunks) >= 2  # several prompts' chunks in one launch
    assert misaligned == [] and {1, 2} <= decode_rows  # chunks after 1 and 2 decode rows: 4 and 8 bytes into the rows


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])  # logit softcap; attention sinks (s_aux)
def test_paged_prefill_kernel_applies_softcap_and_sinks(monkeypatch, model_type):
    """The zoo's Engine path with the Triton backend: prefill chunks through the paged prefill kernel, which applies
    the softcap and sinks the attention function is handed, give each prompt's generate() tokens and logits."""
    require_triton_on_cpu()
    model = zoo.tiny_model(model_type, zoo.architectures()[model_type])
    model_inputs = zoo.inputs()
    expected = zoo.single_reference(model, model_inputs)
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    calls = []
    import hf_paged.attention.kernels.triton_prefill as triton_prefill

    kernel = triton_prefill.paged_prefill_attention_triton
    monkeypatch.setattr(
        triton_prefill, "paged_prefill_attention_triton", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw)
    )
    assert zoo.compare(zoo._engine(model, model_inputs), expected) is None
    option = "softcap" if model_type == "gemma2" else "sinks"
    assert calls and all(call[option] is not None for call in calls)


def test_a_request_larger_than_the_pool_fails_alone():
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine("llama", 9, max_num_seqs=4)  # request 3 needs 10 blocks, the pool has 9
    with pytest.raises(RequestFailed, match="input 3: request 3 needs 10 blocks .* the pool has 9") as info:
        engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reference = greedy_reference("llama", prompts, NEW_TOKENS)
    assert list(info.value.errors) == [3]
    assert [out for i, out in enumerate(info.value.outputs) if i != 3] == reference[:3] + reference[4:]
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_a_sliding_model_runs_in_the_blocks_it_needs_alone(name):
    """A 40-token prompt and 12 new tokens with window 8 in blocks of 4: computed in one chunk, the prompt would take
    10 blocks in each sliding group, but a query only ever sees 3 of them. In a pool of exactly what the request
    needs alone (`solo_need`: 3 blocks all-sliding, 13 full + 3 sliding for Gemma3), it is let in, computes its
    prompt in the chunks the pool holds, and gives generate()'s tokens; one block fewer and it is turned away with
    its numbers."""
    prompts, new_tokens = random_prompts((40,)), [12]
    probe, _ = tiny_engine(name, 64)
    need = probe.scheduler.block_manager.solo_need(Request(0, prompts[0], SamplingParams(max_new_tokens=12)))
    assert need == {"mistral": 3, "gemma3": 16}[name]
    engine, pool = tiny_engine(name, need)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert pool.num_used_blocks == 0 and engine.stats.num_preemptions == 0
    engine, pool = tiny_engine(name, need - 1)
    with pytest.raises(RequestFailed, match=f"request 0 needs {need} blocks .* the pool has {need - 1}"):
        engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    assert pool.num_used_blocks == 0


def test_seeded_sampling_does_not_depend_on_the_batch():
    prompts = random_prompts((6, 9, 4))
    engine, _ = tiny_engine("llama", 64, max_num_seqs=4)
    kwargs = dict(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    together = engine.generate(prompts, **kwargs)  # prompt i draws from its own generator, seeded with 7 + i
    alone = [engine.generate([p], **{**kwargs, "seed": 7 + i})[0] for i, p in enumerate(prompts)]
    assert together == alone
    assert len({tuple(out) for out in together}) == 3
    greedy = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert engine.generate(prompts, max_new_tokens=10, ignore_eos=True, temperature=1.0, top_k=1, seed=0) == greedy


def test_greedy_and_sampled_rows_share_steps_with_an_unfinished_prefill_chunk():
    """Greedy and seeded-sampled decode rows in the same steps as a 30-token prompt prefilled 8 tokens at a time (a
    chunk short of its prompt's end samples nothing): each request gets what it gets alone."""
    prompts = random_prompts((6, 9, 30))
    settings = [{}, dict(temperature=0.9, top_k=20, seed=3), {}]
    engine, _ = tiny_engine("llama", 64, max_num_seqs=4, max_num_batched_tokens=8)
    ids = [engine.add_request(p, max_new_tokens=10, ignore_eos=True, **kw) for p, kw in zip(prompts, settings)]
    while engine.has_unfinished():
        engine.step()
    alone = [engine.generate([p], max_new_tokens=10, ignore_eos=True, **kw)[0] for p, kw in zip(prompts, settings)]
    assert [engine.request(i).output_ids for i in ids] == alone
    assert alone[0] == greedy_reference("llama", prompts[:1], [10])[0]


def test_stop_tokens_end_a_request_and_are_kept():
    prompts = random_prompts((6,))
    engine, _ = tiny_engine("llama", 64)
    full = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)[0]
    stop = full[4]
    out = engine.generate(prompts, max_new_tokens=10, stop_token_ids=(stop,))[0]
    assert out == full[: full.index(stop) + 1]
    assert engine.generate(prompts, max_new_tokens=10, eos_token_id=stop)[0] == out
    assert engine.generate(prompts, max_new_tokens=10, eos_token_id=stop, ignore_eos=True)[0] == full


def test_stream_yields_every_token_in_order_per_request():
    prompts = random_prompts((5, 8))
    engine, _ = tiny_engine("llama", 64)
    expected = engine.generate(prompts, max_new_tokens=[6, 3], ignore_eos=True)
    streamed = [[], []]
    for index, token in engine.stream(prompts, max_new_tokens=[6, 3], ignore_eos=True):
        streamed[index].append(token)
    assert streamed == expected


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_max_pool_tokens_is_what_one_request_holds_alone(name):
    """A request whose K/V (prompt + new tokens - 1: the last token is never fed back) reach `max_pool_tokens` is
    queued; one token more and it finishes at once with its error."""
    engine, pool = tiny_engine(name, 12)
    limit = engine.max_pool_tokens
    if name == "llama":
        assert limit == pool.num_blocks // len(pool.layer_groups) * pool.block_size
    fits = engine.add_request(random_prompts((limit - 3,))[0], max_new_tokens=4)
    too_long = engine.add_request(random_prompts((limit - 2,))[0], max_new_tokens=4)
    assert not engine.request(fits).finished
    assert engine.request(too_long).finished and "the pool has 12" in engine.request(too_long).error
    engine.abort_request(fits)


def test_serving_loop_with_add_request_and_step():
    prompts = random_prompts((5, 8))
    engine, pool = tiny_engine("llama", 64)
    first = engine.add_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    engine.step()  # the first request is running when the second arrives
    second = engine.add_request(prompts[1], max_new_tokens=4, ignore_eos=True)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_running == engine.num_waiting == 0
    assert [engine.request(first).output_ids, engine.request(second).output_ids] == greedy_reference(
        "llama", prompts, [4, 4]
    )
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be >= 0"),
    ],
)
def test_bad_sampling_parameters_name_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_arguments():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="max_num_seqs and max_num_batched_tokens must be >= 1"):
        Engine(model, pool, max_num_seqs=0)
    engine = Engine(model, pool)
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], max_new_tokens=[3])


def _shared_prefix_prompts(num_requests=6, prefix_len=40, seed=3):
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 128, (prefix_len,), generator=generator).tolist()
    return [system + torch.randint(1, 128, (5 + i,), generator=generator).tolist() for i in range(num_requests)]


def test_shared_system_prompt_is_computed_once_with_identical_output():
    prompts = _shared_prefix_prompts()
    new_tokens = [6] * len(prompts)
    reference = greedy_reference("llama", prompts, new_tokens)
    results = {}
    for caching in (False, True):
        model = tiny_model("llama", "hf_paged")
        pool = BlockPool.for_model(model, num_blocks=96, block_size=4)
        # A budget of 44 tokens: the first request's prefill fills a step, the others start after it is cached.
        engine = Engine(model, pool, max_num_seqs=8, max_num_batched_tokens=44, enable_prefix_caching=caching)
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        results[caching] = engine.stats
        assert pool.num_used_blocks == 0
    cold, warm = results[False], results[True]
    assert cold.prefill_tokens == sum(map(len, prompts)) and cold.prefix_hit_tokens == 0
    # Every request after the first finds the 40-token system prompt (10 full blocks of 4) cached.
    assert warm.prefix_hit_tokens == 40 * (len(prompts) - 1)
    assert warm.prefill_tokens == cold.prefill_tokens - warm.prefix_hit_tokens
    assert warm.decode_tokens == cold.decode_tokens == sum(new_tokens) - len(prompts)


def test_parallel_samples_of_one_prompt_compute_it_once():
    """Four requests with one prompt, admitted together: the first computes the prompt; the others wait until its
    blocks are cached and take them, instead of all four computing a copy in the same step."""
    prompt = random_prompts((30,))[0]
    engine, pool = tiny_engine("llama", 64, max_num_seqs=8, enable_prefix_caching=True)
    assert (
        engine.generate([prompt] * 4, max_new_tokens=6, ignore_eos=True) == greedy_reference("llama", [prompt], [6]) * 4
    )
    hit = (len(prompt) - 1) // 4 * 4  # 28 tokens: 7 full blocks (one token is always left to compute)
    assert engine.stats.prefix_hit_tokens == 3 * hit
    assert engine.stats.prefill_tokens == len(prompt) + 3 * (len(prompt) - hit)
    assert pool.num_used_blocks == 0


def test_admission_counts_blocks_that_running_requests_share_once():
    """Requests sharing a 32-token system prompt (8 blocks of 4) in a 30-block pool peak at 10-12 blocks each: counted
    one by one, 2 fit. Counting the 8 shared blocks once, held by the running ones or about to be taken from the
    cache by a newcomer, 6 run side by side, and still none is preempted."""
    prompts = _shared_prefix_prompts(num_requests=8, prefix_len=32)
    new_tokens = [8] * len(prompts)
    engine, pool = tiny_engine("llama", 30, max_num_seqs=8, enable_prefix_caching=True)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert engine.stats.num_preemptions == 0 and engine.stats.peak_running >= 6  # counted one by one, 2 fit
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_admission_counts_shared_blocks_once_in_the_full_group_of_a_layer_group_pool():
    """Gemma3-style sliding + full groups (window 8, blocks of 4), 8 requests sharing a 32-token system prompt, a
    56-block pool: counting the prompt's 8 full-group blocks once however many running requests hold them, 5 run
    side by side (3 when every request counts its blocks as its own), none is preempted, and every output is
    generate()'s."""
    prompts = _shared_prefix_prompts(num_requests=8, prefix_len=32)
    new_tokens = [8] * len(prompts)
    engine, pool = tiny_engine("gemma3", 56, max_num_seqs=8)
    assert pool.num_groups == 2 and pool.allocator.enable_prefix_caching
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "gemma3", prompts, new_tokens
    )
    assert engine.stats.num_preemptions == 0 and engine.stats.peak_running >= 5
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


@pytest.mark.parametrize("name, num_blocks, prefix_len, peak", [("gemma3", 40, 32, 5), ("mistral", 24, 48, 8)])
def test_sliding_models_run_requests_continuing_a_cached_prompt_side_by_side(name, num_blocks, prefix_len, peak):
    """8 requests sharing a system prompt on a pool with sliding groups (window 8, blocks of 4). A request that
    continues the cached prompt takes it when admitted, so admission counts its full-group blocks as shared and its
    sliding groups from the prompt's end (a window, not the prompt): 5 and 8 run at once, with no preemption and
    generate()'s outputs (counting the prompt as fresh, the same pools run at most 3 and 4)."""
    prompts = _shared_prefix_prompts(num_requests=8, prefix_len=prefix_len)
    new_tokens = [8] * len(prompts)
    engine, pool = tiny_engine(name, num_blocks, max_num_seqs=8)
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        name, prompts, new_tokens
    )
    assert engine.stats.num_preemptions == 0 and engine.stats.peak_running >= peak
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_admission_counts_a_newcomers_cached_prefix_as_held():
    """A request holds a 32-token system prompt (8 blocks of 4) in a 15-block pool. A newcomer with the same system
    prompt takes those 8 blocks from the cache when its prefill starts: counted as held, both peak at 9 + 2 fresh =
    11 blocks and it fits; counted as fresh (10 blocks) it would not, and a newcomer with another prompt does not."""
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=15, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    system = list(range(1, 33))
    running = Request(0, system, SamplingParams(max_new_tokens=5))  # peaks at 32 + 4 tokens: 9 blocks
    scheduler.add(running)
    assert scheduler.schedule().prefill == [(running, 32)]
    running.num_computed = 32  # what the engine does after the forward
    scheduler.cache_full_blocks(running)
    assert pool.allocator.num_cached_blocks == 8

    def newcomer(prompt: list[int]) -> Request:
        return Request(1, prompt, SamplingParams(max_new_tokens=5))  # 36 + 4 tokens at peak: 10 blocks

    assert scheduler.fits(newcomer(system + [40, 41, 42, 43]))
    assert not scheduler.fits(newcomer(list(range(40, 76))))
    assert pool.num_free_blocks == 7 and pool.allocator.ref_count(0) == 1  # fits() took nothing
    pool.allocator.check_invariants()


def test_lookahead_admission_never_preempts_and_a_short_reserve_does():
    prompts = random_prompts(PROMPT_LENGTHS)
    runs = {}
    for reserve in (0, 4, None):
        # Strict arrival order: with backfill, reserve 0 admits the three short prompts before the 30-token one
        # and this pool happens to hold them without preempting.
        engine, pool = tiny_engine("llama", 16, max_num_seqs=5, decode_reserve_tokens=reserve, backfill_depth=1)
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == greedy_reference(
            "llama", prompts, NEW_TOKENS
        )
        runs[reserve] = engine.stats
        assert pool.num_used_blocks == 0
    assert runs[None].num_preemptions == 0 < runs[0].num_preemptions
    assert runs[4].num_preemptions <= runs[0].num_preemptions
    # The lookahead still runs requests side by side when their peaks fit together.
    assert runs[None].peak_running >= 2
    with pytest.raises(ValueError, match="decode_reserve_tokens must be None or >= 0, got -1"):
        tiny_engine("llama", 16, decode_reserve_tokens=-1)


def test_lookahead_counts_blocks_freed_by_requests_that_finish_first():
    # A 4-block pool of 4-token blocks: a request of 6 prompt + 7 new tokens peaks at 12 tokens = 3 blocks. A second
    # 2-token request with 3 new tokens peaks at 4 tokens (1 block) and finishes long before the first one peaks.
    engine, pool = tiny_engine("llama", 4, max_num_seqs=4)
    scheduler = engine.scheduler
    engine.add_request(list(range(2, 8)), max_new_tokens=7, ignore_eos=True)
    engine.step()  # the first request is running, 2 blocks held
    engine.add_request([9, 10], max_new_tokens=3, ignore_eos=True)
    assert scheduler.fits(scheduler.waiting[0])
    engine.add_request(list(range(2, 14)), max_new_tokens=2, ignore_eos=True)  # 13 tokens at peak: 4 blocks
    assert not scheduler.fits(scheduler.waiting[-1])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_preemptions == 0 and engine.stats.peak_running == 2


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_every_step_is_one_forward_with_decode_rows_and_prefill_chunks_packed(name):
    # Small token budget: prompts arrive in chunks while earlier requests decode, so steps mix both kinds.
    prompts = random_prompts((5, 17, 9, 30, 3))
    engine, pool = tiny_engine(name, 64, max_num_seqs=4, max_num_batched_tokens=10)
    forwards, mixed = [], []
    original = engine.step_runner.forward

    def spy(rows):
        forwards.append(len(rows))
        mixed.append(any(n == 1 for _, n in rows) and any(n > 1 for _, n in rows))
        return original(rows)

    engine.step_runner.forward = spy
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert outputs == greedy_reference(name, prompts, NEW_TOKENS)
    assert len(forwards) == engine.stats.num_steps  # exactly one forward per step
    assert sum(mixed) >= 3  # and some of them carried decode rows and prefill chunks together
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("name, group_layers", [("gemma3", True), ("gemma3", False), ("mistral", True)])
def test_sliding_groups_give_back_blocks_out_of_the_window(name, group_layers):
    # Window 8, blocks of 4: a sliding group holds at most 3 blocks per decoding request (2 for the window, 1 for
    # the block being filled), while a full group (and a one-group Gemma pool) holds the whole sequence.
    model = tiny_model(name, "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=96, block_size=4, group_layers=group_layers)
    engine = Engine(model, pool, max_num_seqs=3)
    prompts, new_tokens = random_prompts((5, 17, 9)), [30, 24, 40]
    sliding = [g for g, window in enumerate(engine.scheduler.group_windows) if window is not None]
    assert len(sliding) == {"gemma3": 1 if group_layers else 0, "mistral": 1}[name]
    peak_sliding = 0
    original = engine.step_runner.forward

    def spy(rows):  # what each decode row holds while its step runs
        nonlocal peak_sliding
        for request, num_tokens in rows:
            if num_tokens == 1:
                assert all(request.first_blocks[g] == 0 for g in range(pool.num_groups) if g not in sliding)
                peak_sliding = max([peak_sliding] + [len(request.block_tables[g]) for g in sliding])
        return original(rows)

    engine.step_runner.forward = spy
    request_ids = [engine.add_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    while engine.has_unfinished():
        engine.step()
    assert [engine.request(r).output_ids for r in request_ids] == greedy_reference(name, prompts, new_tokens)
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()
    if sliding:
        assert peak_sliding == 3
    assert engine.stats.num_preemptions == 0


@pytest.mark.parametrize("name", ["gemma3", "mistral"])  # sliding + full layer groups; every layer sliding
def test_shared_system_prompt_with_sliding_layers_is_computed_once(name):
    """Each layer group caches its own blocks; a sliding group (window 8, blocks of 4) takes only the 2 blocks its
    window sees from position 40, a full group all 10, and the output is what generate() gives each prompt."""
    prompts = _shared_prefix_prompts()
    new_tokens = [6] * len(prompts)
    reference = greedy_reference(name, prompts, new_tokens)
    model = tiny_model(name, "hf_paged")
    results = {}
    for caching in (False, True):
        pool = BlockPool.for_model(model, num_blocks=96, block_size=4)
        engine = Engine(model, pool, max_num_seqs=8, max_num_batched_tokens=44, enable_prefix_caching=caching)
        hits = []
        take = engine.scheduler.prefix.take

        def spy(request, take=take, hits=hits):  # the tables each prefill starts from
            take(request)
            hits.append((request.num_computed, list(request.first_blocks), [len(t) for t in request.block_tables]))

        engine.scheduler.prefix.take = spy
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        results[caching] = engine.stats
        assert pool.num_used_blocks == 0
        pool.allocator.check_invariants()
    cold, warm = results[False], results[True]
    assert cold.prefix_hit_tokens == 0 and warm.prefix_hit_tokens == 40 * (len(prompts) - 1)
    assert warm.prefill_tokens == cold.prefill_tokens - warm.prefix_hit_tokens
    windows = engine.scheduler.group_windows
    expected = [(0, [0] * len(windows), [0] * len(windows))] + [
        (40, [0 if w is None else 8 for w in windows], [10 if w is None else 2 for w in windows])
    ] * (len(prompts) - 1)
    assert hits == expected


def test_a_sliding_groups_blocks_out_of_the_window_may_be_evicted_without_losing_the_hit():
    """A 30-token prompt's second run finds 7 blocks (28 tokens) although the sliding group's blocks 0-4, which
    the window of 8 from position 28 does not see, were evicted. With the full group's block 6 evicted too, a hit
    of 6 blocks or fewer would need a window from position 24 or earlier, which starts in block 4: no hit."""
    model = tiny_model("gemma3", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=4)
    prompt = random_prompts((30,))[0]
    reference = greedy_reference("gemma3", [prompt], [6])
    assert engine.generate([prompt], max_new_tokens=6, ignore_eos=True) == reference
    windows = engine.scheduler.group_windows
    sliding, full = windows.index(8), windows.index(None)
    allocator, hashes = pool.allocator, block_hashes(prompt, 4)[:7]
    for block_id in allocator.peek_blocks(hashes[:5], sliding):
        allocator.uncache(block_id)
    assert engine.generate([prompt], max_new_tokens=6, ignore_eos=True) == reference
    assert engine.stats.prefix_hit_tokens == 28
    (block_id,) = allocator.peek_blocks(hashes[6:7], full)
    allocator.uncache(block_id)  # a hit of at most 6 blocks, whose window needs evicted sliding blocks: none
    assert engine.generate([prompt], max_new_tokens=6, ignore_eos=True) == reference
    assert engine.stats.prefix_hit_tokens == 28
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_preemption_and_prefix_caching_on_a_pool_with_layer_groups():
    """Sliding + full groups, admission that keeps no room for growth: requests are preempted and recomputed, every
    output is what generate() gives, and no block leaks. What each group cached on the way serves the longest
    prompt again: 7 blocks (28 of its 30 tokens)."""
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, pool = tiny_engine("gemma3", 24, max_num_seqs=4, decode_reserve_tokens=0)
    assert pool.num_groups == 2 and pool.allocator.enable_prefix_caching
    reference = greedy_reference("gemma3", prompts, NEW_TOKENS)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True) == reference
    assert engine.stats.num_preemptions > 0
    assert pool.num_used_blocks == 0
    assert engine.generate([prompts[3]], max_new_tokens=NEW_TOKENS[3], ignore_eos=True) == [reference[3]]
    assert engine.stats.prefix_hit_tokens == 28
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_a_packed_step_reads_no_device_value_before_its_tokens(monkeypatch):
    """The packed step on the CUDA branch (Triton store, decode and prefill kernels) makes no tensor from host values
    on the device and reads no device value on the host inside its forward: on CUDA each would make the host wait
    for the GPU. Its tensors come from `to_device`, before the forward; Triton's interpreter's own reads are its."""
    import sys as _sys

    from hf_paged.engine.packed import PackedStep

    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    engine, _ = tiny_engine("llama", 64, max_num_seqs=3, max_num_batched_tokens=10)
    forward, forwards = PackedStep.forward, []

    def outside_triton() -> bool:
        frame = _sys._getframe(2)
        while frame is not None:
            if "/triton/" in frame.f_code.co_filename:
                return False
            frame = frame.f_back
        return True

    def checked_forward(self, rows):
        if self.runner is not None and all(n == 1 for _, n in rows):
            return forward(self, rows)  # decode-only: the runner (tests/test_decode_runner.py)
        originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu", "__bool__")}
        tensor = torch.tensor

        def reading(name):
            def read(self, *args, **kwargs):
                assert not outside_triton(), f"Tensor.{name} inside a packed step's forward"
                return originals[name](self, *args, **kwargs)

            return read

        def made(*args, **kwargs):
            assert kwargs.get("device") is None or not outside_triton(), "a tensor made on the device from host values"
            return tensor(*args, **kwargs)

        with monkeypatch.context() as patched:
            for name in originals:
                patched.setattr(torch.Tensor, name, reading(name))
            patched.setattr(torch, "tensor", made)
            logits = forward(self, rows)
        forwards.append(len(rows))
        return logits

    monkeypatch.setattr(PackedStep, "forward", checked_forward)
    prompts = random_prompts((13, 22, 5))
    new_tokens = [5, 12, 6]
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == greedy_reference(
        "llama", prompts, new_tokens
    )
    assert forwards and max(forwards) >= 2  # steps of several rows, prefill chunks beside decode rows
