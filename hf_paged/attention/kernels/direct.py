"""A Triton kernel's compiled variants, launched without `JITFunction.run`'s work at every call.

`kernel[grid](*args)` binds every argument, works out its specialization (each pointer's 16-byte alignment, each
int's class: 1, a multiple of 16, 32 or 64 bits), hashes that into the cache key of a compiled variant, checks the
kernel's globals, then calls the variant's launcher. For a decode step of a small model that Python is the step's
cost: the GPU finishes a layer's kernels long before the host has issued the next ones (bench/launch_overhead.py
measures it, 9-14 us a launch). A launcher of this package knows which of its arguments can change between calls
and passes them as a `key` it builds from a few attribute reads; `DirectKernel` maps that key to the variant the
first `kernel[grid]` call compiled or found, and calls the variant's launcher itself, as `JITFunction.run` would
(same stream, same launch hooks, the same arguments in the kernel's order, constexprs included).

The key must determine Triton's specialization of the arguments: equal keys must mean equal specializations.
`pointer_key` and `int_key` give what Triton reads of a tensor and of a specialized int; tests/test_direct_launch.py
checks, with Triton's driver stood in, that every launch takes the variant `JITFunction.run` would take, with the
arguments it would pass. Under `TRITON_INTERPRET=1` the kernels are interpreted functions and every call goes
through `kernel[grid]`.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Variants kept per kernel before the map starts again: keys hold exact strides, so a process that sees many
# layouts (pools of several shapes) makes a few; what a launcher's key holds is bounded, this bounds the rest.
MAX_VARIANTS = 128


def pointer_key(tensor: torch.Tensor) -> tuple:
    """What Triton specializes a tensor argument on: its dtype and whether its address is 16-byte aligned."""
    return tensor.dtype, tensor.data_ptr() % 16 == 0


def int_key(value: int) -> tuple:
    """What Triton specializes an int argument on (one not in `do_not_specialize`): equal to 1 (a constant), a
    multiple of 16, and its type (i32, i64 or u64)."""
    return value == 1, value % 16 == 0, -(1 << 31) <= value < (1 << 31), value < (1 << 63)


class DirectKernel:
    """One Triton JIT kernel, launched through the compiled variant that its launcher's `key` names.

    Args:
        fn: a `triton.jit` function (an interpreted one under `TRITON_INTERPRET=1`, launched as `fn[grid]` always).
    """

    def __init__(self, fn):
        self.fn = fn
        self.direct = isinstance(fn, JITFunction)
        self.variants: dict = {}

    def launch(self, grid: tuple[int, int, int], key: tuple, args: tuple, options: dict) -> None:
        """`fn[grid](*args, **options)`.

        Args:
            grid: the launch grid, three ints.
            key: hashable; equal keys must mean the same specialization of `args` (see the module docstring) on the
                same device (a compiled variant is loaded on the device that first ran it).
            args: every parameter of the kernel in its order, constexprs included.
            options: the launch options (`num_warps`, `num_stages`), the same for every call with one key.
        """
        kernel = self.variants.get(key) if self.direct else None
        if kernel is None:
            kernel = self.fn[grid](*args, **options)
            if self.direct and kernel is not None:
                if len(self.variants) >= MAX_VARIANTS:
                    self.variants.clear()
                self.variants[key] = kernel
            return
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            kernel.function,
            kernel.packed_metadata,
            kernel.launch_metadata(grid, stream, *args),
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *args,
        )
