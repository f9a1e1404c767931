"""Typed errors that a user of hf_paged can hit. No torch import: the allocator raises these too."""


class PoolExhausted(RuntimeError):
    """The block pool has fewer free blocks than an operation needs. The pool is left exactly as before the call."""

    def __init__(self, num_needed: int, num_free: int, num_total: int):
        self.num_needed, self.num_free, self.num_total = num_needed, num_free, num_total
        super().__init__(f"need {num_needed} blocks, {num_free} free of {num_total}")


class PoolMismatch(ValueError):
    """A pool was built for another model shape, dtype or device than the one it is used with."""
