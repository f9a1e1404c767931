"""The seam between a cache and the "hf_paged" attention function: a plan object with one method, `attend`.

transformers calls an attention function with what the model hands it (module, query, key, value, mask, kwargs),
never the cache. The one value both `generate()`'s cache and the engine's step cache control is what
`Cache.update` returns, so a cache that wants to run attention itself returns an empty placeholder tensor carrying
a plan (`plan_placeholders`), and the attention function calls `plan_of(key).attend(...)`. Attention knows only this
contract: `DecodePlan` (a `PagedCache` decode step) and the engine's packed-step plan both implement it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .kernels.dispatch import resolve_backend, resolve_backends

# The attention implementation name hf_paged registers. "paged" is transformers' own continuous batching.
PAGED_ATTENTION = "hf_paged"

# Set by `enable(model, backend=...)` on every attention module (they all have a `layer_idx`).
BACKEND_ATTR = "hf_paged_attention_backend"

PLAN_ATTR = "hf_paged_plan"

# The keyword a cache adds to the attention keywords a model passes to `cache.update(..., kwargs=kwargs)` and then to
# the attention function, for models that expand what `update` returns (multi-head latent attention): the plan then
# travels beside the K/V, and its `attend` takes the expanded `key=` and `value=`.
EXPANDED_PLAN_KWARG = "hf_paged_expanded_plan"


class AttentionPlan(Protocol):
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs
    ) -> tuple[torch.Tensor, None]:
        """query [B, heads, q_len, head_dim] -> ([B, q_len, heads, head_dim], None), like every transformers
        attention function. `kwargs`: the attention function's (dropout, scaling, sliding_window, softcap, ...)."""


def plan_placeholders(
    key_states: torch.Tensor, value_states: torch.Tensor, plan: AttentionPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a cache's `update` returns to hand attention `plan`: empty keys `[B, kv_heads, 0, head_dim]` and values
    `[B, value_heads, 0, value_head_dim]` of the states' own shapes (V's head_dim may differ from K's), both carrying
    `plan`."""
    placeholders = []
    for states in (key_states, value_states):
        placeholder = states.new_empty(*states.shape[:2], 0, states.shape[-1])
        setattr(placeholder, PLAN_ATTR, plan)
        placeholders.append(placeholder)
    return placeholders[0], placeholders[1]


def plan_of(key: torch.Tensor) -> AttentionPlan | None:
    """The plan a cache attached to `key`, or None for ordinary K/V."""
    return getattr(key, PLAN_ATTR, None)


def memoized_backend(backends: dict, module: torch.nn.Module, device: torch.device) -> str:
    """`module_backend(module, device)`, resolved once per backend setting in `backends` (a plan's memo, shared by
    the step's layers)."""
    setting = getattr(module, BACKEND_ATTR, None)
    backend = backends.get(setting)
    if backend is None:
        backend = backends[setting] = module_backend(module, device)
    return backend


def module_backend(module: torch.nn.Module, device: torch.device) -> str:
    """ "triton" or "torch" for `module`'s attention: what `enable(model, backend=...)` set on it, else
    `HF_PAGED_ATTENTION_BACKEND`, else "auto", resolved for `device` (memoized per device and environment:
    `resolve_backends`)."""
    return backend_of(resolve_backends(device), module, device)


def backend_of(backends: Mapping, module: torch.nn.Module, device: torch.device) -> str:
    """ "triton" or "torch" for `module`'s backend setting, read in `backends` (`resolve_backends`' mapping, which a
    compiled step resolves on the host beforehand); a setting spelled otherwise than BACKENDS is resolved (or refused)
    as given. A setting that cannot run raises a fresh error: the memoized one keeps no traceback of earlier raises."""
    setting = getattr(module, BACKEND_ATTR, None)
    backend = backends.get(setting)
    if backend is None:
        return resolve_backend(setting, device)
    if isinstance(backend, Exception):
        raise type(backend)(*backend.args)
    return backend
