"""The benchmark's model: an embedded Llama-style config with random weights, or a real checkpoint by path."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

# ~27M parameters: big enough that CPU decode is not all Python overhead, small enough for a 2-core machine.
# initializer_range is raised and embeddings are untied so greedy output is not one token repeated;
# eos_token_id=None lets every request run to its max_new_tokens.
DEFAULT_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)


# Llama-3.2-1B's shape (random weights): the model of the GPU numbers (bench/generate_speed.py, bench/engine_speed.py).
LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
)
# The same architecture in 2 layers of hidden 64: those scripts' dry run on a CPU.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def llama_shaped(shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """A random-weight `LlamaForCausalLM` of `shape` (LLAMA_1B_SHAPE, TINY_SHAPE) in eval mode, sdpa attention."""
    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        initializer_range=0.2,  # random weights: a spread wide enough for varied greedy tokens
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path: str | None = None, *, dtype: torch.dtype | None = None, device: str | None = None, seed: int = 0):
    """The embedded default model (random weights, seeded), or `from_pretrained(path)` placed by accelerate."""
    if path is not None:
        device = torch.device(device) if device is not None else default_device()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", device_map=str(device))
        return model.eval()
    return _random_model(LlamaForCausalLM, LlamaConfig(**DEFAULT_CONFIG), device=device, dtype=dtype, seed=seed)


def sliding_window_model(
    sliding_window: int = 256, *, device: str | None = None, dtype: torch.dtype | None = None, seed: int = 0
):
    """The default model's sizes as a Mistral-style model whose every layer has a sliding window."""
    config = MistralConfig(**DEFAULT_CONFIG, sliding_window=sliding_window)
    return _random_model(MistralForCausalLM, config, device=device, dtype=dtype, seed=seed)


def mixed_window_model(
    sliding_window: int = 256, *, device: str | None = None, dtype: torch.dtype | None = None, seed: int = 0
):
    """The default model's sizes as a Gemma3-style model: 5 sliding-window layers, then 1 full-attention layer."""
    sizes = {key: value for key, value in DEFAULT_CONFIG.items() if key not in ("bos_token_id", "pad_token_id")}
    config = Gemma3TextConfig(
        **sizes,
        head_dim=DEFAULT_CONFIG["hidden_size"] // DEFAULT_CONFIG["num_attention_heads"],
        query_pre_attn_scalar=DEFAULT_CONFIG["hidden_size"] // DEFAULT_CONFIG["num_attention_heads"],
        sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        pad_token_id=0,
        bos_token_id=1,
    )
    return _random_model(Gemma3ForCausalLM, config, device=device, dtype=dtype, seed=seed)


# `--layers` of the tools that run the embedded model's sizes with other attention layers (window 256).
LAYERS = ("full", "sliding", "mixed")
LAYERS_HELP = (
    "the embedded model's attention layers: all full (default), all sliding (Mistral-style), or 5 sliding : 1 full "
    "(Gemma3-style); window 256"
)


def embedded_model(layers: str = "full", **kwargs):
    """The embedded model (`load_model()`), or its sizes with every layer sliding ("sliding") or 5 sliding : 1 full
    ("mixed"), window 256. `kwargs`: device, dtype, seed."""
    models = {"full": _default_model, "sliding": sliding_window_model, "mixed": mixed_window_model}
    if layers not in models:
        raise ValueError(f"layers must be one of {', '.join(map(repr, LAYERS))}, got {layers!r}")
    return models[layers](**kwargs)


def _default_model(**kwargs):
    return load_model(None, **kwargs)


def _random_model(model_class, config, *, device: str | None, dtype: torch.dtype | None, seed: int):
    """`model_class(config)` with weights drawn from `seed`, in eval mode on `device` (default: cuda if available)
    in `dtype` (default: bfloat16 on cuda, float32 elsewhere)."""
    device = torch.device(device) if device is not None else default_device()
    torch.manual_seed(seed)
    model = model_class(config)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model.to(device=device, dtype=dtype).eval()
