"""The zoo in CI: every causal LM of transformers, tiny and random, through each hf_paged path (tests/zoo.py).

Asserts the two floors (no path is ever silently wrong or silently bypassed) and that every architecture's outcome
per path equals the committed table `tests/zoo_expected.json`, so a change in what is supported shows in review.
After a change in support (or a transformers upgrade), regenerate the table and the matrix of docs/models.md with
`python -m tests.zoo --write` and review the diff.

`HF_PAGED_ZOO_JOBS` sets how many architectures run at once (default 2).
"""

from __future__ import annotations

import json
import os

import pytest
import zoo

pytestmark = pytest.mark.slow

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


def test_never_silently_wrong_or_bypassed(results):
    silent = {
        f"{model_type} / {name}": f"{result['outcome']}: {result['detail']}"
        for model_type, by_path in results.items()
        for name, result in by_path.items()
        if result["outcome"] in ("silently wrong", "silently bypassed")
    }
    assert not silent, json.dumps(silent, indent=1)


def test_outcomes_match_expectations(results, expected):
    changed = {
        f"{model_type} / {name}": f"expected {expected.get(model_type, {}).get(name)}, got {result['outcome']}: "
        f"{result['detail']}"
        for model_type, by_path in results.items()
        for name, result in by_path.items()
        if expected.get(model_type, {}).get(name) != result["outcome"]
    }
    assert not changed, "regenerate with python -m tests.zoo --write if intended:\n" + json.dumps(changed, indent=1)
