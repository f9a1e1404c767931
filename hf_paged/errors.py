"""Every error and warning a user of hf_paged can hit, in one place. No torch import: the allocator raises these too."""


class PoolExhausted(RuntimeError):
    """The block pool has fewer free blocks than an operation needs. The pool is left exactly as before the call."""

    def __init__(self, num_needed: int, num_free: int, num_total: int):
        self.num_needed, self.num_free, self.num_total = num_needed, num_free, num_total
        super().__init__(
            f"need {num_needed} blocks, {num_free} free of {num_total}; give the pool more blocks (BlockPool "
            "num_blocks or max_memory), or run fewer or shorter sequences on it at once"
        )


class PoolMismatch(ValueError):
    """A pool was built for another model shape, dtype or device than the one it is used with."""


class PoolTooLarge(ValueError):
    """A pool would need more memory than its device has; raised before anything is allocated."""

    def __init__(self, num_blocks: int, bytes_per_block: int, capacity: int, device: str):
        self.num_blocks, self.bytes_per_block, self.capacity = num_blocks, bytes_per_block, capacity
        super().__init__(
            f"a pool of {num_blocks} blocks of {bytes_per_block} bytes needs "
            f"{num_blocks * bytes_per_block / 2**30:.1f} GiB, more than the {capacity / 2**30:.1f} GiB {device} can "
            "hold; lower num_blocks or max_memory"
        )


class UnknownBackend(KeyError):
    """No backend has this name. The message lists the available names and any plugins that failed to load."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0])


class BackendOptionError(TypeError):
    """`create_cache` got an option the backend's factory does not accept, or lacks a required one."""


class DuplicateBackend(ValueError):
    """Two plugins register the same backend name."""


class PluginLoadError(RuntimeError):
    """A plugin failed to import or to register its backends (raised in strict mode; a warning otherwise)."""


class PluginLoadWarning(UserWarning):
    """A plugin failed to load and was skipped; the other backends keep working."""


class RequestFailed(RuntimeError):
    """Some requests could not run (e.g. larger than the whole pool); the others finished.

    `errors` maps input index -> message; `outputs` holds every input's tokens (empty for a failed one).
    """

    def __init__(self, errors: dict[int, str], outputs: list[list[int]]):
        self.errors, self.outputs = errors, outputs
        super().__init__("; ".join(f"input {index}: {message}" for index, message in errors.items()))


class UnsupportedModel(NotImplementedError):
    """hf_paged refuses a model it would run wrong (or not at all) on the path asked for, before computing anything.

    `model_type` is the config's model type; `reason` says what the model does that the path cannot.
    """

    def __init__(self, model_type: str | None, reason: str, path: str = "hf_paged"):
        self.model_type, self.reason, self.path = model_type, reason, path
        super().__init__(f"{path} does not support model type {model_type!r}: {reason}")


class UnsupportedCacheAttribute(UnsupportedModel, AttributeError):
    """A model read an attribute of a paged cache layer that transformers' own layer classes have and `PagedLayer`
    does not (the K/V tensors `keys` / `values`, a state of the model's own): refused by name. It is an
    `AttributeError` as well, so `hasattr(layer, name)` stays False."""

    def __init__(self, model_type: str | None, name: str, layer_class: str = "PagedLayer"):
        self.name = name
        super().__init__(
            model_type,
            f"its forward reads cache layer attribute {name!r}, which {layer_class} does not have (the K/V live in the "
            "shared BlockPool, not in per-layer tensors)",
            "PagedCache",
        )


class GradientsUnsupported(RuntimeError):
    """A forward that records autograd history (grad mode on, parameters that require grad) stores K/V in a
    `PagedCache`: the pool is shared storage written in place, which keeps no history, so gradients through the cache
    would be silently wrong. Raised at the first layer whose K/V require grad, before that layer writes, with the step
    undone in the layers before it: the cache runs it again under `torch.no_grad()` (a hybrid model whose states
    advanced: `IncompleteStep`, only `release()`)."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        super().__init__(
            f"layer {layer_idx}'s key_states/value_states require grad: a PagedCache stores K/V in place in a shared "
            "pool and keeps no autograd history. Run the forward under torch.no_grad() or torch.inference_mode() "
            "(generate() does), or use DynamicCache to backpropagate through the cache"
        )


class UnknownRequest(ValueError):
    """An Engine was asked about a request id it never issued."""


class PositionLimitWarning(UserWarning):
    """A request goes past the model's `max_position_embeddings` on a model whose positions are not a table (rotary,
    ALiBi): it runs, as `generate()` lets it, but the model was not trained that far."""


class InvalidRequest(ValueError):
    """A request the server refuses before it runs: answered with HTTP 400 and an OpenAI-style error body naming
    `param`, the request field at fault."""

    status_code = 400
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        self.message, self.param = message, param
        super().__init__(message)


class ModelNotFound(InvalidRequest):
    """A request for a model the server does not serve: HTTP 404 with code `model_not_found`, as OpenAI answers."""

    status_code = 404
    code = "model_not_found"

    def __init__(self, requested: str, served: str):
        super().__init__(f"the model {requested!r} does not exist here; this server serves {served!r}", "model")


class ServeUnavailable(RuntimeError):
    """`hf-paged serve` cannot start: serving packages are missing, or transformers' serving code lacks a seam the
    server plugs into (the message names the supported transformers range)."""


class LockstepError(RuntimeError):
    """A tensor-parallel engine's ranks did not run a step alike: a rank raised, or ranks scheduled different rows.
    Raised on every rank, so no rank goes on alone. `errors` maps rank -> what went wrong there."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__(
            "tensor-parallel ranks left lockstep: "
            + "; ".join(f"rank {rank}: {message}" for rank, message in sorted(errors.items()))
        )


class IncompleteStep(RuntimeError):
    """A hybrid model's forward stopped part-way (`PoolExhausted` or `GradientsUnsupported` at an attention layer)
    after earlier layers had advanced their recurrent or conv states: running the step again would apply it twice to
    those states, so the cache is only good for `release()`."""
