"""What an Engine counts while it runs: totals and sums, never a record per request or per step, so a serving loop
that runs for days holds the same few numbers (and a fixed-size window of recent steps)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Steps `EngineStats.used_blocks` keeps: enough for a benchmark run's every step, bounded for a server.
RECENT_STEPS = 16384


@dataclass
class EngineStats:
    num_steps: int = 0
    peak_running: int = 0
    running_sum: int = 0  # sum over steps of the requests that ran, for the mean
    num_preemptions: int = 0
    num_aborted: int = 0  # requests stopped by `abort_request` before their end
    num_failed: int = 0  # requests finished with an error (refused at add, failed sampling or forward)
    num_failed_steps: int = 0  # steps whose forward raised and was undone (the exception went to the caller)
    prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    prefill_tokens: int = 0  # input tokens computed before a request's first output (recomputation included)
    decode_tokens: int = 0  # generated tokens fed back
    num_async_steps: int = 0  # steps launched before the host read the tokens of the step before (async scheduling)
    num_failed_launches: int = 0  # asynchronous launches that raised (their rows ran again synchronously)
    used_blocks_sum: int = 0  # sum over steps of the pool blocks in use after the step, for the mean
    peak_used_blocks: int = 0
    # Pool blocks in use after each of the last RECENT_STEPS steps (all of them in a shorter run).
    used_blocks: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.num_steps if self.num_steps else 0.0

    @property
    def mean_used_blocks(self) -> float:
        """Pool blocks in use after a step, averaged over every step."""
        return self.used_blocks_sum / self.num_steps if self.num_steps else 0.0

    def record_step(self, num_rows: int, num_used_blocks: int) -> None:
        self.num_steps += 1
        self.running_sum += num_rows
        self.peak_running = max(self.peak_running, num_rows)
        self.used_blocks_sum += num_used_blocks
        self.peak_used_blocks = max(self.peak_used_blocks, num_used_blocks)
        self.used_blocks.append(num_used_blocks)
