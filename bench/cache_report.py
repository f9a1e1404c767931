"""PagedCache against DynamicCache under plain `generate()`: output, KV bytes held, decode speed.

Run with `python -m bench` (see bench/__main__.py). Every number is measured in this process, side by side.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_paged import PAGED_ATTENTION, BlockPool, PagedCache


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def demo(model, *, prompt_len: int = 24, max_new_tokens: int = 16) -> dict:
    """Greedy generate() with both caches on one prompt: both outputs and their KV bytes."""
    torch.manual_seed(0)
    input_ids = torch.randint(2, model.config.vocab_size, (1, prompt_len), device=model.device)
    dynamic = DynamicCache(config=model.config)
    paged = PagedCache(config=model.config)
    out_dynamic = model.generate(input_ids, past_key_values=dynamic, max_new_tokens=max_new_tokens, do_sample=False)
    out_paged = model.generate(input_ids, past_key_values=paged, max_new_tokens=max_new_tokens, do_sample=False)
    result = {
        "dynamic_tokens": out_dynamic[0, prompt_len:].tolist(),
        "paged_tokens": out_paged[0, prompt_len:].tolist(),
        "identical": bool(torch.equal(out_dynamic, out_paged)),
        "dynamic_kv_bytes": dynamic_cache_bytes(dynamic),
        "paged_kv_bytes": paged.held_bytes,
        "paged_block_size": paged.block_size,
    }
    paged.release()
    return result


def kv_bytes_held(
    model, *, prompt_len: int, max_new_tokens: int, block_size: int = 16, attentions: tuple[str, ...] = ("sdpa",)
) -> list[dict]:
    """KV bytes held at the end of generate() for num_return_sequences=8 (sampling) and num_beams=4, per attention
    implementation of `attentions` ("sdpa" hands SDPA every row's whole context, gathered into the workspace;
    "hf_paged" reads the prompt the rows share once and gathers only their own tails). DynamicCache runs sdpa."""
    original = model.config._attn_implementation
    try:
        return [
            row
            for attention in attentions
            for row in _kv_bytes_held(model, prompt_len, max_new_tokens, block_size, attention, original)
        ]
    finally:
        model.set_attn_implementation(original)


def _kv_bytes_held(model, prompt_len, max_new_tokens, block_size, attention, original) -> list[dict]:
    rows = []
    modes = [
        ("num_return_sequences=8 (sampling)", dict(num_return_sequences=8, do_sample=True)),
        ("num_beams=4", dict(num_beams=4, do_sample=False)),
    ]
    torch.manual_seed(0)
    input_ids = torch.randint(2, model.config.vocab_size, (1, prompt_len), device=model.device)
    for name, kwargs in modes:
        model.set_attn_implementation(original)
        dynamic = DynamicCache(config=model.config)
        torch.manual_seed(1)
        out_dynamic = model.generate(input_ids, past_key_values=dynamic, max_new_tokens=max_new_tokens, **kwargs)
        pool = BlockPool.for_model(model, max_memory=4 * dynamic_cache_bytes(dynamic), block_size=block_size)
        model.set_attn_implementation(attention)
        with PagedCache(config=model.config, pool=pool) as paged:
            torch.manual_seed(1)
            out_paged = model.generate(input_ids, past_key_values=paged, max_new_tokens=max_new_tokens, **kwargs)
            held, workspace = paged.held_bytes, paged.workspace_bytes
        rows.append(
            {
                "mode": name,
                "attention": attention,
                "prompt_len": prompt_len,
                "max_new_tokens": max_new_tokens,
                "dynamic_bytes": dynamic_cache_bytes(dynamic),
                "paged_bytes": held,
                "ratio": held / dynamic_cache_bytes(dynamic),
                # The gather buffer: one layer's visible K/V of the largest step, reused; not pool memory.
                "paged_workspace_bytes": workspace,
                "ratio_with_workspace": (held + workspace) / dynamic_cache_bytes(dynamic),
                "identical": bool(torch.equal(out_dynamic, out_paged)),
            }
        )
        del dynamic
    return rows


def sliding_window_bytes(model, *, prompt_len: int, max_new_tokens: int, block_size: int = 16) -> list[dict]:
    """K/V bytes held at the end of generate() on a model with sliding-window layers: DynamicCache (keeps the last
    window - 1 tokens per sliding layer) vs PagedCache releasing out-of-window blocks per layer group, and without
    release."""
    torch.manual_seed(0)
    input_ids = torch.randint(2, model.config.vocab_size, (1, prompt_len), device=model.device)
    dynamic = DynamicCache(config=model.config)
    reference = model.generate(input_ids, past_key_values=dynamic, max_new_tokens=max_new_tokens, do_sample=False)
    rows = []
    for release in (True, False):
        paged = PagedCache(config=model.config, block_size=block_size, release_out_of_window=release)
        out = model.generate(input_ids, past_key_values=paged, max_new_tokens=max_new_tokens, do_sample=False)
        rows.append(
            {
                "model": type(model).__name__.removesuffix("ForCausalLM"),
                "cache": f"PagedCache (release_out_of_window={release})",
                "sliding_window": model.config.sliding_window,
                "layer_groups": paged.pool.num_groups,
                "tokens": prompt_len + max_new_tokens,
                "dynamic_bytes": dynamic_cache_bytes(dynamic),
                "paged_bytes": paged.held_bytes,
                "ratio": paged.held_bytes / dynamic_cache_bytes(dynamic),
                "identical": bool(torch.equal(out, reference)),
            }
        )
        paged.release()
    return rows


class StepClock(LogitsProcessor):
    """Records a timestamp at every generation step (called once per forward, after the logits exist)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


