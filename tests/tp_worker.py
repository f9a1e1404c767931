"""One rank of the tensor-parallel checks of tests/test_tensor_parallel.py, run under
`torchrun --nproc-per-node 2 --standalone tests/tp_worker.py MODEL_DIR OUT_DIR [--backend gloo|nccl]`.

Every rank loads each tiny model twice from the checkpoints the test saved: sharded (`tp_plan="auto"`) and whole
(the single-process reference), runs every check on both, and writes what it saw to `OUT_DIR/rank{r}.json`; the test
compares. A check that raises is recorded by name, so one failure does not hide the others.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from hf_paged import BlockPool, Engine, LockstepError, PagedCache, create_cache

MODELS = ("llama", "mistral")
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 61, 23], [11, 2, 90], [64, 33, 21, 70, 12, 9, 4, 100, 55, 31, 18, 6, 77]]
NEW_TOKENS = 10  # mistral's window is 8: prompt + new tokens run past it


def save_models(model_dir: str) -> None:
    """The tiny random-weight models of tests/models.py (Llama GQA: 4 query heads, 2 kv heads; Mistral: the same
    heads, every layer sliding with window 8), saved with `save_pretrained` under `model_dir/<name>`."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models import tiny_model

    for name in MODELS:
        tiny_model(name, "sdpa").save_pretrained(os.path.join(model_dir, name))


def load(path: str, tp: bool, device: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tp_plan= on from_pretrained is deprecated in favour of DistributedConfig
        if tp:
            model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        else:
            model = AutoModelForCausalLM.from_pretrained(path).to(device)
    return model.eval()


def generate_checks(model, device: str, paged: bool) -> dict:
    """Tokens of generate() (greedy, beams, seeded samples) with PagedCache (private and shared pool) or DynamicCache,
    and the pool's used blocks after each."""
    out, used = {}, {}
    input_ids = torch.tensor([PROMPTS[0]], device=device)
    pool = BlockPool.for_model(model, max_memory="1MiB", block_size=4) if paged else None
    runs = {
        "greedy": dict(do_sample=False),
        "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
        "samples": dict(do_sample=True, num_return_sequences=3, top_k=0),
    }
    # Pools: a private one through create_cache("paged", model) or PagedCache(config=model.config) (the rank's share
    # of the heads read from the first key_states), or the shared one of BlockPool.for_model(model).
    for name, kwargs in runs.items():
        for pool_kind in ("create_cache", "config", "shared") if paged else ("dynamic",):
            if not paged:
                cache = DynamicCache()
            elif pool_kind == "shared":
                cache = PagedCache(config=model.config, pool=pool)
            elif pool_kind == "config":
                cache = PagedCache(config=model.config, block_size=4)
            else:
                cache = create_cache("paged", model, block_size=4)
            torch.manual_seed(0)
            tokens = model.generate(input_ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, **kwargs)
            key = name if pool_kind in ("dynamic", "create_cache") else f"{name}/{pool_kind}"
            out[key] = tokens.tolist()
            if paged:
                cache.release()
                used[key] = cache.pool.num_used_blocks
    if not paged:
        return {"tokens": out}
    return {"tokens": out, "used_after": used, "num_kv_heads": list(pool.layout.num_kv_heads)}


def engine_checks(model, rank: int) -> dict:
    # Each rank offers a different budget: the pool takes the smallest block count over ranks.
    pool = BlockPool.for_model(model, max_memory=(48 + 16 * rank) * 1024, block_size=4)
    engine = Engine(model, pool, max_num_seqs=2, max_num_batched_tokens=16)
    greedy = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    # Unseeded samples: each rank's global generator differs, so only rank 0's draws keep the ranks in step.
    torch.manual_seed(1000 + rank)
    unseeded = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.0)
    seeded = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7)
    return {
        "greedy": greedy,
        "seeded": seeded,
        "unseeded": unseeded,
        "num_blocks": pool.num_blocks,
        "used_after": pool.num_used_blocks,
        "num_steps": engine.stats.num_steps,
    }


def failure_checks(model, rank: int) -> dict:
    """A step that raises on rank 1 only: every rank's call fails, and the engine runs again afterwards."""
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=2, enable_prefix_caching=False)
    original = engine.scheduler.schedule
    calls = {"n": 0}

    def flaky_schedule():
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise RuntimeError("scheduler failed on rank 1")
        return original()

    engine.scheduler.schedule = flaky_schedule
    result = {}
    try:
        engine.generate(PROMPTS[:2], max_new_tokens=4)
        result["raised"] = None
    except LockstepError as error:
        result["raised"] = "LockstepError"
        result["failed_ranks"] = sorted(error.errors)
    except RuntimeError as error:
        result["raised"] = type(error).__name__ + ": " + str(error)
    result["used_after_failure"] = pool.num_used_blocks
    engine.scheduler.schedule = original
    result["after"] = engine.generate(PROMPTS[:2], max_new_tokens=4)
    result["used_after"] = pool.num_used_blocks
    return result


def group_checks(model) -> dict:
    """Each engine's lockstep group goes away with the engine."""
    from torch.distributed import distributed_c10d

    before = len(distributed_c10d._world.pg_map)
    engine = Engine(model, BlockPool.for_model(model, num_blocks=16, block_size=4))
    during = len(distributed_c10d._world.pg_map)
    del engine
    gc.collect()
    return {"before": before, "during": during, "after": len(distributed_c10d._world.pg_map)}


def timeout_checks(model, rank: int) -> dict:
    """Rank 1 never steps: rank 0 does not wait for it longer than the engine's lockstep timeout."""
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, lockstep_timeout=2.0)
    if rank == 1:
        time.sleep(5.0)  # alive, but not stepping
        return {"raised": None}
    start = time.perf_counter()
    try:
        engine.generate(PROMPTS[:1], max_new_tokens=2)
    except LockstepError as error:
        return {"raised": "LockstepError", "seconds": time.perf_counter() - start, "message": str(error)}
    return {"raised": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{torch.cuda.current_device()}"
    results: dict = {"world_size": dist.get_world_size()}

    def record(key, fn, *fn_args):
        try:
            results[key] = fn(*fn_args)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
            print(f"rank {rank}, {key}:", results[key]["error"], file=sys.stderr, flush=True)

    for name in MODELS:
        path = os.path.join(args.model_dir, name)
        reference, sharded = load(path, tp=False, device=device), load(path, tp=True, device=device)
        if name == "llama":
            sharded_llama = sharded
        record(f"{name}/generate/reference", generate_checks, reference, device, False)
        record(f"{name}/generate/tp", generate_checks, sharded, device, True)
        record(f"{name}/engine/reference", engine_checks, reference, 0)
        record(f"{name}/engine/tp", engine_checks, sharded, rank)
        if name == "llama":
            record(f"{name}/failure", failure_checks, sharded, rank)
            record(f"{name}/groups", group_checks, sharded)
    record("llama/timeout", timeout_checks, sharded_llama, rank)  # last: it leaves the ranks out of step
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
