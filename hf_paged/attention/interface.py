"""The `hf_paged` attention implementation: decode reads K/V straight from the pool.

Registered with transformers under `PAGED_ATTENTION` ("hf_paged"; "paged" already means transformers' own
continuous batching), together with a mask function: without one, a custom attention name gets
`attention_mask=None` and a left-padded batch is silently wrong.

How it meets the cache: when the model runs this implementation, `PagedCache.update` on a decode step (one new
token per row) stores the token and returns an empty `[B, kv_heads, 0, head_dim]` tensor carrying a `DecodePlan`
instead of gathering the whole context (plan.py). The plan holds the block tables of the layer's layer group (a
Gemma-style pool keeps one per group; a sliding group's tables start at its first unreleased block,
`position_offset`), so the same code serves every group. This function finds the plan on `key` and calls its
`attend`. Prefill steps, and any other cache (DynamicCache, StaticCache), get plain SDPA: with no plan on `key`,
this is exactly `sdpa_attention_forward`.

The backend comes from `enable(model, backend=...)`, else `HF_PAGED_ATTENTION_BACKEND`, else "auto".
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import UnsupportedModel
from .kernels.dispatch import resolve_backend
from .plan import BACKEND_ATTR, EXPANDED_PLAN_KWARG, PAGED_ATTENTION, plan_of
from .torch_attention import sdpa_or_torch_attention


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, heads, q_len, head_dim], key/value [B, kv_heads, kv_len, head_dim] or a placeholder carrying a plan
    -> ([B, q_len, heads, head_dim], None), like every transformers attention function."""
    plan = plan_of(key)
    indices = kwargs.pop("indices", None)
    if indices is not None:
        # DeepSeek Sparse Attention hands the indexer's top-k keys per query to attention functions other than eager
        # and sdpa (which get them folded into the mask): fold them in here, as those models do for sdpa.
        if plan is not None:
            raise UnsupportedModel(
                _model_type(module),
                "its sparse attention passes top-k key indices, which a decode plan does not apply",
                "hf_paged attention",
            )
        attention_mask = index_masked(attention_mask, indices, key.shape[-2], query.dtype)
    if plan is None:
        # A cache whose model expands what `update` returns (multi-head latent attention) cannot hang its plan on
        # the K/V; it hands it over in the keywords the model passes to both (`EXPANDED_PLAN_KWARG`), and the plan
        # attends the expanded K/V given here.
        expanded_plan = kwargs.pop(EXPANDED_PLAN_KWARG, None)
        if expanded_plan is not None:
            return expanded_plan.attend(
                module,
                query,
                attention_mask,
                key=key,
                value=value,
                dropout=dropout,
                scaling=scaling,
                sliding_window=sliding_window,
                softcap=softcap,
                **kwargs,
            )
        if key.shape[-2] == 0:
            raise UnsupportedModel(
                _model_type(module),
                "its attention got no keys: it changes the K/V that cache.update() returns before attention, so a "
                "decode plan the cache returned was lost",
                "hf_paged attention",
            )
    if plan is None:
        # SDPA, or the torch attention for a softcap or sinks. A plan handles both itself (the paged kernels apply a
        # softcap, not sinks: a decode step with sinks gathers its K/V).
        return sdpa_or_torch_attention(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)
    if getattr(plan, "takes_states", False):  # a plan hung on the layer's new K/V (a compiled packed step's)
        kwargs.update(key=key, value=value)
    return plan.attend(
        module,
        query,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        **kwargs,
    )


