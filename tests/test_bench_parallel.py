"""`python -m bench --tp N`: arguments, and the torchrun relaunch (the ranks themselves run in
tests/test_tensor_parallel.py; a whole benchmark run on 2 ranks is too long for CI)."""

import pytest

from bench import __main__ as harness
from bench import parallel


def test_tp_runs_the_sharded_backends_serving_only():
    args = harness.parse_args(["--tp", "2"])
    assert args.tp == 2 and args.backends == list(parallel.TP_BACKENDS) and args.serving_only
    assert args.linear == "torch"
    assert harness.parse_args([]).tp == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "2", "--backends", "engine,static"], "static cannot run sharded"),
        (["--tp", "0"], "--tp must be a positive number of ranks, got 0"),
        (["--tp", "2", "--cache-only"], "--tp runs the serving benchmark only"),
    ],
)
def test_tp_refuses_what_cannot_run_sharded(argv, message, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(argv)
    assert message in capsys.readouterr().err


def test_tp_outside_torchrun_relaunches_under_torchrun(monkeypatch):
    launched = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(parallel.subprocess, "run", lambda command: launched.append(command) or _Done())
    assert harness.main(["--tp", "2", "--budgets", "2"]) == 7
    (command,) = launched
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "bench",
        "--tp",
        "2",
        "--budgets",
        "2",
    ]


def test_tp_under_a_launch_of_another_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="--tp 2 but torchrun started 3 ranks"):
        parallel.init_ranks(2)


class _Done:
    returncode = 7
