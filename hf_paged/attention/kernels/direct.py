"""A Triton kernel's compiled variants, launched without `JITFunction.run`'s work at every call.

`kernel[grid](*args)` binds every argument, works out its specialization (each pointer's 16-byte alignment, each
int's class: 1, a multiple of 16, 32 or 64 bits), hashes that into the cache key of a compiled variant, checks the
kernel's globals, then calls the variant's launcher. For a decode step of a small model that Python is the step's
cost: the GPU finishes a layer's kernels long before the host has issued the next ones (bench/launch_overhead.py
measures it, 10-30 us a launch on a small host). A launcher of this package knows which of its arguments can change
between calls and passes them as a `key` it builds from a few attribute reads; `DirectKernel` maps that key to the
variant the first `kernel[grid]` call compiled or found, and calls the variant's launcher itself, as
`JITFunction.run` would (the current device's current stream, the same launch hooks, the same arguments in the
kernel's order, constexprs included).

The key must determine Triton's specialization of the arguments: equal keys must mean equal specializations. A
tensor's is its dtype and whether its address is a multiple of 16 (`pointer_keys`), a specialized int's its class
(`int_keys`); Triton's process-wide settings that enter its own key (debug, instrumentation, sanitizer casts) are
added here, and a kernel with pre-run hooks, or a stage-inspection hook installed, always goes through
`kernel[grid]`; so does every launch on a Triton without `triton.knobs` (before 3.4).
tests/test_direct_launch.py checks, with Triton's driver stood in, that every launch takes the variant
`JITFunction.run` would take, with the arguments it would pass. Under `TRITON_INTERPRET=1` the kernels are
interpreted functions and every call goes through `kernel[grid]`; so does every call inside `through_jit_run()`.
"""

from __future__ import annotations

import contextlib

import torch
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton before 3.4 has no knobs: its launches go through kernel[grid], as interpreted ones do
    knobs = None

# Variants kept per kernel before the map starts again: keys hold exact strides, so a process that sees many
# layouts (pools of several shapes, prompts of many lengths) makes a few; what a launcher's key holds is bounded, this
# bounds the rest.
MAX_VARIANTS = 128
_through_jit = False  # set by `through_jit_run`


def pointer_keys(*tensors: torch.Tensor) -> tuple:
    """What Triton specializes a tensor argument on, for each tensor: its dtype and whether its address is 16-byte
    aligned (hot launch paths write the same inline)."""
    return tuple([(tensor.dtype, tensor.data_ptr() % 16 == 0) for tensor in tensors])


def int_keys(*values: int) -> tuple:
    """What Triton specializes an int argument on (one not in `do_not_specialize`), for each value: equal to 1 (a
    constant), a multiple of 16, and its type (i32, i64 or u64)."""
    return tuple([(v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31), v < (1 << 63)) for v in values])


class DirectKernel:
    """One Triton JIT kernel, launched through the compiled variant that its launcher's `key` names.

    Args:
        fn: a `triton.jit` function (an interpreted one under `TRITON_INTERPRET=1`, launched as `fn[grid]` always).
    """

    def __init__(self, fn):
        self.fn = fn
        self.direct = knobs is not None and isinstance(fn, JITFunction)
        self.variants: dict = {}

    def launch(self, grid: tuple[int, int, int], key: tuple, args: tuple, options: dict) -> None:
        """`fn[grid](*args, **options)`.

        Args:
            grid: the launch grid, three ints.
            key: hashable; equal keys must mean the same specialization of `args` (see the module docstring).
            args: every parameter of the kernel in its order, constexprs included.
            options: the launch options (`num_warps`, `num_stages`), the same for every call with one key.
        """
        if (
            not self.direct
            or _through_jit
            or getattr(self.fn, "pre_run_hooks", None)
            or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None
        ):
            self.fn[grid](*args, **options)
            return
        # A compiled variant is loaded on the device that first ran it; the process-wide settings Triton keys on.
        device = driver.active.get_current_device()
        compilation = knobs.compilation
        variant = (
            device,
            knobs.runtime.debug,
            compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None),  # Triton 3.9's
            key,
        )
        kernel = self.variants.get(variant)
        if kernel is None:
            kernel = self.fn[grid](*args, **options)
            if hasattr(kernel, "result"):  # a compile of Triton's async mode, finished by the launch
                kernel = kernel.result()
            if kernel is not None:
                if len(self.variants) >= MAX_VARIANTS:
                    self.variants.clear()
                self.variants[variant] = kernel
            return
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


@contextlib.contextmanager
def through_jit_run():
    """Within: every launch of this package's launchers goes through `kernel[grid]` (`JITFunction.run`), as when
    Triton's launch is replaced (resources.py records the launches) or measured against (bench/launch_overhead.py).
    Process-wide, for those tools: not for threads that launch meanwhile."""
    global _through_jit
    saved, _through_jit = _through_jit, True
    try:
        yield
    finally:
        _through_jit = saved
