"""A compileable PagedCache (`max_cache_len`) and the paged kernels as torch custom ops.

On CPU, torch.compile runs with the "aot_eager" backend (the graph dynamo and AOTAutograd build, run eagerly): what
these tests check is that a decode step is ONE graph with no break, that it is reused step after step, and that its
tokens equal the eager ones and DynamicCache's. CUDA graphs and inductor are checked in tests/test_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from models import left_padded_batch, random_prompt, require_triton_on_cpu, tiny_model
from torch._dynamo.utils import counters
from torch.library import opcheck
from transformers import DynamicCache, StaticCache
from transformers.generation import CompileConfig

import hf_paged
from hf_paged import BlockPool, PagedCache, UnsupportedModel
from hf_paged.attention.kernels import ops  # noqa: F401  (registers torch.ops.hf_paged.*)

MAX_NEW_TOKENS = 20


@pytest.fixture(autouse=True)
def no_grad():
    """A PagedCache refuses K/V that require grad (GradientsUnsupported): these forwards run as generate()'s do."""
    with torch.no_grad():
        yield


def compile_config() -> CompileConfig:
    """fullgraph: a graph break fails the compile instead of splitting the step."""
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles generate() by itself on CUDA only
    return config


def generate(model, cache, input_ids, attention_mask=None, **options):
    torch.manual_seed(0)
    return model.generate(
        input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=MAX_NEW_TOKENS, **options
    )


def compiled_generate(model, cache, input_ids, attention_mask=None, **options):
    """generate() with the decode forward compiled; returns (tokens, number of graphs dynamo built). The compiled
    call generate() keeps on the model is dropped after: the tiny models are shared between tests."""
    torch._dynamo.reset()
    counters.clear()
    try:
        out = generate(model, cache, input_ids, attention_mask, compile_config=compile_config(), **options)
    finally:
        for attribute in ("_compiled_call", "_last_compile_config"):
            model.__dict__.pop(attribute, None)
    return out, counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------- custom ops
def test_store_op_passes_opcheck_and_writes_the_slots():
    torch.manual_seed(0)
    key_cache, value_cache = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, 17, 30])
    opcheck(torch.ops.hf_paged.store_kv.default, (key, value, key_cache.clone(), value_cache.clone(), slots, "torch"))
    torch.ops.hf_paged.store_kv(key, value, key_cache, value_cache, slots, "torch")
    assert torch.equal(key_cache.view(-1, 2, 16)[slots], key)
    assert torch.equal(value_cache.view(-1, 2, 16)[slots], value)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("extras", [{}, {"sliding_window": 5, "softcap": 30.0}])
