"""StepCache: one engine forward over every scheduled request, packed into a single sequence.

`PagedCache` serves `generate()`, where every row has the same length. The engine runs one forward per step over
requests of different lengths and kinds, so each step packs their new tokens into one `[1, num_tokens]` sequence:

    tokens:  | r0 | r1 | r2 |  r3 (prefill chunk, 5 tokens)  |      decode rows first, then prefill chunks
    row b:   seq_lens[b] cached tokens in blocks tables[b], q_lens[b] new ones at positions seq_lens[b]...

Linear layers, norms and rotary embeddings are per token, so they do not care how the rows are packed; only
attention does. `update` stores every new token in its slot and returns an empty placeholder carrying a `StepPlan`,
which the "hf_paged" attention hands the whole step to (`StepPlan.attend`):
- the decode rows (one query each) go through the paged decode path as one ragged batch (Triton kernel on the
  pool, or one gather + SDPA with a per-row length mask), so no row is padded to the longest for storage;
- the prefill chunks: with the Triton backend, one launch of the paged prefill kernel for all of them (each chunk
  attends causally to its row's keys in the pool, no gather and no mask); otherwise each chunk gathers its own row's
  K/V and runs SDPA with a causal mask offset by its cached length (the mask `generate()` would build for that row
  alone, so the numbers match a batch-1 forward).

Layer groups: each row has one block table per layer group of the pool, and layer l reads and writes through the
table of its group (`pool.group_of_layer[l]`). A sliding group's table may start after blocks that were released:
`first_blocks[g][b]` of them, so its keys start at position `first_blocks[g][b] * block_size`; the group's
`seq_lens` count from there, which is all the ragged decode path needs (a window is measured from the end).

The blocks must already be allocated (the scheduler does it); a `StepCache` never allocates or frees.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention import DecodePlan, length_mask, module_backend, plan_placeholders, store_backend, store_kv_rows
from ..attention.kernels import paged_prefill_attention
from ..attention.plan import EXPANDED_PLAN_KWARG
from ..attention.torch_attention import torch_attention_forward
from ..cache.block_tables import head_major_index
from ..errors import UnsupportedModel
from ..storage import BlockPool


class StepLayer(CacheLayerMixin):
    """Layer view for the mask machinery: it describes the step's keys, the cache does the work (the packed step's
    `StepCache` and the decode runner's `RunnerCache`)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: StepCache):
        super().__init__()
        self._cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None: ...

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("StepCache.update is called on the cache, not its layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # NOTE: the step's attention builds its own masks (StepPlan.attend ignores the model's), so describe a
        # plain causal block: sdpa's mask function then skips building a [1, 1, T, kv_len] mask nobody reads.
        return query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


@dataclass
class StepPlan:
    """What attention needs for one layer of a packed step (attached to the placeholder `update` returns)."""

    cache: StepCache
    layer_idx: int

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [1, heads, num_tokens, head_dim] -> ([1, num_tokens, heads, value_head_dim], None). `attention_mask`
        is ignored: each row's keys are described by its lengths, and each prefill chunk builds its own causal mask.

        `key` / `value`: the model's expansion of what `update` returned for a latent layout (multi-head latent
        attention): every row's keys padded to the longest, `[rows, heads, longest, head_dim]` (and V's head_dim);
        without them, each row's K/V are read from the pool."""
        cache = self.cache
        expanded = None if key is None else (key, value)
        chunk_size = cache.chunk_sizes[self.layer_idx]
        if chunk_size is not None:
            out = cache.attend_chunked(module, self.layer_idx, query, chunk_size, expanded=expanded, **kwargs)
            return out, None
        num_decode = cache.num_decode
        decoded = None
        if num_decode:
            decode_query = query[0, :, :num_decode].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, D]
            decoded = cache.attend_decode(
                module, self.layer_idx, decode_query, sliding_window=sliding_window, expanded=expanded, **kwargs
            )
            if num_decode == len(cache.seq_lens):  # a decode-only step: the decode rows are the whole output
                return decoded.transpose(0, 1), None
        _, num_heads, num_tokens, _ = query.shape
        out = query.new_empty(1, num_tokens, num_heads, cache.value_head_dim(self.layer_idx, expanded))
        if decoded is not None:
            out[0, :num_decode] = decoded[:, 0]  # [n, heads, D]
        if expanded is None and cache.prefill_kernel_runs(module, self.layer_idx, query.device):
            # Every prefill chunk in one launch of the paged prefill kernel, reading the pool in place.
            cache.attend_prefill(self.layer_idx, query, out, sliding_window=sliding_window, **kwargs)
            return out, None
        for row in range(num_decode, len(cache.seq_lens)):
            start, q_len, seq_len = cache.starts[row], cache.q_lens[row], cache.seq_lens[row]
            key, value = cache.row_kv(self.layer_idx, row, expanded)  # [1, kv_heads, seq_len + q_len - first, D]
            first = cache.first_position(self.layer_idx, row)
            chunk_query = query[:, :, start : start + q_len]
            if _needs_torch_attention(kwargs):  # SDPA has no softcap or sinks: the torch attention, explicit mask
                mask = _chunk_mask(seq_len, q_len, sliding_window, first, query.device, explicit=True)
                chunk, _ = _torch_attention(chunk_query, key, value, mask, kwargs)
            else:
                mask = _chunk_mask(seq_len, q_len, sliding_window, first, query.device, lazy=query.is_cuda)
                chunk, _ = sdpa_attention_forward(
                    module, chunk_query, key, value, mask, sliding_window=sliding_window, **kwargs
                )
            out[0, start : start + q_len] = chunk[0]  # [q_len, heads, D]
        return out, None


