"""`python -m bench.host_overhead`: what hf_paged's Python costs around the model, on a model whose arithmetic is
negligible (16 layers, hidden 64, one thread), where a step is almost all host time, as on a GPU.

1. `generate()`'s decode step: one forward of one new token per row after a `--prompt-len` prompt, with a
   PagedCache (sdpa, and the "hf_paged" attention) against DynamicCache;
2. an Engine decode step (`--rows` requests of `--prompt-len` tokens, every row adding one token: scheduling, the
   decode runner's forward, argmax, bookkeeping) against a bare forward of the same rows with DynamicCache, and
   against the runner's forward alone; the packed step (no runner) beside it.
3. with `--prefill`: Engine steps that prefill (16 requests of 200 tokens in chunks of up to 64 tokens beside the
   decode rows), eager against `compile_prefill` (`--backend`, inductor by default), each Engine warmed up first.
4. with `--compiled`: a decode step whose forward is compiled (`--backend`, fullgraph), as generate() compiles it
   for a compileable cache, on `PagedCache(max_cache_len)` (reserved before the forward) with sdpa and with the
   "hf_paged" attention against `StaticCache`, with the same tokens; then what `PagedCache.reserve` (the host's share
   of each such step) costs. On CPU the compiled forward still runs its kernels on the host ("hf_paged" runs its
   torch path inside the graph); on a GPU a CUDA graph replays it, and what stays on the host is the loop around
   it, the guards and `reserve`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

import hf_paged
from bench.models import llama_shaped
from hf_paged import BlockPool, Engine, PagedCache


def negligible_model():
    """Llama, 16 layers of hidden 64, float32 on CPU: a step is almost all host time."""
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return llama_shaped(shape, torch.float32, "cpu")


class Decoder:
    """A batch decoding one token per call on a cache of its own (`make_cache(model)`)."""

    def __init__(self, model, make_cache, prompts: torch.Tensor):
        self.model, self.cache = model, make_cache(model)
        self.position = prompts.shape[1]
        with torch.inference_mode():
            self.token = model(prompts, cache=self.cache).logits[:, -1:].argmax(-1)

    def step(self) -> None:
        with torch.inference_mode():
            positions = torch.full_like(self.token, self.position)
            logits = self.model(self.token, cache=self.cache, position_ids=positions).logits
            self.token = logits[:, -1:].argmax(-1)
            self.token.tolist()  # the host reads the tokens every step, as generate() and the Engine do
        self.position += 1


def engine_for(model, prompts: torch.Tensor, steps: int, runner: bool) -> Engine:
    rows, prompt_len = prompts.shape
    model = copy.deepcopy(model)
    pool = BlockPool.for_model(model, num_blocks=rows * (-(-(prompt_len + steps + 8) // 16)), block_size=16)
    engine = Engine(model, pool, max_num_seqs=rows, max_num_batched_tokens=rows * prompt_len)
    if not runner:
        engine.step_runner.step.runner = None  # decode steps packed too
    for prompt in prompts.tolist():
        engine.add_request(prompt, max_new_tokens=steps + 4, ignore_eos=True)
    engine.step()  # every prefill
    return engine


def interleaved(steppers: dict, steps: int) -> dict[str, float]:
    times = {name: [] for name in steppers}
    for _ in range(steps):
        for name, step in steppers.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", action="store_true", help="steps that prefill, eager against compiled, only")
    parser.add_argument("--compiled", action="store_true", help="compiled generate() decode steps, per cache, only")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend of --prefill, --compiled")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = negligible_model()
    if args.prefill:
        return prefill_steps(model, args.backend, args.repeats)
    if args.compiled:
        return compiled_decode(model, args.backend, args.repeats, args.prompt_len, args.steps)
    paged_model = hf_paged.enable(copy.deepcopy(model))
    for rows in args.rows:
        prompts = torch.randint(1, 128, (rows, args.prompt_len), generator=torch.Generator().manual_seed(rows))
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            decoders = {
                "dynamic": Decoder(model, lambda m: DynamicCache(config=m.config), prompts),
                "paged (sdpa)": Decoder(model, lambda m: PagedCache(config=m.config), prompts),
                "paged (hf_paged)": Decoder(paged_model, lambda m: PagedCache(config=m.config), prompts),
            }
            engine, packed = engine_for(model, prompts, args.steps, True), engine_for(model, prompts, args.steps, False)
            forward_times = []
            run_model = engine.runner._run_model

            def timed_forward(run_model=run_model, forward_times=forward_times):
                start = time.perf_counter()
                out = run_model()
                forward_times.append(time.perf_counter() - start)
                return out

            engine.runner._run_model = timed_forward
            steppers = {name: decoder.step for name, decoder in decoders.items()}
            steppers.update({"engine step": engine.step, "engine step (packed)": packed.step})
            medians = interleaved(steppers, args.steps)
            medians["engine runner forward"] = statistics.median(forward_times)
            best = {name: min(best.get(name, float("inf")), value) for name, value in medians.items()}
        base = best["dynamic"]
        print(f"rows {rows}, prompt {args.prompt_len}: DynamicCache decode forward {base * 1e3:.3f} ms")
        for name, value in best.items():
            against = "" if name == "dynamic" else f"{value / base:.3f}x DynamicCache"
            if name == "engine step":
                against += f", {value / best['engine runner forward']:.3f}x its runner's forward"
            print(f"  {name:24s} {value * 1e3:7.3f} ms  {against}")
    return 0


def prefill_steps(model, backend: str, repeats: int, num_requests: int = 16, prompt_len: int = 200) -> int:
    """Median host time of an Engine step that prefills, eager and with `compile_prefill`, best of `repeats`."""
    generator = torch.Generator().manual_seed(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return torch.randint(1, 128, (count, length), generator=generator).tolist()

    engines = {}
    for name, options in (("eager", {}), ("compiled", {"compile_prefill": {"backend": backend}})):
        engine_model = copy.deepcopy(model)
        pool = BlockPool.for_model(engine_model, num_blocks=512, block_size=16)
        engines[name] = Engine(engine_model, pool, max_num_seqs=16, max_num_batched_tokens=64, **options)
        start = time.perf_counter()
        engines[name].generate(prompts(3, 40), max_new_tokens=3, ignore_eos=True)  # compiles
        print(f"{name}: warm-up {time.perf_counter() - start:.1f} s")
    best = {name: float("inf") for name in engines}
    for _ in range(repeats):
        times: dict[str, list[float]] = {name: [] for name in engines}
        burst = prompts(num_requests, prompt_len)
        for engine in engines.values():
            for prompt in burst:
                engine.add_request(prompt, max_new_tokens=8, ignore_eos=True)
        while any(engine.has_unfinished() for engine in engines.values()):
            for name, engine in engines.items():  # one step each in turn
                if not engine.has_unfinished():
                    continue
                prefilled = engine.stats.prefill_tokens
                start = time.perf_counter()
                engine.step()
                if engine.stats.prefill_tokens != prefilled:
                    times[name].append(time.perf_counter() - start)
        best = {name: min(best[name], statistics.median(values)) for name, values in times.items()}
    step = engines["compiled"].step_runner.step
    print(f"steps that prefill ({num_requests} requests of {prompt_len} tokens, chunks of up to 64 tokens), median ms:")
    for name, value in best.items():
        print(f"  {name:9s} {value * 1e3:7.3f} ms  {value / best['eager']:.3f}x eager")
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    print(f"compiled steps: {step.num_compiled_steps} ({graphs} graphs compiled), compile error: {step.compile_error}")
    return 0 if step.compile_error is None else 1


class CompiledDecoder(Decoder):
    """A `Decoder` whose steps run the model's forward compiled (`backend`, fullgraph) on a compileable cache: a
    `StaticCache`, or a `PagedCache(max_cache_len)` reserved before each forward, as generate() reserves it."""

    def __init__(self, model, cache, prompts: torch.Tensor, backend: str):
        super().__init__(model, lambda m: cache, prompts)  # the prompt's forward eagerly, as generate() runs it
        self.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
        self.tokens: list[list[int]] = []  # each step's tokens

    def step(self) -> None:
        with torch.inference_mode():
            if isinstance(self.cache, PagedCache):
                self.cache.reserve(1)
            positions = torch.full_like(self.token, self.position)
            logits = self.forward(
                input_ids=self.token, position_ids=positions, cache_position=positions[0], cache=self.cache
            ).logits
            self.token = logits[:, -1:].argmax(-1)
            self.tokens.append(self.token.tolist())
        self.position += 1


def compiled_decode(model, backend: str, repeats: int, prompt_len: int, steps: int) -> int:
    """Median host time of a compiled decode step per compileable cache (one step each in turn), best of `repeats`,
    and the host time of `PagedCache.reserve` a step; 1 if a cache's tokens differ from StaticCache's."""
    from transformers import StaticCache

    paged_model = hf_paged.enable(copy.deepcopy(model))
    prompts = torch.randint(1, 128, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    max_cache_len = prompt_len + 2 * steps + 2
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for _ in range(repeats):
        decoders = {
            "StaticCache": CompiledDecoder(
                model, StaticCache(config=model.config, max_cache_len=max_cache_len), prompts, backend
            ),
            "PagedCache, sdpa": CompiledDecoder(
                model, PagedCache(config=model.config, max_cache_len=max_cache_len), prompts, backend
            ),
            'PagedCache, "hf_paged"': CompiledDecoder(
                paged_model, PagedCache(config=paged_model.config, max_cache_len=max_cache_len), prompts, backend
            ),
        }
        for decoder in decoders.values():  # each compiles at its first step
            decoder.step()
        medians = interleaved({name: decoder.step for name, decoder in decoders.items()}, steps)
        best = {name: min(best.get(name, float("inf")), value) for name, value in medians.items()}
        tokens = {name: decoder.tokens for name, decoder in decoders.items()}
    base = best["StaticCache"]
    print(f"compiled decode step ({backend}), prompt {prompt_len}, median of {steps} steps, best of {repeats}:")
    same = True
    for name, value in best.items():
        identical = tokens[name] == tokens["StaticCache"]
        same &= identical
        print(f"  {name:24s} {value * 1e3:7.3f} ms  {value / base:.3f}x StaticCache's, same tokens: {identical}")
    print(f"PagedCache.reserve, a decode step's host share: {reserve_us(model, prompt_len):.1f} us")
    return 0 if same else 1


def reserve_us(model, prompt_len: int, steps: int = 500) -> float:
    """Host time of a compileable PagedCache's `reserve(1)` (and the settle after its forward), best of 5 runs."""
    cache = PagedCache(config=model.config, max_cache_len=prompt_len + 5 * steps + 1)
    with torch.inference_mode():
        model(torch.randint(1, 128, (1, prompt_len)), cache=cache)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(steps):
                cache.reserve(1)
                cache._fixed.pending = None  # what the forward's last layer does
            best = min(best, (time.perf_counter() - start) / steps)
    cache.release()
    return best * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
