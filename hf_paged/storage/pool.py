"""BlockPool: the K/V storage of every layer of one model, carved into fixed-size blocks, plus its allocator.

Layout per layer (head-major, like FlashInfer's HND pages with the head dimension hoisted out):

    key_cache[layer_idx]:   [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache[layer_idx]: [num_value_heads, num_blocks, block_size, value_head_dim]

K and V of a layer may differ in heads and head_dim (the layout's `key_shape` / `value_shape`): multi-head latent
attention caches a `kv_lora_rank` latent as K and a `qk_rope_head_dim` rotary key as V.

Token `pos` of a sequence with block table `table` lives at slot `table[pos // block_size] * block_size +
pos % block_size` of the flattened `[num_kv_heads, num_blocks * block_size, head_dim]` view.

Why head-major: gathering one row's blocks with `index_select(dim=1)` lands directly in the `[kv_heads, seq, dim]`
layout that attention wants, in one block-granular copy. Gathering from a token-major pool needs a second,
transposing copy, and returning the transposed view instead changes eager attention's matmul
results in the last bit. `nhd_view` gives kernels the `[num_blocks, block_size, num_kv_heads, head_dim]` view.

Layer groups (layer_groups.py): a block id names the same token range in every layer *of one layer group*, so a
sequence allocates one block per `block_size` tokens per group, not one per layer, and block tables and slot
mappings are built once per step per group. A uniform model (all full, or all sliding) is one group, and then
`key_cache[l]` is layer l's own tensor. A model that mixes attention types has several groups of `num_slots` layers;
`key_cache[l]` is then the storage tensor of layer l's slot, shared (aliased) with the layers of other groups at
that slot, and a block is `num_slots` layers' worth of bytes.
"""

from __future__ import annotations

import math
import os
import re
import weakref

import torch

from ..errors import PoolMismatch, PoolTooLarge
from .allocator import BlockAllocator
from .layer_groups import LayerGroups, group_of_layer, slot_of_layer
from .layout import KVLayout, block_bytes
from .sharding import agree_num_blocks, tp_process_group

# K, M, G, T are powers of 1000 and Ki, Mi, Gi, Ti powers of 1024, as in Kubernetes and vLLM; a trailing B is optional.
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:e\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_memory(max_memory: int | float | str) -> int:
    """`536870912`, `2e9`, `"512MiB"`, `"0.5GB"`, `"2G"` -> bytes (K/M/G/T: powers of 1000; Ki/Mi/Gi/Ti: of 1024)."""
    num_bytes = 0
    if isinstance(max_memory, (int, float)) and not isinstance(max_memory, bool) and math.isfinite(max_memory):
        num_bytes = int(max_memory)
    elif isinstance(max_memory, str) and (match := _SIZE.fullmatch(max_memory)):
        num_bytes = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if num_bytes <= 0:
        raise ValueError(
            "max_memory must be a positive byte count (an int, or a float such as 2e9) or a size string such as "
            f"'512MiB', '2GB' or '2G' (units K/M/G/T = 1000^n, Ki/Mi/Gi/Ti = 1024^n), got {max_memory!r}"
        )
    return num_bytes


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch floating dtype, or its name ("bfloat16", "torch.float16"), as a `torch.dtype`; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch.dtype or its name ('float32', 'float16', 'bfloat16'), got {dtype!r}"
        )
    return resolved


