"""IndexerKeys: the indexer key cache of DeepSeek Sparse Attention layers, kept beside a `PagedCache`'s paged K/V.

"indexed_attention" layers (DeepSeek-V3.2, GLM-MoE-DSA, dots3, Hunyuan-V4, AXK2) cache one more per-token tensor:
the indexer's key, `[B, S, index_head_dim]`, through `cache.update_indexer(states, layer_idx)`, which returns every
cached indexer key of the layer. The indexer scores every cached token for every query and keeps the top k, so it
reads the whole tensor on every step; it is kept contiguous per layer, grown by concatenation, exactly as
transformers' `DynamicIndexedLayer` keeps it (the same tensors, so the same top-k choice). It is small next to the
K/V (one head of `index_head_dim`, 128 for DeepSeek-V3.2, against a 576-wide MLA latent) and not paged: it follows
the cache's rows (beam reorders, repeats, selections) and lengths (crop, release) instead.

Qwen4-Exp's QSA indexer also keeps the position ids of every cached token on its first indexed layer
(`cache.layers[i].indexer_position_ids`, `[..., B, S]`: rows on the second-to-last dim, tokens on the last), which
the model reads and replaces at every forward; they follow the rows and lengths the same way.
"""

from __future__ import annotations

import torch


class IndexerKeys:
    """Per layer, the `[B, S, index_head_dim]` indexer keys of a cache's rows (layers that never stored any: none),
    and the position ids a model keeps beside them."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}  # layer -> `[..., B, S]` position ids (Qwen4-Exp)

    def set_positions(self, layer_idx: int, position_ids: torch.Tensor | None) -> None:
        """Replace layer `layer_idx`'s position ids (`[..., B, S]`), or forget them (None)."""
        if position_ids is None:
            self.positions.pop(layer_idx, None)
            return
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() < 2:
            shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids)
            raise ValueError(f"indexer position ids must be a tensor [..., batch, seq_len], got {shape}")
        self.positions[layer_idx] = position_ids

    def update(self, layer_idx: int, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append `indexer_key_states` ([B, q_len, index_head_dim]) to layer `layer_idx`'s keys; return them all
        ([B, kv_len, index_head_dim])."""
        if indexer_key_states.dim() != 3:
            raise ValueError(
                "indexer key states must be [batch, q_len, index_head_dim], got shape "
                f"{tuple(indexer_key_states.shape)}"
            )
        cached = self.keys.get(layer_idx)
        if cached is not None and (cached.shape[0], cached.shape[2]) != (
            indexer_key_states.shape[0],
            indexer_key_states.shape[2],
        ):
            raise ValueError(
                f"layer {layer_idx} holds indexer keys of shape {tuple(cached.shape)}, got new ones of shape "
                f"{tuple(indexer_key_states.shape)} (the batch and index_head_dim must match)"
            )
        keys = indexer_key_states if cached is None else torch.cat([cached, indexer_key_states], dim=1)
        self.keys[layer_idx] = keys
        return keys

    def select_rows(self, rows: list[int]) -> None:
        """Row i becomes old row `rows[i]` in every layer (beam reorder, repeat, selection)."""
        for layer_idx, keys in self.keys.items():
            self.keys[layer_idx] = keys.index_select(0, torch.tensor(rows, device=keys.device))
        for layer_idx, positions in self.positions.items():
            self.positions[layer_idx] = positions.index_select(-2, torch.tensor(rows, device=positions.device))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens of every layer's keys (every indexed layer sees every token)."""
        for layer_idx, keys in self.keys.items():
            self.keys[layer_idx] = keys[:, :num_tokens]
        for layer_idx, positions in self.positions.items():
            self.positions[layer_idx] = positions[..., :num_tokens]

    def copy(self) -> IndexerKeys:
        """A branch: the same tensors (never written in place: `update` makes new ones)."""
        branch = IndexerKeys()
        branch.keys, branch.positions = dict(self.keys), dict(self.positions)
        return branch

    def clear(self) -> None:
        self.keys.clear()
        self.positions.clear()
