"""PagedCache, BlockPool and the Engine under transformers tensor parallelism: 2 ranks under `torchrun`.

One `torchrun --nproc-per-node 2 --standalone tests/tp_worker.py` launch (gloo, on CPU) runs every check on both
ranks: tiny Llama (GQA) and Mistral (sliding window) checkpoints saved with `save_pretrained`, loaded sharded with
`from_pretrained(path, tp_plan="auto")` and whole (the single-process reference). Each test reads the ranks' reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.tp_worker import MODELS, save_models

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.slow,  # both ranks run whole generate() checks in one module-scoped fixture
]


def run_ranks(tmp_path, backend: str) -> list[dict]:
    model_dir, out_dir = tmp_path / "models", tmp_path / "out"
    out_dir.mkdir()
    save_models(str(model_dir))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", WORKER]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(model_dir), str(out_dir), "--backend", backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("tp"), "gloo")


def report(ranks: list[dict], key: str) -> list[dict]:
    """Both ranks' report of check `key`; fails with the traceback a rank recorded."""
    reports = [rank[key] for rank in ranks]
    for rank, entry in enumerate(reports):
        assert "error" not in entry, f"rank {rank}, {key}:\n{entry['error']}"
    return reports


@pytest.mark.parametrize("name", MODELS)
def test_generate_with_paged_cache_gives_the_single_process_tokens_on_every_rank(ranks, name):
    reference = report(ranks, f"{name}/generate/reference")[0]["tokens"]
    for rank, tp in enumerate(report(ranks, f"{name}/generate/tp")):
        assert tp["num_kv_heads"] == [1, 1]  # 2 kv heads per layer, split over 2 ranks
        assert len(tp["tokens"]) == 9  # greedy, beams, seeded samples x create_cache, PagedCache(config), shared pool
        for run, tokens in tp["tokens"].items():
            assert tokens == reference[run.split("/")[0]], (rank, run)
        assert set(tp["used_after"].values()) == {0}, tp["used_after"]


@pytest.mark.parametrize("name", MODELS)
def test_engine_gives_the_single_process_tokens_on_every_rank(ranks, name):
    reference = report(ranks, f"{name}/engine/reference")[0]
    for rank, tp in enumerate(report(ranks, f"{name}/engine/tp")):
        # Unseeded samples too: each rank's global generator differs, and rank 0's draws (the same seed as the
        # reference's) are every rank's.
        for run in ("greedy", "seeded", "unseeded"):
            assert tp[run] == reference[run], (rank, run)
        # Budgets of 48 KiB and 64 KiB hold 48 and 64 blocks of one kv head: the ranks take the smaller.
        assert tp["num_blocks"] == 48, rank
        assert tp["used_after"] == 0 and tp["num_steps"] == reference["num_steps"], rank


def test_an_error_on_one_rank_fails_the_call_on_every_rank(ranks):
    for rank, failure in enumerate(report(ranks, "llama/failure")):
        assert failure["raised"] == "LockstepError" and failure["failed_ranks"] == [1], (rank, failure)
        assert failure["used_after_failure"] == 0 and failure["used_after"] == 0, (rank, failure)
    greedy = report(ranks, "llama/engine/reference")[0]["greedy"]
    assert all(failure["after"] == [tokens[:4] for tokens in greedy[:2]] for failure in report(ranks, "llama/failure"))


def test_an_engines_lockstep_group_goes_with_the_engine(ranks):
    for groups in report(ranks, "llama/groups"):
        assert groups["during"] == groups["before"] + 1 and groups["after"] == groups["before"], groups


def test_no_rank_waits_past_the_lockstep_timeout(ranks):
    waiting = report(ranks, "llama/timeout")[0]
    assert waiting["raised"] == "LockstepError", waiting
    assert 1.5 < waiting["seconds"] < 4.5, waiting  # lockstep_timeout=2.0 while rank 1 sleeps 5 s


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl tensor parallelism needs 2 CUDA devices")
def test_nccl_ranks_on_two_gpus_give_the_single_process_tokens(tmp_path):
    ranks = run_ranks(tmp_path, "nccl")
    for name in MODELS:
        reference = report(ranks, f"{name}/engine/reference")[0]
        for tp in report(ranks, f"{name}/engine/tp"):
            assert tp["greedy"] == reference["greedy"] and tp["used_after"] == 0
        generated = report(ranks, f"{name}/generate/reference")[0]["tokens"]["greedy"]
        assert all(tp["tokens"]["greedy"] == generated for tp in report(ranks, f"{name}/generate/tp"))
