"""A zoo of tiny random-weight decoder-only models built from configs (no download), shared by the test files.

Every model is built once per (name, attention, size) and cached: tests must not mutate them (no training, no
attribute changes; monkeypatch a forward only through pytest's `monkeypatch`, which restores it).

Why the configs look like this (see DESIGN.md): random weights give degenerate greedy output (one token repeated)
unless `initializer_range` is raised and embeddings are untied; `eos_token_id=None` makes generation run to
`max_new_tokens`, so every case compares the same number of tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
# Small enough that a test with ~30 tokens in total runs past the window, so the sliding path really slides.
SLIDING_WINDOW = 8

MODEL_NAMES = ("llama", "qwen3", "mistral", "gemma3", "gpt2", "phi3")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=PAD_TOKEN_ID,
)


def gemma3_config(layer_types: list[str]) -> Gemma3TextConfig:
    """The tiny Gemma3 config with the given layer types (one layer each; window SLIDING_WINDOW)."""
    return Gemma3TextConfig(
        **_COMMON,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        max_position_embeddings=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=layer_types,
    )


def _config(name: str, num_layers: int):
    """The config of model `name`: hidden 64, `num_layers` decoder layers, vocab VOCAB_SIZE."""
    decoder = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, max_position_embeddings=256)
    if name == "llama":  # GQA: 4 query heads share 2 kv heads
        return LlamaForCausalLM, LlamaConfig(**_COMMON, **decoder, num_attention_heads=4, num_key_value_heads=2)
    if name == "qwen3":  # GQA with q/k norms and an explicit head_dim
        config = Qwen3Config(**_COMMON, **decoder, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return Qwen3ForCausalLM, config
    if name == "mistral":  # every layer slides
        config = MistralConfig(
            **_COMMON, **decoder, num_attention_heads=4, num_key_value_heads=2, sliding_window=SLIDING_WINDOW
        )
        return MistralForCausalLM, config
    if name == "gemma3":  # mixed sliding / full layers
        layer_types = ["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (
            num_layers % 2
        )
        return Gemma3ForCausalLM, gemma3_config(layer_types)
    if name == "gpt2":  # MHA, learned positions
        config = GPT2Config(**_COMMON, n_embd=64, n_inner=128, n_layer=num_layers, n_head=4, n_positions=256)
        return GPT2LMHeadModel, config
    if name == "phi3":  # fused qkv projection
        config = Phi3Config(**_COMMON, **decoder, num_attention_heads=4, num_key_value_heads=4, sliding_window=None)
        return Phi3ForCausalLM, config
    raise ValueError(f"unknown tiny model {name!r}; choose one of {list(MODEL_NAMES)}")


@functools.cache
def tiny_model(
    name: str, attn_implementation: str = "sdpa", *, num_layers: int = 2, seed: int = 0, device: str = "cpu"
):
    """A tiny random-weight `*ForCausalLM` in eval mode, on `device` (the same weights on every device). Cached: do
    not mutate the returned model.

    `num_layers`/`seed` make a different model of the same family and vocab (an assistant for assisted decoding).
    """
    model_class, config = _config(name, num_layers)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class(config).eval().to(device)
    assert model.config._attn_implementation == attn_implementation, model.config._attn_implementation
    return model


def require_triton_on_cpu() -> None:
    """Skip a test that runs the Triton backend on these CPU models unless Triton's interpreter is on (conftest.py
    turns it on when CUDA is absent). With CUDA, the Triton path is tested on CUDA models (tests/test_gpu.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU models needs TRITON_INTERPRET=1; on CUDA see tests/test_gpu.py")


def count_decode_launches(monkeypatch) -> list:
    """Record every call of the Triton decode kernel's launch (`triton_decode.DecodeLaunch`: one per layer whose
    decode attention runs the kernel, whichever path made it) while the test runs; empty without Triton."""
    calls = []
    if importlib.util.find_spec("triton") is None:
        return calls
    from hf_paged.attention.kernels import triton_decode

    launch = triton_decode.DecodeLaunch.__call__
    monkeypatch.setattr(
        triton_decode.DecodeLaunch, "__call__", lambda self, *a, **k: calls.append(1) or launch(self, *a, **k)
    )
    return calls


def count_store_launches(monkeypatch) -> list:
    """Record every launch of the Triton store kernel (`triton_store._store_kv_kernel`, whichever launcher makes it)
    while the test runs; empty without Triton."""
    calls = []
    if importlib.util.find_spec("triton") is None:
        return calls
    from hf_paged.attention.kernels import triton_store

    kernel = triton_store._STORE.fn  # what every store launcher launches through (`direct.DirectKernel`)

    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_store._STORE, "fn", Counted())
    return calls


def tiny_assistant(name: str, attn_implementation: str = "sdpa"):
    """A second, smaller model of the same family and vocab, for `generate(assistant_model=...)`."""
    return tiny_model(name, attn_implementation, num_layers=1, seed=1)


def left_padded_batch(batch: int = 3, length: int = 12, vocab: int = VOCAB_SIZE, seed: int = 0):
    """`(input_ids, attention_mask)`, both `[batch, length]` int64, row i left-padded with `i * 2` pad tokens.

    Tokens are drawn from `[1, vocab)`, so no real token equals the pad id.
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(batch):
        num_pad = min(2 * row, length - 1)
        input_ids[row, :num_pad] = PAD_TOKEN_ID
        attention_mask[row, :num_pad] = 0
    return input_ids, attention_mask


def random_prompt(length: int = 12, vocab: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    """`[1, length]` int64 token ids in `[1, vocab)`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, length), generator=generator)


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """One prompt per length, token ids in `[1, VOCAB_SIZE)`, drawn one after the other from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def tiny_engine(name: str = "llama", num_blocks: int = 64, **kwargs):
    """`(Engine, BlockPool)`: the tiny `name` model on the "hf_paged" attention, a pool of `num_blocks` blocks of 4;
    `kwargs` go to `Engine`."""
    from hf_paged import BlockPool, Engine

    model = tiny_model(name, "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=num_blocks, block_size=4)
    return Engine(model, pool, **kwargs), pool


def greedy_reference(name: str, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """Each prompt alone through `generate()` with `DynamicCache` on the sdpa `name` model: its greedy new tokens."""
    model = tiny_model(name, "sdpa")
    return [
        model.generate(torch.tensor([p]), past_key_values=DynamicCache(), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, new_tokens)
    ]
