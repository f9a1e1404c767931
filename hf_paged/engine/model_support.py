"""Which models the Engine serves, and how: the packed step, the per-request step, or an up-front refusal.

`choose_step_mode(model)` decides once, in `Engine.__init__`: "packed" when the packed step computes the model right,
"per-request" (with the reason the packed step cannot) when only the per-request step does (`per_request.py`), else
`UnsupportedModel` naming the model type and the reason.

The Engine packs every scheduled request's new tokens into one `[1, num_tokens]` sequence (see `StepCache`), gives
the model each token's position (`position_ids`), reads the logits of each row's last token only
(`logits_to_keep`), and computes attention itself per row (`StepPlan.attend`: a causal mask per prefill chunk, a
length or sliding-window mask per decode row; the model's own mask is not read). A model that breaks one of these
assumptions would compute the packed step wrong without any error, so `refuse_unsupported_engine` raises
`UnsupportedModel` (path "Engine", naming the model type and the reason) before anything runs:

- attention that does not go through transformers' attention interface, or K/V read after `cache.update()` (the
  checks of `hf_paged.enable`, which the Engine relies on);
- a forward that takes no `position_ids` (positions would come from the cache length: every packed row after the
  first gets the wrong ones) or no `logits_to_keep` (the Engine would read the wrong positions);
- attention that is not causal (`is_causal=False` on an attention module, or `use_bidirectional_attention`: a
  packed prefill chunk is causal);
- a sliding window the attention modules do not pass to the attention function (the window comes from the model's
  mask or the cache's truncation, neither of which the packed step reads);
- looped layers (`n_recurrent_loops`: each loop writes cache layers beyond the model's, which the pool lacks);
- hybrid models (linear-attention, mamba or conv layers): each request has a recurrent or conv state the pool does
  not hold and a packed row cannot carry (the per-request step keeps it per request: `per_request.RequestStates`).
- indexed attention (DeepSeek Sparse Attention: indexer keys beside the K/V, which the pool does not hold);
- a model class with a `generate()` of its own (MusicGen): the Engine only takes tokens from the logits.

Two checks run with every step instead, for what the classes do not show: a forward that never stores K/V in the
step's cache (it ran on a cache of its own), and a write to a cache layer the pool does not hold; both raise
`UnsupportedModel` from the step.

The per-request step runs each scheduled request in a forward of its own (batch 1, the model's own attention and
mask, positions from the cache length, the logits of its last token), so it serves every model above but those
whose prompt cannot be computed in chunks over cached tokens: the Engine splits prompts into chunks and reuses
cached prefixes. Looped layers and `use_bidirectional_attention` = True / "all" are refused here (both steps);
"vision" is causal for the Engine, which passes token ids only (no vision inputs). What the config does not show
(`is_causal=False` modules without a causal mask of their own, a forward that asserts one new token over a cache,
one that stores K/V of tokens of its own) is found by `per_request.check_chunked_prompt`, which the Engine runs
before serving a model per request: a short prompt in chunks over a `DynamicCache` must give the logits of one
forward.

The rules read the model's classes and modules, not a list of model types, so a new architecture is judged the same
way.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from ..attention.interface import class_source, refuse_unsupported_attention
from ..errors import UnsupportedModel
from ..storage import KVLayout, sliding_windows
from ..storage.kv_layers import holds_state, mlp_only_layers

PATH = "Engine"
PACKED, PER_REQUEST = "packed", "per-request"


def choose_step_mode(model) -> tuple[str, str | None]:
    """How the Engine runs `model`: `("packed", None)`, or `("per-request", why the packed step cannot)`; raises
    `UnsupportedModel` for a model neither step serves (see the module docstring)."""
    if isinstance(model, torch.nn.Module):
        # Neither step holds indexer keys: refused, never run per request. (Recurrent or conv states and MLP-only
        # layers: the per-request step keeps the states per request and maps the layers, see below.)
        config = model.config.get_text_config(decoder=True)
        state_reason = _indexed_reason(config) or _own_generate_reason(model)
        if state_reason is not None:
            raise UnsupportedModel(getattr(model.config, "model_type", None), state_reason, PATH)
    try:
        refuse_unsupported_engine(model)
    except UnsupportedModel as error:
        if error.path != PATH:
            raise
        packed_reason = error.reason
    else:
        return PACKED, None
    config = model.config.get_text_config(decoder=True)
    reason = _loop_reason(config) or _prompt_order_reason(config)
    if reason is None and KVLayout.from_config(config).latent:
        reason = (
            f"the packed step cannot run it ({packed_reason}), and the per-request step does not expand the "
            "multi-head latent attention latents the pool holds"
        )
    if reason is not None:
        raise UnsupportedModel(getattr(model.config, "model_type", None), reason, PATH)
    return PER_REQUEST, packed_reason


def refuse_unsupported_engine(model) -> None:
    """Raise `UnsupportedModel` for a model the Engine's packed step would run wrong (see the module docstring).
    A stand-in that is not a torch module (bench/replay.py's, which returns logits without attention) is not
    judged."""
    if not isinstance(model, torch.nn.Module):
        return
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(model.config, "model_type", None)
    # First: whatever else the model does, the pool lacks its recurrent states or indexer keys.
    state_reason = _recurrent_state_reason(config) or _indexed_reason(config) or _mlp_only_reason(config)
    if state_reason is not None:
        raise UnsupportedModel(model_type, state_reason, PATH)
    refuse_unsupported_attention(model, path=PATH)
    # The decoder's attention layers only: a multimodal model's encoders (bidirectional, with layer indices of their
    # own) never see the packed step.
    decoder = _decoder(model) or model
    reason = (
        _position_ids_reason(model)
        or _logits_to_keep_reason(model)
        or _non_causal_reason(decoder)
        or _bidirectional_reason(model, config)
        or _loop_reason(config)
        or _window_reason(decoder, config)
    )
    if reason is not None:
        raise UnsupportedModel(model_type, reason, PATH)


def _parameters(forward) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return {}


def takes(forward, name: str) -> bool:
    """Whether `forward`'s signature names the argument `name`."""
    return name in _parameters(forward)


def _passes_keywords(forward) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _parameters(forward).values())