def _needs_torch_attention(kwargs: dict) -> bool:
    """The attention function's keywords ask for what SDPA does not do: a softcap or attention sinks (`s_aux`)."""
    return kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None


def _torch_attention(query, key, value, mask, kwargs: dict) -> tuple[torch.Tensor, None]:
    """`torch_attention_forward` with the attention function's keywords (softcap, s_aux, scaling, dropout)."""
    return torch_attention_forward(
        query,
        key,
        value,
        mask,
        kwargs.get("dropout", 0.0),
        kwargs.get("scaling"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )


def _chunk_mask(
    seq_len: int,
    q_len: int,
    sliding_window: int | None,
    first: int,
    device,
    explicit: bool = False,
    lazy: bool = False,
) -> torch.Tensor | CausalBias | None:
    """[1, 1, q_len, seq_len + q_len - first] bool for keys from position `first` on: query i (position seq_len + i)
    sees the key at position p when p <= seq_len + i (and, with a window, p > seq_len + i - sliding_window). None
    where sdpa's own mask would be skipped for plain causal attention (no cached keys, the whole chunk inside the
    window), as `generate()` does for a batch-1 prompt, unless `explicit` (an attention without SDPA's `is_causal`).

    `lazy` (CUDA): a chunk over cached keys that needs no more than causality (every key from position 0, no window)
    gets SDPA's lower-right causal bias instead, which its flash and memory-efficient kernels apply without a mask
    over the whole context."""
    kv_len = seq_len + q_len
    if not explicit and seq_len == 0 and (sliding_window is None or kv_len < sliding_window):
        return None
    if lazy and not explicit and first == 0 and sliding_window is None:
        return causal_lower_right(q_len, kv_len)
    query_positions = torch.arange(seq_len, kv_len, device=device)[:, None]
    key_positions = torch.arange(first, kv_len, device=device)[None, :]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return visible[None, None]


@dataclass
class _GroupStep:
    """One layer group's share of a step: its rows' block tables and where the new tokens go."""

    tables: torch.Tensor  # [B, width] long: row b's held blocks, padded with 0 (never read)
    num_table_blocks: list[int]  # per row: blocks its keys span
    first_positions: list[int]  # per row: position of its table's first key
    slots: torch.Tensor  # [num_tokens] long: pool slot of each new token
    seq_lens: torch.Tensor  # [B] int32: keys per row from its first held block, the new ones included
    host_seq_lens: list[int]  # the same on the host (no device sync to read one)
    length_masks: dict  # window -> the decode rows' length mask, shared by the group's layers this step
    decode_tables: torch.Tensor | None = None  # [num_decode, width] int32, made on first use (Triton path)


class StepCache(Cache):
    """Rows `b` holding `seq_lens[b]` cached tokens; this forward adds `q_lens[b]` tokens to each.

    The rows' new tokens are packed into one sequence in row order: the model's input is `[1, sum(q_lens)]`.

    Args:
        pool (`BlockPool`): the shared pool.
        block_tables (`list[list[list[int]]]`): `block_tables[g][b]`, row b's held blocks in layer group g; each
            must already cover `seq_lens[b] + q_lens[b]` tokens.
        seq_lens (`list[int]`): tokens already cached per row.
        q_lens (`list[int]`): new tokens per row; decode rows (1) come before prefill chunks (more than 1).
        first_blocks (`list[list[int]]`, *optional*): `first_blocks[g][b]`, blocks released before row b's table in
            group g (sliding groups); default none.
        chunk_sizes (`list[int | None]`, *optional*): per layer, the chunk of a chunked-attention layer (Llama 4's
            `attention_chunk_size`: a query sees the keys of its own chunk of positions, up to itself) or None;
            default none. The model passes no window for these layers: its mask makes the chunks.
        workspace (`dict`, *optional*): gather buffers to reuse; pass the same dict every step to allocate once.
        model_type (`str`, *optional*): the model's type, named by the `UnsupportedModel` an update of a layer the
            pool does not hold raises.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_tables: list[list[list[int]]],
        seq_lens: list[int],
        q_lens: list[int],
        *,
        first_blocks: list[list[int]] | None = None,
        chunk_sizes: list[int | None] | None = None,
        workspace: dict | None = None,
        model_type: str | None = None,
    ):
        num_rows = len(seq_lens)
        if len(block_tables) != pool.num_groups:
            raise ValueError(
                f"block_tables needs one list per layer group ({pool.num_groups}), got {len(block_tables)}"
            )
        if first_blocks is None:
            first_blocks = [[0] * num_rows for _ in block_tables]
        if (
            not num_rows
            or len(q_lens) != num_rows
            or any(
                len(tables) != num_rows or len(firsts) != num_rows for tables, firsts in zip(block_tables, first_blocks)
            )
        ):
            raise ValueError(
                f"block tables, first blocks, seq_lens and q_lens need one entry per row, got "
                f"{[len(t) for t in block_tables]}, {[len(f) for f in first_blocks]}, {num_rows}, {len(q_lens)}"
            )
        if any(q < 1 for q in q_lens):
            raise ValueError(f"every row adds at least one token, got q_lens {q_lens}")
        self.num_decode = sum(1 for q in q_lens if q == 1)
        if any(q != 1 for q in q_lens[: self.num_decode]):
            raise ValueError(f"decode rows (q_len 1) must come before prefill chunks, got q_lens {q_lens}")
        self.pool = pool
        self.model_type = model_type
        self.num_updates = 0  # update calls so far (the Engine checks that a forward stored its K/V)
        self.chunk_sizes = [None] * pool.layout.num_layers if chunk_sizes is None else list(chunk_sizes)
        self.seq_lens, self.q_lens = list(seq_lens), list(q_lens)
        self.starts = list(itertools.accumulate(q_lens[:-1], initial=0))
        positions = [p for n, q in zip(seq_lens, q_lens) for p in range(n, n + q)]
        self.position_ids = torch.tensor([positions], device=pool.device)  # [1, T]: the model's position_ids
        self._store_backend = store_backend(pool.device)  # resolved once for the step's layers
        self._groups = [self._group_step(tables, firsts) for tables, firsts in zip(block_tables, first_blocks)]
        self._workspace = {} if workspace is None else workspace
        self._index: dict[tuple, torch.Tensor] = {}  # (group, first row, end row, kv_heads, pool blocks) -> index
        self._prefill_cu_seqlens: torch.Tensor | None = None  # [chunks + 1] int32, made on the first kernel call
        super().__init__(layers=[StepLayer(self) for _ in range(pool.layout.num_layers)])

    def _group_step(self, tables: list[list[int]], first_blocks: list[int]) -> _GroupStep:
        # Slots, lengths and padded tables are worked out on the host and sent once: a decode step adds one token
        # per row, and a few Python ints cost less than a chain of tiny tensor ops.
        device, block_size = self.pool.device, self.pool.block_size
        first_positions = [first * block_size for first in first_blocks]
        ends = [n + q for n, q in zip(self.seq_lens, self.q_lens)]
        num_table_blocks = [-(-(end - first) // block_size) for end, first in zip(ends, first_positions)]
        for table, needed, end in zip(tables, num_table_blocks, ends):
            if len(table) < needed:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {end} tokens")
        width = max(num_table_blocks)
        # Rows padded to the longest table; padding entries are never read (each row stops at its length).
        padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
        slots = [
            table[(p - first) // block_size] * block_size + (p - first) % block_size
            for table, first, n, q in zip(tables, first_positions, self.seq_lens, self.q_lens)
            for p in range(n, n + q)
        ]
        host_seq_lens = [end - first for end, first in zip(ends, first_positions)]
        return _GroupStep(
            tables=torch.tensor(padded, dtype=torch.long, device=device),
            num_table_blocks=num_table_blocks,
            first_positions=first_positions,
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            seq_lens=torch.tensor(host_seq_lens, dtype=torch.int32, device=device),
            host_seq_lens=host_seq_lens,
            length_masks={},
        )

    @property
    def last_token_indices(self) -> list[int]:
        """Index in the packed sequence of each row's last new token (where its next-token logits are)."""
        return [start + q - 1 for start, q in zip(self.starts, self.q_lens)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens)

    def first_position(self, layer_idx: int, row: int) -> int:
        """Position of the first key `row` still holds in layer `layer_idx` (0 unless its group released blocks)."""
        return self._groups[self.pool.group_of_layer[layer_idx]].first_positions[row]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [1, kv_heads, num_tokens, head_dim] -> an empty [1, kv_heads, 0, head_dim] placeholder
        carrying the step's `StepPlan` (twice, as keys and values); attention does the rest."""
        pool = self.pool
        if not 0 <= layer_idx < pool.layout.num_layers:
            raise UnsupportedModel(
                self.model_type,
                f"it writes cache layer {layer_idx}, while the pool holds its {pool.layout.num_layers} layers (a model "
                "that adds cache layers of its own, such as a copy per loop of looped layers)",
                "Engine",
            )
        pool.check_states(layer_idx, key_states, value_states)
        self.num_updates += 1
        group = self._groups[pool.group_of_layer[layer_idx]]
        store_kv_rows(
            pool.key_cache[layer_idx],
            pool.value_cache[layer_idx],
            key_states,
            value_states,
            group.slots,
            backend=self._store_backend,
        )
        if pool.layout.latent:
            return self._latent_kv(layer_idx, kwargs)
        return plan_placeholders(key_states, value_states, StepPlan(self, layer_idx))

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise UnsupportedModel(
            self.model_type,
            "its indexed-attention layers keep indexer keys beside the K/V, which the Engine's pool does not hold",
            "Engine",
        )

    def _latent_kv(self, layer_idx: int, update_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A latent layout (multi-head latent attention) expands what `update` returns before attention, so it gets
        every row's latents, `[rows, 1, longest, dim]` (each row's keys from its first held block, padded to the
        longest row), and the step's plan goes to attention in the keywords the model hands to both
        (`EXPANDED_PLAN_KWARG`); the model's expansion of these rows reaches `StepPlan.attend` as `key=`/`value=`."""
        attention_kwargs = update_kwargs.get("kwargs")
        if not isinstance(attention_kwargs, dict):
            raise UnsupportedModel(
                self.model_type,
                "it expands the K/V that cache.update() returns (multi-head latent attention) but does not pass its "
                "attention keywords to update(..., kwargs=kwargs), so the packed step's plan cannot reach attention",
                "Engine",
            )
        attention_kwargs[EXPANDED_PLAN_KWARG] = StepPlan(self, layer_idx)
        return self._gather(layer_idx, 0, len(self.seq_lens))

    def attend_decode(
        self,
        module: torch.nn.Module,
        layer_idx: int,
        query: torch.Tensor,
        expanded: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The decode rows' attention in layer `layer_idx`: query [num_decode, heads, 1, head_dim] ->
        [num_decode, 1, heads, value_head_dim]. `kwargs`: the attention function's (scaling, sliding_window, ...).
        `expanded`: every row's expanded K/V of a latent layout (see `StepPlan.attend`), read instead of the pool.

        With the Triton backend the kernel reads the pool in place (a `DecodePlan`, made only here); with the torch
        backend the rows' keys are gathered once, padded to the longest row, for SDPA with a per-row length mask.
        The backend is the one `enable(model, backend=...)` set on `module`, else `HF_PAGED_ATTENTION_BACKEND`, else
        "auto", resolved for the query's device.
        """
        group = self._groups[self.pool.group_of_layer[layer_idx]]
        # The paged kernels apply no attention sinks: rows with sinks take the torch path too, as do expanded K/V.
        if module_backend(module, query.device) == "torch" or kwargs.get("s_aux") is not None or expanded is not None:
            if expanded is None:
                key, value = self._gather(layer_idx, 0, self.num_decode)
            else:
                length = max(group.host_seq_lens[: self.num_decode])
                key, value = (states[: self.num_decode, :, :length] for states in expanded)
            mask = length_mask(
                group.seq_lens[: self.num_decode],
                kwargs.get("sliding_window"),
                group.length_masks,
                max_len=max(group.host_seq_lens[: self.num_decode]),
            )
            if _needs_torch_attention(kwargs):
                return _torch_attention(query, key, value, mask, kwargs)[0]
            return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
        pool = self.pool
        if group.decode_tables is None:
            group.decode_tables = group.tables[: self.num_decode].to(torch.int32)
        plan = DecodePlan(
            key_cache=pool.nhd_view(pool.key_cache[layer_idx]),
            value_cache=pool.nhd_view(pool.value_cache[layer_idx]),
            block_tables=group.decode_tables,
            seq_lens=group.seq_lens[: self.num_decode],
            kv_offset=0,
            position_offset=0,
            gather=lambda: self._gather(layer_idx, 0, self.num_decode),
            ragged=True,
            length_masks=group.length_masks,
        )
        return plan.attend(module, query, None, **kwargs)[0]

    def prefill_kernel_runs(self, module: torch.nn.Module, layer_idx: int, device: torch.device) -> bool:
        """Whether the step's prefill chunks of layer `layer_idx` go through the paged prefill kernel: the Triton
        backend for `module` (as `attend_decode` resolves it), K and V of one shape (the kernel reads both alike)."""
        pool = self.pool
        if pool.key_cache[layer_idx].shape != pool.value_cache[layer_idx].shape:
            return False
        return module_backend(module, device) == "triton"

    def attend_prefill(
        self, layer_idx: int, query: torch.Tensor, out: torch.Tensor, sliding_window: int | None = None, **kwargs
    ) -> None:
        """The prefill chunks' attention in layer `layer_idx` by the paged prefill kernel, in place: query
        [1, heads, num_tokens, head_dim] (the chunks after the decode rows) -> `out` [1, num_tokens, heads, head_dim]
        rows `num_decode:`. Each chunk attends causally to its row's keys from its first held block (positions and
        the window count from there, as the decode rows' do), with the attention function's scaling, softcap and
        sinks (`s_aux`)."""
        pool, first = self.pool, self.num_decode
        group = self._groups[pool.group_of_layer[layer_idx]]
        if self._prefill_cu_seqlens is None:
            lengths = itertools.accumulate(self.q_lens[first:], initial=0)
            self._prefill_cu_seqlens = torch.tensor(list(lengths), dtype=torch.int32, device=pool.device)
        scaling = kwargs.get("scaling")
        paged_prefill_attention(
            query[0, :, self.starts[first] :].transpose(0, 1),  # [chunk tokens, heads, head_dim]
            pool.nhd_view(pool.key_cache[layer_idx]),
            pool.nhd_view(pool.value_cache[layer_idx]),
            group.tables[first:],
            self._prefill_cu_seqlens,
            group.seq_lens[first:],
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            sliding_window=sliding_window,
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
            out=out[0, self.starts[first] :],
            backend="triton",
        )

    def attend_chunked(
        self,
        module: torch.nn.Module,
        layer_idx: int,
        query: torch.Tensor,
        chunk_size: int,
        expanded: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Chunked attention over every row of the step, one row at a time: query [1, heads, num_tokens, head_dim]
        -> [1, num_tokens, heads, value_head_dim]. The query at position q sees the keys at positions p with
        q // chunk_size * chunk_size <= p <= q (the sliding group of these layers keeps at least that much).
        `expanded`: as in `attend_decode`."""
        kwargs.pop("sliding_window", None)
        _, num_heads, num_tokens, _ = query.shape
        out = query.new_empty(1, num_tokens, num_heads, self.value_head_dim(layer_idx, expanded))
        for row, (start, q_len, seq_len) in enumerate(zip(self.starts, self.q_lens, self.seq_lens)):
            key, value = self.row_kv(layer_idx, row, expanded)  # [1, kv_heads, seq_len + q_len - first, D]
            first = self.first_position(layer_idx, row)
            query_positions = torch.arange(seq_len, seq_len + q_len, device=query.device)[:, None]
            key_positions = torch.arange(first, seq_len + q_len, device=query.device)[None, :]
            visible = (key_positions <= query_positions) & (key_positions >= query_positions // chunk_size * chunk_size)
            row_query = query[:, :, start : start + q_len]
            if _needs_torch_attention(kwargs):
                attended, _ = _torch_attention(row_query, key, value, visible[None, None], kwargs)
            else:
                attended, _ = sdpa_attention_forward(module, row_query, key, value, visible[None, None], **kwargs)
            out[0, start : start + q_len] = attended[0]  # [q_len, heads, D]
        return out

    def gather_row(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s held keys and values, cached and new: two [1, kv_heads, keys, head_dim] tensors, from
        `first_position(layer_idx, row)` to its last new token."""
        return self._gather(layer_idx, row, row + 1)

    def row_kv(
        self, layer_idx: int, row: int, expanded: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_row`, or row `row` of a latent layout's expanded K/V (`[rows, heads, longest, D]`, see
        `StepPlan.attend`) cut to its own keys."""
        if expanded is None:
            return self.gather_row(layer_idx, row)
        length = self._groups[self.pool.group_of_layer[layer_idx]].host_seq_lens[row]
        key, value = expanded
        return key[row : row + 1, :, :length], value[row : row + 1, :, :length]

    def value_head_dim(self, layer_idx: int, expanded: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """head_dim of the values attention reads in layer `layer_idx` (the expanded ones where given)."""
        return expanded[1].shape[-1] if expanded is not None else self.pool.value_cache[layer_idx].shape[-1]

    def _gather(self, layer_idx: int, first_row: int, end_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [first_row, end_row): [rows, kv_heads, longest, head_dim] keys and values (V's heads and head_dim may
        differ) from each row's first held block, views into the workspace (valid until the next gather); positions
        past a row's length are not keys."""
        group_idx = self.pool.group_of_layer[layer_idx]
        group = self._groups[group_idx]
        num_rows, length = end_row - first_row, max(group.host_seq_lens[first_row:end_row])
        gathered = []
        for name, cache in (("keys", self.pool.key_cache[layer_idx]), ("values", self.pool.value_cache[layer_idx])):
            num_heads, num_pool_blocks, block_size, head_dim = cache.shape
            # Layers (and K and V) may differ in kv heads, so the index is keyed by shape (one entry per row range
            # for most models).
            key = (group_idx, first_row, end_row, num_heads, num_pool_blocks)
            index = self._index.get(key)
            if index is None:
                tables = group.tables[first_row:end_row, : max(group.num_table_blocks[first_row:end_row])]
                index = self._index[key] = head_major_index(tables, num_heads, num_pool_blocks)
            numel = index.numel() * block_size * head_dim
            out = self._buffer(name, numel, cache).view(index.numel(), block_size * head_dim)
            torch.index_select(cache.view(-1, block_size * head_dim), 0, index, out=out)  # 2-D rows: see gather.py
            gathered.append(out.view(num_rows, num_heads, -1, head_dim)[:, :, :length])
        return gathered[0], gathered[1]

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, reused across layers and steps (grown, never shrunk)."""
        key = (name, like.dtype, like.device)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._workspace[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]
