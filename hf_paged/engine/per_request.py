"""The per-request step: each scheduled request in a forward of its own, with the model's own attention.

The packed step (`StepCache`) needs a model that takes `position_ids` and `logits_to_keep`, attends through
transformers' attention interface and reads no K/V after `cache.update()`. A model that breaks one of these
(model_support.py names it) is served one request at a time instead:

    step rows:  | d0 | d1 | p0: prompt chunk, 5 tokens |
    forwards:   model([d0's token], cache=RowCache(d0))      each [1, q_len], batch 1
                model([d1's token], cache=RowCache(d1))
                model([p0's 5 tokens], cache=RowCache(p0))
    logits:     each forward's last token -> [num_rows, vocab]

A `RowCache` is a one-row `Cache` over the Engine's pool: `update()` stores the new K/V in the request's blocks and
returns the K/V that a batch-1 `DynamicCache` would return (the cached tokens, through a sliding layer's window,
and the new ones), gathered from the pool. So the model's own mask, its positions (`get_seq_length()`) and any code
that reads K/V see what `generate()` of that request alone shows them, and the attention is the model's own
(sdpa, eager, or code of its own).

Sliding layers: `generate()` computes a prompt in one forward, so every prompt token sees all the prompt before it
(through the model's own mask; some models, such as Moshi, take no window from their mask at all), and a sliding
layer's cache keeps only its window after that. So a prompt chunk here attends as a full layer, and each generated
token fed back through a sliding layer's window; the Engine keeps every block of a per-request model (no block
leaves a window), so a chunk finds the whole prompt before it. A request's output blocks are then not what another
request's prompt holding that output computes: the Engine turns prefix caching off for such a model
(`prefix_caching_reason`).

The cost: one forward per scheduled request, so a step gets no batching gain (each decode row is a batch-1
forward), and a sliding model holds all its blocks and caches no prefix. Everything else is the Engine's:
scheduling, blocks, prefix caching, chunked prefill, preemption, sampling, aborts, failure isolation (a row that
raises fails alone, without the halving of the packed step).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from ..cache.block_tables import GatherTables, head_major_index
from ..cache.gather import visible_kv
from ..cache.hybrid import PagedHybridLayer, decoder_layers
from ..cache.layer import PagedLayer
from ..errors import UnsupportedModel
from ..storage import BlockPool, KVLayout, sliding_windows
from ..storage.kv_layers import holds_state
from .model_support import never_stored, takes
from .request import Request
from .step_cache import StepCache


class RowCache(Cache):
    """One request's cache for one forward: `seq_len` tokens cached in its blocks, `q_len` new ones.

    Args:
        pool (`BlockPool`): the Engine's pool.
        block_tables (`list[list[int]]`): per layer group, the request's held blocks (covering `seq_len + q_len`
            tokens from `first_blocks[g] * block_size`).
        first_blocks (`list[int]`): per layer group, the blocks released before its table (sliding groups).
        seq_len (`int`): tokens whose K/V are in the blocks.
        q_len (`int`): tokens this forward adds.
        windows (`list[int | None]`): per layer, its sliding window (None: full attention), as `DynamicCache` makes
            its layers (`sliding_windows(config)`).
        model_type (`str`, *optional*): named by the `UnsupportedModel` a write to a layer the pool lacks raises.

    `update(key_states, value_states, layer_idx)` takes `[1, kv_heads, q_len, head_dim]` and returns
    `[1, kv_heads, kv_len, head_dim]`: the new K/V themselves when nothing is cached, else the layer's visible K/V
    from the pool: a view of the pool where the row's blocks are consecutive, else of the pool's gather workspace
    (`cache/gather.py`), valid until the next update.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_tables: list[list[int]],
        first_blocks: list[int],
        seq_len: int,
        q_len: int,
        windows: list[int | None],
        *,
        model_type: str | None = None,
        states: RequestStates | None = None,
    ):
        # NOTE: the one-row StepCache stores the new tokens in their slots (and checks the layer and shapes).
        self._step = StepCache(
            pool,
            [[table] for table in block_tables],
            [seq_len],
            [q_len],
            first_blocks=[[first] for first in first_blocks],
            model_type=model_type,
        )
        self.seq_len, self.q_len = seq_len, q_len
        self._tables = [_RowTables(pool, table, first) for table, first in zip(block_tables, first_blocks)]
        if states is None:  # an attention-only model: decoder layer i is pool layer i
            layers = [PagedLayer(self, layer_idx, window) for layer_idx, window in enumerate(windows)]
            self._paged, self._pool_layers = layers, list(range(len(layers)))
        else:
            layers, self._paged = states.layers_for(self, windows, fresh=seq_len == 0)
            self._pool_layers = states.pool_layers
        for layer in self._paged:
            layer.cumulative_length = seq_len
        super().__init__(layers=layers)

    @property
    def num_updates(self) -> int:
        """`update` calls so far (the Engine checks that a forward stored its K/V)."""
        return self._step.num_updates

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store `key_states`/`value_states` ([1, kv_heads, q_len, head_dim]) in the request's blocks and return
        layer `layer_idx`'s visible K/V ([1, kv_heads, kv_len, head_dim]), as `DynamicCache.update` would."""
        pool_layer = self._pool_layers[layer_idx] if 0 <= layer_idx < len(self._pool_layers) else layer_idx
        if pool_layer is None:
            raise UnsupportedModel(
                self._step.model_type,
                f"it writes K/V to its layer {layer_idx}, which keeps a recurrent or convolution state only",
                "Engine",
            )
        self._step.update(key_states, value_states, pool_layer)  # checks the layer and shapes, stores
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        layer.cumulative_length = self.seq_len + self.q_len
        if self.seq_len == 0:  # a first prefill: the visible K/V are this forward's
            return key_states, value_states
        # A view of the pool where the row's blocks are consecutive, else a gather into the pool's workspace.
        tables = self._tables[self._step.pool.group_of_layer[pool_layer]]
        return visible_kv(tables, pool_layer, layer.first_visible(self.seq_len), self.seq_len + self.q_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in decoder layer `layer_idx`; a layer with no K/V (a recurrent state) means the first
        attention layer, as in `Cache.get_seq_length`."""
        if layer_idx >= len(self.layers):
            return 0
        length = getattr(self.layers[layer_idx], "cumulative_length", None)
        return length if length is not None else self._paged[0].cumulative_length

    @property
    def model_type(self) -> str | None:
        """The model type named by the refusals of this cache and its layers."""
        return self._step.model_type


class RequestStates:
    """A hybrid model's per-request recurrent and convolution states, kept by its `Request` between the forwards of
    the per-request step (the pool holds only K/V), and the map from its decoder layers to the pool's (also for a
    model with MLP-only layers, which hold nothing).

    The cache layers of every decoder layer are transformers' own state layers (`LinearAttentionLayer`, as
    `DynamicCache` makes them), paged layers for the attention layers, and `PagedHybridLayer`s for layers that keep
    both. A request's first forward (nothing cached: a new request, or a preempted one computed again) makes fresh
    states; each later forward of the request reuses them, so a prompt computed in chunks carries its state from
    chunk to chunk, as one forward would. `num_tokens` says how many of the request's tokens the states have seen: a
    forward over other cached tokens (its states lost to a forward that failed part-way, or advanced by a step that
    was then undone) computes the request again from its first token instead (`PerRequestStep`). A state cannot be
    rebuilt from blocks, so the Engine turns prefix caching off for such a model (`prefix_caching_reason`).
    """

    def __init__(self, config):
        self.layer_types, self.layer_kwargs = get_layer_types_and_kwargs(config)
        layout = KVLayout.from_config(config)
        self.pool_layers = layout.pool_layers(len(self.layer_types))  # decoder layer -> pool layer (None: no K/V)
        self.kv_layers = layout.kv_layers
        self.keeps_state = any(holds_state(layer_type) for layer_type in self.layer_types)  # else MLP-only layers
        self.layers: list | None = None  # the last forward's cache layers, holding the states
        self.num_tokens = 0  # the request's tokens the states have seen (set after each forward)

    def layers_for(self, cache: Cache, windows: list[int | None], fresh: bool) -> tuple[list, list[PagedLayer]]:
        """(cache layers of every decoder layer, the paged ones in pool-layer order) for a forward of `cache`:
        new states when `fresh`, else the request's from its last forward."""
        if fresh or self.layers is None or not self.keeps_state:
            assert fresh or not self.keeps_state, "a forward over cached tokens needs the states that saw them"
            layers, paged = decoder_layers(cache, self.layer_types, self.layer_kwargs, self.kv_layers, windows)
        else:
            layers, paged = [], []
            for layer_idx, previous in enumerate(self.layers):
                pool_layer = self.pool_layers[layer_idx]
                if pool_layer is None:  # a state-only layer: the same object, its states advance
                    layers.append(previous)
                    continue
                if isinstance(previous, PagedHybridLayer):  # its states and a view of this forward's cache
                    previous.rebind(cache)
                    previous.sliding_window = windows[pool_layer]  # a prompt forward's (None) or a token's window
                    previous.is_sliding = previous.sliding_window is not None
                    layer = previous
                else:
                    layer = PagedLayer(cache, layer_idx, windows[pool_layer])
                layers.append(layer)
                paged.append(layer)
        self.layers = layers
        return layers, paged