def _position_ids_reason(model) -> str | None:
    """A forward that takes `position_ids`, or passes its keywords on to a decoder whose forward does."""
    if takes(model.forward, "position_ids"):
        return None
    decoder = _decoder(model)
    if decoder is not None and _passes_keywords(model.forward) and takes(decoder.forward, "position_ids"):
        return None
    return (
        f"{type(model).__name__}.forward takes no position_ids: positions come from the cache length, so every "
        "request packed after the first in a step would get the wrong positions"
    )


def _decoder(model):
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if get_decoder is not None else None
    except Exception:  # a model whose get_decoder cannot find its decoder
        return None
    return decoder if decoder is not model else None


def _logits_to_keep_reason(model) -> str | None:
    if takes(model.forward, "logits_to_keep"):
        return None
    return (
        f"{type(model).__name__}.forward takes no logits_to_keep: the Engine reads each request's next-token logits "
        "at its own last token of the packed step, which this model would not select"
    )


def _attention_modules(model) -> list:
    """The model's attention layers: modules with a `layer_idx` whose class name says attention."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx") and "attention" in type(module).__name__.lower()
    ]


def _non_causal_reason(model) -> str | None:
    non_causal = sorted({type(m).__name__ for m in _attention_modules(model) if getattr(m, "is_causal", True) is False})
    if not non_causal:
        return None
    return (
        f"its attention is not causal (is_causal=False on {', '.join(non_causal)}): the Engine's packed prefill "
        "attends causally, so it would not compute what this model computes"
    )


def _bidirectional_reason(model, config) -> str | None:
    mode = getattr(config, "use_bidirectional_attention", None)
    if not mode or (mode == "vision" and config is model.config):  # a text-only model has no vision tokens
        return None
    which = "its vision tokens attend" if mode == "vision" else "it attends"
    return (
        f"{which} bidirectionally (use_bidirectional_attention = {mode!r}), through a mask the model builds from "
        "absolute positions: the Engine's packed prefill attends causally"
    )


def cache_keyword(model) -> str:
    """The keyword the model's forward takes its cache by: `cache` (transformers 5's name) where the forward names
    it, else `past_key_values`. A forward that takes `cache` but has no alias for the old name would put a
    `past_key_values=` cache in its `**kwargs` and run on a cache of its own."""
    forward = getattr(model, "forward", None)
    return "cache" if forward is not None and takes(forward, "cache") else "past_key_values"


def _recurrent_state_reason(config) -> str | None:
    layer_types, _ = get_layer_types_and_kwargs(config)
    state_layers = [layer_idx for layer_idx, layer_type in enumerate(layer_types) if holds_state(layer_type)]
    if not state_layers:
        return None
    return (
        f"it is a hybrid model: its layers {state_layers} keep a per-request recurrent or convolution state "
        f"(layer types {sorted({layer_types[i] for i in state_layers})}), which the paged pool does not hold and a "
        "packed step does not carry"
    )


def never_stored(model_type: str | None, cache_keyword: str) -> UnsupportedModel:
    """The error of a step whose forward stored no K/V in the Engine's cache: the model ran on a cache of its own,
    so it computed something else than the step."""
    return UnsupportedModel(
        model_type, f"its forward never stored K/V in the Engine's cache (passed as {cache_keyword}=)", PATH
    )


def _mlp_only_reason(config) -> str | None:
    mlp_only = mlp_only_layers(config)
    if not mlp_only:
        return None
    return (
        f"its layers {list(mlp_only)} are MLP-only (no K/V), and the packed step maps the model's cache layers to "
        "the pool's layers one to one"
    )


def _loop_reason(config) -> str | None:
    loops = getattr(config, "n_recurrent_loops", None)
    if not isinstance(loops, int) or loops <= 1:
        return None
    return (
        f"it loops its middle layers (n_recurrent_loops = {loops}), and each loop writes cache layers of its own "
        "beyond the model's layers, which the pool does not hold"
    )


def chunk_sizes(config) -> list[int | None]:
    """Per layer of a (decoder text) config: the chunk of a chunked-attention layer, else None."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    return [
        kwargs["sliding_window"] if layer_type == "chunked_attention" else None
        for layer_type, kwargs in zip(layer_types, layer_kwargs)
    ]


