"""UpdatePath: the eager `PagedCache.update` of one layer, from the new K/V to what attention reads.

    update(key_states, value_states, layer_idx)         [B, kv_heads, q_len, head_dim]
      check the layer and its states' shapes            (a private pool is built at the first update)
      layer 0: start the step                           sliding groups give back what left the window; the store
                                                        backend and the attention are resolved once for the step
      first forward: start the rows                     identical adjacent rows form one row group
      write plan (group's first layer, memoized)        fresh blocks and copies-on-write for the writers, their slots
      store                                             KVStore: the writers' new K/V at their slots
      return                                            the step's own K/V (a first prefill), else VisibleKV

A write plan is all or nothing: a step that runs out of blocks (`PoolExhausted`) is undone in the layer groups that
already stored it, so the cache can run it again once blocks are free (`_write_plan`).

A compileable cache's reserved steps take another path (`ReservedSteps.update`, fixed_width.py).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..errors import PoolExhausted, PoolMismatch, UnsupportedModel
from ..storage import BlockPool, KVLayout
from .block_tables import BlockTables
from .fixed_width import check_fits
from .store import KVStore
from .visible import VisibleKV

if TYPE_CHECKING:
    from .rows import CacheRows
    from .table_metadata import TableMetadata


class UpdatePath:
    """The eager update of every layer of one `PagedCache` (see the module docstring).

    Args:
        cache (`PagedCache`): the cache, held weakly: its `layout`, which the first `key_states` of a private pool may
            narrow to one rank's share (tensor parallelism), and its `layers`, named in refusals.
        rows (`CacheRows`): the cache's rows (tables, lengths, states, indexer keys), written here.
        pool_layers (`list[int | None]`): per decoder layer, its pool layer (None: it holds no K/V).
        config: the model's text config (None for a cache built from a pool alone).
        block_size, dtype, device: of a private pool.
        share_rows (`bool`): identical adjacent rows of the first forward form one row group.
        max_cache_len (`int`, *optional*): a compileable cache's; a step may not hold more tokens per row.
        last_cached_layer (`int`): the last pool layer a forward updates (layers after it share others' K/V).
        kv_sources (`frozenset[int]`): pool layers whose K/V later layers attend again (see `VisibleKV`).
    """

    def __init__(
        self,
        cache,
        rows: CacheRows,
        pool_layers: list[int | None],
        config,
        *,
        block_size: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        share_rows: bool,
        max_cache_len: int | None,
        last_cached_layer: int,
        kv_sources: frozenset[int],
    ):
        self._cache = weakref.proxy(cache)
        self._rows = rows
        self._pool_layers = pool_layers
        self._model_type = getattr(config, "model_type", None)
        self._block_size, self._dtype, self._device = block_size, dtype, device
        self._share_rows = share_rows
        self._max_cache_len = max_cache_len
        self._last_cached_layer = last_cached_layer
        self.store = KVStore()
        self.visible = VisibleKV(rows.tables, config, cache.layout.latent, kv_sources)
        self.last_layer_updated = 0  # the highest layer updated since layer 0's last update
        self._multi_device = False  # resolved at every step's layer 0 (`_start_step`)
        self._checked_shapes: dict[int, tuple] = {}  # layer -> the (K, V) shapes `check_states` last accepted
        # Per pool layer: its PagedLayer, its group's tables and their metadata (fixed for the cache's life).
        self._layer_parts = [
            (layer, rows.tables.of_layer(i), rows.tables.metadata_of(i)) for i, layer in enumerate(rows.paged_layers)
        ]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` ([B, kv_heads, q_len, head_dim]) after the cached tokens of decoder
        layer `layer_idx` and return that layer's visible K/V ([B, kv_heads, kv_len, head_dim])."""
        # NOTE: every layer of every decode step runs this, so it reads attributes once and calls out only where
        # something happens (a refusal, a first forward, layer 0's step start, a write plan not yet memoized).
        rows = self._rows
        states = rows.states
        if states.incomplete:
            states.check_complete()
        pool_layers = self._pool_layers
        pool_layer = pool_layers[layer_idx] if layer_idx < len(pool_layers) else None
        if pool_layer is None:
            self._refuse_layer(layer_idx)
        # From here on, `layer_idx` is the pool layer (the same number unless the model is hybrid).
        layer_idx = pool_layer
        layer, blocks, metadata = self._layer_parts[layer_idx]
        key_shape = key_states.shape
        batch_size, _, q_len, _ = key_shape
        num_past = layer.cumulative_length
        num_tokens = num_past + q_len
        pool = blocks.pool
        if pool is None:
            self._init_pool(layer_idx, key_states, num_tokens)
            pool = blocks.pool
        shapes = (key_shape, value_states.shape)
        if self._checked_shapes.get(layer_idx) != shapes:  # the shapes of a layer's states are checked once
            pool.check_states(layer_idx, key_states, value_states)
            self._checked_shapes[layer_idx] = shapes
        if self._max_cache_len is not None:
            check_fits(num_tokens, self._max_cache_len)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)

        if layer_idx == 0:
            self._start_step(pool)
        num_rows = len(blocks.tables)
        starting = num_rows == 0
        if starting:
            blocks.start_rows(key_states, value_states, self._share_rows)
        elif batch_size != num_rows:
            raise ValueError(
                f"PagedCache holds {num_rows} rows but layer {layer_idx} got key_states for {batch_size}; "
                "use batch_repeat_interleave / batch_select_indices to change the batch of a filled cache"
            )

        if layer_idx:  # `_check_layer_count` at layer 0
            if layer_idx > self.last_layer_updated:
                self.last_layer_updated = layer_idx
        else:
            self._check_layer_count(layer_idx)
        if blocks.has_groups():
            blocks.verify_row_groups(key_states, value_states)
        device = pool.devices[layer_idx] if self._multi_device else None  # a pool split over devices: this layer's
        plan = metadata.memo.get(("write", num_past, num_tokens, device))
        if plan is None:
            plan = self._write_plan(blocks, metadata, layer_idx, num_past, num_tokens, starting, device)
        self.store.store(pool, layer_idx, key_states, value_states, plan[0], plan[1], device)
        layer.cumulative_length = num_tokens
        if num_past == 0:
            # A first prefill: the visible K/V are exactly this step's (a sliding layer returns them all, as
            # DynamicSlidingWindowLayer does), so nothing is gathered back from the pool.
            return key_states, value_states
        first = 0 if layer.sliding_window is None else layer.first_visible(num_past)
        return self.visible.visible(layer_idx, metadata, key_states, value_states, first, num_tokens)

    def _start_step(self, pool: BlockPool) -> None:
        """At layer 0's update: release what left the sliding windows, and resolve once for the step's layers what
        every layer would otherwise look up again (the attention implementation, the store backend).

        NOTE: the release happens at the start of a step, never during one: the previous step's attention has read
        its keys, and each layer's `first_visible(cumulative_length)` is exactly where its next gather starts. Not
        while past states are recorded (assisted decoding may crop back past the window edge); `crop` releases then.
        """
        rows = self._rows
        if rows.sliding_groups and not any(layer.record_past for layer in rows.paged_layers):
            rows.release_before_windows()
        self._multi_device = multi_device = pool.is_multi_device
        self.store.start_step(pool, multi_device)
        self.visible.start_step(pool, multi_device)

    def _write_plan(
        self,
        blocks: BlockTables,
        metadata: TableMetadata,
        layer_idx: int,
        num_past: int,
        num_tokens: int,
        starting: bool,
        device: torch.device | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Make positions [num_past, num_tokens) writable for the writers of layer `layer_idx`'s group
        (`BlockTables.prepare_write`) and return where they go: their slots, and the writer rows to take from the
        step's states (an int64 index on `device`, None when every row writes). Memoized in the group's `metadata`
        (under `("write", num_past, num_tokens, device)`) for the step's other layers, which look it up there.

        All or nothing: a PoolExhausted leaves the tables, the free queue and the prefix cache as they were; only the
        rows that start_rows just began are dropped, so a failed first update leaves the cache empty. With several
        layer groups, the groups that already stored this step are rolled back too (see _undo_step). A hybrid
        model's states cannot be rolled back: its cache is then only good for release() (IncompleteStep)."""
        key = ("write", num_past, num_tokens, device)
        writers = blocks.writers()
        pool = blocks.pool
        # A pool that may grow here while layers keep placeholders: their plans view its tensors, which must go.
        pool_blocks = pool.num_blocks if pool.growable and self.visible.placeholders else None
        try:
            blocks.prepare_write(writers, num_past, num_tokens)
            if pool_blocks is not None and pool.num_blocks != pool_blocks:
                self.visible.drop_plans(in_step=True)
        except PoolExhausted:
            if starting:
                blocks.release()
            self._undo_step(layer_idx, num_past)
            self._rows.indexer.truncate(num_past)  # the layers this step already wrote
            self.last_layer_updated = 0  # the step starts again at layer 0
            self._rows.states.stop_step()
            raise
        subset = len(writers) < blocks.num_rows
        slots = metadata.slots(writers if subset else None, num_past, num_tokens, device)
        plan = metadata.memo[key] = (slots, metadata.writer_index(device) if subset else None)
        return plan

    def refuse_step(self, layer_idx: int, error: Exception) -> None:
        """Raise `error`, refusing decoder layer `layer_idx`'s update before it writes, with the step undone: the
        layers that stored it (this forward's earlier ones) go back to the refused layer's length and their groups
        give back the blocks they took for it, so the cache can run the step again (a first prefill leaves it
        empty). A hybrid model's states that advanced cannot go back: its cache is then only good for `release()`
        (`IncompleteStep`)."""
        pool_layer = self._pool_layers[layer_idx] if layer_idx < len(self._pool_layers) else None
        if pool_layer is not None and pool_layer > 0 and self._rows.tables.pool is not None:
            num_past = self._rows.paged_layers[pool_layer].cumulative_length
            self._undo_step(pool_layer, num_past, failing_group_too=True)
            self._rows.indexer.truncate(num_past)
            self.last_layer_updated = 0
        states = self._rows.states
        if any(index < layer_idx for index in states.layer_indices):
            states.stop_step()
        raise error

    def _undo_step(self, layer_idx: int, num_past: int, *, failing_group_too: bool = False) -> None:
        """Layer `layer_idx` could not get blocks: put the layers of OTHER layer groups that stored this step back at
        `num_past` tokens and give back the blocks their groups took for it.

        A group takes its blocks for the whole step at its first layer, so when that is where it runs out (the usual
        case: no block for the next tokens), the step is undone in every layer and the cache can run it again once
        blocks are free, as a one-group cache can after a failed first layer. The failing group itself follows the
        per-call rule (as it was before this call); when it runs out at a later layer of its own (rows that turn
        out to differ need copies), its earlier layers keep the step and the cache is only good for `release()`.
        `failing_group_too`: undo the failing group's earlier layers as well (`refuse_step`: layer `layer_idx`
        stored nothing). What the undone groups keep: their copies-on-write (a row's private copy of a shared block,
        same contents) and the sliding groups' release of blocks that left the window at the start of the step.
        """
        tables = self._rows.tables
        failing = tables.of_layer(layer_idx)
        advanced = [
            (pool_layer, layer)
            for pool_layer, layer in enumerate(self._rows.paged_layers[:layer_idx])
            if layer.cumulative_length > num_past and (failing_group_too or tables.of_layer(pool_layer) is not failing)
        ]
        touched: list[BlockTables] = []  # the tables of the advanced layers' groups, each once
        for pool_layer, layer in advanced:
            layer.cumulative_length = num_past
            group_tables = tables.of_layer(pool_layer)
            if all(group_tables is not other for other in touched):
                touched.append(group_tables)
        for group_tables in touched:
            group_tables.release() if num_past == 0 else group_tables.truncate(num_past)

    def _check_layer_count(self, layer_idx: int) -> None:
        """A model's forward updates every layer of its cache: one that came back to layer 0 after updating more
        than layer 0 but not the last layer has fewer layers than the config the cache was built from."""
        if layer_idx:
            self.last_layer_updated = max(self.last_layer_updated, layer_idx)
            return
        last, self.last_layer_updated = self.last_layer_updated, 0
        if 0 < last < self._last_cached_layer:
            raise PoolMismatch(
                f"the model's forward updated layers 0..{last} of this PagedCache, built for "
                f"{len(self._rows.paged_layers)} layers: build it from the config of the model it runs with, "
                "PagedCache(config=model.config) (or an earlier forward stopped part-way: only release() is valid then)"
            )

    def _init_pool(self, layer_idx: int, key_states: torch.Tensor, num_tokens: int) -> None:
        """Build the cache's private pool, sized from the first forward (`num_tokens` per row of `key_states`), with
        its dtype and device unless the cache was given them."""
        cache = self._cache
        cache.layout = layout = _rank_layout(cache.layout, layer_idx, key_states.shape[1])
        tables = self._rows.tables
        # Groups of layers that cache nothing of their own (KV sharing) never take a block.
        num_groups = sum(any(layout.layer_types[i] != "dummy" for i in group) for group in tables.layer_groups)
        if self._max_cache_len is not None:  # every row's whole table, so the pool's tensors never move under a graph
            num_tokens = self._max_cache_len
        num_blocks = max(-(-num_tokens // self._block_size) * key_states.shape[0] * num_groups, 4)
        pool = BlockPool(
            layout,
            num_blocks=num_blocks,
            block_size=self._block_size,
            dtype=self._dtype if self._dtype is not None else key_states.dtype,
            device=self._device if self._device is not None else key_states.device,
            growable=self._max_cache_len is None,
        )
        assert pool.layer_groups == tables.layer_groups, (pool.layer_groups, tables.layer_groups)
        tables.set_pool(pool)

    def _refuse_layer(self, layer_idx: int) -> None:
        """Raise for decoder layer `layer_idx`, which has no pool layer: past the model's layers, or holding no K/V."""
        layers = self._cache.layers
        num_decoder_layers = len(self._pool_layers)
        if layer_idx >= num_decoder_layers and len(layers) > num_decoder_layers:
            raise UnsupportedModel(
                self._model_type,
                f"it adds cache layers of its own ({len(layers)} for its {num_decoder_layers} layers, such as "
                f"a copy per loop of looped layers) and writes layer {layer_idx}; a PagedCache holds blocks for the "
                "model's layers only",
                "PagedCache",
            )
        if layer_idx >= len(layers):
            raise PoolMismatch(
                f"layer_idx {layer_idx}: this PagedCache was built for {len(layers)} layers; build it from the "
                "config of the model it runs with: PagedCache(config=model.config)"
            )
        raise UnsupportedModel(
            self._model_type,
            f"it writes K/V to layer {layer_idx}, whose config layer type caches none (a "
            f"{type(layers[layer_idx]).__name__}); a PagedCache holds K/V of the attention layers only",
            "PagedCache",
        )


def _rank_layout(layout: KVLayout, layer_idx: int, num_kv_heads: int) -> KVLayout:
    """`layout`, or one rank's share of it when a tensor-parallel model's first `key_states` (of layer `layer_idx`,
    with `num_kv_heads` heads) show that each rank holds 1 / tp_size of the config's heads: inside an initialized
    process group whose size tp_size divides. Anything else stays as it is (`check_states` raises `PoolMismatch`)."""
    heads = layout.num_kv_heads[layer_idx]
    if layout.tp_size != 1 or num_kv_heads >= heads or heads % num_kv_heads:
        return layout
    tp_size = heads // num_kv_heads
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() % tp_size:
        return layout
    if any(h % tp_size for h in layout.num_kv_heads):
        return layout
    return layout.shard(tp_size)
