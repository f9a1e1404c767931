"""`python -m bench.host_ops`: the host operations of one step, counted on CPU as the CUDA branch issues them.

On a GPU a small model's step is bound by the host: every aten operation and every Triton launch is host time, a
tensor made from a host list on the device is a copy the host waits for, and a read of a device value waits for the
GPU. This counts them for one step of each kind, with the Triton backend forced on CPU (`TRITON_INTERPRET=1`,
`HF_PAGED_ATTENTION_BACKEND=triton`: the store, decode and prefill kernels' paths, as on CUDA) and the kernels' own
work left out (a launch is counted and returns at once), on Llama-shaped models of 16 layers with 32 q / 8 kv heads
of 64 and little else (hidden 64), in bf16:

    engine decode   an eager decode-only Engine step of `--rows` rows (what a replayed CUDA graph saves)
    engine mixed    an Engine step of those rows decoding and two prompts of 600 and 1500 tokens starting
                    (`max_num_batched_tokens` 1200: the second one chunked): an eager step that prefills
    generate        one decode step of `generate()` at batch 1 after a 128-token prompt, with DynamicCache,
                    PagedCache (sdpa) and PagedCache with the "hf_paged" attention

Columns: aten operations (views included), Triton launches, tensors made from host values (`torch.tensor` /
`as_tensor`; `to_device` makes one per dtype and copies it once), host reads of device values (`tolist`, `item`,
`cpu`), and for generate() the Python function calls of a decode step per layer (the model's own included, so
DynamicCache's are the baseline: what a cache adds is the difference).

    python -m bench.host_ops
"""

from __future__ import annotations

import os

# Before torch and Triton are imported: Triton reads TRITON_INTERPRET when the kernels are defined.
os.environ["TRITON_INTERPRET"] = "1"
os.environ["HF_PAGED_ATTENTION_BACKEND"] = "triton"

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import DynamicCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import llama_shaped  # noqa: E402
from hf_paged import BlockPool, Engine, PagedCache  # noqa: E402

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=256,
)
H200_SMS = 132  # the split-K choice of the decode kernel, as on the GPU the numbers are for


class Counts(TorchDispatchMode):
    """Every aten operation dispatched while active, and the host events the patches below report."""

    active: Counts | None = None

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.events = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        Counts.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Counts.active = None
        return super().__exit__(*exc)


def _note(kind: str) -> None:
    if Counts.active is not None:
        Counts.active.events[kind] += 1


@contextlib.contextmanager
def counted_host():
    """Patch what dispatch does not show: Triton launches (counted, not run), tensors from host values, host reads."""
    import triton.runtime.interpreter as interpreter

    from hf_paged.attention.kernels import triton_decode

    patches = []

    def patch(owner, name, wrapper):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def launch(self, *args, grid, warmup, **kwargs):
        _note("launch")

    def from_host(original):
        def made(*args, **kwargs):
            _note("from host")
            return original(*args, **kwargs)

        return made

    def read(original):
        def reading(self, *args, **kwargs):
            _note("read")
            return original(self, *args, **kwargs)

        return reading

    patch(interpreter.InterpretedFunction, "run", launch)
    patch(triton_decode, "_num_sms", lambda device: H200_SMS)
    for name in ("tensor", "as_tensor"):
        patch(torch, name, from_host(getattr(torch, name)))
    for name in ("tolist", "item", "cpu"):
        patch(torch.Tensor, name, read(getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def count(run) -> dict:
    counts = Counts()
    with counts, torch.inference_mode():
        run()
    events = counts.events
    return dict(ops=counts.ops, launches=events["launch"], from_host=events["from host"], reads=events["read"])


def model(num_layers: int):
    # bf16, as on the GPU: the launches' tiles and split-K choices follow the dtype
    return llama_shaped({**SHAPE, "num_hidden_layers": num_layers}, torch.bfloat16, "cpu")


def engine_steps(num_layers: int, rows: int) -> dict[str, dict]:
    """Host counts of an eager decode-only Engine step of `rows` rows and of a step that starts two prompts."""
    lm = model(num_layers)
    engine = Engine(lm, BlockPool.for_model(lm, num_blocks=1024, block_size=16), max_num_batched_tokens=1200)
    rng = random.Random(0)
    for _ in range(rows):
        prompt = [rng.randrange(1, SHAPE["vocab_size"]) for _ in range(rng.randrange(100, 300))]
        engine.add_request(prompt, max_new_tokens=60, ignore_eos=True)
    while engine.num_waiting or any(request.num_pending > 1 for request in engine.scheduler.running):
        engine.step()
    engine.step()
    decode = count(engine.step)
    for length in (600, 1500):
        engine.add_request([rng.randrange(1, SHAPE["vocab_size"]) for _ in range(length)], max_new_tokens=8)
    return {f"engine decode, {rows} rows": decode, f"engine mixed, {rows} rows + 2 prompts": count(engine.step)}


def generate_steps(num_layers: int) -> dict[str, dict]:
    """Host counts of one decode step of generate() at batch 1, per cache and attention."""
    import hf_paged

    prompt = torch.randint(1, SHAPE["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, attention in (("DynamicCache", None), ("PagedCache, sdpa", "sdpa"), ("PagedCache, hf_paged", "hf")):
        lm = model(num_layers)
        if attention == "hf":
            hf_paged.enable(lm)
        pool = BlockPool.for_model(lm, num_blocks=64, block_size=16)
        cache = DynamicCache() if attention is None else PagedCache(config=lm.config, pool=pool)
        results[f"generate step, {name}"] = third_forward(lm, prompt, cache)
    return results


def third_forward(lm, prompt: torch.Tensor, cache) -> dict:
    """Host counts of generate()'s third forward (after the prompt's and a first decode step's), and the Python
    function calls of its fourth (`python_calls`: apart, as the operator count runs Python at every operator)."""
    forwards: list[dict | None] = []
    forward = lm.forward

    def counted(*args, **kwargs):
        result = {}
        if len(forwards) == 2:
            forwards.append(count(lambda: result.setdefault("out", forward(*args, **kwargs))))
        elif len(forwards) == 3:
            forwards[2]["python_calls"] = python_calls(lambda: result.setdefault("out", forward(*args, **kwargs)))
            forwards.append(None)
        else:
            forwards.append(None)
            return forward(*args, **kwargs)
        return result["out"]

    lm.forward = counted
    lm.generate(prompt, past_key_values=cache, max_new_tokens=5, do_sample=False)
    return forwards[2]


def python_calls(run) -> int:
    """Python function calls made while `run()` runs (this module's stand-ins for launches and host reads left out:
    on a GPU those are Triton's and torch's own)."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename != __file__:
            calls += 1

    with torch.inference_mode():
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=40, help="decode rows of the Engine steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with counted_host():
        results = {**engine_steps(args.layers, args.rows), **generate_steps(args.layers)}
    headers = ["step", "aten ops", "per layer", "Triton launches", "tensors from host values", "host reads"]
    headers.append("Python calls per layer")
    rows = [
        [name, r["ops"], f"{r['ops'] / args.layers:.1f}", r["launches"], r["from_host"], r["reads"]]
        + [f"{r['python_calls'] / args.layers:.1f}" if "python_calls" in r else ""]
        for name, r in results.items()
    ]
    print(f"{args.layers} layers, 32 q / 8 kv heads of 64, CUDA branch on CPU (Triton launches counted, not run)")
    print(tabulate(rows, headers, tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
