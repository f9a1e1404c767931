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
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..attention import PAGED_ATTENTION, DecodePlan, plan_placeholders, store_backend, store_kv_rows
from ..attention.fixed_plan import FixedDecodePlan, resolve_backends
from ..attention.kernels.dispatch import triton_possible
from ..attention.prefill_plan import PrefillPlan
from ..errors import PoolExhausted, PoolMismatch, UnsupportedModel
from ..storage import BlockPool, KVLayout, block_hashes, group_of_layer, group_windows, sliding_windows
from ..storage.layout import cache_layers, refuse_generate_cache
from ..storage.pool import check_positive_int, resolve_dtype
from .fixed_width import FixedWidthSteps, gather_fixed
from .gather import shared_prefix_kv, visible_kv, workspace_for
from .group_tables import GroupTables
from .hybrid import HybridStates, decoder_layers
from .indexer import IndexerKeys


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
    `[B, num_kv_heads, kv_len, head_dim]` (V's heads and head_dim may differ from K's: multi-head latent attention
    caches a `[B, 1, q_len, kv_lora_rank]` latent as K and a `[B, 1, q_len, qk_rope_head_dim]` rotary key as V),
    where `kv_len` is the cached length plus `q_len` (for a sliding layer, only the window, exactly like
    `DynamicSlidingWindowLayer`). A first prefill (nothing cached) returns the step's own `key_states`/`value_states`.
    Later steps return views: of the pool when the cache holds one row whose blocks are consecutive pool blocks (one
    row in a private pool), else of a gather workspace that the caches of one pool share within a thread. They are
    valid until the next `update` of a cache of that pool in that thread (attention consumes them at once), except
    for the layers whose K/V KV-sharing layers attend again (Gemma 3n), which get copies of their own. The indexer
    keys of DeepSeek Sparse Attention layers (`update_indexer`) are kept beside the pool (cache/indexer.py).

    Blocks go back to the pool on `release()`, on leaving a `with PagedCache(...)` block, or when the cache is
    garbage-collected. One cache belongs to one thread at a time; several caches may share one pool across threads.

    Hybrid models (Qwen3-Next, Jamba, Bamba, Falcon-H1, LFM2, ...): the pool holds the K/V of the attention layers
    only (`layout.kv_layers`: the decoder layer of each pool layer); the linear-attention, mamba and conv states stay
    in transformers' own cache layers (`layers[i]` is a `LinearAttentionLayer` as in `DynamicCache`), reordered with
    the block tables by beam search. Such a cache needs `config`; prefix reuse (`from_prefix`,
    `release(token_ids=...)`) raises `UnsupportedModel`, since a recurrent state cannot be rebuilt from blocks.

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
        if config is not None:
            layout = KVLayout.from_config(config, tp_size=tp_size)
            config = config.get_text_config(decoder=True)
            refuse_generate_cache(config)
            if pool is not None:
                pool.check_compatible(layout)
                pool.serve_model(config)
            windows = sliding_windows(config)
            layer_types, layer_kwargs, _ = cache_layers(config)  # a looped model's per-loop copies included
        else:
            layout = pool.layout
            windows = list(layout.windows)  # the windows of the model the pool was built for
            if layout.kv_layers != tuple(range(layout.num_layers)):
                raise ValueError(
                    f"this pool holds K/V of decoder layers {list(layout.kv_layers)} only (a hybrid model's attention "
                    "layers): a PagedCache on it needs the model's config for its other layers, "
                    "PagedCache(config=model.config, pool=pool)"
                )
            layer_types, layer_kwargs = list(layout.layer_types), [{}] * layout.num_layers
        self.layout = layout
        self._config = config
        self.block_size = pool.block_size if pool is not None else block_size
        self._dtype, self._device = resolve_dtype(dtype), device
        self.share_rows = share_rows
        self.release_out_of_window = release_out_of_window
        self._last_layer_updated = 0  # the highest layer updated since layer 0's last update
        # A private pool is built later from `layout`, with the same groups `layout.layer_groups()` gives now.
        self.layer_groups = pool.layer_groups if pool is not None else layout.layer_groups()
        self._tables = GroupTables(self.layer_groups, pool)
        # NOTE: `_blocks` is group 0's tables: the only ones of a uniform model (tests read its row groups).
        self._blocks = self._tables.groups[0]
        # Resolved at every step's layer 0 (`_start_step`) for the step's other layers.
        self._paged_attention, self._store_backend = False, None
        self._multi_device, self._kernel_possible = False, False
        self._nhd_memo: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> (key, value, their nhd views)
        self._indexer = IndexerKeys()  # "indexed_attention" layers' indexer keys, beside the paged K/V
        self._flat_memo: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> (key, value, their flat views)
        self._checked_shapes: dict[int, tuple] = {}  # layer -> the (K, V) shapes `check_states` last accepted
        # NOTE: holds the tables (not `self`), so the finalizer can run once `self` is unreachable.
        self._finalizer = weakref.finalize(self, self._tables.release)
        # `layers`: one per decoder layer (what transformers indexes); `_paged_layers`: one per pool layer, the
        # PagedLayers of the decoder layers holding K/V (all layers but a hybrid model's state and MLP-only ones).
        layers, self._paged_layers = decoder_layers(self, layer_types, layer_kwargs, layout.kv_layers, windows)
        self._pool_layers = layout.pool_layers(len(layers))  # decoder layer -> its pool layer (None: no K/V)
        self._states = HybridStates(layers, getattr(config, "model_type", None))
        super().__init__(layers=layers)
        # Per group, the window of a group whose every layer slides and gives back blocks that left the window (all
        # of them for Mistral), None for a group that keeps every block.
        # A compileable cache keeps every block (its tables have a fixed width from position 0): a sliding layer sees
        # its window through the mask.
        self.max_cache_len = max_cache_len
        self._group_windows = (
            group_windows(self.layer_groups, windows)
            if release_out_of_window and max_cache_len is None
            else [None] * len(self.layer_groups)
        )
        self._sliding_groups = tuple(group for group, window in enumerate(self._group_windows) if window is not None)
        # The last layer a forward updates (layers after it cache nothing of their own: KV-sharing layers), and the
        # layers whose returned K/V later layers attend again (KV sharing's "store" layers): those get K/V of their
        # own, not views of the gather workspace, which the next layer's gather overwrites.
        cached = [i for i, layer_type in enumerate(self.layout.layer_types) if layer_type != "dummy"]
        self._last_cached_layer = cached[-1] if cached else len(self._paged_layers) - 1
        modes = getattr(config, "kv_sharing_modes", None) if config is not None else None
        if modes is not None:  # per decoder layer: the pool layers of the "store" ones
            sources = (self._pool_layers[i] for i, mode in enumerate(modes) if mode == "store" and i < len(layers))
            self._kv_sources = frozenset(p for p in sources if p is not None)
        elif len(cached) < len(self._paged_layers):  # no config to say which: any pool layer may be a source
            self._kv_sources = frozenset(cached)
        else:
            self._kv_sources = frozenset()
        self._fixed = None if max_cache_len is None else self._compileable(max_cache_len)

    # ------------------------------------------------------------ compileable
    def _compileable(self, max_cache_len: int) -> FixedWidthSteps:
        """Refuse what a fixed-width step cannot hold, mark the layers compileable, and make the step buffers."""
        layer_types = self.layout.layer_types
        reason = None
        if self._states:
            reason = "its linear-attention / mamba / conv states are not paged"
        elif self.layout.latent:
            reason = "it expands latent K/V (multi-head latent attention) after cache.update()"
        elif "indexed_attention" in layer_types:
            reason = "its indexer keys live beside the pool"
        elif "dummy" in layer_types or self._kv_sources:
            reason = "its KV-sharing layers attend another layer's K/V"
        if reason is not None:
            model_type = getattr(self._config, "model_type", None)
            raise UnsupportedModel(model_type, reason, "PagedCache(max_cache_len=...)")
        for layer in self._paged_layers:
            layer.is_compileable = True
        self._pending = None  # tokens per row reserved for the next forward, until that forward's last layer
        self._unsettled = 0  # tokens per row a reserved forward wrote that the layers' lengths do not count yet
        self._group_of = group_of_layer(self.layer_groups)
        self._fixed_plans, self._fixed_backends = False, None  # set by reserve
        return FixedWidthSteps(max_cache_len, self.block_size, len(self.layer_groups))

    def reserve(self, num_new_tokens: int) -> None:
        """Take the blocks the next forward writes (`num_new_tokens` per row) and fill the step's buffers, on the host
        and before that forward: a compiled forward only reads buffers. `generate()` calls it through
        `get_mask_sizes`; a caller running a compiled forward of its own calls it before each one. Idempotent until
        that forward runs. Every row writes its own blocks from here on (a block rows shared is copied first)."""
        if self._fixed is None:
            raise ValueError("reserve() is for a compileable cache: PagedCache(config=..., max_cache_len=N)")
        check_positive_int("num_new_tokens", num_new_tokens)
        self._settle()
        if self._pending is not None:
            if self._pending != num_new_tokens:
                raise ValueError(
                    f"{self._pending} tokens per row are reserved for the next forward, not {num_new_tokens}"
                )
            return
        if not self._tables.num_rows:
            raise ValueError("reserve() continues the cache's rows: the first forward (the prefill) starts them")
        past_length = self._paged_layers[0].cumulative_length
        end = past_length + num_new_tokens
        self._check_fits(end)
        for tables in self._tables.groups:
            followers = [row for row, leader in enumerate(tables.leaders) if leader != row]
            if followers:
                tables.split(followers)
            tables.prepare_write(tables.writers(), past_length, end)
        device = self.pool.device
        self._fixed.fill(self._tables.groups, past_length, num_new_tokens, device)
        # A decode step of the "hf_paged" attention where its kernel can run: placeholders carrying a plan.
        self._fixed_plans = num_new_tokens == 1 and self._runs_paged_attention() and triton_possible(device)
        if self._fixed_plans and self._fixed_backends is None:
            self._fixed_backends = resolve_backends(device)
        self._pending = self._unsettled = num_new_tokens

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.max_cache_len:
            raise ValueError(
                f"the forward would hold {num_tokens} tokens per row, over max_cache_len={self.max_cache_len}: build "
                "the cache with a larger max_cache_len"
            )

    def _settle(self) -> None:
        """Count in the layers' lengths what a reserved forward wrote (a compiled forward changes no host state but
        `_pending`)."""
        if self._fixed is not None and self._unsettled and self._pending is None:
            for layer in self._paged_layers:
                layer.cumulative_length += self._unsettled
            self._unsettled = 0

    def _drop_reservation(self) -> int | None:
        """Forget a reservation no forward used (rows or lengths are about to change); returns its token count."""
        pending = self._pending if self._fixed is not None else None
        if pending is not None:
            self._pending, self._unsettled = None, 0
        return pending

    def _update_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """A reserved step of decoder layer `layer_idx`: store at the step's slots, return `[B, kv_heads,
        max_cache_len, head_dim]` read through the fixed-width tables. Nothing here takes a block or reads a device
        value on the host, so it traces into one graph and replays in a CUDA graph."""
        if self._pending is None:
            raise ValueError(
                "a forward of a compileable PagedCache writes only the blocks reserved before it: generate() reserves "
                "them; before a compiled forward of your own, call cache.reserve(num_new_tokens)"
            )
        if key_states.shape[2] != self._pending:
            raise ValueError(f"the forward writes {key_states.shape[2]} tokens per row, {self._pending} were reserved")
        pool_layer = self._pool_layers[layer_idx]
        fixed, group = self._fixed, self._group_of[pool_layer]
        key_cache, value_cache = self._tables.pool.key_cache[pool_layer], self._tables.pool.value_cache[pool_layer]
        slots = fixed.slot_mapping[group]
        for cache, states in ((key_cache, key_states), (value_cache, value_states)):
            cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(1, slots, _heads_first(states))
        if pool_layer == self._last_cached_layer:
            self._pending = None
        table, max_cache_len = fixed.block_tables[group], self.max_cache_len

        def gather():
            return gather_fixed(key_cache, table, max_cache_len), gather_fixed(value_cache, table, max_cache_len)

        if not self._fixed_plans:
            return gather()
        plan = FixedDecodePlan(
            key_cache=BlockPool.nhd_view(key_cache),
            value_cache=BlockPool.nhd_view(value_cache),
            block_tables=table,
            seq_lens=fixed.seq_lens,
            gather=gather,
            backends=self._fixed_backends,
        )
        return plan_placeholders(key_states, value_states, plan)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """As `Cache.get_mask_sizes`; a compileable cache with rows reserves the next forward's blocks here (outside
        a compiled region), and its steps then describe `max_cache_len` keys from position 0."""
        if self._fixed is None:
            return super().get_mask_sizes(query_length, layer_idx)
        if not torch.compiler.is_compiling():
            self._settle()
            if self._pending is None and self._tables.num_rows:
                self.reserve(query_length)
            if self._pending is None:  # a first prefill: the step's own K/V, as without max_cache_len
                return super().get_mask_sizes(query_length, layer_idx)
        return self.max_cache_len, 0

    # ------------------------------------------------------------------ pool
    @property
    def pool(self) -> BlockPool | None:
        """The pool holding this cache's blocks (None until the first update of a cache with a private pool)."""
        return self._tables.pool

    def _init_pool(self, layer_idx: int, key_states: torch.Tensor, num_tokens: int) -> None:
        self.layout = _rank_layout(self.layout, layer_idx, key_states.shape[1])
        # Groups of layers that cache nothing of their own (KV sharing) never take a block.
        num_groups = sum(any(self.layout.layer_types[i] != "dummy" for i in group) for group in self.layer_groups)
        if self._fixed is not None:  # every row's whole table, so the pool's tensors never move under a graph
            num_tokens = self.max_cache_len
        num_blocks = max(-(-num_tokens // self.block_size) * key_states.shape[0] * num_groups, 4)
        pool = BlockPool(
            self.layout,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=self._dtype if self._dtype is not None else key_states.dtype,
            device=self._device if self._device is not None else key_states.device,
            growable=self._fixed is None,
        )
        assert pool.layer_groups == self.layer_groups, (pool.layer_groups, self.layer_groups)
        self._tables.set_pool(pool)

    # ---------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` ([B, kv_heads, q_len, head_dim]) after the cached tokens of layer
        `layer_idx` and return that layer's visible K/V ([B, kv_heads, kv_len, head_dim])."""
        if self._fixed is not None and (self._pending is not None or torch.compiler.is_compiling()):
            return self._update_fixed(key_states, value_states, layer_idx)
        self._settle()
        self._states.check_complete()
        pool_layer = self._pool_layers[layer_idx] if layer_idx < len(self._pool_layers) else None
        if pool_layer is None:
            self._refuse_layer(layer_idx)
        # From here on, `layer_idx` is the pool layer (the same number unless the model is hybrid).
        layer_idx = pool_layer
        layer = self._paged_layers[layer_idx]
        blocks = self._tables.of_layer(layer_idx)
        batch_size, _, q_len, _ = key_states.shape
        num_past = layer.cumulative_length
        num_tokens = num_past + q_len
        if blocks.pool is None:
            self._init_pool(layer_idx, key_states, num_tokens)
        pool = blocks.pool
        shapes = (key_states.shape, value_states.shape)
        if self._checked_shapes.get(layer_idx) != shapes:  # the shapes of a layer's states are checked once
            pool.check_states(layer_idx, key_states, value_states)
            self._checked_shapes[layer_idx] = shapes
        if self._fixed is not None:
            self._check_fits(num_tokens)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)

        if layer_idx == 0:
            self._start_step(pool)
        starting = blocks.num_rows == 0
        if starting:
            blocks.start_rows(key_states, value_states, self.share_rows)
        elif batch_size != blocks.num_rows:
            raise ValueError(
                f"PagedCache holds {blocks.num_rows} rows but layer {layer_idx} got key_states for {batch_size}; "
                "use batch_repeat_interleave / batch_select_indices to change the batch of a filled cache"
            )

        self._check_layer_count(layer_idx)
        if blocks.has_groups():
            blocks.verify_row_groups(key_states, value_states)
        device = pool.devices[layer_idx] if self._multi_device else None  # a pool split over devices: this layer's
        slots, rows = self._write_plan(blocks, layer_idx, num_past, num_tokens, starting, device)
        self._store(pool, layer_idx, key_states, value_states, slots, rows, device)
        layer.cumulative_length = num_tokens
        if num_past == 0:
            # A first prefill: the visible K/V are exactly this step's (a sliding layer returns them all, as
            # DynamicSlidingWindowLayer does), so nothing is gathered back from the pool.
            return key_states, value_states
        return self._visible(layer_idx, key_states, value_states, layer.first_visible(num_past), num_tokens)

    def _write_plan(self, blocks, layer_idx: int, num_past: int, num_tokens: int, starting: bool, device):
        """(slots, rows) of the step's new tokens in layer `layer_idx`'s group (`BlockTables.write_plan`). All or
        nothing: a PoolExhausted leaves the tables, the free queue and the prefix cache as they were; only the rows
        that start_rows just began are dropped, so a failed first update leaves the cache empty. With several layer
        groups, the groups that already stored this step are rolled back too (see _undo_step). A hybrid model's
        states cannot be rolled back: its cache is then only good for release() (IncompleteStep)."""
        try:
            return blocks.write_plan(num_past, num_tokens, device)
        except PoolExhausted:
            if starting:
                blocks.release()
            self._undo_step(layer_idx, num_past)
            self._indexer.truncate(num_past)  # the layers this step already wrote
            self._last_layer_updated = 0  # the step starts again at layer 0
            self._states.stop_step()
            raise

    def _store(self, pool: BlockPool, layer_idx: int, key_states, value_states, slots, rows, device) -> None:
        """Store the new rows ([W, kv_heads, q_len, head_dim], the `rows` that write, all when None) of pool layer
        `layer_idx` at their `slots`."""
        stored_keys, stored_values = key_states, value_states
        if rows is not None:
            stored_keys, stored_values = key_states[rows], value_states[rows]
        backend = store_backend(device) if self._multi_device else self._store_backend
        if backend == "torch" and not self._multi_device:
            # `store_kv_rows`' torch path, with the pool's flat views made once: one `index_copy_` per K and V.
            key_slots, value_slots = self._flat_views(pool, layer_idx)  # [1, kv_heads, num_slots, head_dim]
            if stored_keys.shape[0] == 1:
                key_slots.index_copy_(2, slots, stored_keys)
                value_slots.index_copy_(2, slots, stored_values)
            else:
                key_slots[0].index_copy_(1, slots, _heads_first(stored_keys))
                value_slots[0].index_copy_(1, slots, _heads_first(stored_values))
            return
        store_kv_rows(
            pool.key_cache[layer_idx], pool.value_cache[layer_idx], stored_keys, stored_values, slots, backend=backend
        )

    def _visible(self, layer_idx: int, key_states, value_states, first: int, num_tokens: int):
        """What pool layer `layer_idx`'s update returns after cached tokens: its K/V from position `first` to
        `num_tokens` gathered, or placeholders carrying a plan that reads them in place (decode and prefill steps of
        the "hf_paged" attention)."""
        blocks = self._tables.of_layer(layer_idx)
        pool = blocks.pool
        # A latent layout (multi-head latent attention) expands what update returns before attention: it gets the
        # stored latents themselves, never a placeholder.
        plannable = self._paged_attention and not self._multi_device and not self._latent(pool)
        if key_states.shape[2] == 1 and plannable:
            # A plan when the attention may run a kernel on the pool, or when the rows share a prefix of blocks
            # (read once); otherwise the attention would gather the K/V anyway: hand them over directly.
            split = self._shared_split(blocks, first, num_tokens)
            if split is not None or self._kernel_possible:
                return self._decode_placeholders(layer_idx, key_states, value_states, first, num_tokens, split)
        elif plannable and self._kernel_possible and layer_idx not in self._kv_sources:
            # Several tokens over cached ones (a prompt chunk, a prompt after a prefix hit): the paged prefill kernel
            # may read the pool in place (PrefillPlan); it gathers when it cannot.
            return self._prefill_placeholders(layer_idx, key_states, value_states, first, num_tokens)
        keys, values = self._gather_visible(layer_idx, first, num_tokens)
        if layer_idx in self._kv_sources:  # later layers attend these again, after other layers' gathers
            return keys.clone(), values.clone()
        return keys, values

    def _refuse_layer(self, layer_idx: int) -> None:
        """Raise for decoder layer `layer_idx`, which has no pool layer: past the model's layers, or holding no K/V."""
        num_decoder_layers = len(self._pool_layers)
        if layer_idx >= num_decoder_layers and len(self.layers) > num_decoder_layers:
            raise UnsupportedModel(
                getattr(self._config, "model_type", None),
                f"it adds cache layers of its own ({len(self.layers)} for its {num_decoder_layers} layers, such as "
                f"a copy per loop of looped layers) and writes layer {layer_idx}; a PagedCache holds blocks for the "
                "model's layers only",
                "PagedCache",
            )
        if layer_idx >= len(self.layers):
            raise PoolMismatch(
                f"layer_idx {layer_idx}: this PagedCache was built for {len(self.layers)} layers; build it from the "
                "config of the model it runs with: PagedCache(config=model.config)"
            )
        raise UnsupportedModel(
            getattr(self._config, "model_type", None),
            f"it writes K/V to layer {layer_idx}, whose config layer type caches none (a "
            f"{type(self.layers[layer_idx]).__name__}); a PagedCache holds K/V of the attention layers only",
            "PagedCache",
        )

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append an "indexed_attention" layer's indexer keys ([B, q_len, index_head_dim]: DeepSeek Sparse Attention)
        and return all of them ([B, kv_len, index_head_dim]), as `DynamicIndexedLayer.update_indexer` does. They are
        kept beside the paged K/V (see indexer.py)."""
        if layer_idx >= len(self.layers):
            raise PoolMismatch(f"layer_idx {layer_idx}: this PagedCache was built for {len(self.layers)} layers")
        return self._indexer.update(layer_idx, indexer_key_states)

    def get_indexer_position_ids(self, layer_idx: int) -> torch.Tensor | None:
        """The position ids decoder layer `layer_idx` keeps beside its indexer keys (Qwen4-Exp's QSA indexer:
        `[..., B, S]`), as `DynamicIndexedLayer.indexer_position_ids`; None before a forward set them."""
        return self._indexer.positions.get(layer_idx)

    def set_indexer_position_ids(self, layer_idx: int, position_ids: torch.Tensor | None) -> None:
        """Replace decoder layer `layer_idx`'s indexer position ids (`[..., B, S]`: every cached token's); they then
        follow the rows (beams, repeats, selections) and lengths (crop, release) as the indexer keys do."""
        self._indexer.set_positions(layer_idx, position_ids)

    @property
    def model_type(self) -> str | None:
        """The model type of the config this cache was built for (None for a cache built from a pool alone)."""
        return getattr(self._config, "model_type", None)

    @property
    def indexer_bytes(self) -> int:
        """Bytes of the indexer keys of "indexed_attention" layers this cache holds (outside the pool)."""
        return self._indexer.nbytes

    def _start_step(self, pool: BlockPool) -> None:
        """At layer 0's update: release what left the sliding windows, and resolve once for the step's layers what
        every layer would otherwise look up again (the attention implementation, the store backend)."""
        if self._sliding_groups:
            self._release_out_of_window()
        self._paged_attention = self._runs_paged_attention()
        self._store_backend = store_backend(pool.device)
        self._multi_device = pool.is_multi_device
        self._kernel_possible = triton_possible(pool.device)

    def _check_layer_count(self, layer_idx: int) -> None:
        """A model's forward updates every layer of its cache: one that came back to layer 0 after updating more
        than layer 0 but not the last layer has fewer layers than the config the cache was built from."""
        if layer_idx:
            self._last_layer_updated = max(self._last_layer_updated, layer_idx)
            return
        last, self._last_layer_updated = self._last_layer_updated, 0
        if 0 < last < self._last_cached_layer:
            raise PoolMismatch(
                f"the model's forward updated layers 0..{last} of this PagedCache, built for {len(self._paged_layers)} "
                "layers: build it from the config of the model it runs with, PagedCache(config=model.config) (or an "
                "earlier forward stopped part-way: only release() is valid then)"
            )

    def _undo_step(self, layer_idx: int, num_past: int) -> None:
        """Layer `layer_idx` could not get blocks: put the layers of OTHER layer groups that stored this step back at
        `num_past` tokens and give back the blocks their groups took for it.

        A group takes its blocks for the whole step at its first layer, so when that is where it runs out (the usual
        case: no block for the next tokens), the step is undone in every layer and the cache can run it again once
        blocks are free, as a one-group cache can after a failed first layer. The failing group itself follows the
        per-call rule (as it was before this call); when it runs out at a later layer of its own (rows that turn
        out to differ need copies), its earlier layers keep the step and the cache is only good for `release()`.
        What the undone groups keep: their copies-on-write (a row's private copy of a shared block, same contents)
        and the sliding groups' release of blocks that left the window at the start of the step.
        """
        failing = self._tables.of_layer(layer_idx)
        advanced = [
            (pool_layer, layer)
            for pool_layer, layer in enumerate(self._paged_layers[:layer_idx])
            if layer.cumulative_length > num_past and self._tables.of_layer(pool_layer) is not failing
        ]
        touched: list = []  # the BlockTables of the advanced layers' groups, each once
        for pool_layer, layer in advanced:
            layer.cumulative_length = num_past
            tables = self._tables.of_layer(pool_layer)
            if all(tables is not other for other in touched):
                touched.append(tables)
        for tables in touched:
            tables.release() if num_past == 0 else tables.truncate(num_past)

    def _release_out_of_window(self) -> None:
        """Before a step: in each sliding group, give back the blocks before the first key any of the group's layers
        can return in its next update.

        NOTE: at the start of a step (layer 0's update), never during one: the previous step's attention has read
        its keys, and each layer's `first_visible(cumulative_length)` is exactly where its next gather starts. Not
        while past states are recorded (assisted decoding may crop back past the window edge); `crop` releases then.
        """
        if not any(layer.record_past for layer in self._paged_layers):
            self._release_before_windows()

    def _release_before_windows(self) -> None:
        """In each sliding group, give back the blocks before the first key its layers' next updates return.

        With prefix caching, from the first key a query at the end of the last full block sees instead (at most one
        block more): `release(token_ids=...)` caches what the group still holds, and `from_prefix` of every full
        block of the conversation needs that window (`BlockAllocator.peek_longest_prefix`)."""
        pool, block_size = self._tables.pool, self.block_size
        caching = pool is not None and pool.allocator.enable_prefix_caching
        first_needed = {}
        for group_idx in self._sliding_groups:
            layers = [self._paged_layers[layer_idx] for layer_idx in self.layer_groups[group_idx]]
            lengths = [layer.cumulative_length for layer in layers]
            if caching:
                lengths = [length - length % block_size for length in lengths]
            first_needed[group_idx] = min(layer.first_visible(length) for layer, length in zip(layers, lengths))
        self._tables.release_front(first_needed)

    def _latent(self, pool: BlockPool) -> bool:
        """Whether the model expands the K/V this cache returns before attention (multi-head latent attention)."""
        return self.layout.latent or pool.layout.latent

    def _runs_paged_attention(self) -> bool:
        return getattr(self._config, "_attn_implementation", None) == PAGED_ATTENTION

    def _gather_visible(self, layer_idx: int, first: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, num_tokens) of every row of layer `layer_idx`: two [B, kv_heads, num_tokens - first,
        head_dim] views of the pool, or of the gather workspace the caches of its pool share in this thread; valid
        until the next update of a cache of that pool in this thread (see gather.py). On a pool split over devices,
        with index tensors on the layer's device."""
        blocks = self._tables.of_layer(layer_idx)
        if self._multi_device:
            blocks = blocks.on(blocks.pool.devices[layer_idx])
        return visible_kv(blocks, layer_idx, first, num_tokens)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the gather workspace this cache uses (transient K/V of one layer, not pool memory), shared with
        the other caches of its pool in this thread; 0 before the first gather."""
        pool = self.pool
        return 0 if pool is None else workspace_for(pool).nbytes

    @staticmethod
    def _shared_split(blocks, first: int, num_tokens: int) -> int | None:
        """Where the decode attention splits every row's visible K/V into a prefix read once and the rows' own tails
        (see `shared_prefix_kv`), or None when the rows share no block after `first`.

        The end of the blocks every row shares (clipped to `num_tokens`), or, when those blocks are not one run of
        pool blocks, the end of the run they start with if gathering the rest once per row copies less than
        gathering the whole prefix once."""
        shared = blocks.shared_blocks()
        if not shared:
            return None
        block_size = blocks.pool.block_size
        first_block, shared_end = first // block_size, blocks.base + shared
        if shared_end * block_size <= first:
            return None
        run_end = blocks.run_end(0, first_block, shared_end)
        if run_end < shared_end and blocks.num_rows * (shared_end - run_end) < shared_end - first_block:
            shared_end = run_end
        return min(shared_end * block_size, num_tokens)

    def _decode_placeholders(
        self,
        layer_idx: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        first: int,
        num_tokens: int,
        split: int | None = None,
    ):
        split_gather = None
        if split is not None:
            blocks = self._tables.of_layer(layer_idx)
            split_gather = lambda: shared_prefix_kv(blocks, layer_idx, first, split, num_tokens)  # noqa: E731
        plan = self._plan(DecodePlan, layer_idx, first, num_tokens, split_gather=split_gather)
        return plan_placeholders(key_states, value_states, plan)

    def _prefill_placeholders(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, first: int, num_tokens: int
    ):
        return plan_placeholders(key_states, value_states, self._plan(PrefillPlan, layer_idx, first, num_tokens))

    def _plan(self, plan_class, layer_idx: int, first: int, num_tokens: int, **extra):
        """A `DecodePlan` or `PrefillPlan` of pool layer `layer_idx` for a step ending at `num_tokens`, its mask from
        position `first`: the step's tables, lengths and memos, built by the group's first layer and shared by the
        rest."""
        blocks = self._tables.of_layer(layer_idx)
        step = blocks.step_metadata(num_tokens)
        key_cache, value_cache = self._nhd_views(blocks.pool, layer_idx)
        return plan_class(
            key_cache=key_cache,
            value_cache=value_cache,
            block_tables=step["block_tables"],
            seq_lens=step["seq_lens"],
            kv_offset=first,
            position_offset=step["position_offset"],
            gather=lambda: self._gather_visible(layer_idx, first, num_tokens),
            _kv_starts=step["kv_starts"],
            _backends=step["backends"],
            **extra,
        )

    def _flat_views(self, pool: BlockPool, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s [1, kv_heads, num_blocks * block_size, head_dim] K and V views of the pool
        (slot-indexed), made again only when the pool's tensors changed (a private pool grew)."""
        return _memo_views(self._flat_memo, pool, layer_idx, lambda t: t.view(1, t.shape[0], -1, t.shape[-1]))

    def _nhd_views(self, pool: BlockPool, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s [num_blocks, block_size, kv_heads, head_dim] K and V views of the pool, made again
        only when the pool's tensors changed (a private pool grew)."""
        return _memo_views(self._nhd_memo, pool, layer_idx, pool.nhd_view)

    # ------------------------------------------------------------- lifecycle
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
        _check_prefix_caching(pool, "from_prefix")
        if "indexed_attention" in pool.layout.layer_types:
            raise UnsupportedModel(
                getattr(config, "model_type", None),
                "its indexed-attention layers keep indexer keys beside the paged K/V, which the prefix cache does not "
                "hold",
                "PagedCache.from_prefix",
            )
        token_ids = _token_rows(input_ids)
        if len(token_ids) != 1:
            raise ValueError(f"from_prefix takes one sequence ([S] or [1, S] token ids), got {len(token_ids)} rows")
        cache = cls(config, pool=pool, **kwargs)
        cache._states.refuse_prefix_reuse("from_prefix")
        block_size = pool.block_size
        num_blocks = (len(token_ids[0]) - 1) // block_size
        hashes = block_hashes(token_ids[0][: num_blocks * block_size], block_size)
        num_cached, first_blocks, tables = pool.allocator.take_longest_prefix(hashes, cache._group_windows, block_size)
        if num_cached:
            for group_tables, first, table in zip(cache._tables.groups, first_blocks, tables):
                group_tables.adopt(table, base=first)
        for layer in cache._paged_layers:
            layer.cumulative_length = num_cached * block_size
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
        self._settle()
        self._drop_reservation()
        try:
            if token_ids is not None:
                self._cache_rows(token_ids, attention_mask)
        finally:  # the blocks go back even when the token ids were refused
            self._tables.release()
            self._indexer.clear()
            if self.pool is not None:
                workspace_for(self.pool).clear()
            self._last_layer_updated = 0
            for layer in self._paged_layers:
                layer.cumulative_length = 0
            self._states.clear()

    def _cache_rows(self, token_ids, attention_mask) -> None:
        """Remember every full block of every unpadded row in the prefix cache (see `release`)."""
        blocks = self._blocks
        self._states.refuse_prefix_reuse("release(token_ids=...)")
        _check_prefix_caching(blocks.pool, "release(token_ids=...)")
        if not blocks.num_rows:
            return
        rows = _token_rows(token_ids)
        if len(rows) != blocks.num_rows:
            raise ValueError(f"release got token_ids for {len(rows)} rows, the cache holds {blocks.num_rows}")
        num_tokens = min(layer.cumulative_length for layer in self._paged_layers)
        shortest = min(len(row) for row in rows)
        if shortest < num_tokens:
            raise ValueError(
                f"release got a row of {shortest} token_ids, the cache computed {num_tokens} per row: pass every token "
                "of each row, prompt and generated (what generate() returned)"
            )
        padded = [False] * len(rows) if attention_mask is None else [not all(r) for r in _token_rows(attention_mask)]
        for group, group_tables in enumerate(self._tables.groups):
            group_tables.cache_rows(rows, padded, num_tokens, group)

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
        self._settle()
        branch._tables.share_from(self._tables)
        branch._indexer = self._indexer.copy()
        branch._last_layer_updated = self._last_layer_updated
        for layer, source in zip(branch._paged_layers, self._paged_layers):
            layer.cumulative_length, layer.record_past = source.cumulative_length, source.record_past
            if source.is_initialized:
                layer.dtype, layer.device, layer.is_initialized = source.dtype, source.device, True
        branch._states.copy_from(self._states)
        memo[id(self)] = branch
        return branch

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def reset(self) -> None:
        self.release()

    # ------------------------------------------------------ generate() hooks
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as in `DynamicCache.crop`)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        self._settle()
        self._drop_reservation()
        if tokens_to_remove == 0:
            self._states.crop(0)
            self._release_before_windows()
            return
        self._states.check_croppable(tokens_to_remove)
        lengths = [max(layer.cumulative_length + tokens_to_remove, 0) for layer in self._paged_layers]
        self._tables.truncate(
            [min(self._paged_layers[i].first_visible(lengths[i]) for i in group) for group in self.layer_groups],
            [max(lengths[i] for i in group) for group in self.layer_groups],
            crop_call=f"crop({tokens_to_remove})",
        )
        for layer, length in zip(self._paged_layers, lengths):
            layer.cumulative_length = length
        self._states.crop(tokens_to_remove)
        self._indexer.truncate(max(lengths))  # every indexed layer holds every token (a KV-sharing one no K/V)
        # NOTE: recording past states or not. `DynamicSlidingWindowLayer.crop` (crop(0) too) cuts its states back to
        # the window that ends at the new length, so no later crop can reach further back in DynamicCache either;
        # releasing here bounds assisted / prompt-lookup decoding to about the window plus the candidates.
        self._release_before_windows()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`. Permutes block tables (ref counts), never K/V; a hybrid
        model's states are index-selected on the batch dim, as DynamicCache does."""
        self._select_rows(beam_idx.tolist())
        self._states.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self._tables.num_rows) for _ in range(repeats)])
        self._states.repeat_rows(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist())
        self._states.select_rows(indices)

    def _select_rows(self, rows: list[int]) -> None:
        self._settle()
        reserved = self._drop_reservation()
        self._tables.select_rows(rows)
        self._indexer.select_rows(rows)
        if reserved is not None:  # the rows changed under the reservation: take it again for the new rows
            self.reserve(reserved)

    # ---------------------------------------------------------------- queries
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in decoder layer `layer_idx`. A layer without K/V (a hybrid model's linear-attention
        layer) tracks no length: layer 0 then means the first attention layer, as in `Cache.get_seq_length`. Inside
        a compiled forward of a compileable cache: a 0-dim tensor, as `StaticCache` returns."""
        if self._fixed is not None:
            if torch.compiler.is_compiling():
                return self._fixed.past_length
            self._settle()
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
        return self._paged_layers[pool_layer].cumulative_length

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


def _heads_first(states: torch.Tensor) -> torch.Tensor:
    """[W, kv_heads, q_len, head_dim] -> [kv_heads, W * q_len, head_dim]."""
    return states.transpose(0, 1).reshape(states.shape[1], -1, states.shape[-1])


def _check_prefix_caching(pool: BlockPool | None, call: str) -> None:
    if pool is None or not pool.allocator.enable_prefix_caching:
        raise ValueError(
            f"{call} needs a pool with prefix caching: BlockPool.for_model(model, ..., enable_prefix_caching=True)"
        )


def _token_rows(token_ids) -> list[list[int]]:
    """[S] or [B, S] ids (tensor or nested lists) -> B lists of ints."""
    rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    return [list(rows)] if not rows or not isinstance(rows[0], (list, tuple)) else [list(row) for row in rows]


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


def _memo_views(memo: dict, pool: BlockPool, layer_idx: int, make) -> tuple[torch.Tensor, torch.Tensor]:
    """`make(key_cache)` and `make(value_cache)` of layer `layer_idx`, kept in `memo` with the pool tensors they view
    and made again when those changed (a private pool grew)."""
    key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
    views = memo.get(layer_idx)
    if views is None or views[0] is not key_cache or views[1] is not value_cache:
        views = memo[layer_idx] = (key_cache, value_cache, make(key_cache), make(value_cache))
    return views[2], views[3]
