"""StepCache: one engine step's rows (decode rows, then prefill chunks) packed into one forward over the pool."""

import pytest
import torch

from hf_paged import BlockPool
from hf_paged.attention import paged_attention_forward
from hf_paged.attention.kernels.launch_config import INDEX_DTYPE
from hf_paged.engine import StepCache
from tests.models import tiny_model


@pytest.mark.parametrize(
    "lengths",
    [
        [(7, 1), (12, 1), (3, 1), (0, 6), (9, 5)],  # three decode rows and two prefill chunks, one with cached tokens
        [(7, 1), (12, 1), (3, 1)],  # decode rows only: attention returns the decode path's output as is
    ],
    ids=["mixed", "decode-only"],
)
def test_step_cache_packed_attention_equals_each_row_alone(lengths):
    # Rows of different lengths, (cached tokens, new tokens) each, in one forward.
    model = tiny_model("llama", "hf_paged", seed=3)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 128, (n + q,), generator=generator).tolist() for n, q in lengths]
    tables, next_block = [], 0
    with torch.inference_mode():
        for (cached, new), row_tokens in zip(lengths, tokens):
            num_blocks = -(-(cached + new) // 4)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
            if cached:  # fill the cached part through a one-row step, as the engine's first chunk would
                cache = StepCache(pool, [[tables[-1]]], [0], [cached])
                model(torch.tensor([row_tokens[:cached]]), position_ids=cache.position_ids, past_key_values=cache)
        cache = StepCache(pool, [tables], [n for n, _ in lengths], [q for _, q in lengths])
        packed = [t for (n, q), row_tokens in zip(lengths, tokens) for t in row_tokens[n : n + q]]
        logits = model(
            torch.tensor([packed]), position_ids=cache.position_ids, past_key_values=cache, use_cache=True
        ).logits[0]
        reference = tiny_model("llama", "sdpa", seed=3)
        for b, ((cached, new), row_tokens) in enumerate(zip(lengths, tokens)):
            expected = reference(torch.tensor([row_tokens])).logits[0, cached:]
            start = cache.starts[b]
            torch.testing.assert_close(logits[start : start + new], expected, rtol=1e-4, atol=1e-4)


def test_step_cache_decode_rows_use_the_attention_scaling_and_keep_row_order():
    # Decode rows of different lengths through the step's attention with a scale that is not the default:
    # each row's output is SDPA over its own keys with that scale, in row order, shaped [1, rows, heads, head_dim].
    model = tiny_model("llama", "hf_paged", seed=3)
    module = model.model.layers[0].self_attn
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    kv_heads, head_dim = pool.layout.num_kv_heads[0], pool.layout.head_dims[0]
    heads = model.config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    lengths = [9, 2, 14]  # keys per row, the new one included
    tables, next_block = [], 0
    for length in lengths:
        tables.append(list(range(next_block, next_block + -(-length // 4))))
        next_block += len(tables[-1])
    keys = [torch.randn(1, kv_heads, n, head_dim, generator=generator) for n in lengths]
    values = [torch.randn(1, kv_heads, n, head_dim, generator=generator) for n in lengths]
    with torch.inference_mode():
        for b, n in enumerate(lengths):  # the cached part, through a one-row prefill step
            if n > 1:
                StepCache(pool, [[tables[b]]], [0], [n - 1]).update(keys[b][:, :, :-1], values[b][:, :, :-1], 0)
        cache = StepCache(pool, [tables], [n - 1 for n in lengths], [1] * len(lengths))
        new_keys = torch.cat([k[:, :, -1:] for k in keys], dim=2)  # [1, kv_heads, rows, head_dim]
        new_values = torch.cat([v[:, :, -1:] for v in values], dim=2)
        placeholder, _ = cache.update(new_keys, new_values, 0)
        query = torch.randn(1, heads, len(lengths), head_dim, generator=generator)
        out, _ = paged_attention_forward(module, query, placeholder, placeholder, None, scaling=0.3)
    assert out.shape == (1, len(lengths), heads, head_dim)
    for b in range(len(lengths)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, b : b + 1], keys[b], values[b], scale=0.3, enable_gqa=True
        )  # [1, heads, 1, head_dim]
        torch.testing.assert_close(out[0, b], expected[0, :, 0], rtol=1e-5, atol=1e-5)


def test_step_cache_rejects_bad_rows():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    with pytest.raises(
        ValueError, match=r"decode rows \(q_len 1\) must come before prefill chunks, got q_lens \[3, 1\]"
    ):
        StepCache(pool, [[[0], [1]]], [0, 0], [3, 1])
    with pytest.raises(ValueError, match="a block table of 1 blocks cannot hold 5 tokens"):
        StepCache(pool, [[[0]]], [2], [3])
    with pytest.raises(ValueError, match=r"one entry per row, got \[2\], \[1\], 1, 1"):
        StepCache(pool, [[[0], [1]]], [0], [1])
    with pytest.raises(ValueError, match=r"one list per layer group \(1\), got 2"):
        StepCache(pool, [[[0]], [[1]]], [0], [1])


def test_the_steps_tensors_come_from_one_copy_per_dtype_each_on_16_bytes(monkeypatch):
    """No tensor of a step is made from a host list on the device directly (on CUDA each would be a copy the host
    waits for): `to_device` makes them all. Each starts on a 16-byte boundary, the prefill rows' lengths and tables
    too (the Triton kernels compile a variant per pointer alignment), and holds the step's values."""
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    tensor = torch.tensor

    def host_only(*args, **kwargs):
        assert kwargs.get("device") is None, "a step tensor made on the device from a host list"
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", host_only)
    # three decode rows (a slice of all rows' lengths after them would start 12 bytes in), two prefill chunks
    tables = [[0, 1], [2], [3, 4, 5], [6, 7], [8, 9, 10]]
    cache = StepCache(pool, [tables], [5, 2, 9, 0, 4], [1, 1, 1, 6, 5], token_ids=list(range(1, 15)))
    (group,) = cache._groups
    tensors = [cache.position_ids, cache.input_ids, cache.logits_indices, cache.prefill_cu_seqlens(), group.slots]
    tensors += [group.seq_lens, group.prefill_seq_lens, group.tables[3:], group.decode_tables]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)
    assert cache.position_ids.tolist() == [[5, 2, 9, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]]
    assert cache.input_ids.tolist() == [list(range(1, 15))] and cache.logits_indices.tolist() == [0, 1, 2, 8, 13]
    assert cache.prefill_cu_seqlens().tolist() == [0, 6, 11] and group.prefill_seq_lens.tolist() == [6, 9]
    assert group.seq_lens.tolist() == [6, 3, 10, 6, 9] and group.tables.shape == (5, 4)  # 3 blocks, padded to even
    assert group.tables[3:, :3].tolist() == [[6, 7, 0], [8, 9, 10]]
    # the decode kernel's tables as wide as the longest row (its split choice reads the width), not padded
    assert all(
        t.dtype == INDEX_DTYPE for t in (group.tables, group.decode_tables, group.seq_lens, group.prefill_seq_lens)
    )
    assert group.decode_tables.tolist() == [
        [0, 1, 0],
        [2, 0, 0],
        [3, 4, 5],
    ]
    assert group.slots.tolist() == [5, 10, 21, 24, 25, 26, 27, 28, 29, 36, 37, 38, 39, 40]
    with pytest.raises(ValueError, match=r"token_ids needs one id per new token \(14\), got 2"):
        StepCache(pool, [tables], [5, 2, 9, 0, 4], [1, 1, 1, 6, 5], token_ids=[1, 2])
    # prompt positions whose logits are kept too (prompt_logprobs) come after the rows', in the same copy
    kept = StepCache(
        pool, [tables], [5, 2, 9, 0, 4], [1, 1, 1, 6, 5], token_ids=list(range(1, 15)), extra_logits=[3, 9]
    )
    assert kept.logits_indices.tolist() == [0, 1, 2, 8, 13, 3, 9] and kept.logits_indices.data_ptr() % 16 == 0


def test_to_device_gives_each_list_its_own_aligned_tensor():
    from hf_paged.storage.transfer import to_device

    segments = [[1, 2, 3], [], [4], list(range(9))]
    for dtype in (torch.int32, torch.long):
        tensors = to_device(segments, dtype, torch.device("cpu"))
        assert [t.tolist() for t in tensors] == segments and all(t.dtype == dtype for t in tensors)
        assert all(t.data_ptr() % 16 == 0 for t in tensors)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one host tensor: one copy on a GPU


def test_a_lazy_chunk_mask_is_sdpas_lower_right_causal_bias_with_the_same_result():
    """On CUDA a prefill chunk over cached keys gets SDPA's lower-right causal bias (no mask over the context); it
    attends exactly the keys of the boolean chunk mask, through transformers' sdpa_attention_forward with GQA."""
    from torch.nn.attention.bias import CausalBias
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_paged.attention.step_plan import chunk_mask

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 5, 16, generator=generator)
    key, value = torch.randn(1, 2, 12, 16, generator=generator), torch.randn(1, 2, 12, 16, generator=generator)
    bias = chunk_mask(7, 5, None, 0, "cpu", lazy=True)
    assert isinstance(bias, CausalBias)
    expected, _ = sdpa_attention_forward(module, query, key, value, chunk_mask(7, 5, None, 0, "cpu"))
    got, _ = sdpa_attention_forward(module, query, key, value, bias)
    torch.testing.assert_close(got, expected)
    # A window, or keys that start after released blocks, keep the boolean mask
    assert chunk_mask(7, 5, 4, 0, "cpu", lazy=True).dtype == torch.bool
    assert chunk_mask(7, 5, None, 4, "cpu", lazy=True).dtype == torch.bool


def test_to_device_refuses_a_cuda_graph_capture(monkeypatch):
    """Inside a capture the host values would be frozen into the graph and replayed at every later step: refused."""
    from hf_paged.storage.transfer import to_device

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="which a CUDA graph cannot capture"):
        to_device([[1, 2]], torch.long, torch.device("cuda"))
