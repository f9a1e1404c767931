"""The zoo in CI: every causal LM of transformers, tiny and random, through each hf_paged path (tests/zoo.py).

Asserts the two floors (no path is ever silently wrong or silently bypassed) and that every architecture's outcome
per path equals the committed table `tests/zoo_expected.json`, so a change in what is supported shows in review.
After a change in support (or a transformers upgrade), regenerate the table and the matrix of docs/models.md with
`python -m tests.zoo --write` and review the diff.

The zoo run is one module-scoped fixture (each architecture in a forked child; `HF_PAGED_ZOO_JOBS` sets how many at
once, default 2) shared by the two tests marked slow; the refusals and per-layer shapes it relies on are also
checked directly, by fast tests at the end of this file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import zoo
from transformers import FalconConfig, Gemma4TextConfig, T5Config

import hf_paged
from hf_paged import KVLayout, PagedCache, UnsupportedModel

JOBS = int(os.environ.get("HF_PAGED_ZOO_JOBS", "2"))
TIME_LIMIT = 120.0  # seconds per architecture; the slowest tiny model takes a few seconds alone


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, dict]]:
    return zoo.run_zoo(jobs=JOBS, time_limit=TIME_LIMIT)


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, str]]:
    return json.loads(zoo.EXPECTED_PATH.read_text())


def test_expectations_list_every_architecture(expected):
    assert sorted(expected) == sorted(zoo.architectures()), "regenerate: python -m tests.zoo --write"
    assert all(sorted(paths) == sorted(path.name for path in zoo.PATHS) for paths in expected.values())


@pytest.mark.slow
def test_never_silently_wrong_or_bypassed(results):
    silent = {
        f"{model_type} / {name}": f"{result['outcome']}: {result['detail']}"
        for model_type, by_path in results.items()
        for name, result in by_path.items()
        if result["outcome"] in ("silently wrong", "silently bypassed")
    }
    assert not silent, json.dumps(silent, indent=1)


@pytest.mark.slow
def test_outcomes_match_expectations(results, expected):
    changed = {
        f"{model_type} / {name}": f"expected {expected.get(model_type, {}).get(name)}, got {result['outcome']}: "
        f"{result['detail']}"
        for model_type, by_path in results.items()
        for name, result in by_path.items()
        if expected.get(model_type, {}).get(name) != result["outcome"]
    }
    assert not changed, "regenerate with python -m tests.zoo --write if intended:\n" + json.dumps(changed, indent=1)


# The refusals and shapes the zoo relies on, checked directly (fast).


def test_paged_cache_refuses_encoder_decoder_models():
    with pytest.raises(UnsupportedModel, match="model type 't5': encoder-decoder"):
        PagedCache(config=T5Config(d_model=64, num_layers=2, num_heads=4, d_kv=16, vocab_size=128))


@pytest.mark.parametrize(
    ("options", "num_kv_heads"),
    [
        (dict(multi_query=True, new_decoder_architecture=False), 1),  # Falcon-7B: one kv head
        (dict(multi_query=False, new_decoder_architecture=False), 4),  # multi-head
        (dict(new_decoder_architecture=True, num_kv_heads=2), 4),  # K/V expanded to every query head
    ],
)
def test_falcon_kv_heads(options, num_kv_heads):
    config = FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, **options)
    assert KVLayout.from_config(config).num_kv_heads == (num_kv_heads, num_kv_heads)


def test_per_layer_head_dims_come_from_each_layers_config():
    config = Gemma4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
    )
    layout = KVLayout.from_config(config)
    assert layout.head_dims == (16, 32) and layout.num_kv_heads == (2, 2)


def test_enable_refuses_attention_of_its_own():
    model = zoo.tiny_model("bloom", "BloomForCausalLM")
    with pytest.raises(
        UnsupportedModel, match="model type 'bloom': its attention \\(BloomAttention\\) is its own code"
    ):
        hf_paged.enable(model)


def test_a_compileable_cache_refuses_a_model_that_sizes_its_bias_from_the_cache():
    model = zoo.tiny_model("bloom", "BloomForCausalLM")
    PagedCache(config=model.config)  # the eager cache serves it (the zoo's "paged" path)
    with pytest.raises(UnsupportedModel, match="model type 'bloom': it builds its ALiBi bias over"):
        PagedCache(config=model.config, max_cache_len=32)


def test_the_attention_function_applies_sinks_as_transformers_does():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    model = zoo.tiny_model("gpt_oss", "GptOssForCausalLM")
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 16, generator=generator)
    key, value = torch.randn(2, 2, 7, 16, generator=generator), torch.randn(2, 2, 7, 16, generator=generator)
    mask = torch.zeros(2, 1, 5, 7)
    mask[0, :, :, :3] = torch.finfo(torch.float32).min  # row 0 left-padded
    expected, _ = eager_attention_forward(attention, query, key, value, mask, scaling=0.25)
    got, _ = hf_paged.paged_attention_forward(attention, query, key, value, mask, scaling=0.25, s_aux=attention.sinks)
    torch.testing.assert_close(got, expected)
    without_sinks, _ = hf_paged.paged_attention_forward(attention, query, key, value, mask, scaling=0.25)
    assert not torch.allclose(without_sinks, expected, atol=1e-3)


def test_torch_attention_without_a_mask_is_causal_like_sdpa():
    # Where transformers skips the mask (SDPA's is_causal), the torch attention of softcap and sinks masks itself.
    from hf_paged.attention.torch_attention import torch_attention_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 16, generator=generator)
    key, value = torch.randn(1, 2, 5, 16, generator=generator), torch.randn(1, 2, 5, 16, generator=generator)
    causal = torch.ones(3, 5, dtype=torch.bool).tril(2)[None, None]  # 2 cached keys, then the 3 queries
    expected, _ = torch_attention_forward(query, key, value, causal, softcap=5.0)
    got, _ = torch_attention_forward(query, key, value, None, softcap=5.0, is_causal=True)
    torch.testing.assert_close(got, expected)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, causal, enable_gqa=True)
    torch.testing.assert_close(
        torch_attention_forward(query, key, value, None, is_causal=True)[0], sdpa.transpose(1, 2)
    )