class _RowTables(GatherTables):
    """One row's block table in one layer group, as `visible_kv` reads it: `table[i]` holds logical block
    `base + i` (the blocks before `base` were released)."""

    num_rows = 1

    def __init__(self, pool: BlockPool, table: list[int], base: int):
        self.pool, self.table, self.base = pool, table, base
        self._memo: dict[tuple, object] = {}  # for the forward's other layers

    @property
    def memo(self) -> dict:
        """Values worked out once for this forward's layers (`cache/gather.py` keeps its pool views here)."""
        return self._memo

    def consecutive_run(self, first_block: int, end_block: int) -> int | None:
        """The pool block id of logical block `first_block` when blocks [first_block, end_block) are consecutive."""
        key = ("run", first_block, end_block)
        if key not in self._memo:
            run = self.table[first_block - self.base : end_block - self.base]
            self._memo[key] = run[0] if run == list(range(run[0], run[0] + len(run))) else None
        return self._memo[key]

    def gather_index(self, first_block: int, end_block: int, num_heads: int, num_pool_blocks: int) -> torch.Tensor:
        """[num_heads * n] rows of the `[num_heads * num_pool_blocks, block_size, head_dim]` pool view."""
        assert first_block >= self.base, f"block {first_block} was released (base {self.base})"
        key = ("gather", first_block, end_block, num_heads, num_pool_blocks)
        if key not in self._memo:
            run = self.table[first_block - self.base : end_block - self.base]
            tables = torch.tensor([run], device=self.pool.device)
            self._memo[key] = head_major_index(tables, num_heads, num_pool_blocks)
        return self._memo[key]


