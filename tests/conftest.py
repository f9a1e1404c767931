"""Shared pytest setup.

Triton kernels run on CPU tensors in Triton's interpreter when there is no GPU. `triton.jit` reads
`TRITON_INTERPRET` when a kernel is *defined*, so it is set here, at conftest import, before any test module can
import `hf_paged.attention.kernels.triton_*`. `setdefault`: an explicit `TRITON_INTERPRET=0` from the shell still wins.

Under pytest-xdist (`make test` runs one worker per core) each worker computes with one intra-op thread: the workers
already share the cores, and two threads each would make them wait on one another.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test: steps of a tiny model are too small to share, and tests that run threads of
    their own (or a server beside them) would oversubscribe a 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(items):
    """Test files that hold a test marked slow run first, the rest in their own order: pytest-xdist hands each file
    whole to one worker in collection order, and a long file handed out last runs alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
