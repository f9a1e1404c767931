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
from .kv_layers import holds_state, kv_layer_indices, mlp_only_layers, paged_layer_type
from .layer_groups import LayerGroups, derive_layer_groups
from .sharding import kv_shard_factors, model_tp_size

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
# DeepSeek Sparse Attention: full attention over the K/V that an indexer's top-k choice masks; the indexer keeps keys
# of its own (`PagedCache.update_indexer`, beside the paged K/V).
INDEXED_LAYER_TYPES = ("indexed_attention",)
# A layer that caches nothing of its own: a KV-sharing layer (Gemma 3n, Gemma 4 with `num_kv_shared_layers`: it
# attends the K/V its source layer's `update` returned) or an MLP-only layer. It keeps a place in the layout (so
# layer indices stay the model's) but forms layer groups of its own that never take a block.
NO_CACHE_LAYER_TYPES = ("dummy",)
SUPPORTED_LAYER_TYPES = ("full_attention", *SLIDING_LAYER_TYPES, *INDEXED_LAYER_TYPES, *NO_CACHE_LAYER_TYPES)


@dataclass(frozen=True)
class KVLayout:
    """Per-layer K/V shapes of one model: what a pool must hold for it.

    `layer_types` (one transformers layer type per layer, such as "full_attention" or "sliding_attention"; all
    "full_attention" when not given) decides how a pool groups layers (`layer_groups`). `windows` (per layer: its
    sliding window, None for full attention; all None when not given) lets a cache built from the pool alone give
    back blocks that left a window, as a cache built from the config does.

    K and V of a layer may differ in shape: `num_kv_heads` / `head_dims` are K's, `num_value_heads` /
    `value_head_dims` V's (default: K's). Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, ...)
    caches two latents, `[B, 1, S, kv_lora_rank]` as K and `[B, 1, S, qk_rope_head_dim]` as V, and expands them to
    every head after `cache.update()`: `latent` says so (a cache then returns the stored K/V themselves, never a
    decode plan, since the model computes on what it gets back).

    Under tensor parallelism (`tp_size` > 1 ranks run the model in lockstep; see sharding.py) `num_kv_heads` are
    one rank's heads: `from_config(model)` reads them from the model's sharding.

    `kv_layers` (per layer: the decoder layer it stores; `range(num_layers)` when not given) is what a hybrid model
    needs: only its layers holding K/V are layers of the layout (see kv_layers.py).

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
    num_value_heads: tuple[int, ...] | None = None
    value_head_dims: tuple[int, ...] | None = None
    latent: bool = field(default=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "num_kv_heads", tuple(self.num_kv_heads))
        object.__setattr__(self, "head_dims", tuple(self.head_dims))
        if len(self.num_kv_heads) != len(self.head_dims) or not self.num_kv_heads:
            raise ValueError(f"num_kv_heads and head_dims need one entry per layer, got {self} ")
        for name, keys in (("num_value_heads", self.num_kv_heads), ("value_head_dims", self.head_dims)):
            values = keys if getattr(self, name) is None else tuple(getattr(self, name))
            if len(values) != len(keys):
                raise ValueError(f"{name} needs one entry per layer ({len(keys)}), got {len(values)}")
            object.__setattr__(self, name, values)
        if min(self.num_kv_heads + self.num_value_heads) <= 0 or min(self.head_dims + self.value_head_dims) <= 0:
            raise ValueError(f"kv heads and head dims must be positive, got {self}")
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

    def pool_layers(self, num_cache_layers: int) -> list[int | None]:
        """The one map from a model's cache layers (decoder layers, plus a looped model's per-loop copies:
        `cache_layers`) to pool layers: entry i is the pool layer of cache layer i, None for a layer without K/V (a
        hybrid model's state layers, MLP-only layers)."""
        pool_layers: list[int | None] = [None] * num_cache_layers
        for pool_layer, layer_idx in enumerate(self.kv_layers):
            pool_layers[layer_idx] = pool_layer
        return pool_layers

    def key_shape(self, layer_idx: int) -> tuple[int, int]:
        """(kv heads, head_dim) of the K layer `layer_idx` caches."""
        return self.num_kv_heads[layer_idx], self.head_dims[layer_idx]

    def value_shape(self, layer_idx: int) -> tuple[int, int]:
        """(kv heads, head_dim) of the V layer `layer_idx` caches."""
        return self.num_value_heads[layer_idx], self.value_head_dims[layer_idx]

    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Per layer: (K heads, K head_dim, V heads, V head_dim)."""
        return [(*self.key_shape(i), *self.value_shape(i)) for i in range(self.num_layers)]

    def describe(self) -> str:
        """The layer count and the distinct kv heads and head_dims (of V too where they differ), for errors."""
        text = (
            f"{self.num_layers} layers with kv heads {sorted(set(self.num_kv_heads))} and head_dim "
            f"{sorted(set(self.head_dims))}"
        )
        if self.num_value_heads != self.num_kv_heads or self.value_head_dims != self.head_dims:
            text += (
                f" (V: kv heads {sorted(set(self.num_value_heads))} and head_dim {sorted(set(self.value_head_dims))})"
            )
        return text

    def layer_groups(self) -> LayerGroups:
        """The layer groups a pool of this layout uses (see layer_groups.py): one group unless types mix."""
        return derive_layer_groups(self.layer_types, self.shapes())

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
        sources = cache_layers(config)[2]  # a looped layer's copies have its shapes
        shapes = [
            _kv_shape(config if layer_configs is None else layer_configs[sources[i]], layer_type)
            for i, layer_type in zip(kv_layers, layer_types)
        ]
        windows = _windows(layer_types, layer_kwargs)
        num_kv_heads, head_dims, num_value_heads, value_head_dims = zip(*shapes)
        layout = cls(
            num_kv_heads,
            head_dims,
            tuple(layer_types),
            tuple(windows),
            num_value_heads=num_value_heads,
            value_head_dims=value_head_dims,
            kv_layers=kv_layers,
            latent=any(_global_attr(c, "kv_lora_rank") for c in (layer_configs or [config])),
        )
        if model is not None:
            return layout.shard(kv_shard_factors(model, layout.num_kv_heads), model_tp_size(model))
        return layout if tp_size is None else layout.shard(tp_size)

    def shard(self, factors: int | tuple[int, ...], tp_size: int | None = None) -> KVLayout:
        """One rank's layout when each layer's kv heads are split over `factors` ranks (an int: every layer alike;
        a layer whose heads the plan replicates has factor 1) out of `tp_size` (defaults to the largest factor).
        A latent layout keeps its whole latents on every rank. Raises `ValueError` when a layer's heads do not split
        evenly."""
        if isinstance(factors, int) and not isinstance(factors, bool):
            tp_size = factors if tp_size is None else tp_size
            factors = (factors,) * self.num_layers
        if len(factors) != self.num_layers or any(isinstance(f, bool) or not isinstance(f, int) for f in factors):
            raise ValueError(f"need one int factor per layer ({self.num_layers}), got {factors!r}")
        if self.latent:  # every rank computes (and caches) the whole latent: multi-head latent attention shards heads
            factors = (1,) * self.num_layers  # only after expanding it
        uneven = [
            (i, h, f)
            for i, (k, v, f) in enumerate(zip(self.num_kv_heads, self.num_value_heads, factors))
            for h in dict.fromkeys((k, v))
            if f <= 0 or h % f
        ]
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
            num_value_heads=tuple(h // f for h, f in zip(self.num_value_heads, factors)),
            value_head_dims=self.value_head_dims,
            kv_layers=self.kv_layers,
            latent=self.latent,
        )

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of `block_size` tokens in *every* layer (a one-group pool's block; also what
        DynamicCache pays per `block_size` tokens of a full-attention model)."""
        return block_bytes(self.shapes(), block_size, dtype)


def block_bytes(shapes, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of `block_size` tokens of K and V in layers of `shapes` ((K heads, K head_dim, V heads, V head_dim)
    each)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return block_size * itemsize * sum(kh * kd + vh * vd for kh, kd, vh, vd in shapes)


def sliding_windows(config) -> list[int | None]:
    """Per layer holding K/V (every layer but the state-only and MLP-only layers of a hybrid model, see kv_layers.py):
    its sliding window (an int) or None for full attention. Raises `UnsupportedModel` for a model PagedCache cannot
    store (see `refuse_unsupported`)."""
    refuse_unsupported(config)
    _, layer_types, layer_kwargs = _kv_layers(config)
    return _windows(layer_types, layer_kwargs)


def cache_layers(config) -> tuple[list[str], list[dict], list[int]]:
    """The cache layers a model writes: transformers' `get_layer_types_and_kwargs` per decoder layer, then, for a
    model that loops its middle layers with a cache per loop (Dory, `recurrent_kv_cache_mode="per_loop"`), a copy of
    the looped layers per loop after the first, where the model appends them; and each cache layer's decoder layer.
    A cache that has all of them from the start is one the model does not extend."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    sources = list(range(len(layer_types)))
    loops = getattr(config, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1 and getattr(config, "recurrent_kv_cache_mode", None) == "per_loop":
        start = config.n_input_layers
        looped = list(range(start, start + config.n_recurrent_layers))
        for _ in range(loops - 1):
            layer_types += [layer_types[i] for i in looped]
            layer_kwargs += [layer_kwargs[i] for i in looped]
            sources += looped
    return layer_types, layer_kwargs, sources


def _kv_layers(config) -> tuple[tuple[int, ...], list[str], list[dict]]:
    """The cache layers holding K/V (see kv_layers.py and `cache_layers`) and their `get_layer_types_and_kwargs`, a
    hybrid layer typed as its attention part."""
    layer_types, layer_kwargs, _ = cache_layers(config)
    # A KV-sharing layer that keeps only indexer keys of its own (Mistral-Large-4's "reuse_but_indexer", which
    # transformers types "indexed_attention") stores no K/V: a "dummy" layer here, its indexer keys beside the pool.
    modes = getattr(config, "kv_sharing_modes", None) or ()
    layer_types = [
        "dummy" if mode == "reuse_but_indexer" else t
        for t, mode in zip(layer_types, [*modes, *[None] * len(layer_types)])
    ]
    mlp_only = mlp_only_layers(config)  # "dummy" layers that cache nothing; KV-sharing "dummy" layers stay
    kv_layers = tuple(i for i in kv_layer_indices(layer_types, SUPPORTED_LAYER_TYPES) if i not in mlp_only)
    return kv_layers, [paged_layer_type(layer_types[i]) for i in kv_layers], [layer_kwargs[i] for i in kv_layers]


def block_windows(config) -> list[int | None]:
    """`sliding_windows`, except that a layer caching nothing of its own ("dummy": KV sharing, MLP only) gets a
    window of 1: a block holder such as the Engine's scheduler then keeps only the blocks of a step's new tokens in
    the layer groups of such layers (they are never written), not the whole context."""
    windows = sliding_windows(config)
    _, layer_types, _ = _kv_layers(config)
    return [1 if t in NO_CACHE_LAYER_TYPES else w for t, w in zip(layer_types, windows)]


# Models whose forward uses a cache other than through `Cache.update`, by model type.
NO_PAGED_CACHE = {
    "xlnet": "it keeps its own memory (mems) and never stores K/V in a transformers Cache",
    "reformer": "its LSH and local attention keep their own buckets and states, never K/V in a transformers Cache",
    "minimax": "it keeps its lightning-attention states in a cache of its own (MiniMaxCache) and refuses any other",
    "openai-gpt": "its forward takes no cache: every step computes the whole sequence again",
    **dict.fromkeys(
        ("mllama", "mllama_text_model"),
        "its cross-attention layers read cache.layers[i].keys, which a paged layer does not have",
    ),
}


# Models whose `generate()` fills any cache passed to it wrong, by model type: refused by `PagedCache` (the Engine
# runs their forward itself and is not concerned).
NO_GENERATE_CACHE = {
    "mpt": (
        "its generate() feeds every token again at each step, also with a cache passed in, so a cache given to it "
        "holds each token several times; it generates right only with no cache passed (its default)"
    ),
}


def refuse_generate_cache(config) -> None:
    """Raise `UnsupportedModel` for a (decoder text) config whose `generate()` would fill a `PagedCache` wrong."""
    model_type = getattr(config, "model_type", None)
    if model_type in NO_GENERATE_CACHE:
        raise UnsupportedModel(model_type, NO_GENERATE_CACHE[model_type], "PagedCache")


def refuse_unsupported(config) -> None:
    """Raise `UnsupportedModel`, naming the model type and the reason, for a (decoder text) config whose K/V a
    PagedCache would store or return wrong: encoder-decoder models, layer types other than full / sliding / chunked /
    indexed attention, KV sharing and the state and MLP-only layers of hybrid models (see kv_layers.py), and a model
    with no attention layer."""
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
        raise UnsupportedModel(
            model_type,
            f"PagedCache supports layer types {list(SUPPORTED_LAYER_TYPES)} (and the linear-attention, conv, hybrid "
            f"and MLP-only layers of hybrid models); this model has {unsupported}",
            "PagedCache",
        )
    if not kv_layer_indices(layer_types, SUPPORTED_LAYER_TYPES):
        raise UnsupportedModel(
            model_type,
            f"none of its layers holds attention K/V (layer types {sorted(set(layer_types))}): its cache is "
            "recurrent or convolution states only, nothing a paged pool holds; use DynamicCache",
            "PagedCache",
        )


# Models whose sliding layers cache a multiple of the config's kv heads (their modeling code says so, not the config).
SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}


def _kv_shape(config, layer_type: str) -> tuple[int, int, int, int]:
    """(K heads, K head_dim, V heads, V head_dim) of what one layer (of type `layer_type`) of this config caches.

    Multi-head latent attention (a `kv_lora_rank`) caches its compressed latent `[B, 1, S, kv_lora_rank]` as K and
    the shared rotary key `[B, 1, S, qk_rope_head_dim]` as V (transformers' DeepSeek-V2/V3 family); a `v_head_dim`
    alone (MiMo-V2-Flash) gives V its own head_dim."""
    kv_lora_rank = _global_attr(config, "kv_lora_rank")
    if kv_lora_rank:
        return 1, kv_lora_rank, 1, config.qk_rope_head_dim
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
    value_head_dim = _global_attr(config, "v_head_dim") or head_dim
    return num_kv_heads, head_dim, num_kv_heads, value_head_dim


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
