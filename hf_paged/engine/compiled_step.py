"""The packed step's forward compiled, with the step's token count a dynamic size (`Engine(compile_prefill=...)`).

An eager step that prefills costs the host one Python dispatch and one kernel launch per operation of every layer,
whatever its token count (`python -m bench.host_ops` counts them), while its GPU work is a few milliseconds.
Compiled, the model's own operations (projections, norms, rotary, activations) run as one graph with inductor's fused
kernels, and each layer's attention stays one opaque call, as vLLM's piecewise compilation keeps it:

    host, per step                            compiled forward (one graph for every token count T >= 2)
    --------------                            ---------------------------------------------------------
    StepCache: the rows' slots, lengths and   embeddings ... q/k/v ... hf_paged::step_attention(q, k, v, layer) ...
    tables, one copy to the device      ->    ... logits at each row's last token (padded to `num_logits` rows)
    `running(cache, modules)`                                        |
                                              the step's StepCache: store K/V at its slots, then `StepPlan.attend`
                                              (the paged decode and prefill kernels, or the torch path)

The graph reads nothing of the step but its input ids and positions (`[1, T]`, T marked dynamic) and the rows' logits
indices (`[num_logits]`, a fixed size): what differs between steps (how many rows, their lengths and tables) lives in
the `StepCache` that `running` makes current for the custom op, which runs it eagerly, so no row's length or table is
guarded on and one graph serves every token count T >= 2 (a sliding model's mask code may ask for a second one, as
whether T reaches the window; a step of one token, a decode row without a decode runner, gets its own). The op does
on the step's cache exactly what the eager forward's `update` and "hf_paged" attention do, so a compiled forward's
attention is the eager one's, bit for bit.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from ..attention.plan import PLAN_ATTR, plan_of
from ..errors import UnsupportedModel
from .step_cache import StepCache, StepLayer

_current = threading.local()  # .step: (StepCache, {layer index: attention module}) of the forward running


@contextmanager
def running(cache: StepCache, modules: dict[int, torch.nn.Module]):
    """Make `cache` the step that `hf_paged::step_attention` calls (on this thread) serve, `modules` the attention
    module of each layer (what the eager attention function would be handed)."""
    previous = getattr(_current, "step", None)
    _current.step = (cache, modules)
    try:
        yield
    finally:
        _current.step = previous


# NOTE: cudagraph_unsafe: what the op does depends on the step the host made current (its rows, slots and tables), so a
# CUDA graph recorded around it (torch.compile's "reduce-overhead" or "max-autotune" modes) would replay the first
# step's work for every later one; with the tag, inductor leaves the op out of its graphs.
@torch.library.custom_op("hf_paged::step_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def step_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One layer of the current packed step (`running`): query `[1, heads, T, head_dim]`, key / value `[1, kv_heads,
    T, head_dim]` (the step's new tokens) -> `[1, T, heads, value_head_dim]`. Stores the new K/V at the step's slots
    (in the pool, which the compiled graph does not see) and attends as `StepPlan.attend` does."""
    step = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError("hf_paged::step_attention runs only inside a packed step's forward (compiled_step.running)")
    cache, modules = step
    placeholder, _ = cache.update(key, value, layer_idx)
    kwargs = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    if sinks is not None:
        kwargs["s_aux"] = sinks
    out, _ = plan_of(placeholder).attend(modules[layer_idx], query, None, **kwargs)
    return out.contiguous()


@step_attention.register_fake
def _(query, key, value, layer_idx, dropout, scaling, sliding_window, softcap, sinks):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


class StatesPlan:
    """A layer's plan in a compiled packed step: `update` hangs it on the layer's new K/V (which it returns as they
    are), and the "hf_paged" attention hands it them back (`takes_states`) for `hf_paged::step_attention`."""

    takes_states = True

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [1, heads, T, head_dim], key / value the layer's new [1, kv_heads, T, head_dim] -> ([1, T, heads,
        value_head_dim], None). The mask is the step's: each row's lengths say what it sees."""
        out = torch.ops.hf_paged.step_attention(
            query, key, value, self.layer_idx, dropout, scaling, sliding_window, softcap, kwargs.get("s_aux")
        )
        return out, None


class CompiledStepCache(Cache):
    """The cache a compiled packed forward is handed, one for the Engine's life: `update` only marks the new K/V with
    the layer's `StatesPlan`; storing and attending happen in `hf_paged::step_attention`, on the current step."""

    def __init__(self, num_layers: int, model_type: str | None = None):
        self.model_type = model_type
        self.plans = [StatesPlan(layer_idx) for layer_idx in range(num_layers)]
        super().__init__(layers=[StepLayer(self) for _ in range(num_layers)])

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # for the mask, which describes the new tokens alone (StepLayer) and which no one reads

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Positions are given, and the mask sizes describe the new tokens alone (StepLayer): a model that asks uses the
        # answer for something else (Llama 4 scales its no-rope layers' queries by position), which no one number can
        # give for rows of different lengths. Raised while tracing: the step runs eagerly instead.
        raise NotImplementedError(
            "a compiled packed step's rows hold different numbers of tokens, so its cache has no one sequence length"
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [1, kv_heads, T, head_dim] -> the same tensors, carrying the layer's plan."""
        if not 0 <= layer_idx < len(self.plans):
            raise UnsupportedModel(
                self.model_type,
                f"it writes cache layer {layer_idx}, while the pool holds its {len(self.plans)} layers",
                "Engine",
            )
        plan = self.plans[layer_idx]
        setattr(key_states, PLAN_ATTR, plan)
        setattr(value_states, PLAN_ATTR, plan)
        return key_states, value_states


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each layer index's attention module (the first module with that `layer_idx` whose class names attention): what
    the model hands the attention function, which `hf_paged::step_attention` hands the step's plan."""
    modules: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and "attention" in type(module).__name__.lower():
            modules.setdefault(layer_idx, module)
    return modules


def mark_dynamic_size(dim: int, *tensors: torch.Tensor) -> None:
    """Mark dimension `dim` of each input of a compiled forward dynamic (a packed step's tokens, a decode step's rows),
    so that one graph serves every size >= 2; a size of 0 or 1 stays static (torch.compile specializes them)."""
    for tensor in tensors:
        if tensor.shape[dim] >= 2:
            torch._dynamo.mark_dynamic(tensor, dim)