def _indexed_reason(config) -> str | None:
    """DeepSeek Sparse Attention ("indexed_attention" layers) keeps indexer keys beside the K/V, which the Engine's
    pool does not hold."""
    layer_types, _ = get_layer_types_and_kwargs(config)
    if "indexed_attention" not in layer_types:
        return None
    return (
        "its indexed-attention layers (DeepSeek Sparse Attention) keep indexer keys beside the K/V, which the Engine's "
        "pool does not hold (generate() with a PagedCache serves it)"
    )


def _own_generate_reason(model) -> str | None:
    """A model class with a `generate()` of its own (MusicGen's codebook delay pattern) generates otherwise than
    greedy or sampled tokens from its forward's logits, which is all the Engine does."""
    from transformers import GenerationMixin

    for cls in type(model).__mro__:
        if "generate" in cls.__dict__:
            if cls is GenerationMixin or not issubclass(cls, GenerationMixin):
                return None
            return (
                f"its class has a generate() of its own ({cls.__name__}.generate), which the Engine does not run: it "
                "takes each next token from the forward's logits"
            )
    return None


def _window_reason(model, config) -> str | None:
    """A sliding layer must hand its window to the attention function (`sliding_window=`): the Engine masks the
    window there, from that argument, and reads neither the model's mask nor a truncated cache."""
    windows, chunks = sliding_windows(config), chunk_sizes(config)
    for module in _attention_modules(model):
        layer_idx = module.layer_idx
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(windows) or windows[layer_idx] is None:
            continue
        if chunks[layer_idx] is not None:  # chunked attention: the step masks the chunks itself (StepCache)
            continue
        if "sliding_window" not in class_source(type(module)):
            return (
                f"layer {layer_idx} slides (window {windows[layer_idx]}) but its attention "
                f"({type(module).__name__}) does not pass sliding_window to the attention function: the window "
                "comes from the model's mask or the cache's truncation, neither of which the Engine's step reads"
            )
    return None


def _prompt_order_reason(config) -> str | None:
    """Why a token of a prompt would see tokens after it (the config says so), else None."""
    mode = getattr(config, "use_bidirectional_attention", None)
    if not mode or mode == "vision":
        return None
    return (
        f"it attends bidirectionally (use_bidirectional_attention = {mode!r}): the Engine computes a prompt in chunks "
        "and reuses cached prefixes, so a token must not see the tokens after it"
    )
