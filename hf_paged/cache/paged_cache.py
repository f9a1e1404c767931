"""PagedCache: a `transformers.Cache` whose K/V live in a shared `BlockPool`.

`model.generate(..., past_key_values=PagedCache(config=model.config))` gives the same tokens as `DynamicCache`:
every layer's `update` returns exactly the K/V tensor a `DynamicLayer` (or `DynamicSlidingWindowLayer`) would,
gathered from the pool instead of kept contiguous. What changes is storage: blocks are allocated `block_size`
tokens at a time from a pool that many caches can share, rows that hold the same prefix share its blocks by
reference count, and beam search reorders block tables instead of copying K/V.

Layer groups (storage/layer_groups.py): the cache keeps one `BlockTables` per layer group of its pool, and layer
`l` uses its group's tables. A group whose layers all slide gives back the blocks that left the window at the start
of each step; a group with a full-attention layer keeps every block. Mistral (all sliding) is one sliding group;
Gemma2/3 get sliding groups and full groups, so a long generation holds about what DynamicCache holds.

Hybrid models (cache/hybrid.py): only the decoder layers holding K/V are pool layers; linear-attention, mamba and
conv layers keep their states in transformers' own cache layer classes, in `layers` next to the paged ones.

`PagedCache` is the `Cache` transformers calls; the work is done by collaborators, one job each:

    CacheRows      rows.py          what the cache keeps per row (block tables, lengths, hybrid states, indexer keys)
                                    and the row and length operations: beam reorder, select, repeat, crop, release,
                                    branches, prefix-cache hits
    UpdatePath     update_path.py   the eager update of a layer: write plans, the store (store.py) and what attention
                                    reads (visible.py: the visible K/V or placeholders carrying a plan)
    ReservedSteps  fixed_width.py   a compileable cache's steps (`max_cache_len`): reserved on the host, traced inside
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..errors import GradientsUnsupported, PoolMismatch, UnsupportedModel
from ..storage import BlockPool, KVLayout, group_windows, sliding_windows
from ..storage.layout import cache_layers, refuse_generate_cache
from ..storage.pool import check_positive_int, resolve_dtype
from .fixed_width import ReservedSteps, check_compileable
from .gather import workspace_for
from .group_tables import GroupTables
from .hybrid import HybridStates, decoder_layers
from .rows import CacheRows, check_prefix_caching, token_rows
from .update_path import UpdatePath


class PagedCache(Cache):
    """A paged KV cache for `generate()` and any model on the standard `Cache` API.

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config; gives the layer types (full / sliding window)
            and, for a private pool, the K/V shapes. Needed unless `pool` is given.
        pool (`BlockPool`, *optional*): a pool shared with other caches. Without one, the cache makes a private,
            growable pool on its first `update`, with the dtype and device of the first `key_states` (and layer
            groups from the config's layer types).
        block_size (`int`, defaults to 16): tokens per block of a private pool (a shared pool has its own).
        dtype (`torch.dtype`, *optional*), device (`torch.device`, *optional*): for a private pool; default to the
            model's (the first `key_states`).
        share_rows (`bool`, defaults to `True`): store identical rows (the expanded prompt of
            `num_return_sequences` / `num_beams`) once, shared by reference count.
        release_out_of_window (`bool`, defaults to `True`): in every layer group whose layers all slide, give back
            the blocks that fell out of the window, so a long generation holds about what DynamicCache does. A group
            with a full-attention layer keeps every block (a one-group pool of a Gemma-style model releases nothing).
        tp_size (`int`, *optional*): under tensor parallelism, the ranks the config's kv heads are split over; the
            cache then holds one rank's share. A private pool needs no `tp_size` inside an initialized process
            group: its first `key_states` show the rank's share (`PagedCache(config=model.config)` works as is under
            `torchrun` with `from_pretrained(path, tp_plan="auto")`); a shared pool has its own (`BlockPool.for_model`
            reads the model's sharding).
        max_cache_len (`int`, *optional*): make the cache compileable, as `StaticCache(max_cache_len=...)`: block
            tables of a fixed width, and every decode step's K/V `[B, kv_heads, max_cache_len, head_dim]` (the mask
            hides what is not written yet), so `generate()` compiles the decode forward (on CUDA by itself, with CUDA
            graphs; elsewhere with a `CompileConfig` for all devices). Blocks are still taken as the rows grow, before
            each forward (`reserve`, which `generate()` reaches through the mask sizes), and rows still share their
            prompt's blocks. Every block is kept (no release out of a sliding window); attention-only models on one
            device.

    Shapes: `update(key_states, value_states, layer_idx)` takes `[B, num_kv_heads, q_len, head_dim]` and returns
    `[B, num_kv_heads, kv_len, head_dim]`, exactly what `DynamicCache` returns (a sliding layer: its window): views of
    the pool or of a gather workspace, valid until the next `update` of a cache of that pool in that thread. Blocks
    go back on `release()`, on leaving a `with` block, or when the cache is garbage-collected. Hybrid models keep
    their recurrent and conv states in transformers' own layers beside the paged ones. docs/design.md#pagedcache has
    the detail: multi-head latent attention, KV sharing, indexer keys, threads.

    Example:

    ```python
    >>> pool = BlockPool.for_model(model, max_memory="256MiB")
    >>> with PagedCache(config=model.config, pool=pool) as cache:
    ...     out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    >>> pool.num_used_blocks
    0
    ```
    """

    def __init__(
        self,
        config=None,
        *,
        pool: BlockPool | None = None,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        share_rows: bool = True,
        release_out_of_window: bool = True,
        tp_size: int | None = None,
        max_cache_len: int | None = None,
    ):
        _check_arguments(config, pool, block_size, max_cache_len)
        layout, config, windows, layer_types, layer_kwargs = _model_layers(config, pool, tp_size)
        self.layout = layout
        self.model_type: str | None = getattr(config, "model_type", None)  # None for a cache built from a pool alone
        self._config = config
        self.block_size = pool.block_size if pool is not None else block_size
        self._dtype, self._device = resolve_dtype(dtype), device
        self.share_rows = share_rows
        self.release_out_of_window = release_out_of_window
        self.max_cache_len = max_cache_len
        # A private pool is built later from `layout`, with the same groups `layout.layer_groups()` gives now.
        self.layer_groups = pool.layer_groups if pool is not None else layout.layer_groups()
        self._tables = GroupTables(self.layer_groups, pool)
        # NOTE: `_blocks` is group 0's tables: the only ones of a uniform model (tests read its row groups).
        self._blocks = self._tables.groups[0]
        # NOTE: holds the tables (not `self`), so the finalizer can run once `self` is unreachable.
        self._finalizer = weakref.finalize(self, self._tables.release)
        # `layers`: one per decoder layer (what transformers indexes); `paged_layers`: one per pool layer, the
        # PagedLayers of the decoder layers holding K/V (all layers but a hybrid model's state and MLP-only ones).
        layers, paged_layers = decoder_layers(self, layer_types, layer_kwargs, layout.kv_layers, windows)
        self._pool_layers = layout.pool_layers(len(layers))  # decoder layer -> its pool layer (None: no K/V)
        super().__init__(layers=layers)
        states = HybridStates(layers, self.model_type)
        last_cached_layer, kv_sources = _kv_sharing(config, layout, self._pool_layers, len(paged_layers))
        self._fixed: ReservedSteps | None = None
        if max_cache_len is not None:
            check_compileable(self.model_type, layout, bool(states), kv_sources)
            self._fixed = ReservedSteps(
                max_cache_len,
                self.block_size,
                self._tables,
                paged_layers,
                self._pool_layers,
                last_cached_layer=last_cached_layer,
                config=config,
            )
        # Per group, the window of a group whose every layer slides and gives back blocks that left it (all of them for
        # Mistral), else None. A compileable cache keeps every block: a sliding layer sees its window through the mask.
        windows_of_groups = (
            group_windows(self.layer_groups, windows)
            if release_out_of_window and max_cache_len is None
            else [None] * len(self.layer_groups)
        )
        self._rows = CacheRows(self._tables, paged_layers, states, windows_of_groups, self._fixed)
        self._update = UpdatePath(
            self,
            self._rows,
            self._pool_layers,
            config,
            block_size=self.block_size,
            dtype=self._dtype,
            device=device,
            share_rows=share_rows,
            max_cache_len=max_cache_len,
            last_cached_layer=last_cached_layer,
            kv_sources=kv_sources,
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` ([B, kv_heads, q_len, head_dim]) after the cached tokens of layer
        `layer_idx` and return that layer's visible K/V ([B, kv_heads, kv_len, head_dim]). States that require grad
        are refused (`GradientsUnsupported`): the pool keeps no autograd history."""
        fixed = self._fixed
        if fixed is not None:
            if fixed.pending is not None or torch.compiler.is_compiling():
                if key_states.requires_grad or value_states.requires_grad:
                    # Nothing to undo: a reserved step writes fixed slots, and counts them after its last layer.
                    raise GradientsUnsupported(layer_idx)
                return fixed.update(key_states, value_states, layer_idx)
            fixed.settle()
        if key_states.requires_grad or value_states.requires_grad:
            self._update.refuse_step(layer_idx, GradientsUnsupported(layer_idx))
        return self._update.update(key_states, value_states, layer_idx)

    def reserve(self, num_new_tokens: int) -> None:
        """Take the blocks the next forward writes (`num_new_tokens` per row) and fill the step's buffers, on the host
        and before that forward: a compiled forward only reads buffers. `generate()` calls it through
        `get_mask_sizes`; a caller running a compiled forward of its own calls it before each one. Idempotent until
        that forward runs. Every row writes its own blocks from here on (a block rows shared is copied first)."""
        if self._fixed is None:
            raise ValueError("reserve() is for a compileable cache: PagedCache(config=..., max_cache_len=N)")
        self._fixed.reserve(num_new_tokens)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """As `Cache.get_mask_sizes`; a compileable cache with rows reserves the next forward's blocks here (outside
        a compiled region), and its steps then describe `max_cache_len` keys from position 0."""
        sizes = None if self._fixed is None else self._fixed.mask_sizes(query_length)
        return super().get_mask_sizes(query_length, layer_idx) if sizes is None else sizes

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append an "indexed_attention" layer's indexer keys ([B, q_len, index_head_dim]: DeepSeek Sparse Attention)
        and return all of them ([B, kv_len, index_head_dim]), as `DynamicIndexedLayer.update_indexer` does. They are
        kept beside the paged K/V (see indexer.py)."""
        if layer_idx >= len(self.layers):
            raise PoolMismatch(f"layer_idx {layer_idx}: this PagedCache was built for {len(self.layers)} layers")
        return self._rows.indexer.update(layer_idx, indexer_key_states)

    def get_indexer_position_ids(self, layer_idx: int) -> torch.Tensor | None:
        """The position ids decoder layer `layer_idx` keeps beside its indexer keys (Qwen4-Exp's QSA indexer:
        `[..., B, S]`), as `DynamicIndexedLayer.indexer_position_ids`; None before a forward set them."""
        return self._rows.indexer.positions.get(layer_idx)

    def set_indexer_position_ids(self, layer_idx: int, position_ids: torch.Tensor | None) -> None:
        """Replace decoder layer `layer_idx`'s indexer position ids (`[..., B, S]`: every cached token's); they then
        follow the rows (beams, repeats, selections) and lengths (crop, release) as the indexer keys do."""
        self._rows.indexer.set_positions(layer_idx, position_ids)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`. Permutes block tables (ref counts), never K/V; a hybrid
        model's states are index-selected on the batch dim, as DynamicCache does."""
        self._rows.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows.select(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as in `DynamicCache.crop`)."""
        self._rows.crop(tokens_to_remove)

    @classmethod
    def from_prefix(cls, pool: BlockPool, input_ids, config=None, **kwargs) -> PagedCache:
        """A cache already holding the longest cached prefix of `input_ids` ([S] or [1, S] token ids).

        At least one token is always left to compute (generate() re-feeds the whole prompt when the cache holds all
        of it), so at most `(S - 1) // block_size` blocks are reused. Needs `BlockPool(...,
        enable_prefix_caching=True)`; blocks get cached by `release(token_ids=...)`. With layer groups, each group
        caches its own blocks, and a sliding group that gave back blocks out of its window needs only those its
        window sees (`BlockAllocator.peek_longest_prefix`): a generation's release caches that group's last window
        (kept from the end of its last full block), enough to continue the conversation it ended from every full
        block. Blocks a sliding group gave back during the generation were not cached, so a shorter prefix of it
        usually finds nothing (and is computed in full).

        `model.generate(input_ids, past_key_values=PagedCache.from_prefix(pool, input_ids, model.config))` then
        computes only the rest of the prompt.
        """
        check_prefix_caching(pool, "from_prefix")
        if "indexed_attention" in pool.layout.layer_types:
            raise UnsupportedModel(
                getattr(config, "model_type", None),
                "its indexed-attention layers keep indexer keys beside the paged K/V, which the prefix cache does not "
                "hold",
                "PagedCache.from_prefix",
            )
        token_ids = token_rows(input_ids)
        if len(token_ids) != 1:
            raise ValueError(f"from_prefix takes one sequence ([S] or [1, S] token ids), got {len(token_ids)} rows")
        cache = cls(config, pool=pool, **kwargs)
        cache._rows.adopt_prefix(token_ids[0])
        return cache

    def release(self, token_ids=None, attention_mask=None) -> None:
        """Return every block to the pool. The cache is empty afterwards and can be filled again.

        Args:
            token_ids (`torch.Tensor` or list, *optional*): `[B, S]` (or `[S]` for one row): every token of each
                row, prompt and generated (what `generate()` returned). With prefix caching on, the full blocks
                they describe stay cached in the pool for `from_prefix`.
            attention_mask (`torch.Tensor`, *optional*): `[B, S]`; rows with padding are not cached (their K/V
                were computed with shifted positions).
        """
        self._update.last_layer_updated = 0  # the next update starts a step
        self._update.visible.drop_plans()
        self._rows.release(token_ids, attention_mask)

    reset = release  # transformers' name for it

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """A branch of this cache (`copy.deepcopy(cache)`, e.g. to continue one prompt several ways): the same rows
        and lengths, sharing every block with this cache by reference count. The first write to a shared block, by
        either cache, copies only that block; each releases its blocks on its own. The pool and config are shared,
        not copied."""
        branch = type(self)(
            self._config,
            pool=self.pool,
            block_size=self.block_size,
            dtype=self._dtype,
            device=self._device,
            share_rows=self.share_rows,
            release_out_of_window=self.release_out_of_window,
            max_cache_len=self.max_cache_len,
        )
        branch._rows.share_from(self._rows)
        branch._update.last_layer_updated = self._update.last_layer_updated
        memo[id(self)] = branch
        return branch

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    @property
    def pool(self) -> BlockPool | None:
        """The pool holding this cache's blocks (None until the first update of a cache with a private pool)."""
        return self._tables.pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in decoder layer `layer_idx`. A layer without K/V (a hybrid model's linear-attention
        layer) tracks no length: layer 0 then means the first attention layer, as in `Cache.get_seq_length`. Inside
        a compiled forward of a compileable cache: a 0-dim tensor, as `StaticCache` returns."""
        if self._fixed is not None:
            if torch.compiler.is_compiling():
                return self._fixed.steps.past_length
            self._fixed.settle()
        if layer_idx >= len(self.layers):
            return 0
        pool_layer = self._pool_layers[layer_idx] if layer_idx < len(self._pool_layers) else None
        if pool_layer is None:
            if layer_idx:
                raise ValueError(
                    f"get_seq_length({layer_idx}): layer {layer_idx} is a {type(self.layers[layer_idx]).__name__}, "
                    "which tracks no sequence length; ask an attention layer"
                )
            pool_layer = 0
        return self._rows.paged_layers[pool_layer].cumulative_length

    @property
    def num_held_blocks(self) -> int:
        """Distinct pool blocks this cache holds, all layer groups (a block shared by rows counts once)."""
        return sum(self.held_blocks_per_group)

    @property
    def held_blocks_per_group(self) -> tuple[int, ...]:
        """Distinct pool blocks held per layer group (`pool.layer_groups` order)."""
        return self._tables.held_blocks_per_group()

    @property
    def held_bytes(self) -> int:
        """Bytes of K/V this cache holds in the pool, all layers."""
        pool = self.pool
        return 0 if pool is None else self.num_held_blocks * pool.bytes_per_block

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the gather workspace this cache uses (transient K/V of one layer, not pool memory), shared with
        the other caches of its pool in this thread; 0 before the first gather."""
        pool = self.pool
        return 0 if pool is None else workspace_for(pool).nbytes

    @property
    def block_tables(self) -> list[list[int]]:
        """A copy of the per-row block tables (block ids in token order) of layer group 0, the only group of a
        uniform model; `layer_block_tables(layer_idx)` gives any layer's."""
        return [list(table) for table in self._blocks.tables]

    def layer_block_tables(self, layer_idx: int) -> list[list[int]]:
        """A copy of the per-row block tables that decoder layer `layer_idx` reads (its layer group's); their first
        entry is logical block `base` of the group (blocks before it were released by the sliding window)."""
        pool_layer = self._pool_layers[layer_idx]
        if pool_layer is None:
            raise ValueError(f"layer {layer_idx} holds no K/V (a {type(self.layers[layer_idx]).__name__})")
        return [list(table) for table in self._tables.of_layer(pool_layer).tables]

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self._tables.num_rows}, seq_length={self.get_seq_length()}, "
            f"layer_groups={len(self.layer_groups)}, held_blocks={self.num_held_blocks}, pool={self.pool!r})"
        )


