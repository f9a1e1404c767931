"""KVLayout: the per-layer K/V shapes a pool must hold for one model, and what a model's config says about them.

The one module of `storage/` that reads a transformers config: `KVLayout.from_config` and `sliding_windows` use
transformers' own `get_layer_types_and_kwargs`, so layer types mean exactly what they mean to `DynamicCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import UnsupportedModel
from .hybrid import holds_state, kv_layer_indices, mlp_only_layers, paged_layer_type
from .layer_groups import LayerGroups, derive_layer_groups
from .sharding import kv_shard_factors, model_tp_size

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
SUPPORTED_LAYER_TYPES = ("full_attention", *SLIDING_LAYER_TYPES)


@dataclass(frozen=True)
class KVLayout:
    """Per-layer K/V shapes of one model: what a pool must hold for it.

    `layer_types` (one transformers layer type per layer, such as "full_attention" or "sliding_attention"; all
    "full_attention" when not given) decides how a pool groups layers (`layer_groups`). `windows` (per layer: its
    sliding window, None for full attention; all None when not given) lets a cache built from the pool alone give
    back blocks that left a window, as a cache built from the config does.

    Under tensor parallelism (`tp_size` > 1 ranks run the model in lockstep; see sharding.py) `num_kv_heads` are
    one rank's heads: `from_config(model)` reads them from the model's sharding.

    `kv_layers` (per layer: the decoder layer it stores; `range(num_layers)` when not given) is what a hybrid model
    needs: only its layers holding K/V are layers of the layout (see hybrid.py).

    NOTE: `layer_types`, `windows` and `tp_size` are left out of equality. Two layouts are equal when they store the
    same shapes, and any grouping serves any model of those shapes correctly: a `PagedCache` keeps one block table per
    group of its pool and releases a group's blocks only when every layer of that group slides (by the cache's own
    config).
    """

    num_kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    layer_types: tuple[str, ...] | None = field(default=None, compare=False)
    windows: tuple[int | None, ...] | None = field(default=None, compare=False)
    tp_size: int = field(default=1, compare=False)
    kv_layers: tuple[int, ...] | None = field(default=None, compare=False)

    def __post_init__(self):
        if len(self.num_kv_heads) != len(self.head_dims) or not self.num_kv_heads:
            raise ValueError(f"num_kv_heads and head_dims need one entry per layer, got {self} ")
        if min(self.num_kv_heads) <= 0 or min(self.head_dims) <= 0:
            raise ValueError(f"num_kv_heads and head_dims must be positive, got {self}")
        layer_types = ("full_attention",) * self.num_layers if self.layer_types is None else tuple(self.layer_types)
        if len(layer_types) != self.num_layers:
            raise ValueError(f"layer_types needs one entry per layer ({self.num_layers}), got {len(layer_types)}")
        object.__setattr__(self, "layer_types", layer_types)
        windows = (None,) * self.num_layers if self.windows is None else tuple(self.windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"windows needs one entry per layer ({self.num_layers}), got {len(windows)}")
        object.__setattr__(self, "windows", windows)
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size <= 0:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        kv_layers = tuple(range(self.num_layers)) if self.kv_layers is None else tuple(self.kv_layers)
        if len(kv_layers) != self.num_layers or list(kv_layers) != sorted(set(kv_layers)) or min(kv_layers) < 0:
            raise ValueError(f"kv_layers needs {self.num_layers} ascending decoder layer indices, got {kv_layers}")
        object.__setattr__(self, "kv_layers", kv_layers)

    @property
    def num_layers(self) -> int:
        return len(self.num_kv_heads)

    def layer_groups(self) -> LayerGroups:
        """The layer groups a pool of this layout uses (see layer_groups.py): one group unless types mix."""
        return derive_layer_groups(self.layer_types, list(zip(self.num_kv_heads, self.head_dims)))

    @classmethod
    def from_config(cls, config, *, tp_size: int | None = None) -> KVLayout:
        """Read the decoder's layer count, kv heads and head_dim from a transformers config or a model.

        Given a model loaded with a tensor-parallel plan (`from_pretrained(path, tp_plan="auto")`), the kv heads are
        this rank's share (see `sharding.kv_shard_factors`). A config alone knows nothing of sharding: pass
        `tp_size` (the ranks its K/V projections are split over) to get one rank's heads; the default is 1 (every
        head on this process).
        """
        model = config if isinstance(config, torch.nn.Module) else None
        config = getattr(config, "config", config)  # a model: use its config
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"expected a transformers model or its config, got {type(config).__name__} {config!r:.80}; load a "
                "checkpoint first (AutoModelForCausalLM.from_pretrained(path) or AutoConfig.from_pretrained(path))"
            )
        if model is not None and tp_size is not None and tp_size != model_tp_size(model):
            raise ValueError(
                f"tp_size={tp_size!r} but the model runs on {model_tp_size(model)} tensor-parallel rank(s); leave "
                "tp_size out when giving a model (it is read from the model's sharding)"
            )
        config = config.get_text_config(decoder=True)
        refuse_unsupported(config)
        # A heterogeneous config (Gemma 4, dots) gives some layers other kv heads or head_dim: read each layer's.
        layer_configs = list(config.per_layer_config) if getattr(config, "is_heterogeneous", False) else None
        kv_layers, layer_types, layer_kwargs = _kv_layers(config)
        shapes = [
            _kv_shape(config if layer_configs is None else layer_configs[i], layer_type)
            for i, layer_type in zip(kv_layers, layer_types)
        ]
        windows = _windows(layer_types, layer_kwargs)
        num_kv_heads, head_dims = zip(*shapes)
        layout = cls(tuple(num_kv_heads), tuple(head_dims), tuple(layer_types), tuple(windows), kv_layers=kv_layers)
        if model is not None:
            return layout.shard(kv_shard_factors(model, layout.num_kv_heads), model_tp_size(model))
        return layout if tp_size is None else layout.shard(tp_size)

    def shard(self, factors: int | tuple[int, ...], tp_size: int | None = None) -> KVLayout:
        """One rank's layout when each layer's kv heads are split over `factors` ranks (an int: every layer alike;
        a layer whose heads the plan replicates has factor 1) out of `tp_size` (defaults to the largest factor).
        Raises `ValueError` when a layer's heads do not split evenly."""
        if isinstance(factors, int) and not isinstance(factors, bool):
            factors = (factors,) * self.num_layers
        if len(factors) != self.num_layers or any(isinstance(f, bool) or not isinstance(f, int) for f in factors):
            raise ValueError(f"need one int factor per layer ({self.num_layers}), got {factors!r}")
        uneven = [(i, h, f) for i, (h, f) in enumerate(zip(self.num_kv_heads, factors)) if f <= 0 or h % f]
        if uneven:
            layer_idx, heads, factor = uneven[0]
            raise ValueError(
                f"layer {layer_idx} has {heads} kv heads, which do not split over tp_size={factor} ranks; "
                f"the kv heads per layer are {sorted(set(self.num_kv_heads))}"
            )
        tp_size = max(factors) if tp_size is None else tp_size
        if self.tp_size != 1:
            raise ValueError(f"this layout already holds one rank's heads of {self.tp_size} ranks")
        return KVLayout(
            tuple(h // f for h, f in zip(self.num_kv_heads, factors)),
            self.head_dims,
            self.layer_types,
            self.windows,
            tp_size,
            self.kv_layers,
        )

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of `block_size` tokens in *every* layer (a one-group pool's block; also what
        DynamicCache pays per `block_size` tokens of a full-attention model)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * itemsize * sum(h * d for h, d in zip(self.num_kv_heads, self.head_dims))


def sliding_windows(config) -> list[int | None]:
    """Per layer holding K/V (every layer but the state-only and MLP-only layers of a hybrid model, see hybrid.py):
    its sliding window (an int) or None for full attention. Raises `UnsupportedModel` for a model PagedCache cannot
    store (see `refuse_unsupported`)."""
    refuse_unsupported(config)
    _, layer_types, layer_kwargs = _kv_layers(config)
    return _windows(layer_types, layer_kwargs)


def _kv_layers(config) -> tuple[tuple[int, ...], list[str], list[dict]]:
    """The decoder layers holding K/V (see hybrid.py) and their `get_layer_types_and_kwargs`, a hybrid layer typed as
    its attention part."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    kv_layers = kv_layer_indices(layer_types, SUPPORTED_LAYER_TYPES)
    return kv_layers, [paged_layer_type(layer_types[i]) for i in kv_layers], [layer_kwargs[i] for i in kv_layers]


# Models whose forward uses a cache other than through `Cache.update`, by model type.
NO_PAGED_CACHE = {
    "xlnet": "it keeps its own memory (mems) and never stores K/V in a transformers Cache",
    "reformer": "its LSH and local attention keep their own buckets and states, never K/V in a transformers Cache",
    **dict.fromkeys(
        ("mllama", "mllama_text_model"),
        "its cross-attention layers read cache.layers[i].keys, which a paged layer does not have",
    ),
}


def refuse_unsupported(config) -> None:
    """Raise `UnsupportedModel`, naming the model type and the reason, for a (decoder text) config whose K/V a
    PagedCache would store or return wrong: encoder-decoder models, layer types other than full / sliding / chunked
    attention and the state and MLP-only layers of hybrid models (see hybrid.py), such as shared K/V, a model with
    no attention layer, and latent (MLA) caches."""
    model_type = getattr(config, "model_type", None)
    if model_type in NO_PAGED_CACHE:
        raise UnsupportedModel(model_type, NO_PAGED_CACHE[model_type], "PagedCache")
    if _global_attr(config, "num_attention_heads", per_layer=True) is None:
        raise UnsupportedModel(
            model_type, "its config names no attention heads: it caches no attention K/V", "PagedCache"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            model_type,
            "encoder-decoder models keep a self-attention and a cross-attention cache (EncoderDecoderCache); "
            "PagedCache is a decoder-only cache",
            "PagedCache",
        )
    layer_types, _ = get_layer_types_and_kwargs(config)
    mlp_only = mlp_only_layers(config)
    unsupported = sorted(
        {
            layer_type
            for layer_idx, layer_type in enumerate(layer_types)
            if layer_type not in SUPPORTED_LAYER_TYPES
            and not holds_state(layer_type)
            and not (layer_type == "dummy" and layer_idx in mlp_only)
        }
    )
    if unsupported:
        # transformers marks a layer that caches nothing of its own "dummy": one that reads another layer's K/V (KV
        # sharing: Gemma 3n), or an MLP-only layer.
        why = (
            " ('dummy': layers that cache nothing of their own, such as KV-sharing layers that read another layer's "
            "K/V, or MLP-only layers)"
            if "dummy" in unsupported
            else ""
        )
        raise UnsupportedModel(
            model_type,
            f"PagedCache supports layer types {list(SUPPORTED_LAYER_TYPES)} (and the linear-attention, conv, hybrid "
            f"and MLP-only layers of hybrid models); this model has {unsupported}{why}",
            "PagedCache",
        )
    if not kv_layer_indices(layer_types, SUPPORTED_LAYER_TYPES):
        raise UnsupportedModel(
            model_type,
            f"none of its layers holds attention K/V (layer types {sorted(set(layer_types))}): its cache is "
            "recurrent or convolution states only, nothing a paged pool holds; use DynamicCache",
            "PagedCache",
        )
    kv_lora_rank = _global_attr(config, "kv_lora_rank")
    if kv_lora_rank:
        raise UnsupportedModel(
            model_type,
            f"multi-head latent attention ({kv_lora_rank = }) caches K and V of different widths, not kv heads x "
            "head_dim; the pool stores K and V of one shape per layer",
            "PagedCache",
        )


# Models whose sliding layers cache a multiple of the config's kv heads (their modeling code says so, not the config).
SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}


def _kv_shape(config, layer_type: str) -> tuple[int, int]:
    """(kv heads, head_dim) of the K/V one layer (of type `layer_type`) of this config caches."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    model_type = getattr(config, "model_type", None)
    if layer_type in SLIDING_LAYER_TYPES:
        num_kv_heads *= SLIDING_KV_HEADS_FACTOR.get(model_type, 1)
        # Sliding layers with shapes of their own (Inkling's "hybrid_sliding" layers)
        num_kv_heads = getattr(config, "swa_num_key_value_heads", None) or num_kv_heads
        head_dim = getattr(config, "swa_head_dim", None) or head_dim
    if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        num_kv_heads = num_heads  # Falcon's new decoder architecture caches K/V expanded to every query head
    elif getattr(config, "multi_query", False):
        num_kv_heads = 1  # multi-query attention (Falcon, GPTBigCode): one kv head whatever the kv-head count says
    return num_kv_heads, head_dim


def _global_attr(config, name: str, per_layer: bool = False):
    """`config.<name>`, or None where the config lacks it. Where it is a per-layer attribute of a heterogeneous
    config: layer 0's value with `per_layer`, else None."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError: a per-layer attribute
        return getattr(config.per_layer_config[0], name, None) if per_layer else None


def _windows(layer_types: list[str], layer_kwargs: list[dict]) -> list[int | None]:
    return [
        kwargs["sliding_window"] if layer_type in SLIDING_LAYER_TYPES else None
        for layer_type, kwargs in zip(layer_types, layer_kwargs)
    ]
