"""PagedCache: a `transformers.Cache` whose K/V live in a shared `BlockPool`.

`model.generate(..., past_key_values=PagedCache(config=model.config))` gives the same tokens as `DynamicCache`:
every layer's `update` returns exactly the K/V tensor a `DynamicLayer` (or `DynamicSlidingWindowLayer`) would,
gathered from the pool instead of kept contiguous. What changes is storage: blocks are allocated `block_size`
tokens at a time from a pool that many caches can share, rows that hold the same prefix share its blocks by
reference count, and beam search reorders block tables instead of copying K/V.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .allocator import block_hashes
from .block_tables import BlockTables
from .errors import PoolExhausted
from .kernels import store_kv
from .kernels.dispatch import BACKEND_ENV_VAR, resolve_backend
from .pool import BlockPool, KVLayout

# The attention implementation name hf_paged registers (see attention.py). "paged" is transformers' own.
PAGED_ATTENTION = "hf_paged"
_SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
_SUPPORTED_LAYER_TYPES = ("full_attention", *_SLIDING_LAYER_TYPES)


@dataclass
class DecodePlan:
    """What a decode step's attention needs to read one layer's K/V from the pool without gathering it.

    `PagedCache.update` returns it attached to an empty `[B, kv_heads, 0, head_dim]` tensor (`key.decode_plan`)
    when the model runs the `hf_paged` attention implementation. `block_tables`, `seq_lens` and the kv_start memo
    are built once per step and shared by every layer.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] view of the head-major pool
    value_cache: torch.Tensor  # same
    block_tables: torch.Tensor  # [B, num_table_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: tokens per row from the first held block, the new one included
    kv_offset: int  # absolute position of the first key that the attention mask describes
    position_offset: int  # absolute position of block_tables[:, 0]'s first token (blocks released before it)
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the K/V an sdpa step would get: [B, H, kv_len, D]
    # Rows of different lengths (the engine's batches): `seq_lens` alone says which keys each row sees, the
    # attention mask is ignored, and `gather` pads every row to the longest (mask with `length_mask`).
    ragged: bool = False
    _kv_starts: dict = field(default_factory=dict)  # id(mask) -> (mask, kv_start); shared by the step's layers

    def kv_start(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[B] int32: the first visible key of each row, from a decode mask ([B, 1, 1, kv_len] bool, or None).

        None when the mask is not "hidden prefix, then every key visible" (left padding, sliding window): such a
        mask cannot be described by one start per row, and the caller falls back to gather + SDPA.
        """
        if attention_mask is None or self.ragged:
            return torch.zeros_like(self.seq_lens)
        memo = self._kv_starts.get(id(attention_mask))
        if memo is not None and memo[0] is attention_mask:
            return memo[1]
        kv_start = None
        if attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1:
            visible = attention_mask[:, 0, -1, :]  # [B, kv_len]
            first = visible.int().argmax(dim=-1)
            if bool((visible.sum(dim=-1) == visible.shape[-1] - first).all()):
                kv_start = (first + self.kv_offset - self.position_offset).to(torch.int32)
        self._kv_starts[id(attention_mask)] = (attention_mask, kv_start)
        return kv_start


    def length_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[B, 1, 1, max_len] bool for a ragged `gather`: key j is visible to row b when j < seq_lens[b] (and,
        with a sliding window, j > seq_lens[b] - 1 - sliding_window)."""
        positions = torch.arange(int(self.seq_lens.max()), device=self.seq_lens.device)[None, :]
        lengths = self.seq_lens[:, None]
        visible = positions < lengths
        if sliding_window is not None:
            visible &= positions > lengths - 1 - sliding_window
        return visible[:, None, None, :]


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`. It holds a length, not tensors: the K/V are in the pool.

    `sliding_window=None` mirrors `DynamicLayer`; an int mirrors `DynamicSlidingWindowLayer` (same returned K/V,
    same mask sizes; the pool still keeps every block, see `PagedCache`).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedCache, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        # A weak reference: the cache owns its layers, and a cycle would delay the finalizer that frees blocks.
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self.record_past = False  # as DynamicSlidingWindowLayer: keep out-of-window blocks until the next crop

    def activate_past_recording(self) -> None:
        self.record_past = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def first_visible(self, num_past: int) -> int:
        """Absolute position of the first key returned by an update after `num_past` cached tokens."""
        if self.sliding_window is None:
            return 0
        return max(num_past - self.sliding_window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self.first_visible(self.cumulative_length)
        return self.cumulative_length - kv_offset + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self._cache.release()

    def crop(self, tokens_to_remove: int) -> None:
        self._cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cache.batch_select_indices(indices)

    def offload(self):
        raise NotImplementedError("PagedCache layers cannot be offloaded: their K/V live in the shared BlockPool")

    prefetch = offload


class PagedCache(Cache):
    """A paged KV cache for `generate()` and any model on the standard `Cache` API.

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config; gives the layer types (full / sliding window)
            and, for a private pool, the K/V shapes. Needed unless `pool` is given.
        pool (`BlockPool`, *optional*): a pool shared with other caches. Without one, the cache makes a private,
            growable pool on its first `update`, with the dtype and device of the first `key_states`.
        block_size (`int`, defaults to 16): tokens per block of a private pool (a shared pool has its own).
        dtype (`torch.dtype`, *optional*), device (`torch.device`, *optional*): for a private pool; default to the
            model's (the first `key_states`).
        share_rows (`bool`, defaults to `True`): store identical rows (the expanded prompt of
            `num_return_sequences` / `num_beams`) once, shared by reference count.
        release_out_of_window (`bool`, defaults to `True`): when every layer has a sliding window (Mistral-style),
            give back blocks that fell out of all windows, so a long generation holds about what DynamicCache
            does. Models with any full-attention layer keep every block.

    Shapes: `update(key_states, value_states, layer_idx)` takes `[B, num_kv_heads, q_len, head_dim]` and returns
    `[B, num_kv_heads, kv_len, head_dim]`, where `kv_len` is the cached length plus `q_len` (for a sliding layer,
    only the window, exactly like `DynamicSlidingWindowLayer`). Unlike DynamicCache's, the returned tensors are
    views into a reused gather buffer, valid until the next `update` (attention consumes them at once).

    Blocks go back to the pool on `release()`, on leaving a `with PagedCache(...)` block, or when the cache is
    garbage-collected. One cache belongs to one thread at a time; several caches may share one pool across threads.

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
    ):
        if config is None and pool is None:
            raise ValueError("PagedCache needs a model config, a BlockPool, or both: PagedCache(config=model.config)")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if config is not None:
            config = config.get_text_config(decoder=True)
            layout = KVLayout.from_config(config)
            if pool is not None:
                pool.check_compatible(layout)
            sliding_windows = _sliding_windows(config)
        else:
            layout = pool.layout
            sliding_windows = [None] * layout.num_layers
        self.layout = layout
        self._config = config
        self.block_size = pool.block_size if pool is not None else block_size
        self._dtype, self._device = dtype, device
        self.share_rows = share_rows
        self._blocks = BlockTables()
        self._blocks.pool = pool
        self._workspace: dict[str, torch.Tensor] = {}
        # NOTE: holds `_blocks` (not `self`), so the finalizer can run once `self` is unreachable.
        self._finalizer = weakref.finalize(self, self._blocks.release)
        layers = [PagedLayer(self, i, window) for i, window in enumerate(sliding_windows)]
        super().__init__(layers=layers)
        self._releases_out_of_window = release_out_of_window and all(w is not None for w in sliding_windows)

    # ------------------------------------------------------------------ pool
    @property
    def pool(self) -> BlockPool | None:
        """The pool holding this cache's blocks (None until the first update of a cache with a private pool)."""
        return self._blocks.pool

    def _init_pool(self, key_states: torch.Tensor, num_tokens: int) -> None:
        num_blocks = max(-(-num_tokens // self.block_size) * key_states.shape[0], 4)
        self._blocks.pool = BlockPool(
            self.layout,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=self._dtype if self._dtype is not None else key_states.dtype,
            device=self._device if self._device is not None else key_states.device,
            growable=True,
        )

    # ---------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` ([B, kv_heads, q_len, head_dim]) after the cached tokens of layer
        `layer_idx` and return that layer's visible K/V ([B, kv_heads, kv_len, head_dim])."""
        layer = self.layers[layer_idx]
        blocks = self._blocks
        batch_size, _, q_len, _ = key_states.shape
        num_past = layer.cumulative_length
        num_tokens = num_past + q_len
        if blocks.pool is None:
            self._init_pool(key_states, num_tokens)
        pool = blocks.pool
        pool.check_states(layer_idx, key_states)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)

        if layer_idx == 0 and self._releases_out_of_window:
            self._release_out_of_window()
        starting = blocks.num_rows == 0
        if starting:
            blocks.start(self._initial_leaders(key_states, value_states))
        elif batch_size != blocks.num_rows:
            raise ValueError(
                f"PagedCache holds {blocks.num_rows} rows but layer {layer_idx} got key_states for {batch_size}; "
                "use batch_repeat_interleave / batch_select_indices to change the batch of a filled cache"
            )

        if blocks.has_groups():
            self._verify_groups(key_states, value_states)
        # Both steps check for enough free blocks before they change anything; if the second fails, give back what
        # the first took, so a failed update holds exactly the blocks it held before.
        writers = tuple(sorted(set(blocks.leaders)))
        num_table_blocks = blocks.num_table_blocks
        try:
            blocks.ensure_capacity(num_tokens)
            blocks.make_writable_once(writers, num_past, num_tokens)
        except PoolExhausted:
            if starting:
                blocks.release()
            else:
                blocks.truncate(num_table_blocks * self.block_size)
            raise

        # Store the new rows: [W, kv_heads, q_len, head_dim] -> [kv_heads, W * q_len, head_dim] at their slots.
        subset = len(writers) < batch_size
        slots = blocks.slots(writers if subset else None, num_past, num_tokens).flatten()
        if subset:
            key_states, value_states = key_states[list(writers)], value_states[list(writers)]
        store_kv_rows(pool.key_cache[layer_idx], pool.value_cache[layer_idx], key_states, value_states, slots)
        layer.cumulative_length = num_tokens

        first = layer.first_visible(num_past)
        if q_len == 1 and self._runs_paged_attention():
            return self._decode_placeholders(layer_idx, key_states, first, num_tokens)
        return self._gather_visible(layer_idx, first, num_tokens)

    def _release_out_of_window(self) -> None:
        """Before a step: give back the blocks before the first key any layer's next update can return.

        NOTE: at the start of a step, never during one: the previous step's attention has read its keys, and each
        layer's `first_visible(cumulative_length)` is exactly where its next gather starts.
        """
        if self._blocks.num_rows and not any(layer.record_past for layer in self.layers):
            self._blocks.release_front(min(layer.first_visible(layer.cumulative_length) for layer in self.layers))

    def _runs_paged_attention(self) -> bool:
        return getattr(self._config, "_attn_implementation", None) == PAGED_ATTENTION

    def _gather_visible(self, layer_idx: int, first: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, num_tokens) of every row: two [B, kv_heads, num_tokens - first, head_dim] tensors.

        NOTE: they are views into this cache's workspace, overwritten by the next `update`. Attention consumes
        them at once, and reusing the buffer is what makes the gather cheaper than DynamicCache's `torch.cat`
        (which pays for a fresh allocation every layer and step: measured 5x at batch 16 x 4k tokens on CPU).
        """
        pool = self._blocks.pool
        num_heads, num_pool_blocks, block_size, head_dim = pool.key_cache[layer_idx].shape
        first_block, end_block = first // block_size, -(-num_tokens // block_size)
        index = self._blocks.gather_index(first_block, end_block, num_heads, num_pool_blocks)
        batch_size = self._blocks.num_rows
        start, stop = first - first_block * block_size, num_tokens - first_block * block_size
        gathered = []
        for name, cache in (("keys", pool.key_cache[layer_idx]), ("values", pool.value_cache[layer_idx])):
            out = self._workspace_view(name, (index.numel(), block_size, head_dim), cache)
            torch.index_select(cache.view(-1, block_size, head_dim), 0, index, out=out)
            gathered.append(out.view(batch_size, num_heads, -1, head_dim)[:, :, start:stop])
        return gathered[0], gathered[1]

    def _workspace_view(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `shape` view of a grow-only buffer (25% headroom, so a growing sequence rarely reallocates)."""
        numel = shape[0] * shape[1] * shape[2]
        buffer = self._workspace.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = like.new_empty(numel + numel // 4)
            self._workspace[name] = buffer
        return buffer[:numel].view(shape)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the gather workspace (transient K/V of one layer; not pool memory)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._workspace.values())

    def _decode_placeholders(self, layer_idx: int, key_states: torch.Tensor, first: int, num_tokens: int):
        pool, blocks = self._blocks.pool, self._blocks
        step = blocks.step_metadata(num_tokens)
        plan = DecodePlan(
            key_cache=pool.nhd_view(pool.key_cache[layer_idx]),
            value_cache=pool.nhd_view(pool.value_cache[layer_idx]),
            block_tables=step["block_tables"],
            seq_lens=step["seq_lens"],
            kv_offset=first,
            position_offset=step["position_offset"],
            gather=lambda: self._gather_visible(layer_idx, first, num_tokens),
            _kv_starts=step["kv_starts"],
        )
        batch_size, num_heads, _, head_dim = key_states.shape
        placeholder = key_states.new_empty(batch_size, num_heads, 0, head_dim)
        placeholder.decode_plan = plan
        return placeholder, placeholder

    def _initial_leaders(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
        """Group adjacent identical rows (generate() expands prompts with repeat_interleave, so copies are adjacent)."""
        batch_size = key_states.shape[0]
        leaders = list(range(batch_size))
        if not self.share_rows or batch_size == 1:
            return leaders
        same = _rows_equal(key_states[1:], key_states[:-1]) & _rows_equal(value_states[1:], value_states[:-1])
        for row, is_same in enumerate(same.tolist(), start=1):
            if is_same:
                leaders[row] = leaders[row - 1]
        return leaders

    def _verify_groups(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Split off every follower whose new K/V differ from its leader's at this layer.

        A split row becomes its own writer; the `make_writable_once` that follows copies-on-write the blocks it is
        about to write, with the earlier layers of this step (written by its old leader, equal to its own) inside.
        """
        blocks = self._blocks
        followers = [row for row, leader in enumerate(blocks.leaders) if leader != row]
        leaders = [blocks.leaders[row] for row in followers]
        same = _rows_equal(key_states[followers], key_states[leaders]) & _rows_equal(
            value_states[followers], value_states[leaders]
        )
        diverged = [row for row, is_same in zip(followers, same.tolist()) if not is_same]
        if diverged:
            blocks.split(diverged)

    # ------------------------------------------------------------- lifecycle
    @classmethod
    def from_prefix(cls, pool: BlockPool, input_ids, config=None, **kwargs) -> PagedCache:
        """A cache already holding the longest cached prefix of `input_ids` ([S] or [1, S] token ids).

        At least one token is always left to compute (generate() re-feeds the whole prompt when the cache holds all
        of it), so at most `(S - 1) // block_size` blocks are reused. Needs `BlockPool(...,
        enable_prefix_caching=True)`; blocks get cached by `release(token_ids=...)`.

        `model.generate(input_ids, past_key_values=PagedCache.from_prefix(pool, input_ids, model.config))` then
        computes only the rest of the prompt.
        """
        token_ids = _token_rows(input_ids)
        if len(token_ids) != 1:
            raise ValueError(f"from_prefix takes one sequence ([S] or [1, S] token ids), got {len(token_ids)} rows")
        token_ids = token_ids[0]
        cache = cls(config, pool=pool, **kwargs)
        num_blocks = (len(token_ids) - 1) // pool.block_size
        block_ids = pool.allocator.lookup_prefix(block_hashes(token_ids[: num_blocks * pool.block_size], pool.block_size))
        if block_ids:
            cache._blocks.adopt(block_ids)
            for layer in cache.layers:
                layer.cumulative_length = len(block_ids) * pool.block_size
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
        blocks, pool = self._blocks, self._blocks.pool
        if token_ids is not None and pool is not None and pool.allocator.enable_prefix_caching and blocks.num_rows:
            rows = _token_rows(token_ids)
            if len(rows) != blocks.num_rows:
                raise ValueError(f"release got token_ids for {len(rows)} rows, the cache holds {blocks.num_rows}")
            padded = [False] * len(rows) if attention_mask is None else [not all(r) for r in _token_rows(attention_mask)]
            num_cached_tokens = min(layer.cumulative_length for layer in self.layers)
            for row, (row_ids, is_padded) in enumerate(zip(rows, padded)):
                if is_padded:
                    continue
                row_ids = row_ids[: min(len(row_ids), num_cached_tokens)]
                hashes = block_hashes(row_ids, pool.block_size)[blocks.base :]  # released blocks are gone
                for block_id, block_hash in zip(blocks.tables[row], hashes):
                    pool.allocator.cache_block(block_id, block_hash)
        blocks.release()
        self._workspace.clear()
        for layer in self.layers:
            layer.cumulative_length = 0

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
        if tokens_to_remove == 0:
            return
        lengths = [max(layer.cumulative_length + tokens_to_remove, 0) for layer in self.layers]
        released = self._blocks.base * self.block_size
        needed = min(layer.first_visible(length) for layer, length in zip(self.layers, lengths))
        if needed < released:
            raise RuntimeError(
                f"`crop({tokens_to_remove})` needs keys from position {needed}, but the sliding window already released "
                f"positions before {released}; call `activate_past_recording()` first to be able to roll back"
            )
        if self._blocks.pool is not None:
            self._blocks.truncate(max(lengths))
        for layer, length in zip(self.layers, lengths):
            layer.cumulative_length = length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`. Permutes block tables (ref counts), never K/V."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self._blocks.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist())

    def _select_rows(self, indices: list[int]) -> None:
        if self._blocks.num_rows == 0:
            return
        if not all(0 <= i < self._blocks.num_rows for i in indices):
            raise IndexError(f"row indices must be in [0, {self._blocks.num_rows}), got {indices}")
        self._blocks.select_rows(indices)

    # ---------------------------------------------------------------- queries
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].cumulative_length

    @property
    def num_held_blocks(self) -> int:
        """Distinct pool blocks this cache holds (a block shared by rows counts once)."""
        return len(self._blocks.held_block_ids())

    @property
    def held_bytes(self) -> int:
        """Bytes of K/V this cache holds in the pool, all layers."""
        pool = self._blocks.pool
        return 0 if pool is None else self.num_held_blocks * pool.bytes_per_block

    @property
    def block_tables(self) -> list[list[int]]:
        """A copy of the per-row block tables (block ids in token order)."""
        return [list(table) for table in self._blocks.tables]

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self._blocks.num_rows}, seq_length={self.get_seq_length()}, "
            f"held_blocks={self.num_held_blocks}, pool={self._blocks.pool!r})"
        )


def _sliding_windows(config) -> list[int | None]:
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise NotImplementedError(
            f"PagedCache supports layer types {list(_SUPPORTED_LAYER_TYPES)}; this model has {unsupported}"
        )
    return [
        kwargs["sliding_window"] if layer_type in _SLIDING_LAYER_TYPES else None
        for layer_type, kwargs in zip(layer_types, layer_kwargs)
    ]


def _token_rows(token_ids) -> list[list[int]]:
    """[S] or [B, S] ids (tensor or nested lists) -> B lists of ints."""
    rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    return [list(rows)] if not rows or not isinstance(rows[0], (list, tuple)) else [list(row) for row in rows]


def store_kv_rows(key_cache, value_cache, key_states, value_states, slots) -> None:
    """Write [W, kv_heads, q_len, head_dim] states to `slots` ([W * q_len]) of the head-major pool, in place.

    The Triton store kernel on CUDA (or when HF_PAGED_ATTENTION_BACKEND=triton forces it, e.g. under
    TRITON_INTERPRET=1); `index_copy_` on the flattened [kv_heads, num_blocks * block_size, head_dim] view elsewhere.
    """
    num_heads, _, _, head_dim = key_cache.shape
    device = key_cache.device
    if device.type == "cuda" or os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() == "triton":
        if resolve_backend(None, device) == "triton":
            key_rows = key_states.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [W * q_len, H, D]
            value_rows = value_states.transpose(1, 2).reshape(-1, num_heads, head_dim)
            store_kv(key_rows, value_rows, BlockPool.nhd_view(key_cache), BlockPool.nhd_view(value_cache), slots,
                     backend="triton")
            return
    for cache, states in ((key_cache, key_states), (value_cache, value_states)):
        new = states.transpose(0, 1).reshape(num_heads, -1, head_dim)  # [H, W * q_len, D]
        cache.view(num_heads, -1, head_dim).index_copy_(1, slots, new)


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, ...] x [N, ...] -> [N] bool: row n of a equals row n of b exactly."""
    return (a == b).flatten(1).all(dim=1)