def _check_arguments(config, pool: BlockPool | None, block_size: int, max_cache_len: int | None) -> None:
    if config is None and pool is None:
        raise ValueError("PagedCache needs a model config, a BlockPool, or both: PagedCache(config=model.config)")
    if isinstance(config, torch.nn.Module):
        raise TypeError(
            f"PagedCache takes the model's config, got the model ({type(config).__name__}): "
            "PagedCache(config=model.config)"
        )
    if pool is not None and not isinstance(pool, BlockPool):
        raise TypeError(f"pool must be a BlockPool (BlockPool.for_model(model)), got {type(pool).__name__}")
    check_positive_int("block_size", block_size)
    if max_cache_len is not None:
        check_positive_int("max_cache_len", max_cache_len)


def _model_layers(config, pool: BlockPool | None, tp_size: int | None) -> tuple:
    """(layout, text config, sliding windows per pool layer, layer types and kwargs per decoder layer) of the model
    a cache is built for: from its config (checked against `pool`), else from the model `pool` was built for."""
    if config is not None:
        layout = KVLayout.from_config(config, tp_size=tp_size)
        config = config.get_text_config(decoder=True)
        refuse_generate_cache(config)
        if pool is not None:
            pool.check_compatible(layout)
            pool.serve_model(config)
        windows = sliding_windows(config)
        layer_types, layer_kwargs, _ = cache_layers(config)  # a looped model's per-loop copies included
        return layout, config, windows, layer_types, layer_kwargs
    layout = pool.layout
    if layout.kv_layers != tuple(range(layout.num_layers)):
        raise ValueError(
            f"this pool holds K/V of decoder layers {list(layout.kv_layers)} only (a hybrid model's attention "
            "layers): a PagedCache on it needs the model's config for its other layers, "
            "PagedCache(config=model.config, pool=pool)"
        )
    # The windows of the model the pool was built for.
    return layout, None, list(layout.windows), list(layout.layer_types), [{}] * layout.num_layers


def _kv_sharing(config, layout: KVLayout, pool_layers: list[int | None], num_pool_layers: int) -> tuple:
    """(the last pool layer a forward updates, the pool layers whose returned K/V later layers attend again): layers
    after the last cache nothing of their own (KV-sharing layers), and KV sharing's "store" layers get K/V of their
    own, not views of the gather workspace, which the next layer's gather overwrites."""
    cached = [i for i, layer_type in enumerate(layout.layer_types) if layer_type != "dummy"]
    last_cached_layer = cached[-1] if cached else num_pool_layers - 1
    modes = getattr(config, "kv_sharing_modes", None) if config is not None else None
    if modes is not None:  # per decoder layer: the pool layers of the "store" ones
        sources = (pool_layers[i] for i, mode in enumerate(modes) if mode == "store" and i < len(pool_layers))
        kv_sources = frozenset(p for p in sources if p is not None)
    elif len(cached) < num_pool_layers:  # no config to say which: any pool layer may be a source
        kv_sources = frozenset(cached)
    else:
        kv_sources = frozenset()
    return last_cached_layer, kv_sources