def device_capacity(device: torch.device) -> int | None:
    """Bytes a pool on `device` can take at most: free memory of a CUDA device, physical memory of the host for
    the CPU; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class BlockPool:
    """Paged K/V storage shared by any number of `PagedCache` objects of one model.

    Args:
        layout (`KVLayout`): per-layer kv heads and head_dim; `BlockPool.for_model` reads it from a config.
        num_blocks (`int`, *optional*): how many blocks. Exactly one of `num_blocks` and `max_memory` is needed.
        max_memory (`int` or `str`, *optional*): a byte budget for K and V of all layers ("512MiB", "2GB", 10**9);
            the pool takes as many whole blocks as fit. Under tensor parallelism (`layout.tp_size` > 1) it is the
            budget of each rank, and the ranks take the smallest block count any of them fits (a collective: every
            rank of `process_group` builds its pool together), so a block id means the same tokens on every rank.
        block_size (`int`, defaults to 16): tokens per block.
        dtype (`torch.dtype`, defaults to `torch.float32`): storage dtype; must match the model's K/V dtype.
        device (`torch.device` or `str`, or one per layer, defaults to `"cpu"`): one per layer places each layer's
            storage on its own device (a model split over devices with `device_map="auto"`; `BlockPool.for_model`
            reads them from the model). Layers of other groups share a slot's tensor only on one device: when a
            slot's layers are on different devices, the pool keeps one group of every layer.
        growable (`bool`, defaults to `False`): let `grow` enlarge the pool; used by a `PagedCache`'s private pool.
        enable_prefix_caching (`bool`, defaults to `False`): remember full blocks by a hash chain over their token
            ids (`PagedCache.release(token_ids=...)`) so `PagedCache.from_prefix` can reuse them. A pool with prefix
            caching belongs to one model: two models with the same shapes would read each other's K/V. Each layer
            group caches its own blocks (see `BlockAllocator.peek_longest_prefix` for what a hit needs).
        group_layers (`bool`, defaults to `True`): split layers of different attention types into layer groups
            (`layout.layer_groups()`), so sliding-window layers can give back blocks that left their window. False
            forces one group of every layer (then nothing is released unless every layer slides).
        process_group (*optional*): the tensor-parallel ranks that agree on the block count of a `max_memory`
            pool; `BlockPool.for_model` takes the model's, and the default group is used otherwise.

    Attributes: `layer_groups` (tuple of layer-index tuples), `num_groups`, `num_slots` (layers per group, the
    storage tensors per K and V), `key_cache` / `value_cache` (one tensor per layer; aliased across groups).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        growable: bool = False,
        enable_prefix_caching: bool = False,
        group_layers: bool = True,
        process_group=None,
    ):
        check_positive_int("block_size", block_size)
        if (num_blocks is None) == (max_memory is None):
            raise ValueError(
                f"give exactly one of num_blocks and max_memory, got num_blocks={num_blocks!r}, "
                f"max_memory={max_memory!r}"
            )
        self.layout = layout
        self.block_size = block_size
        self.dtype = resolve_dtype(dtype) or torch.float32
        # Per layer: where its storage lives. `device` is layer 0's: where step metadata (block tables) is built.
        self.devices = _layer_devices(device, layout.num_layers)
        self.device = self.devices[0]
        self.growable = growable
        self.layer_groups: LayerGroups = layout.layer_groups() if group_layers else (tuple(range(layout.num_layers)),)
        if not _slots_share_devices(self.layer_groups, self.devices):
            self.layer_groups = (tuple(range(layout.num_layers)),)
        self.group_of_layer = group_of_layer(self.layer_groups)
        self.slot_of_layer = slot_of_layer(self.layer_groups)
        self.num_slots = max(len(group) for group in self.layer_groups)
        # slot -> (K heads, K head_dim, V heads, V head_dim) of the layers using it; derive_layer_groups guarantees
        # they agree.
        full_group = next(group for group in self.layer_groups if len(group) == self.num_slots)
        self._slot_shapes = [layout.shapes()[i] for i in full_group]
        self._slot_devices = [self.devices[i] for i in full_group]
        self.bytes_per_block = block_bytes(self._slot_shapes, block_size, self.dtype)
        if max_memory is not None:
            budget = parse_memory(max_memory)
            num_blocks = budget // self.bytes_per_block
            if layout.tp_size > 1:
                num_blocks = agree_num_blocks(num_blocks, process_group)
            if num_blocks == 0:
                raise ValueError(
                    f"max_memory={max_memory!r} ({budget} bytes) holds no block of {self.bytes_per_block} bytes"
                )
        check_positive_int("num_blocks", num_blocks)
        self._check_fits(num_blocks)
        self.allocator = BlockAllocator(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self._model_ref: weakref.ref | None = None  # the model this pool serves, once known (see `serve_model`)
        self._model_name: str | None = None  # its checkpoint path or hub name, once known
        self._architecture: dict | None = None  # its config's `_architecture`, once known
        # NOTE: `num_slots` tensors per K and V; the per-layer lists alias them (one entry per layer, so callers
        # index by layer). grow() replaces the tensors and refreshes the lists in place.
        self._key_slots = [self._new_storage(num_blocks, slot) for slot in range(self.num_slots)]
        self._value_slots = [self._new_storage(num_blocks, slot, value=True) for slot in range(self.num_slots)]
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self._alias_layers()

    @classmethod
    def for_model(
        cls,
        model_or_config,
        *,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        enable_prefix_caching: bool = False,
        group_layers: bool = True,
        tp_size: int | None = None,
    ) -> BlockPool:
        """Build a pool shaped for a model (or its config). dtype and device follow the model unless given; a model
        that mixes attention types gets layer groups unless `group_layers=False` (see `BlockPool`).

        A model split over devices (`from_pretrained(..., device_map="auto")`) gets each layer's storage on the
        device its attention runs on (`attention_devices`). A model loaded with a tensor-parallel plan gets this
        rank's kv heads (`KVLayout.from_config`) and, with `max_memory`, the block count its ranks agree on (every
        rank must call this). A config alone takes `tp_size`: the ranks its K/V heads are split over (default 1)."""
        layout = KVLayout.from_config(model_or_config, tp_size=tp_size)
        process_group = None
        if isinstance(model_or_config, torch.nn.Module):
            process_group = tp_process_group(model_or_config)
            dtype = dtype if dtype is not None else model_or_config.dtype
            if device is None:
                devices = attention_devices(model_or_config)
                device = devices if devices and len(devices) == layout.num_layers else model_or_config.device
        elif dtype is None:
            config_dtype = getattr(model_or_config, "dtype", None)
            dtype = config_dtype if isinstance(config_dtype, torch.dtype) else None
        pool = cls(
            layout,
            num_blocks=num_blocks,
            max_memory=max_memory,
            block_size=block_size,
            dtype=dtype,
            device=device,
            enable_prefix_caching=enable_prefix_caching,
            group_layers=group_layers,
            process_group=process_group,
        )
        pool.serve_model(model_or_config)
        return pool

    def serve_model(self, model_or_config) -> None:
        """Record the model this pool serves (the model object when given, and its checkpoint's name), or raise
        `PoolMismatch` for another one while prefix caching is on.

        NOTE: cached blocks are found by token ids alone, so a second model of the same shapes on a prefix-caching
        pool would read the first one's K/V. Two models count as different when both objects are known and differ,
        when both have a checkpoint name (`config.name_or_path`) and the names differ, or when their configs differ
        in architecture (`_architecture`: model type, sizes, vocabulary; how a config without a name, given alone,
        is told from the model served); two configs of one checkpoint are one model. Two nameless configs of the
        same architecture with other weights cannot be told apart."""
        model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "name_or_path", None) or None
        architecture = _architecture(config)
        known = self._model_ref() if self._model_ref is not None else None
        if self.allocator.enable_prefix_caching:
            other_model = model is not None and known is not None and known is not model
            other_name = name is not None and self._model_name is not None and name != self._model_name
            other_architecture = self._architecture is not None and architecture != self._architecture
            if other_model or other_name or other_architecture:
                served = self._model_name or (type(known).__name__ if known is not None else "another model")
                asked = name or (type(model).__name__ if model is not None else "a config")
                differs = (
                    f" (its config: {_differences(self._architecture, architecture)})"
                    if other_architecture and not (other_model or other_name)
                    else ""
                )
                raise PoolMismatch(
                    f"this pool caches prefixes of {served}, not of {asked}{differs}: a prefix-caching pool serves "
                    "one model (the cached K/V are found by token ids alone); give each model its own BlockPool"
                )
        if model is not None and known is None:
            self._model_ref = weakref.ref(model)
        if name is not None and self._model_name is None:
            self._model_name = name
        if self._architecture is None:
            self._architecture = architecture

    def _check_fits(self, num_blocks: int) -> None:
        """Raise `PoolTooLarge` before allocating storage a device cannot hold."""
        for device in dict.fromkeys(self._slot_devices):
            shapes = [shape for shape, on in zip(self._slot_shapes, self._slot_devices) if on == device]
            bytes_per_block = block_bytes(shapes, self.block_size, self.dtype)
            capacity = device_capacity(device)
            if capacity is not None and num_blocks * bytes_per_block > capacity:
                raise PoolTooLarge(num_blocks, bytes_per_block, capacity, str(device))

    def _new_storage(self, num_blocks: int, slot: int, value: bool = False) -> torch.Tensor:
        num_kv_heads, head_dim = self._slot_shapes[slot][2:] if value else self._slot_shapes[slot][:2]
        shape = (num_kv_heads, num_blocks, self.block_size, head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self._slot_devices[slot])

    def _alias_layers(self) -> None:
        """Point every layer's entry of `key_cache` / `value_cache` at its slot's tensor (in place)."""
        self.key_cache[:] = [self._key_slots[slot] for slot in self.slot_of_layer]
        self.value_cache[:] = [self._value_slots[slot] for slot in self.slot_of_layer]

    # ----------------------------------------------------------------- groups
    @property
    def is_multi_device(self) -> bool:
        """Whether layers' storage lives on more than one device (a model split with `device_map`)."""
        return len(set(self.devices)) > 1

    @property
    def num_groups(self) -> int:
        """Layer groups; each needs its own block table per sequence (1 for a uniform model)."""
        return len(self.layer_groups)

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    def stats(self) -> dict[str, int]:
        """Used/free blocks and bytes, for logs and leak checks; prefix-cache counts in blocks (over all layer
        groups)."""
        used, free = self.num_used_blocks, self.num_free_blocks
        allocator = self.allocator
        return {
            "cached_blocks": allocator.num_cached_blocks,
            "prefix_cache_queries": allocator.num_prefix_queries,
            "prefix_cache_hits": allocator.num_prefix_hits,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "num_groups": self.num_groups,
            "used_blocks": used,
            "free_blocks": free,
            "used_bytes": used * self.bytes_per_block,
            "free_bytes": free * self.bytes_per_block,
            "total_bytes": self.num_blocks * self.bytes_per_block,
        }

    # ---------------------------------------------------------------- storage
    def check_compatible(self, layout: KVLayout) -> None:
        """Raise `PoolMismatch` unless this pool stores K/V of the given shape (layer types may differ: see
        `KVLayout`; the pool's layer groups serve any model of its shapes). A layout read from a config alone (every
        head) fits a tensor-parallel pool that holds one rank's share of those heads."""
        if layout.tp_size == 1 and self.layout.tp_size > 1 and _shards_evenly(layout, self.layout.tp_size):
            layout = layout.shard(self.layout.tp_size)
        if layout != self.layout:
            hint = ""
            if layout.tp_size > 1 and self.layout.tp_size == 1:
                hint = (
                    f" (one rank's share: the model runs tensor parallel over {layout.tp_size} ranks); build the pool "
                    "from the model, BlockPool.for_model(model), or pass tp_size"
                )
            raise PoolMismatch(f"pool was built for {self.layout.describe()}; the model has {layout.describe()}{hint}")

    def check_states(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Raise `PoolMismatch` unless `key_states` ([B, kv_heads, q_len, head_dim]) and `value_states` ([B,
        value_heads, q_len, value_head_dim]; not checked when None) fit this pool's layer."""
        if layer_idx >= self.layout.num_layers:
            raise PoolMismatch(
                f"layer_idx {layer_idx} out of range: pool was built for {self.layout.num_layers} layers"
            )
        heads, dim = self.layout.key_shape(layer_idx)
        if key_states.shape[1] != heads or key_states.shape[-1] != dim:
            hint = ""
            if key_states.shape[1] < heads and heads % key_states.shape[1] == 0 and self.layout.tp_size == 1:
                hint = (
                    "; under tensor parallelism each rank holds a share of the kv heads: build the pool from the "
                    "model (BlockPool.for_model(model)), or pass tp_size (PagedCache(config, tp_size=N), "
                    "BlockPool.for_model(config, tp_size=N))"
                )
            raise PoolMismatch(
                f"layer {layer_idx}: pool holds {heads} kv heads x head_dim {dim}, key_states have "
                f"{key_states.shape[1]} x {key_states.shape[-1]} (shape {tuple(key_states.shape)}){hint}"
            )
        if value_states is not None and (
            value_states.dim() != 4
            or key_states.dim() != 4
            or (value_states.shape[1], value_states.shape[-1]) != self.layout.value_shape(layer_idx)
            or value_states.shape[0] != key_states.shape[0]
            or value_states.shape[2] != key_states.shape[2]
        ):
            value_heads, value_dim = self.layout.value_shape(layer_idx)
            raise PoolMismatch(
                f"layer {layer_idx}: pool holds K of {heads} kv heads x head_dim {dim} and V of {value_heads} x "
                f"{value_dim}, the model gave key_states of shape {tuple(key_states.shape)} and value_states of shape "
                f"{tuple(value_states.shape)} ([B, heads, q_len, head_dim] each, same B and q_len)"
            )
        device = self.devices[layer_idx]
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if states is None or (states.dtype == self.dtype and states.device == device):
                continue
            where = f"layer {layer_idx} on {device}" if self.is_multi_device else str(device)
            raise PoolMismatch(
                f"pool stores {self.dtype} on {where}, {name} are {states.dtype} on "
                f"{states.device}; build the pool with dtype/device of the model (BlockPool.for_model(model), "
                "which also places each layer of a model split over devices with device_map on its own device)"
            )

    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy whole blocks (every slot, K and V; so every layer of the group that owns them): the data half of
        copy-on-write."""
        if not src_block_ids:
            return
        for cache in (*self._key_slots, *self._value_slots):
            src = torch.tensor(src_block_ids, device=cache.device)
            dst = torch.tensor(dst_block_ids, device=cache.device)
            cache.index_copy_(1, dst, cache.index_select(1, src))

    @staticmethod
    def nhd_view(cache: torch.Tensor) -> torch.Tensor:
        """[num_kv_heads, num_blocks, block_size, head_dim] -> [num_blocks, block_size, num_kv_heads, head_dim] view
        (of a K or a V tensor)."""
        return cache.permute(1, 2, 0, 3)

    def nhd_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`nhd_view` of layer `layer_idx`'s K and V, made once per layer (and again when a growable pool grew): the
        views the kernels read, asked for at every layer of every step."""
        key_cache, value_cache = self.key_cache[layer_idx], self.value_cache[layer_idx]
        memo = self.__dict__.setdefault("_nhd_views", {})
        views = memo.get(layer_idx)
        if views is None or views[0] is not key_cache or views[1] is not value_cache:
            views = memo[layer_idx] = (key_cache, value_cache, self.nhd_view(key_cache), self.nhd_view(value_cache))
        return views[2], views[3]

    def layer_memo(self, layer_idx: int) -> dict:
        """A dict for what callers derive from layer `layer_idx`'s K and V tensors and keep between steps (their
        views, a kernel's launch into them), dropped with `nhd_views`' when a growable pool replaces the tensors:
        nothing kept there holds the old tensors alive through a `grow`."""
        return self.__dict__.setdefault("_layer_memos", {}).setdefault(layer_idx, {})

    def grow(self, num_new_blocks: int) -> None:
        """Enlarge a growable pool by `num_new_blocks` (new ids follow the old ones; old data stays where it is)."""
        if not self.growable:
            raise RuntimeError("this BlockPool is not growable; give it more num_blocks or max_memory")
        self._check_fits(self.num_blocks + num_new_blocks)
        self.__dict__.pop("_nhd_views", None)  # views of the tensors about to be replaced: not kept alive
        self.__dict__.pop("_layer_memos", None)
        for slots, value in ((self._key_slots, False), (self._value_slots, True)):
            for slot, cache in enumerate(slots):
                slots[slot] = torch.cat([cache, self._new_storage(num_new_blocks, slot, value)], dim=1)
        self._alias_layers()
        self.allocator.grow(num_new_blocks)

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, layers={self.layout.num_layers}, "
            f"groups={self.num_groups}, dtype={self.dtype}, device={_describe(self.devices)}, "
            f"free={self.num_free_blocks})"
        )