def test_decode_op_passes_opcheck_and_matches_the_reference(backend, extras):
    if backend == "triton":
        require_triton_on_cpu()
    torch.manual_seed(0)
    key_cache, value_cache = torch.randn(16, 4, 2, 16), torch.randn(16, 4, 2, 16)
    query = torch.randn(3, 4, 16)
    block_tables = torch.randperm(16, dtype=torch.int32)[:15].view(3, 5)
    seq_lens = torch.tensor([5, 17, 20], dtype=torch.int32)
    kv_start = torch.tensor([0, 3, 1], dtype=torch.int32)
    window, softcap = extras.get("sliding_window"), extras.get("softcap")
    args = (query, key_cache, value_cache, block_tables, seq_lens, kv_start, 0.25, window, softcap, backend)
    opcheck(torch.ops.hf_paged.paged_decode_attention.default, args)
    expected = hf_paged.attention.kernels.paged_decode_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, scale=0.25, kv_start=kv_start, **extras
    )
    torch.testing.assert_close(torch.ops.hf_paged.paged_decode_attention(*args), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ no graph break
def decode_step(model, cache, input_ids, attention_mask):
    """Prefill eagerly, reserve the next token, and return a function running one decode forward (with the 4D mask
    generate() would build outside the compiled region)."""
    model(input_ids, attention_mask=attention_mask, cache=cache)
    next_ids = torch.randint(1, 100, (input_ids.shape[0], 1))
    mask_2d = torch.cat([attention_mask, attention_mask.new_ones(input_ids.shape[0], 1)], dim=1)
    position_ids = mask_2d.cumsum(-1)[:, -1:] - 1
    inputs = model.prepare_inputs_for_generation(
        next_ids, next_sequence_length=1, cache=cache, attention_mask=mask_2d, position_ids=position_ids
    )
    masks = inputs["attention_mask"]  # built here, outside the forward, as generate() does (one per layer type)
    assert all(mask.dim() == 4 for mask in (masks.values() if isinstance(masks, dict) else [masks]))

    def step():
        return model(**inputs).logits

    return step


@pytest.mark.parametrize("attn", ["sdpa", "hf_paged"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_decode_step_is_one_graph_without_breaks(name, attn):
    if attn == "hf_paged":
        require_triton_on_cpu()
    model = copy.deepcopy(tiny_model(name))
    if attn == "hf_paged":
        hf_paged.enable(model, backend="triton")
    input_ids, attention_mask = left_padded_batch(3, 12)
    cache = PagedCache(config=model.config, max_cache_len=40)
    step = decode_step(model, cache, input_ids, attention_mask)
    explanation = torch._dynamo.explain(step)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_a_decode_step_checks_its_mask_once_not_once_a_layer(monkeypatch):
    """The layers of one mask share its check and first visible keys (`FixedDecodePlan.kv_starts`): made by the first
    layer of a step, eagerly and in a traced forward (where each would be a few more kernels a layer)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from hf_paged.attention.fixed_plan import FixedDecodePlan

    require_triton_on_cpu()
    calls = []
    kv_start = FixedDecodePlan._kv_start
    monkeypatch.setattr(FixedDecodePlan, "_kv_start", lambda plan, mask: calls.append(mask) or kv_start(plan, mask))
    model = copy.deepcopy(tiny_model("llama"))
    assert model.config.num_hidden_layers > 1
    hf_paged.enable(model, backend="triton")
    input_ids, attention_mask = left_padded_batch(3, 12)
    torch.manual_seed(0)  # decode_step draws the next tokens
    expected = decode_step(model, PagedCache(config=model.config, max_cache_len=40), input_ids, attention_mask)()
    assert len(calls) == 1
    monkeypatch.undo()
    traced = []

    def backend(graph, example_inputs):  # the aten ops of the traced forward
        def forward(graph, inputs):
            traced.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
            return graph.forward

        return aot_module_simplified(graph, example_inputs, fw_compiler=forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    step = decode_step(model, PagedCache(config=model.config, max_cache_len=40), input_ids, attention_mask)
    with torch.inference_mode():  # the kernel's op has no autograd formula
        got = torch.compile(step, backend=backend, fullgraph=True)()
    assert traced.count("hf_paged.paged_decode_attention.default") == model.config.num_hidden_layers
    assert traced.count("aten.argmax.default") == traced.count("aten._assert_async.msg") == 1
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()


def test_decode_step_reads_no_device_value_on_the_host(monkeypatch):
    """The reserved step (what a compiled forward runs) never calls .item(), .tolist(), .cpu() or bool() on a tensor:
    each would be a host sync in a CUDA graph."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(3, 12)
    cache = PagedCache(config=model.config, max_cache_len=40)
    step = decode_step(model, cache, input_ids, attention_mask)

    def sync(*args, **kwargs):
        raise AssertionError("a host sync inside the decode forward")

    for method in ("item", "tolist", "cpu", "__bool__"):
        monkeypatch.setattr(torch.Tensor, method, sync)
    step()
    monkeypatch.undo()
    assert cache.get_seq_length() == 13


# ------------------------------------------------------- compiled generate()
@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral"])
def test_compiled_generate_matches_eager_and_dynamic_cache(name):
    model = tiny_model(name)
    input_ids, attention_mask = left_padded_batch(3, 12)
    expected = generate(model, DynamicCache(config=model.config), input_ids, attention_mask, do_sample=False)
    eager = generate(model, PagedCache(config=model.config, max_cache_len=48), input_ids, attention_mask)
    cache = PagedCache(config=model.config, max_cache_len=48)
    compiled, num_graphs = compiled_generate(model, cache, input_ids, attention_mask, do_sample=False)
    assert torch.equal(eager, expected)
    assert torch.equal(compiled, expected)
    assert num_graphs == 1  # every decode step replays the graph of the first
    assert cache.get_seq_length() == 12 + MAX_NEW_TOKENS - 1


# gemma3: its forward's decorator pops a kwarg (a dict mutation dynamo tracks) before the attention reads its plan
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_compiled_generate_with_the_paged_kernel_matches_dynamic_cache(name):
    require_triton_on_cpu()
    model = copy.deepcopy(tiny_model(name))
    input_ids, attention_mask = left_padded_batch(3, 12)
    options = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    expected = generate(model, DynamicCache(config=model.config), input_ids, attention_mask, **options)
    hf_paged.enable(model, backend="triton")
    compiled, num_graphs = compiled_generate(
        model, PagedCache(config=model.config, max_cache_len=48), input_ids, attention_mask, **options
    )
    assert num_graphs == 1
    assert torch.equal(compiled.sequences, expected.sequences)
    for got, want in zip(compiled.scores, expected.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_compiled_sampling_shares_the_prompt_blocks_and_takes_blocks_as_rows_grow():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    input_ids = random_prompt(12)
    options = dict(do_sample=True, num_return_sequences=3)
    expected = generate(model, DynamicCache(config=model.config), input_ids, **options)
    cache = PagedCache(config=model.config, pool=pool, max_cache_len=40)
    compiled, _ = compiled_generate(model, cache, input_ids, **options)
    assert torch.equal(compiled, expected)
    # 12 prompt tokens in 3 shared blocks, then each row's own 19 tokens: 3 + 3 * ceil(19 / 4) blocks, far below the
    # 3 rows x 10 blocks of max_cache_len
    assert cache.num_held_blocks == 3 + 3 * 5
    cache.release()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("options", [dict(num_beams=3), dict(prompt_lookup_num_tokens=3)])
def test_beams_and_candidate_decoding_match_dynamic_cache(options):
    """Beams reorder block tables (under a reservation, it is taken again for the new rows); prompt lookup crops."""
    model = tiny_model("llama")
    input_ids = random_prompt(12)
    expected = generate(model, DynamicCache(config=model.config), input_ids, do_sample=False, **options)
    got = generate(model, PagedCache(config=model.config, max_cache_len=48), input_ids, do_sample=False, **options)
    assert torch.equal(got, expected)


def test_matches_static_cache_and_its_compileable_contract():
    model = tiny_model("llama")
    input_ids = random_prompt(12)
    cache = PagedCache(config=model.config, max_cache_len=48)
    static = StaticCache(config=model.config, max_cache_len=48)
    assert cache.is_compileable and not PagedCache(config=model.config).is_compileable
    assert cache.get_max_length() == static.get_max_length() == 48
    assert torch.equal(generate(model, cache, input_ids), generate(model, static, input_ids))


# -------------------------------------------------------------------- errors
def test_a_forward_without_reservation_is_refused():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(2, 12)
    cache = PagedCache(config=model.config, max_cache_len=40)
    step = decode_step(model, cache, input_ids, attention_mask)
    step()
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="call cache.reserve"):
        torch.compile(step, fullgraph=True, backend="aot_eager")()


def test_reserve_checks_its_arguments_and_max_cache_len():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="compileable"):
        PagedCache(config=model.config).reserve(1)
    cache = PagedCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="prefill"):
        cache.reserve(1)
    with pytest.raises(ValueError, match="max_cache_len=16"):
        model(random_prompt(17), cache=cache)
    cache.release()
    model(random_prompt(15), cache=cache)
    cache.reserve(1)
    cache.reserve(1)  # idempotent until a forward uses it
    with pytest.raises(ValueError, match="1 tokens per row are reserved"):
        cache.reserve(2)
    model(random_prompt(1), cache=cache)
    with pytest.raises(ValueError, match="17 tokens per row, over max_cache_len=16"):
        cache.reserve(1)
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        PagedCache(config=model.config, max_cache_len=0)


def test_a_mask_with_holes_takes_the_gather_path_eagerly_and_stops_a_compiled_step():
    """A 2D mask with a hole in the middle is not one start per row: an eager step sees it on the host and gathers
    (DynamicCache's tokens); a compiled one cannot look, and its device-side check stops the step."""
    require_triton_on_cpu()
    model = copy.deepcopy(tiny_model("llama"))
    input_ids, attention_mask = left_padded_batch(2, 12)
    attention_mask[0, 5] = 0
    expected = generate(model, DynamicCache(config=model.config), input_ids, attention_mask)
    hf_paged.enable(model, backend="triton")
    assert torch.equal(
        generate(model, PagedCache(config=model.config, max_cache_len=40), input_ids, attention_mask), expected
    )
    with pytest.raises(RuntimeError, match="hidden prefix"):
        compiled_generate(model, PagedCache(config=model.config, max_cache_len=40), input_ids, attention_mask)


def test_hybrid_models_are_refused_by_name():
    from test_hybrid import build

    model = build("qwen3_next")
    with pytest.raises(UnsupportedModel, match=r"max_cache_len.*qwen3_next.*not paged"):
        PagedCache(config=model.config, max_cache_len=32)


def test_a_second_turn_continues_the_cache_as_dynamic_cache_does():
    """A second generate() on a returned cache feeds several tokens at once into a reserved step."""
    model = tiny_model("llama")
    outputs = []
    for cache in (DynamicCache(config=model.config), PagedCache(config=model.config, max_cache_len=64)):
        first = model.generate(random_prompt(12), cache=cache, max_new_tokens=8, do_sample=False)
        follow_up = torch.cat([first, random_prompt(5, seed=3)], dim=1)
        outputs.append(model.generate(follow_up, cache=cache, max_new_tokens=8, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])


def test_decode_steps_keep_their_buffers_across_turns():
    """The decode step's static buffers stay where they are through a second turn's prompt (several tokens a step):
    a compiled step's CUDA graphs read them in place, and a buffer at a new address records the graphs again."""
    model = tiny_model("llama")
    cache = PagedCache(config=model.config, max_cache_len=64)
    steps, addresses = cache._fixed.steps, []
    fill = steps.fill

    def recording(groups, past_length, num_new_tokens, device):
        fill(groups, past_length, num_new_tokens, device)
        # The buffers themselves, kept alive here: a freed one's address could be taken again by its replacement.
        buffers = [*steps.slot_mapping, *steps.block_tables, steps.seq_lens, steps.past_length]
        addresses.append((num_new_tokens, buffers))

    steps.fill = recording
    first = model.generate(random_prompt(12), cache=cache, max_new_tokens=6, do_sample=False)
    model.generate(torch.cat([first, random_prompt(5, seed=3)], dim=1), cache=cache, max_new_tokens=6, do_sample=False)
    decode = {tuple((id(b), b.data_ptr()) for b in buffers) for n, buffers in addresses if n == 1}
    assert [n for n, _ in addresses].count(1) == 10 and len(decode) == 1  # 5 decode steps a turn, one set of buffers
    assert [n for n, _ in addresses if n != 1] == [6]  # the second turn: its 5 tokens after the last one sampled


def test_a_decode_step_sends_its_values_in_one_copy_and_the_tables_when_they_change(monkeypatch):
    """`reserve` writes a step's slots, lengths and past length with one host-to-device copy (views of one tensor,
    each on 16 bytes, as the kernels' variants expect), and a layer group's tables only when a block was added."""
    import hf_paged.cache.fixed_width as fixed_width

    copies = []
    copy = fixed_width.copy_from_host
    monkeypatch.setattr(
        fixed_width, "copy_from_host", lambda buffer, values: copies.append(buffer) or copy(buffer, values)
    )
    model = tiny_model("llama")
    cache = PagedCache(
        config=model.config, pool=BlockPool.for_model(model, num_blocks=8, block_size=4), max_cache_len=16
    )
    with torch.inference_mode():
        model(random_prompt(6), cache=cache)
        per_step = []
        for _ in range(4):  # positions 6, 7 (the prompt's second block), then 8, 9 (a new block)
            copies.clear()
            cache.reserve(1)
            steps = cache._fixed.steps
            per_step.append(len(copies))
            assert steps.seq_lens.tolist() == [cache.get_seq_length() + 1]
            cache._fixed.pending = None  # what the forward's last layer does
    assert per_step == [2, 1, 2, 1]  # the first step and a new block's: the tables too
    views = [*steps.slot_mapping, steps.seq_lens, steps.past_length]
    assert all(v.data_ptr() % 16 == 0 for v in views) and len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert steps.past_length.item() == 9 and steps.slot_mapping[0].tolist() == [cache.block_tables[0][2] * 4 + 1]
    assert all(t.dtype == torch.int64 for t in (*views, *steps.block_tables))


@pytest.mark.parametrize("first, second", [("hf_paged", "sdpa"), ("sdpa", "hf_paged")])
def test_the_attention_is_asked_at_every_reserved_step(first, second):
    """A model switched between "hf_paged" and sdpa after its cache was built (`hf_paged.enable`,
    `set_attn_implementation`): the next reserved step hands sdpa K/V, and "hf_paged" a plan, as the eager path does."""
    require_triton_on_cpu()
    base = tiny_model("llama")
    prompt, tokens = random_prompt(6), [torch.tensor([[5]]), torch.tensor([[7]])]
    with torch.inference_mode():
        reference = DynamicCache(config=base.config)
        base(prompt, cache=reference)
        base(tokens[0], cache=reference)
        expected = base(tokens[1], cache=reference).logits
        model = copy.deepcopy(base)
        if first == "hf_paged":
            hf_paged.enable(model, backend="triton")
        cache = PagedCache(config=model.config, max_cache_len=32)
        model(prompt, cache=cache)
        model(tokens[0], cache=cache)
        if second == "hf_paged":
            hf_paged.enable(model, backend="triton")
        else:
            model.set_attn_implementation("sdpa")
        logits = model(tokens[1], cache=cache).logits
    assert cache._fixed._plans == (second == "hf_paged")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
