"""Shared pytest setup.

Triton kernels run on CPU tensors in Triton's interpreter when there is no GPU. `triton.jit` reads
`TRITON_INTERPRET` when a kernel is *defined*, so it is set here, at conftest import, before any test module can
import `hf_paged.attention.kernels.triton_*`. `setdefault`: an explicit `TRITON_INTERPRET=0` from the shell still wins.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