def _shards_evenly(layout: KVLayout, tp_size: int) -> bool:
    return all(heads % tp_size == 0 for heads in layout.num_kv_heads + layout.num_value_heads)


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: name it, as tensors do,
        device = torch.device("cuda", torch.cuda.current_device())  # so device checks match
    return device


def _layer_devices(device, num_layers: int) -> tuple[torch.device, ...]:
    if isinstance(device, (list, tuple)):
        if len(device) != num_layers:
            raise ValueError(f"device needs one entry per layer ({num_layers}) when given as a list, got {len(device)}")
        return tuple(_device(d) for d in device)
    return (_device(device),) * num_layers


def _slots_share_devices(groups: LayerGroups, devices: tuple[torch.device, ...]) -> bool:
    """Whether the layers at each slot position of `groups` (which alias one tensor) are on one device."""
    num_slots = max(len(group) for group in groups)
    return all(len({devices[group[slot]] for group in groups if slot < len(group)}) == 1 for slot in range(num_slots))


def _describe(devices: tuple[torch.device, ...]) -> str:
    distinct = list(dict.fromkeys(str(device) for device in devices))
    return distinct[0] if len(distinct) == 1 else f"[{', '.join(str(device) for device in devices)}]"


def attention_devices(model: torch.nn.Module) -> list[torch.device] | None:
    """Per layer: the device its attention (the module of that `layer_idx`, `layer.self_attn`) runs on; None when
    no attention module names every layer. That is the execution device of the nearest accelerate hook above or on
    it when `device_map` dispatched the model (an offloaded layer runs on another device than its weights' home),
    else the device of its parameters: where its `key_states` are."""
    hooked: dict[str, torch.device] = {}  # module name -> execution device of its accelerate hook
    devices: dict[int, torch.device] = {}
    for name, module in model.named_modules():
        execution_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if execution_device is not None:
            hooked[name] = _device(execution_device)
        layer_idx = getattr(module, "layer_idx", None)
        # The attention module itself: a decoder layer may carry its index too.
        if not isinstance(layer_idx, int) or layer_idx in devices or "Attention" not in type(module).__name__:
            continue
        owners = [owner for owner in hooked if owner == "" or name == owner or name.startswith(owner + ".")]
        if owners:
            devices[layer_idx] = hooked[max(owners, key=len)]
            continue
        parameter = next(module.parameters(), None)
        if parameter is not None and parameter.device.type != "meta":
            devices[layer_idx] = parameter.device
    if not devices or sorted(devices) != list(range(len(devices))):
        return None
    return [devices[layer_idx] for layer_idx in range(len(devices))]


# The config fields that tell two models' architectures apart (where a config names them).
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def _architecture(config) -> dict:
    """A model's architecture as its (text) config names it: `ARCHITECTURE_FIELDS` that it has."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    architecture = {}
    for field in ARCHITECTURE_FIELDS:
        try:
            architecture[field] = getattr(config, field)
        except Exception:  # not named, or per layer: a heterogeneous config raises its own error
            continue
    return architecture


def _differences(served: dict, asked: dict) -> str:
    fields = [field for field in ARCHITECTURE_FIELDS if served.get(field) != asked.get(field)]
    return ", ".join(f"{field} {asked.get(field)!r}, the model served {served.get(field)!r}" for field in fields)
