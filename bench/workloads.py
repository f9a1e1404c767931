"""Serving workloads: seeded lists of requests (random prompt token ids, an output length, an arrival time).

Token ids are drawn from [2, vocab) so no prompt token is the pad id (0) or bos (1). Every request runs to its own
`max_new_tokens` (the model has no eos), so the output token count of a workload is fixed and comparable.

    name           quick                                             full
    burst          16 requests at t=0, prompts 64-128, out 32-64     48 requests, prompts 128-384, out 128-256
    poisson        burst's sizes, Poisson arrivals at --rate req/s   (default rate: quick 4/s, full 1/s)
    shared-prefix  16 requests: 256-token shared system prompt       64 requests: 512 shared + 32-128 unique,
                   + 16-64 unique tokens, out 16-32                  out 32-64
    long           6 requests, prompts 512-1536, out 32              16 requests, prompts 1024-3072, out 64
    parallel-      8 requests like burst's, 4 samples each at        24 requests like burst's, 4 samples each
    sampling       temperature 1                                     (n=4)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("burst", "poisson", "shared-prefix", "long", "parallel-sampling")


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival: float = 0.0  # seconds after the run starts


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[RequestSpec, ...]
    description: str = ""
    num_samples: int = 1  # sequences per request (parallel sampling)
    temperature: float = 0.0  # 0: greedy; otherwise every sequence is sampled

    def __post_init__(self):
        if not self.requests:
            raise ValueError(f"workload {self.name!r} has no requests")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {self.num_samples!r}")
        if self.num_samples > 1 and self.temperature <= 0:
            raise ValueError(f"parallel sampling needs temperature > 0, got {self.temperature!r}")
        arrivals = [r.arrival for r in self.requests]
        # The backends take requests in list order; a sorted list makes list order the arrival order.
        if arrivals != sorted(arrivals):
            raise ValueError(f"workload {self.name!r}: requests must be sorted by arrival, got arrivals {arrivals}")

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)

    @property
    def max_new_tokens(self) -> int:
        return max(r.max_new_tokens for r in self.requests)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def sequences(self) -> list[RequestSpec]:
        """One entry per generated sequence, request-major: request i's samples are i*n ... i*n + n-1."""
        return [spec for spec in self.requests for _ in range(self.num_samples)]

    @property
    def num_output_tokens(self) -> int:
        return self.num_samples * sum(r.max_new_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= 2:
        raise ValueError(f"vocab_size must be > 2 (ids 0 and 1 are reserved), got {vocab_size}")


def random_requests(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    *,
    vocab_size: int,
    seed: int = 0,
    prefix: tuple[int, ...] = (),
) -> tuple[RequestSpec, ...]:
    """`num_requests` requests arriving at t=0: `prefix` + a random prompt; lengths uniform in the inclusive ranges."""
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lens)
        prompt = prefix + tuple(rng.randrange(2, vocab_size) for _ in range(prompt_len))
        requests.append(RequestSpec(prompt, rng.randint(*output_lens)))
    return tuple(requests)


def burst(
    *, vocab_size: int, num_requests: int = 16, prompt_lens=(64, 128), output_lens=(32, 64), seed: int = 0
) -> Workload:
    requests = random_requests(num_requests, prompt_lens, output_lens, vocab_size=vocab_size, seed=seed)
    description = (
        f"{num_requests} requests at t=0, prompts {prompt_lens[0]}-{prompt_lens[1]} tokens, "
        f"outputs {output_lens[0]}-{output_lens[1]} tokens (uniform, seed {seed})"
    )
    return Workload("burst", requests, description)