class PerRequestStep:
    """Runs the rows of an Engine step one forward each (see the module docstring).

    Args:
        model: the transformers causal LM, with its own attention implementation.
        pool (`BlockPool`): the Engine's pool.
        cache_keyword (`str`): the keyword the model's forward takes its cache by.
    """

    def __init__(self, model, pool: BlockPool, cache_keyword: str):
        self.model, self.pool = model, pool
        self._cache_keyword = cache_keyword
        config = model.config.get_text_config(decoder=True)
        self._windows = sliding_windows(config)
        self._model_type = getattr(model.config, "model_type", None)
        # A hybrid model (recurrent / conv states, which each request keeps between its forwards) or one with MLP-only
        # layers: the decoder's layers are not the pool's (`RequestStates` maps them).
        self._state_config = (
            config if KVLayout.from_config(config).kv_layers != tuple(range(config.num_hidden_layers)) else None
        )
        layer_types, _ = get_layer_types_and_kwargs(config)
        self._keeps_state = any(holds_state(layer_type) for layer_type in layer_types)

    def forward(self, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """rows (request, new tokens) -> [len(rows), vocab] logits at each row's last new token."""
        return torch.stack([self._forward_row(request, num_tokens)[0] for request, num_tokens in rows])

    def forward_with_prompt_logits(
        self, rows: list[tuple[Request, int]], positions: dict[int, range]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows, and per row index positions of its new prompt tokens -> ([len(rows), vocab] logits at each row's
        last new token, [sum of the positions, vocab] logits at those positions, row by row in `positions`' order)."""
        last, kept = [], []
        for row, (request, num_tokens) in enumerate(rows):
            wanted = positions.get(row, range(0))
            logits, prompt_logits, start = self._forward_row(request, num_tokens, every=bool(wanted))
            last.append(logits)
            if wanted:
                kept.append(prompt_logits[wanted.start - start : wanted.stop - start])
        return torch.stack(last), torch.cat(kept)

    def _forward_row(
        self, request: Request, num_tokens: int, every: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One request's next `num_tokens` tokens -> ([vocab] logits at the last of them, with `every` the
        [prompt tokens run, vocab] logits at each prompt token it ran (else None), the position of the first token
        it ran): its prompt tokens in one forward, then each generated token fed back (a preempted request's
        recomputation) in one of its own."""
        start, end = request.num_computed, request.num_computed + num_tokens
        states = request.states
        if self._keeps_state and start and (states is None or states.num_tokens != start):
            # Its states are gone (a forward of it failed part-way) or saw other tokens (a step undone after they
            # advanced): compute the request again from its first token, over its own blocks (the same K/V again).
            start = 0
        prompt_end = min(end, len(request.prompt_ids))
        prompt_logits = None
        try:
            if start < prompt_end:
                prompt_logits = self._forward(request, start, prompt_end - start, prompt=True, every=every)
                logits = prompt_logits[-1]
            for position in range(max(start, prompt_end), end):
                logits = self._forward(request, position, 1, prompt=False)[-1]
        except BaseException:
            # Its states may have advanced part-way (the layers before the failure): never reused; its next forward
            # computes it again from its first token.
            request.states = None
            raise
        return logits, prompt_logits if every else None, start

    def _forward(self, request: Request, seq_len: int, num_tokens: int, prompt: bool, every: bool = False):
        """A forward over `num_tokens` of the request's tokens after `seq_len` cached ones -> [1 or, with `every`,
        `num_tokens`, vocab] logits at the last token or at each. A prompt chunk sees every prompt token before it,
        as one forward over the whole prompt does (`generate()` truncates a sliding layer's cache only after it); a
        generated token sees what its sliding layers keep after the tokens before it."""
        windows = [None] * len(self._windows) if prompt else self._windows
        if self._state_config is not None and (
            seq_len == 0 or request.states is None or not request.states.keeps_state
        ):
            request.states = RequestStates(self._state_config)  # a first forward (or a preempted one's again)
        cache = RowCache(
            self.pool,
            request.block_tables,
            request.first_blocks,
            seq_len,
            num_tokens,
            windows,
            model_type=self._model_type,
            states=request.states if self._state_config is not None else None,
        )
        token_ids = request.token_ids[seq_len : seq_len + num_tokens]
        out = run_row(self.model, token_ids, seq_len, {self._cache_keyword: cache}, last_only=not every)
        if cache.num_updates == 0:  # it ran on a cache of its own
            raise never_stored(self._model_type, self._cache_keyword)
        if self._state_config is not None:
            request.states.num_tokens = seq_len + num_tokens
        return out.logits[0] if every else out.logits[0, -1:]


def run_row(model, token_ids: list[int], seq_len: int, cache: dict, last_only: bool = False):
    """The model's output for one row's `token_ids` after `seq_len` cached tokens, with what `generate()` passes for
    one unpadded row: a mask of ones, positions from the cached length. `cache`: {keyword: cache}; `last_only`:
    the logits of the last token only, where the forward takes `logits_to_keep`."""
    device = model.device
    inputs = {**cache, "use_cache": True}
    if takes(model.forward, "attention_mask"):
        inputs["attention_mask"] = torch.ones(1, seq_len + len(token_ids), dtype=torch.long, device=device)
    if takes(model.forward, "position_ids"):
        inputs["position_ids"] = torch.arange(seq_len, seq_len + len(token_ids), device=device)[None]
    if last_only and takes(model.forward, "logits_to_keep"):
        inputs["logits_to_keep"] = 1
    return model(input_ids=torch.tensor([token_ids], device=device), **inputs)


def prefix_caching_reason(model) -> str | None:
    """Why the per-request step turns prefix caching off for `model`, else None: a sliding layer computes a
    generated token through its window and a prompt token over the whole prompt before it (as `generate()` does),
    so the blocks of one request's output are not what another request's prompt would compute."""
    config = model.config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(config)
    if any(holds_state(t) for t in layer_types):
        return (
            "prefix caching is off: its recurrent / convolution states summarize every token before them and cannot "
            "be rebuilt from the K/V blocks of a cached prefix"
        )
    windows = sliding_windows(config)
    if all(window is None for window in windows):
        return None
    return (
        "prefix caching is off: its sliding layers see a generated token's window but a prompt token's whole prompt, "
        "so one request's output blocks are no prefix of another's prompt"
    )


# A prompt's first chunk, a chunk over cached tokens, a decode token.
PROBE_CHUNKS = (4, 3, 1)


def _probe_cache(config) -> DynamicCache:
    """A `DynamicCache` of full attention layers (a prompt chunk sees the whole prompt before it), with a hybrid
    model's state layers and MLP-only layers as `DynamicCache(config=...)` makes them."""
    if KVLayout.from_config(config).kv_layers == tuple(range(config.num_hidden_layers)):
        return DynamicCache()
    cache = DynamicCache(config=config)  # state layers, attention layers and MLP-only ones, by layer type
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers]
    return cache


def check_chunked_prompt(model, cache_keyword: str) -> None:
    """Raise `UnsupportedModel` unless a short prompt computed in chunks over a `DynamicCache` of full layers
    (`PROBE_CHUNKS`, as `run_row` calls the model) gives the logits of one forward over it, each chunk adding its
    own tokens to the cache. The Engine splits prompts into chunks and reuses cached prefixes; a model whose tokens
    see later ones, that asserts one new token over a cache, or that stores K/V of tokens of its own fails this.
    The tolerance only absorbs the rounding of different sequence lengths in half precision."""
    config = model.config.get_text_config(decoder=True)
    num_tokens = sum(PROBE_CHUNKS)
    token_ids = [(7 * i + 1) % config.vocab_size for i in range(num_tokens)]
    reason = None
    with torch.inference_mode():
        try:
            whole = run_row(model, token_ids, 0, {cache_keyword: _probe_cache(config)}).logits[0, -num_tokens:]
            whole = whole.float()
            cache, chunks, start = _probe_cache(config), [], 0
            for size in PROBE_CHUNKS:
                out = run_row(model, token_ids[start : start + size], start, {cache_keyword: cache})
                chunks.append(out.logits[0, -size:].float())
                start += size
                if reason is None and cache.get_seq_length() != start:
                    reason = (
                        f"its cache holds {cache.get_seq_length()} tokens after a forward over {start} (K/V of "
                        "tokens of its own), while the Engine's blocks hold a request's tokens"
                    )
        except Exception as error:  # noqa: BLE001 - any failure of the probe is the model's
            reason = f"computing a prompt in chunks over cached tokens raises {type(error).__name__}: {error}"
    if reason is None:
        chunked = torch.cat(chunks)
        if chunked.shape != whole.shape or not torch.allclose(
            chunked, whole, rtol=0.0, atol=1e-2 * whole.abs().max().item() + 1e-5
        ):
            layer_types, _ = get_layer_types_and_kwargs(config)
            why = (
                "recurrent or convolution layers that do not continue a prompt from their cached state?"
                if any(holds_state(t) for t in layer_types)
                else "attention that is not causal over a prompt?"
            )
            reason = f"its logits differ when a prompt is computed in chunks over cached tokens ({why})"
    if reason is not None:
        raise UnsupportedModel(
            getattr(model.config, "model_type", None),
            f"{reason}: the Engine computes prompts in chunks and reuses cached prefixes",
            "Engine",
        )
