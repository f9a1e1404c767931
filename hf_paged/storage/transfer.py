"""Host lists to the device in one copy, without the host waiting for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Triton compiles a kernel variant per 16-byte alignment class of each pointer argument: every tensor `to_device`
# makes starts on such a boundary, so a kernel handed any of them (or an aligned slice) compiles no second variant.
ALIGN_BYTES = 16


def to_device(segments: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Each of `segments` as a 1-D `dtype` tensor on `device`, all made by one host-to-device copy.

    Why: `torch.tensor(list, device="cuda")` copies from pageable memory, which blocks the host until the GPU has
    run everything queued before it; a step that makes several such tensors waits for the GPU several times, some
    of them in the middle of its forward. Here the lists go into one pinned host tensor (on CUDA) and one
    `non_blocking` copy; PyTorch's pinned allocator keeps that host memory until the copy has run. Each tensor starts
    at a 16-byte boundary of the copy (`ALIGN_BYTES`). On CPU the tensors are views of the host tensor itself.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A graph would keep this step's host values and replay them at every step after.
        raise RuntimeError(
            "a step's tensors are made from host values here, which a CUDA graph cannot capture: capture a forward of "
            "a compileable PagedCache (max_cache_len=...) or the Engine's decode runner instead"
        )
    flat, offsets = aligned_flat(segments, dtype)
    host = torch.tensor(flat, dtype=dtype, pin_memory=device.type == "cuda" and torch.cuda.is_available())
    values = host if device.type == "cpu" else host.to(device, non_blocking=host.is_pinned())
    return [values[offset : offset + len(segment)] for offset, segment in zip(offsets, segments)]


def aligned_flat(segments: Sequence[Sequence[int]], dtype: torch.dtype) -> tuple[list[int], list[int]]:
    """(the segments' values one after the other, each padded with zeros up to the next `ALIGN_BYTES` boundary of
    `dtype` elements; where each segment starts): the layout of one tensor whose segments all start aligned."""
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    flat: list[int] = []
    offsets = []
    for segment in segments:
        offsets.append(len(flat))
        flat.extend(segment)
        flat.extend([0] * (-len(flat) % step))
    return flat, offsets
