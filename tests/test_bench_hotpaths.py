"""pytest-benchmark microbenchmarks of the hot paths: allocator operations, PagedCache.update, and the engine's
per-step work outside the model (admission's lookahead, a packed step's bookkeeping and K/V stores), and the
benchmark model's linear layers on a decode step (stock against weight-major, bench/linear.py), and the logprobs
object of an echoed prompt that the server builds.

CI runs these once each with --benchmark-disable (a smoke test); `make microbench` times them for real.
Each still asserts its result, so a broken hot path fails here too.
"""

import pytest
import torch
from transformers import DynamicCache

from bench.cache_report import DECODE_VARIANTS, _prefilled
from bench.linear import weight_major_linear
from bench.models import load_model
from hf_paged import BlockAllocator, BlockPool, KVLayout, PagedCache
from hf_paged.attention import plan_of
from hf_paged.engine import Request, SamplingParams, Scheduler, StepCache
from tests.models import gemma3_config


def test_allocate_free_cycle(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        block_ids = allocator.allocate(64)
        allocator.free(block_ids)
        return block_ids

    assert len(benchmark(cycle)) == 64
    assert allocator.num_free_blocks == 4096


def test_fork_and_copy_on_write(benchmark):
    allocator = BlockAllocator(4096)
    table = allocator.allocate(64)

    def fork_then_write_last_block():
        allocator.incref(table)
        new = allocator.copy_on_write(table[-1])
        allocator.free(table[:-1] + [new])
        return new

    assert benchmark(fork_then_write_last_block) != table[-1]
    assert allocator.num_used_blocks == 64


def _filled_cache(batch_size: int, context: int, num_layers: int = 4, fragmented: bool = False):
    """A cache of `batch_size` rows of `context` tokens. `fragmented`: another cache of the pool took every other
    block, so no row's blocks are consecutive and every step gathers (else one row is a view of the pool)."""
    layout = KVLayout((4,) * num_layers, (64,) * num_layers)
    pool = BlockPool(layout, num_blocks=2 * batch_size * (context // 16 + 4), block_size=16)
    cache, other = PagedCache(pool=pool), PagedCache(pool=pool)
    states = torch.randn(batch_size, 4, context, 64)
    chunks = states.split(16, dim=2) if fragmented else [states]  # the last chunk may be short
    for chunk in chunks:
        for target in (cache, other) if fragmented else (cache,):
            for layer_idx in range(num_layers):
                target.update(chunk, chunk, layer_idx)
    return cache, num_layers


@pytest.mark.parametrize(
    "batch_size, context, fragmented",
    [(1, 500, False), (1, 500, True), (1, 4090, False), (16, 500, False)],
    ids=["1x500-consecutive", "1x500-fragmented", "1x4090-consecutive", "16x500"],
)
def test_cache_update_decode_step(benchmark, batch_size, context, fragmented):
    """One decode step of every layer: store one token per row, return the whole context (a view of the pool for
    one row in consecutive blocks, else a gather). The context leaves room in its last block, so every round
    writes the same block (a round that took a block would give it back at the crop, and the next round would get
    another one from the free queue)."""
    cache, num_layers = _filled_cache(batch_size, context, fragmented=fragmented)
    step = torch.randn(batch_size, 4, 1, 64)

    def decode_step():
        for layer_idx in range(num_layers):
            keys, _ = cache.update(step, step, layer_idx)
        cache.crop(-1)  # keep the context fixed across rounds
        return keys

    keys = benchmark(decode_step)
    assert keys.shape == (batch_size, 4, context + 1, 64)
    assert torch.equal(keys[:, :, -1], step[:, :, 0])
    is_view = keys.untyped_storage().data_ptr() == cache.pool.key_cache[num_layers - 1].untyped_storage().data_ptr()
    assert is_view == (batch_size == 1 and not fragmented)
    cache.release()


@pytest.mark.parametrize("path", ["shared-prefix", "gather"])
def test_shared_prompt_decode_attention(benchmark, path):
    """One decode step's attention of 8 rows that share a 1,008-token prompt and hold 16 tokens of their own (the
    cache report's `num_return_sequences=8`), 4 layers: the "hf_paged" attention's torch path reading the prompt
    once from the pool against gathering every row's whole context for SDPA (the sdpa path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    num_layers, num_rows = 4, 8
    layout = KVLayout((4,) * num_layers, (64,) * num_layers)
    pool = BlockPool(layout, num_blocks=64 + num_rows * 2 + 8, block_size=16)
    cache = PagedCache(pool=pool)
    cache._update.visible._runs_paged_attention = lambda: True  # the "hf_paged" attention's decode plans
    prompt = torch.randn(1, 4, 1008, 64).expand(num_rows, -1, -1, -1)
    for layer_idx in range(num_layers):
        cache.update(prompt, prompt, layer_idx)
    for _ in range(15):
        own = torch.randn(num_rows, 4, 1, 64)
        for layer_idx in range(num_layers):
            cache.update(own, own, layer_idx)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query, step = torch.randn(num_rows, 8, 1, 64), torch.randn(num_rows, 4, 1, 64)

    def decode_step():
        outputs = []
        for layer_idx in range(num_layers):
            keys, _ = cache.update(step, step, layer_idx)
            plan = plan_of(keys)
            if path == "shared-prefix":
                outputs.append(plan.attend_shared_prefix(query, None))
            else:
                keys, values = plan.gather()
                outputs.append(sdpa_attention_forward(module, query, keys, values, None)[0])
        cache.crop(-1)  # keep the context fixed across rounds
        return outputs

    outputs = benchmark(decode_step)
    keys, values = plan_of(cache.update(step, step, 0)[0]).gather()
    expected, _ = sdpa_attention_forward(module, query, keys, values, None)
    torch.testing.assert_close(outputs[0], expected, rtol=1e-4, atol=1e-5)
    cache.release()


@pytest.fixture(scope="module")
def default_model():
    return load_model(device="cpu")


@pytest.mark.parametrize("variant", ["dynamic+sdpa", "paged+sdpa", "paged+hf_paged"])
def test_default_model_decode_step_batch1(benchmark, default_model, variant):
    """One batch-1 decode step of the benchmark's default model after a 512-token context (the cache report's
    decode speed, one step): DynamicCache + sdpa against PagedCache + sdpa and + the "hf_paged" attention. Every
    variant's logits equal DynamicCache's."""
    model = default_model
    label, make_cache, attention = next(v for v in DECODE_VARIANTS if v[0] == variant)
    token, position = torch.tensor([[5]]), torch.tensor([[512]])

    @torch.inference_mode()
    def step(cache):
        logits = model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True).logits
        cache.crop(-1)  # keep the context fixed across rounds
        return logits

    original = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
        expected = step(_prefilled(DynamicCache(config=model.config), model, 1, 512, seed=0))
        model.set_attn_implementation(attention)
        cache = _prefilled(make_cache(model.config), model, 1, 512, seed=0)
        assert torch.equal(benchmark(step, cache), expected)
    finally:
        model.set_attn_implementation(original)


ONE_GROUP = ["full_attention"] * 6
SIX_GROUPS = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma3's pattern: 6 layer groups of one layer


@pytest.mark.parametrize("layer_types", [ONE_GROUP, SIX_GROUPS], ids=["1-group", "6-groups"])
def test_engine_step_cache(benchmark, layer_types):
    """A packed engine step outside the model: build the `StepCache` (per layer group: block tables, slots, decode
    lengths) for 16 decode rows and one 64-token prefill chunk, then every layer's `update` (store + plan)."""
    pool = BlockPool.for_model(gemma3_config(layer_types), num_blocks=2560, block_size=16, dtype=torch.float32)
    seq_lens, q_lens = [300 + 7 * row for row in range(16)] + [128], [1] * 16 + [64]
    blocks_per_row = [-(-(n + q) // 16) for n, q in zip(seq_lens, q_lens)]
    block_ids = iter(range(pool.num_blocks))
    tables = [[[next(block_ids) for _ in range(count)] for count in blocks_per_row] for _ in range(pool.num_groups)]
    num_tokens = sum(q_lens)
    states = torch.randn(1, 2, num_tokens, 16)
    workspace = {}

    def step():
        cache = StepCache(pool, tables, seq_lens, q_lens, workspace=workspace)
        for layer_idx in range(len(layer_types)):
            keys, _ = cache.update(states, states, layer_idx)
        return keys

    plan = plan_of(benchmark(step))
    assert plan.cache.num_decode == 16 and plan.layer_idx == len(layer_types) - 1  # the step's last layer
    # the last layer stored decode row 15's token at its position 300 + 7 * 15 of its own table
    layer, table = len(layer_types) - 1, tables[pool.group_of_layer[len(layer_types) - 1]][15]
    position = 300 + 7 * 15
    stored = pool.key_cache[layer][:, table[position // 16], position % 16]
    assert torch.equal(stored, states[0, :, 15])


def test_scheduler_admission_lookahead(benchmark):
    """Admission's lookahead with 64 running requests (O(n^2) in running requests; only while requests wait)."""
    pool = BlockPool(KVLayout((4,) * 2, (64,) * 2), num_blocks=2048, block_size=16)
    scheduler = Scheduler(pool, max_num_seqs=128, max_num_batched_tokens=512)
    for index in range(64):
        scheduler.add(Request(index, [1] * 100, SamplingParams(max_new_tokens=200)))
    scheduler.schedule()
    assert len(scheduler.running) == 64

    def newcomer(prompt_len: int) -> Request:
        return Request(64, [1] * prompt_len, SamplingParams(max_new_tokens=200))

    assert benchmark(scheduler.fits, newcomer(100))
    # The peak is 199 steps on, when the 64 running requests hold 299 tokens (19 blocks) each: 1,216 blocks, so a
    # newcomer that is 832 blocks (13,312 tokens) by then fits, and one token more does not. At step 0 both would.
    assert scheduler.fits(newcomer(13312 - 199))
    assert not scheduler.fits(newcomer(13312 - 199 + 1))


def test_scheduler_backfill_scan_while_blocked(benchmark):
    """Admission while the pool is full: the backfill window (8) is scanned every step, one lookahead per waiting
    request, 64 running; nothing fits, so nothing changes between rounds."""
    pool = BlockPool(KVLayout((4,) * 2, (64,) * 2), num_blocks=1216 + 18, block_size=16)
    scheduler = Scheduler(pool, max_num_seqs=128, max_num_batched_tokens=512)
    for index in range(64 + 8):
        scheduler.add(Request(index, [1] * 100, SamplingParams(max_new_tokens=200)))
    scheduler.schedule()
    assert (
        len(scheduler.running) == 64 and len(scheduler.waiting) == 8
    )  # 64 x 19 blocks at the peak: 1,216 + 19 > 1,234

    benchmark(scheduler.admit)
    assert len(scheduler.running) == 64 and [r.num_skips for r in scheduler.waiting] == [0] * 8


@pytest.fixture(scope="module")
def default_model_linears(default_model):
    return [m for m in default_model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("linear", ["torch", "weight-major"])
def test_default_model_linears_three_rows(benchmark, default_model_linears, linear):
    """Every linear layer of the benchmark's default model on a 3-row decode step, stock F.linear against
    bench/linear.py's weight-major form (the harness's CPU default)."""
    inputs = {size: torch.randn(1, 3, size) for size in (512, 1536)}
    forward = (lambda layer, x: layer(x)) if linear == "torch" else weight_major_linear

    @torch.inference_mode()
    def all_layers():
        return [forward(layer, inputs[layer.in_features]) for layer in default_model_linears]

    outputs = benchmark(all_layers)
    last = default_model_linears[-1]  # the LM head
    torch.testing.assert_close(outputs[-1], inputs[512] @ last.weight.T, rtol=1e-4, atol=1e-4)


def test_echoed_prompt_logprobs(benchmark):
    """The completions `logprobs` of a 2,048-token prompt echoed with its top alternative (lm-eval's loglikelihood
    request): every token's text, decoded after the tokens before it, in one call of the Rust tokenizer."""
    import random

    from hf_paged.engine.sampling import TokenLogprob
    from hf_paged.serve.handlers import _completion_logprobs
    from hf_paged.serve.stream import GeneratedIds
    from tests.test_serve import make_tokenizer

    tokenizer, rng = make_tokenizer(), random.Random(0)
    prompt = [rng.randrange(4, len(tokenizer)) for _ in range(2048)]
    records = [TokenLogprob(-1.0, ((5, -0.5),))] * len(prompt)
    generated = GeneratedIds([7], records[:1], prompt_ids=prompt, prompt_logprobs=records[1:])
    logprobs = benchmark(_completion_logprobs, tokenizer, generated)
    assert len(logprobs["tokens"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
    echoed = tokenizer.decode(prompt, skip_special_tokens=True) + tokenizer.decode([7])  # the prompt, then the answer
    assert "".join(logprobs["tokens"]) == echoed