def poisson(*, vocab_size: int, rate: float, seed: int = 0, **sizes) -> Workload:
    """burst's requests arriving as a Poisson process of `rate` requests/s (the first at t=0)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    base = burst(vocab_size=vocab_size, seed=seed, **sizes)
    rng = random.Random(seed + 1)
    arrival, requests = 0.0, []
    for spec in base.requests:
        requests.append(RequestSpec(spec.prompt_ids, spec.max_new_tokens, arrival))
        arrival += rng.expovariate(rate)
    description = base.description.replace("at t=0", f"arriving as a Poisson process at {rate:g} req/s")
    return Workload("poisson", tuple(requests), f"{description}, last arrival at {requests[-1].arrival:.1f} s")


def shared_prefix(
    *, vocab_size: int, num_requests: int, prefix_len: int, unique_lens, output_lens, seed: int = 0
) -> Workload:
    """Every request = one shared system prompt of `prefix_len` tokens + its own unique tokens, all at t=0."""
    _check_vocab(vocab_size)
    rng = random.Random(seed + 2)
    prefix = tuple(rng.randrange(2, vocab_size) for _ in range(prefix_len))
    requests = random_requests(num_requests, unique_lens, output_lens, vocab_size=vocab_size, seed=seed, prefix=prefix)
    description = (
        f"{num_requests} requests at t=0, each a shared {prefix_len}-token system prompt + "
        f"{unique_lens[0]}-{unique_lens[1]} unique tokens, outputs {output_lens[0]}-{output_lens[1]} tokens "
        f"(uniform, seed {seed})"
    )
    return Workload("shared-prefix", requests, description)


def long(*, vocab_size: int, num_requests: int, prompt_lens, output_lens, seed: int = 0) -> Workload:
    workload = burst(
        vocab_size=vocab_size, num_requests=num_requests, prompt_lens=prompt_lens, output_lens=output_lens, seed=seed
    )
    return Workload("long", workload.requests, workload.description)


def parallel_sampling(*, vocab_size: int, num_samples: int, temperature: float, seed: int = 0, **sizes) -> Workload:
    """burst's requests, each sampled `num_samples` times at `temperature`."""
    base = burst(vocab_size=vocab_size, seed=seed, **sizes)
    description = f"{base.description}, each sampled {num_samples} times at temperature {temperature:g}"
    return Workload("parallel-sampling", base.requests, description, num_samples=num_samples, temperature=temperature)


# name -> (builder, quick sizes, full sizes)
SIZES = {
    "burst": (
        burst,
        dict(num_requests=16, prompt_lens=(64, 128), output_lens=(32, 64)),
        dict(num_requests=48, prompt_lens=(128, 384), output_lens=(128, 256)),
    ),
    "poisson": (
        poisson,
        dict(num_requests=16, prompt_lens=(64, 128), output_lens=(32, 64), rate=4.0),
        dict(num_requests=48, prompt_lens=(128, 384), output_lens=(128, 256), rate=1.0),
    ),
    "shared-prefix": (
        shared_prefix,
        dict(num_requests=16, prefix_len=256, unique_lens=(16, 64), output_lens=(16, 32)),
        dict(num_requests=64, prefix_len=512, unique_lens=(32, 128), output_lens=(32, 64)),
    ),
    "long": (
        long,
        dict(num_requests=6, prompt_lens=(512, 1536), output_lens=(32, 32)),
        dict(num_requests=16, prompt_lens=(1024, 3072), output_lens=(64, 64)),
    ),
    "parallel-sampling": (
        parallel_sampling,
        dict(num_requests=8, prompt_lens=(64, 128), output_lens=(32, 64), num_samples=4, temperature=1.0),
        dict(num_requests=24, prompt_lens=(128, 384), output_lens=(128, 256), num_samples=4, temperature=1.0),
    ),
}


def make_workload(
    name: str, *, vocab_size: int, full: bool = False, seed: int = 0, rate: float | None = None
) -> Workload:
    """The named workload at quick or full size; `rate` (requests/s) overrides the poisson default."""
    if name not in SIZES:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    builder, quick, large = SIZES[name]
    sizes = dict(large if full else quick)
    if rate is not None:
        if name != "poisson":
            raise ValueError(f"--rate applies to the poisson workload only, not {name!r}")
        sizes["rate"] = rate
    return builder(vocab_size=vocab_size, seed=seed, **sizes)
