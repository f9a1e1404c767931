"""What every serving runner shares: the KV budget, the result record, and the model settings they all use."""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from hf_paged import KVLayout
from hf_paged.storage import first_window_block, group_windows, sliding_windows

from .workloads import Workload

BLOCK_SIZE = 16
PAD_TOKEN_ID = 0
STATIC_SLOT_TOKENS = 1024  # the static backend's default StaticCache slot (at least one reservation is used)
ENGINE_MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 512
PEER = "hf-generate-batch"
OPTIMISTIC = "engine-optimistic"  # opt-in: the Engine with vLLM's admission (see bench/continuous.py)


def budgets_arg(text: str) -> list[float]:
    """The `--budgets` argument of `python -m bench` and `python -m bench.replay`: multiples of one worst-case
    reservation, comma-separated ("2,8" -> [2.0, 8.0]), each > 0."""
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"budgets must be positive numbers, e.g. 2,8; got {text!r}")
    return values


@dataclass(frozen=True)
class Budget:
    """A KV memory budget of `multiple` worst-case reservations, the same bytes for every backend.

    One reservation is what one worst-case request (the workload's longest prompt + longest output) holds, in whole
    blocks, so that `multiple` paged rows of the worst length fit a pool of the budget, as they fit `multiple`
    contiguous slots (a contiguous cache holds under one block per layer less). In a sliding-window layer a row holds
    only the blocks its window spans, as DynamicCache keeps only `window - 1` tokens there: the reservation counts
    the same. A full-attention model has `windows == ()`.
    """

    multiple: float
    reservation_tokens: int  # one worst-case request, rounded up to whole blocks
    bytes_per_token: int  # K/V of one token, every layer
    # One (K/V bytes per token, window) per sliding-window layer: such a layer holds at most a window of a sequence.
    windows: tuple[tuple[int, int], ...] = ()
    # A paged pool's layer groups (hf_paged/layer_groups.py): each group's window (None: it keeps every block), and
    # the K/V bytes of one token in one group's block (a block holds `num_slots` layers, padded groups included;
    # 0: every layer's, the one group of a model whose layers all attend alike).
    group_windows: tuple[int | None, ...] = (None,)
    group_bytes_per_token: int = 0

    @property
    def reservation_bytes(self) -> int:
        """The most K/V bytes a paged row holds on its way to `reservation_tokens` tokens (at the end, unless a
        sliding window's span peaks a little earlier)."""
        windows = [window for window in self.group_windows if window is not None]
        if not windows:
            return self.paged_bytes(self.reservation_tokens)
        # Only the last window and block of tokens can hold more than the end does: earlier rows are shorter.
        first = max(1, self.reservation_tokens - max(windows) - BLOCK_SIZE)
        return max(self.paged_bytes(num_tokens) for num_tokens in range(first, self.reservation_tokens + 1))

    @property
    def bytes(self) -> int:
        return int(self.multiple * self.reservation_bytes)

    @property
    def full_bytes_per_token(self) -> int:
        """K/V bytes of one token in the full-attention layers alone."""
        return self.bytes_per_token - sum(layer_bytes for layer_bytes, _ in self.windows)

    def paged_bytes(self, num_tokens: int) -> int:
        """K/V bytes a paged row holds while its step stores token `num_tokens - 1`: whole blocks of every layer
        group; in a sliding group only from the first block that token's query sees (what the Engine keeps)."""
        blocks = -(-num_tokens // BLOCK_SIZE)
        held = sum(blocks - first_window_block(num_tokens - 1, window, BLOCK_SIZE) for window in self.group_windows)
        return BLOCK_SIZE * held * self._block_bytes_per_token

    def prefill_bytes(self, num_tokens: int) -> int:
        """K/V bytes a paged row holds while one forward computes its first `num_tokens` tokens: every block of them
        in every layer group (a sliding group gives blocks back only after the forward)."""
        blocks = -(-num_tokens // BLOCK_SIZE)
        return BLOCK_SIZE * blocks * len(self.group_windows) * self._block_bytes_per_token

    @property
    def _block_bytes_per_token(self) -> int:
        return self.group_bytes_per_token or self.bytes_per_token

    def contiguous_bytes(
        self, num_tokens: int, *, window_tokens: Callable[[int], int] = lambda window: window - 1
    ) -> int:
        """K/V bytes a contiguous cache holds for a sequence of `num_tokens` tokens: every token in a full-attention
        layer, at most `window_tokens(window)` in a sliding one (DynamicCache keeps `window - 1`, the default;
        StaticCache's sliding layers hold `window`)."""
        over = sum(layer_bytes * max(0, num_tokens - window_tokens(window)) for layer_bytes, window in self.windows)
        return num_tokens * self.bytes_per_token - over

    @classmethod
    def for_workload(cls, model, workload: Workload, multiple: float) -> Budget:
        layout = KVLayout.from_config(model)  # a tensor-parallel model: one rank's share of the kv heads
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        layer_windows = sliding_windows(model.config)
        layer_bytes = [(kh * kd + vh * vd) * itemsize for kh, kd, vh, vd in layout.shapes()]
        windows = tuple((b, window) for b, window in zip(layer_bytes, layer_windows) if window is not None)
        # The pool's layer groups, as `BlockPool` builds them: a block holds the layers of the largest group.
        groups = layout.layer_groups()
        largest = max(groups, key=len)
        worst = workload.max_prompt_len + workload.max_new_tokens
        reservation = -(-worst // BLOCK_SIZE) * BLOCK_SIZE
        return cls(
            multiple,
            reservation,
            sum(layer_bytes),
            windows,
            group_windows=tuple(group_windows(groups, layer_windows)),
            group_bytes_per_token=sum(layer_bytes[layer] for layer in largest),
        )


@dataclass
class RunResult:
    """One backend serving one workload under one budget. Times are seconds since the run started."""

    backend: str
    multiple: float
    outputs: list[list[int]]  # per request, exactly its max_new_tokens tokens
    first_token: list[float]
    finish: list[float]
    wall_s: float
    peak_concurrency: int
    mean_concurrency: float  # rows per forward (padding rows of static batches included), time-weighted over the wall
    # Sequences in flight that still owe tokens, time-weighted over the wall: a sequence counts from its first forward
    # to its own last token. A static batch's row that has its last token computes padding and no longer counts.
    # The engine counts, per step, the requests holding K/V plus those it finished (bench/continuous.py).
    mean_live: float
    reserved_bytes: int  # K/V memory the backend set aside
    live_bytes_peak: int | None  # K/V bytes of real tokens (prompt + own outputs) at the peak; None: not observable
    held_bytes_peak: int | None = None  # pool blocks in use at the peak (paged backends)
    num_preemptions: int = 0
    wasted_tokens: int = 0  # generated past a request's own max_new_tokens (static batches)
    extra: dict = field(default_factory=dict)


@contextmanager
def attention(model, name: str | None):
    """Run with `model` on attention implementation `name` (None: as it is); restore the original afterwards."""
    original = model.config._attn_implementation
    if name is not None and name != original:
        model.set_attn_implementation(name)
    try:
        yield model
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def generation_config(model, workload: Workload | None = None) -> GenerationConfig:
    """The model's generation config, never stopping at eos, padding with PAD_TOKEN_ID: greedy, or for a sampled
    workload plain temperature sampling (no top-k/top-p, as the engine samples) with `num_samples` sequences."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = None, PAD_TOKEN_ID
    # NOTE: generate() compiles the model by itself for a StaticCache on CUDA; compile time inside a timed run (and
    # again for each new batch shape) would measure the compiler, not the storage. No backend is compiled.
    config.disable_compile = True
    if workload is not None and workload.sampled:
        config.do_sample, config.temperature, config.top_k, config.top_p = True, workload.temperature, 0, 1.0
        config.num_return_sequences = workload.num_samples
    else:
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    return config


def sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
