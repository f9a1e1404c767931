"""VisibleKV: what a `PagedCache` layer's update returns once tokens are cached.

transformers hands attention whatever `Cache.update` returns, so this is the one place a cache chooses how attention
reads the pool:

    sdpa / eager attention          the visible K/V, [B, kv_heads, kv_len, head_dim]: a view of the pool or a
                                    gather (gather.py), exactly what DynamicCache would return
    "hf_paged" attention, decode    placeholders [B, kv_heads, 0, head_dim] carrying a `DecodePlan`: the kernel reads
                                    the pool in place; rows sharing a prompt read it once (`shared_prefix_kv`)
    "hf_paged" attention, prefill   placeholders carrying a `PrefillPlan` (a chunk or a prompt after cached tokens)

A plan's block tables, lengths and memos come from the layer group's `TableMetadata`: built by the group's first
layer, shared by the rest. A first prefill returns the step's own K/V and never reaches this.
"""

from __future__ import annotations

import torch

from ..attention import PAGED_ATTENTION, DecodePlan, plan_placeholders
from ..attention.kernels.dispatch import triton_possible
from ..attention.plan import PLAN_ATTR
from ..attention.prefill_plan import PrefillPlan
from ..storage import BlockPool
from .gather import shared_prefix_kv, visible_kv
from .group_tables import GroupTables
from .table_metadata import TableMetadata


def runs_paged_attention(config) -> bool:
    """Whether the model attends through the "hf_paged" attention (`hf_paged.enable(model)` may switch it after its
    cache was built, so a cache asks at every step)."""
    return getattr(config, "_attn_implementation", None) == PAGED_ATTENTION