def index_masked(attention_mask: torch.Tensor, indices: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`attention_mask` ([B, 1, q_len, kv_len], boolean or additive) with every key outside `indices` ([B, q_len,
    top_k] int: the keys each query attends, DeepSeek Sparse Attention's indexer choice) masked, as the models that
    pass `indices` mask for sdpa."""
    if attention_mask is None:
        raise ValueError("sparse attention (top-k key indices) needs an attention mask to fold them into")
    batch_size, q_len, _ = indices.shape
    hidden = indices.new_ones((batch_size, q_len, kv_len), dtype=torch.bool).scatter(-1, indices.long(), False)
    hidden = hidden.unsqueeze(1)  # [B, 1, q_len, kv_len]; True = masked
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~hidden
    return attention_mask.masked_fill(hidden, torch.finfo(dtype).min)


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent; done on `import hf_paged`)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    # The decode plan describes the same key range as the sdpa mask, so the sdpa mask is the right one.
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


def enable(model, backend: str | None = None):
    """Switch a loaded model to the paged attention implementation; returns the model.

    Args:
        model: a transformers `PreTrainedModel`.
        backend (`str`, *optional*): "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch". Default: the
            environment variable `HF_PAGED_ATTENTION_BACKEND`, else "auto".
    """
    if backend is not None:
        resolve_backend(backend, model.device)  # validate now: a bad value names the allowed ones
        backend = backend.strip().lower()  # as the plans look settings up
    refuse_unsupported_attention(model)
    register()
    model.set_attn_implementation(PAGED_ATTENTION)
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            setattr(module, BACKEND_ATTR, backend)
    return model


# Models whose attention reads or changes K/V between `cache.update()` and the attention function: with a decode
# plan, `update` returns an empty placeholder, so they would compute on nothing.
KV_AFTER_UPDATE = {
    "diffllama": "it splits V into two halves after cache.update()",
    "jetmoe": "it repeats K/V per expert after cache.update()",
    "doge": "it indexes the K/V that cache.update() returns (dynamic mask attention)",
    "git": "it concatenates image K/V to what cache.update() returns",
}
INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"
# Keyword arguments a model passes to the attention function that neither SDPA nor the "hf_paged" attention applies.
UNAPPLIED_ATTENTION_KWARGS = {
    "sinks": "it passes per-query attention sinks (sinks=) to the attention function, which the hf_paged attention "
    "does not apply",
}


def refuse_unsupported_attention(model, path: str = "hf_paged.enable") -> None:
    """Raise `UnsupportedModel` for a model the "hf_paged" attention would run wrong or not at all: attention code
    of its own (it never looks the attention function up in transformers' `ALL_ATTENTION_FUNCTIONS`, so enable()
    would change nothing), or K/V read after `cache.update()` (`KV_AFTER_UPDATE`). `path` names the caller in the
    error (the Engine runs the same check)."""
    model_type = _model_type(model)
    if model_type in KV_AFTER_UPDATE:
        raise UnsupportedModel(model_type, KV_AFTER_UPDATE[model_type], path)
    attention_classes = {
        type(module)
        for module in model.modules()
        if hasattr(module, "layer_idx") and "attention" in type(module).__name__.lower()
    }
    if not attention_classes:  # no module says it is an attention layer: look at every layer-indexed module
        attention_classes = {type(module) for module in model.modules() if hasattr(module, "layer_idx")}
    if not any(INTERFACE_NAME in class_source(cls) for cls in attention_classes):
        which = ", ".join(sorted(cls.__name__ for cls in attention_classes)) or "no module with a layer_idx"
        raise UnsupportedModel(
            model_type,
            f'its attention ({which}) is its own code, not transformers\' attention interface, so the "hf_paged" '
            "attention would never run",
            path,
        )
    for name, reason in UNAPPLIED_ATTENTION_KWARGS.items():
        if any(name in _attention_call_keywords(class_source(cls)) for cls in attention_classes):
            raise UnsupportedModel(model_type, reason, path)


def _attention_call_keywords(source: str) -> set[str]:
    """The keyword names of every `attention_interface(...)` call in `source`."""
    keywords = set()
    for match in re.finditer(r"attention_interface\(", source):
        depth, end = 1, match.end()
        while depth and end < len(source):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        keywords.update(re.findall(r"^\s*(\w+)\s*=", source[match.end() : end], re.MULTILINE))
    return keywords


@functools.cache
def class_source(cls: type) -> str:
    """The source of `cls` and of its bases up to torch's `nn.Module` ("" where it cannot be read)."""
    sources = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        try:
            sources.append(inspect.getsource(klass))
        except (OSError, TypeError):
            pass
    return "\n".join(sources)


def _model_type(module) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None)