def _prefilled(cache, model, batch_size: int, num_tokens: int, seed: int):
    """Fill `cache` with `num_tokens` random K/V rows per layer: decode timing without a long CPU prefill."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(seed)
    for layer_idx in range(config.num_hidden_layers):
        shape = (batch_size, config.num_key_value_heads, num_tokens, head_dim)
        keys = torch.randn(shape, generator=generator).to(model.device, model.dtype)
        values = torch.randn(shape, generator=generator).to(model.device, model.dtype)
        cache.update(keys, values, layer_idx)
    return cache


# (label, cache factory, attention implementation); the first is the baseline every ratio divides by.
DECODE_VARIANTS = (
    ("dynamic+sdpa", lambda config: DynamicCache(config=config), "sdpa"),
    ("paged+sdpa", lambda config: PagedCache(config=config), "sdpa"),
    ("paged+hf_paged", lambda config: PagedCache(config=config), PAGED_ATTENTION),
)


def decode_speed(model, *, batch_sizes, contexts, num_steps: int, repeats: int = 2) -> list[dict]:
    """generate() decode tok/s per variant on the same pre-filled context, interleaved, best of `repeats`.

    "paged+sdpa" returns each row's K/V from `PagedCache.update` (a strided view of the pool when the row's blocks
    are consecutive, as for one row in a private pool; else a gather); "paged+hf_paged" runs the registered
    attention (backend "auto": the Triton kernel on CUDA, the same K/V and SDPA on CPU). Every round runs each
    variant once, in turn, so all see the same machine noise; a ratio's spread is the lowest and highest of the
    per-round ratios (paged over dynamic within one round).
    """
    original = model.config._attn_implementation
    rows = []
    baseline = DECODE_VARIANTS[0][0]
    for batch_size in batch_sizes:
        for context in contexts:
            input_ids = torch.randint(2, model.config.vocab_size, (batch_size, context), device=model.device)
            rounds: list[dict[str, float]] = []
            outputs = {}
            for _ in range(repeats):  # interleaved repeats: every variant sees the same machine noise
                tok_s = {}
                for label, make_cache, attention in DECODE_VARIANTS:
                    model.set_attn_implementation(attention)
                    cache = _prefilled(make_cache(model.config), model, batch_size, context - 1, seed=context)
                    clock = StepClock()
                    outputs[label] = model.generate(
                        input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        past_key_values=cache,
                        max_new_tokens=num_steps + 1,
                        do_sample=False,
                        logits_processor=LogitsProcessorList([clock]),
                    )
                    # The first step is the 1-token "prefill"; the rest are pure decode steps.
                    tok_s[label] = batch_size * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
                    if isinstance(cache, PagedCache):
                        cache.release()
                    del cache
                rounds.append(tok_s)
            model.set_attn_implementation(original)
            best = {label: max(tok_s[label] for tok_s in rounds) for label, _, _ in DECODE_VARIANTS}
            row = {"batch": batch_size, "context": context}
            for label, _, _ in DECODE_VARIANTS:
                row[f"{label} tok/s"] = best[label]
            for label, _, _ in DECODE_VARIANTS[1:]:
                row[f"{label} / {baseline}"] = best[label] / best[baseline]
                per_round = [tok_s[label] / tok_s[baseline] for tok_s in rounds]
                row[f"{label} spread"] = f"{min(per_round):.3f}-{max(per_round):.3f}"
            row["identical"] = all(torch.equal(outputs[baseline], out) for out in outputs.values())
            rows.append(row)
    return rows
