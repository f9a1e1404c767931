"""`python -m bench.layer_costs`: what one decoder layer's cache and attention cost the host on a decode step, per cache
and attention, and the pieces they are made of.

Eager `generate()` on a GPU is bound by the host: the GPU finishes each layer before Python issues the next. This
times, without the rest of the model, the part of a layer that depends on the cache: `cache.update` of one new token
and the attention over what it returns, for the 16 layers of a Llama-3.2-1B-shaped model's attention modules (32 q /
8 kv heads of 64, bf16) after a `--context`-token prompt:

    dynamic             DynamicCache.update, then transformers' SDPA attention on the K/V it returns
    paged               PagedCache.update, then the same SDPA attention on the pool's K/V it returns
    paged+hf_paged      PagedCache.update returning a decode plan, then the "hf_paged" attention (the Triton kernel
                        on CUDA)

and the single operations they are made of, each called in a loop on tensors of the same shapes: DynamicCache's two
`torch.cat`, SDPA on contiguous K/V, the Triton store, two `index_copy_`, the gather of the pool's K/V
(`index_select`), the Triton decode kernel (with the split-K it picks, and in one split), an empty Triton kernel of one
argument (Triton's own launch cost), a `torch.empty`.

For each: the host's microseconds per call (wall time over `--iters` calls, one synchronize at the end) and the GPU's
(CUDA events around the same calls): where the two are close, the call is bound by the GPU, not by the host. Each
layer path's step runs its 16 layers in turn; its numbers are per layer. On CPU it runs as a dry run (the "hf_paged"
attention there takes the torch backend, and the Triton pieces are left out).

    python -m bench.layer_costs --batch 1 16 --json bench/results/gpu/layer_costs.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host import device_name, versions  # noqa: E402
from bench.models import LLAMA_1B_SHAPE, TINY_SHAPE, llama_shaped  # noqa: E402
from hf_paged import BlockPool, PagedCache  # noqa: E402
from hf_paged.attention import PAGED_ATTENTION  # noqa: E402
from hf_paged.attention.interface import paged_attention_forward  # noqa: E402
from hf_paged.attention.kernels.dispatch import resolve_backend  # noqa: E402
from hf_paged.attention.kernels.launch_config import INDEX_DTYPE  # noqa: E402


def time_calls(call, iters: int, device: torch.device, warmup: int = 5) -> dict:
    """Host and GPU microseconds per `call()`, over `iters` calls after `warmup` (one synchronize at the end)."""
    for _ in range(warmup):
        call()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    host_s = time.perf_counter() - start
    gpu_us = None
    if cuda:
        end_event.record()
        torch.cuda.synchronize()
        gpu_us = start_event.elapsed_time(end_event) * 1e3 / iters
    return dict(host_us=host_s * 1e6 / iters, gpu_us=gpu_us)


class LayerSteps:
    """One cache's decode steps over the model's attention modules: `step()` updates every layer with one new token
    and runs its attention, as a forward does between the projections."""

    def __init__(self, variant: str, model, batch: int, context: int, iters: int):
        self.modules = [layer.self_attn for layer in model.model.layers]
        config = model.config
        if variant == "paged+hf_paged":
            config = copy.copy(config)
            config._attn_implementation = PAGED_ATTENTION
        self.attention = paged_attention_forward if variant == "paged+hf_paged" else sdpa_attention_forward
        device, dtype = model.device, model.dtype
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if variant == "dynamic":
            self.cache = DynamicCache(config=config)
        else:
            tokens = batch * (context + iters + 16)
            pool = BlockPool.for_model(model, num_blocks=-(-tokens // 16) + batch, block_size=16)
            self.cache = PagedCache(config=config, pool=pool)
        generator = torch.Generator(device=device).manual_seed(0)

        def states(heads: int, length: int) -> torch.Tensor:
            return torch.randn(batch, heads, length, head_dim, generator=generator, device=device).to(dtype)

        for i in range(len(self.modules)):  # the prompt
            self.cache.update(states(kv_heads, context), states(kv_heads, context), i)
        self.query, self.key, self.value = states(heads, 1), states(kv_heads, 1), states(kv_heads, 1)

    def step(self) -> None:
        for i, module in enumerate(self.modules):
            key, value = self.cache.update(self.key, self.value, i)
            self.attention(module, self.query, key, value, None)


def layer_paths(model, batch: int, context: int, iters: int) -> list[dict]:
    rows = []
    for variant in ("dynamic", "paged", "paged+hf_paged"):
        steps = LayerSteps(variant, model, batch, context, iters)
        timed = time_calls(steps.step, iters, model.device)
        layers = len(steps.modules)
        per_layer = {key: None if value is None else value / layers for key, value in timed.items()}
        rows.append(dict(batch=batch, what=f"layer: {variant}", **per_layer))
    return rows


def pieces(model, batch: int, context: int, iters: int) -> list[dict]:
    """The single operations of the layer paths, on tensors of their shapes."""
    config, device, dtype = model.config, model.device, model.dtype
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    module = model.model.layers[0].self_attn

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    cached_k, cached_v = randn(batch, kv_heads, context, head_dim), randn(batch, kv_heads, context, head_dim)
    new_k, new_v = randn(batch, kv_heads, 1, head_dim), randn(batch, kv_heads, 1, head_dim)
    query = randn(batch, heads, 1, head_dim)
    block_size = 16
    blocks_per_row = -(-(context + 1) // block_size)
    num_blocks = batch * blocks_per_row + 1
    key_cache, value_cache = (
        randn(num_blocks, block_size, kv_heads, head_dim),
        randn(num_blocks, block_size, kv_heads, head_dim),
    )
    block_tables = torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_row].view(batch, -1)
    seq_lens = torch.full((batch,), context + 1, dtype=INDEX_DTYPE, device=device)
    slots = (block_tables[:, context // block_size].long() * block_size + context % block_size).contiguous()
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)
    token_slots = (block_tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).view(
        batch, -1
    )
    token_slots = token_slots[:, : context + 1].reshape(-1)

    calls = {
        "torch.cat x2 (DynamicCache.update)": lambda: (
            torch.cat([cached_k, new_k], dim=-2),
            torch.cat([cached_v, new_v], dim=-2),
        ),
        "SDPA attention, contiguous K/V": lambda: sdpa_attention_forward(module, query, cached_k, cached_v, None),
        "index_copy_ x2 (store)": lambda: (
            flat_k.index_copy_(0, slots, new_k[:, :, 0]),
            flat_v.index_copy_(0, slots, new_v[:, :, 0]),
        ),
        "index_select x2 (gather)": lambda: (
            flat_k.index_select(0, token_slots),
            flat_v.index_select(0, token_slots),
        ),
        "torch.empty": lambda: torch.empty(batch, heads, head_dim, dtype=dtype, device=device),
    }
    if resolve_backend(None, device) == "triton":
        from hf_paged.attention.kernels import triton_decode, triton_store

        q3 = query[:, :, 0]
        scale = head_dim**-0.5

        def decode(num_splits=None):
            return lambda: triton_decode.paged_decode_attention_triton(
                q3, key_cache, value_cache, block_tables, seq_lens, scale=scale, num_splits=num_splits
            )

        from hf_paged.attention.kernels import launch_config

        config = launch_config.decode_config(head_dim, dtype, launch_config.device_capability(device))
        max_context = block_tables.shape[1] * block_size
        splits = triton_decode.choose_num_splits(batch, kv_heads, max_context, device, config.block_n)
        calls["Triton store"] = lambda: triton_store.store_kv_triton(
            new_k[:, :, 0], new_v[:, :, 0], key_cache, value_cache, slots
        )
        calls[f"Triton decode ({splits} splits, its choice)"] = decode()
        calls["Triton decode (1 split)"] = decode(1)
        calls["Triton empty kernel (1 argument)"] = _empty_launch(device)
    return [dict(batch=batch, what=name, **time_calls(call, iters, device)) for name, call in calls.items()]


def _empty_launch(device: torch.device):
    import triton

    @triton.jit
    def _empty_kernel(pointer):
        pass

    tensor = torch.empty(1, device=device)
    return lambda: _empty_kernel[(1,)](tensor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--tiny", action="store_true", help="16 layers of hidden 64: a dry run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    # --tiny keeps the 16 layers: a step's once-per-step work (its first layer's) spreads over as many layers
    shape = {**TINY_SHAPE, "num_hidden_layers": LLAMA_1B_SHAPE["num_hidden_layers"]} if args.tiny else LLAMA_1B_SHAPE
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = llama_shaped(shape, dtype, args.device)
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            rows += layer_paths(model, batch, args.context, args.iters)
            rows += pieces(model, batch, args.context, args.iters)
    table = [
        [r["batch"], r["what"], f"{r['host_us']:.1f}", "" if r["gpu_us"] is None else f"{r['gpu_us']:.1f}"]
        for r in rows
    ]
    print(f"context {args.context}, {shape['num_hidden_layers']} layers, {dtype}, {args.device}")
    print(tabulate(table, ["batch", "per layer / per call", "host us", "GPU us"], tablefmt="github"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = dict(args=vars(args), device=device_name(args.device), versions=versions(), rows=rows)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