class VisibleKV:
    """What the layers of one `PagedCache` return after cached tokens (see the module docstring).

    Args:
        tables (`GroupTables`): the cache's block tables.
        config: the model's text config (None for a cache built from a pool alone).
        latent (`bool`): the model expands what `update` returns before attention (multi-head latent attention), so
            it gets the latents themselves, never a placeholder.
        kv_sources (`frozenset[int]`): pool layers whose returned K/V later layers attend again (KV sharing): they
            get K/V of their own, not views of the gather workspace, which the next layer's gather overwrites.
    """

    def __init__(self, tables: GroupTables, config, latent: bool, kv_sources: frozenset[int]):
        self._tables = tables
        self._config = config
        self._latent = latent
        self._kv_sources = kv_sources
        # Resolved at every step's layer 0 (`start_step`) for the step's other layers.
        self._paged_attention, self._multi_device, self._kernel_possible = False, False, False
        self._plannable = False  # the step may hand attention a plan: paged attention, one device, no latents
        self._reuse_placeholders = False
        # Pool layer -> (what its placeholders were made for, the placeholders): made again only when its states
        # change shape, dtype or device (or the inference mode), and handed each step's plan in turn (empty while
        # the model attends otherwise).
        self.placeholders: dict[int, tuple] = {}

    def start_step(self, pool: BlockPool, multi_device: bool) -> None:
        """At layer 0's update: what every layer of the step would otherwise look up again (`multi_device`:
        `pool.is_multi_device`)."""
        if self.placeholders:
            self.drop_plans()
        self._paged_attention = self._runs_paged_attention()
        self._multi_device = multi_device
        self._kernel_possible = triton_possible(pool.device)
        # Every layer group's tables hold blocks of this one pool.
        latent = self._latent or pool.layout.latent
        self._plannable = self._paged_attention and not self._multi_device and not latent
        # A traced step makes fresh placeholders (the memo below would guard the trace on its contents).
        self._reuse_placeholders = not torch.compiler.is_compiling()

    def visible(
        self,
        layer_idx: int,
        metadata: TableMetadata,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        first: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What pool layer `layer_idx`'s update returns after cached tokens (its new K/V `[B, kv_heads, q_len,
        head_dim]` already stored; `metadata`: its layer group's): its K/V from position `first` to `num_tokens`,
        `[B, kv_heads, num_tokens - first, head_dim]`, or placeholders carrying a plan that reads them in place."""
        if self._plannable:
            if key_states.shape[2] == 1:
                # A plan when the attention may run a kernel on the pool, or when the rows share a prefix of blocks
                # (read once); otherwise the attention would gather the K/V anyway: hand them over directly.
                split = self._shared_split(metadata, first, num_tokens)
                if split is not None or self._kernel_possible:
                    return self._decode_placeholders(layer_idx, key_states, value_states, first, num_tokens, split)
            elif self._kernel_possible and layer_idx not in self._kv_sources:
                # Several tokens over cached ones (a prompt chunk, a prompt after a prefix hit): the paged prefill
                # kernel may read the pool in place (PrefillPlan); it gathers when it cannot.
                return self._prefill_placeholders(layer_idx, key_states, value_states, first, num_tokens)
        if self._multi_device:
            keys, values = visible_kv(metadata.on(metadata.pool.devices[layer_idx]), layer_idx, first, num_tokens)
        else:
            keys, values = visible_kv(metadata, layer_idx, first, num_tokens)
        if layer_idx in self._kv_sources:  # later layers attend these again, after other layers' gathers
            return keys.clone(), values.clone()
        return keys, values

    def gather(self, layer_idx: int, first: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, num_tokens) of every row of pool layer `layer_idx`: two [B, kv_heads, num_tokens - first,
        head_dim] views of the pool, or of the gather workspace the caches of its pool share in this thread; valid
        until the next update of a cache of that pool in this thread (see gather.py). On a pool split over devices,
        with index tensors on the layer's device."""
        metadata = self._tables.metadata_of(layer_idx)
        if self._multi_device:
            return visible_kv(metadata.on(metadata.pool.devices[layer_idx]), layer_idx, first, num_tokens)
        return visible_kv(metadata, layer_idx, first, num_tokens)

    def _runs_paged_attention(self) -> bool:
        return runs_paged_attention(self._config)

    @staticmethod
    def _shared_split(metadata: TableMetadata, first: int, num_tokens: int) -> int | None:
        """Where the decode attention splits every row's visible K/V into a prefix read once and the rows' own tails
        (see `shared_prefix_kv`), or None when the rows share no block after `first`.

        The end of the blocks every row shares (clipped to `num_tokens`), or, when those blocks are not one run of
        pool blocks, the end of the run they start with if gathering the rest once per row copies less than
        gathering the whole prefix once."""
        shared = metadata.shared_blocks()
        if not shared:
            return None
        block_size = metadata.pool.block_size
        first_block, shared_end = first // block_size, metadata.tables.base + shared
        if shared_end * block_size <= first:
            return None
        run_end = metadata.run_end(0, first_block, shared_end)
        if run_end < shared_end and metadata.num_rows * (shared_end - run_end) < shared_end - first_block:
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
            metadata = self._tables.metadata_of(layer_idx)
            split_gather = lambda: shared_prefix_kv(metadata, layer_idx, first, split, num_tokens)  # noqa: E731
        plan = self._plan(DecodePlan, layer_idx, first, num_tokens, split_gather=split_gather)
        return self._placeholders_of(layer_idx, key_states, value_states, plan)

    def _prefill_placeholders(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, first: int, num_tokens: int
    ):
        plan = self._plan(PrefillPlan, layer_idx, first, num_tokens)
        return self._placeholders_of(layer_idx, key_states, value_states, plan)

    def drop_plans(self, in_step: bool = False) -> None:
        """Take the plans off the layers' kept placeholders: a plan holds views of the pool's tensors, which a grow
        replaces (the old ones must go then) and a released cache no longer reads. At every step's start, at
        `release`, and `in_step` at a grow, where the plans of KV-sharing source layers stay: later layers of the
        step attend through them again (reading the old tensors, which hold this step's keys), as they did before
        layers kept their placeholders."""
        for layer_idx, (_, placeholders) in self.placeholders.items():
            if in_step and layer_idx in self._kv_sources:
                continue
            for placeholder in placeholders:
                setattr(placeholder, PLAN_ATTR, None)

    def _placeholders_of(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, plan):
        """`plan_placeholders(key_states, value_states, plan)`, the layer's placeholders of its last step handed
        `plan` where they fit (two empty tensors fewer a layer and step; attention reads a plan in the step it is
        handed over, so no earlier one is read again)."""
        if not self._reuse_placeholders:
            return plan_placeholders(key_states, value_states, plan)
        key = (
            key_states.shape,
            value_states.shape,
            key_states.dtype,
            key_states.device,
            torch.is_inference_mode_enabled(),
        )
        made = self.placeholders.get(layer_idx)
        if made is None or made[0] != key:
            made = self.placeholders[layer_idx] = (key, plan_placeholders(key_states, value_states, plan))
            return made[1]
        keys, values = made[1]
        setattr(keys, PLAN_ATTR, plan)
        setattr(values, PLAN_ATTR, plan)
        return keys, values

    def _plan(self, plan_class, layer_idx: int, first: int, num_tokens: int, **extra):
        """A `DecodePlan` or `PrefillPlan` of pool layer `layer_idx` for a step ending at `num_tokens`, its mask from
        position `first`: the step's tables, lengths and memos, built by the group's first layer and shared by the
        rest."""
        metadata = self._tables.metadata_of(layer_idx)
        step = metadata.step(num_tokens)
        key_cache, value_cache = metadata.pool.nhd_views(layer_idx)
        return plan_class(
            key_cache=key_cache,
            value_cache=value_cache,
            block_tables=step["block_tables"],
            seq_lens=step["seq_lens"],
            kv_offset=first,
            position_offset=step["position_offset"],
            # Not through `self`: a layer's placeholders keep its last plan, which must not keep this object alive.
            gather=lambda: visible_kv(metadata, layer_idx, first, num_tokens),  # plans are made on one device
            _kv_starts=step["kv_starts"],
            _backends=step["backends"],
            **({"_launches": step["launches"]} if plan_class is DecodePlan else {}),
            **extra,
        )
