"""StepCache: one engine forward over every scheduled request, packed into a single sequence.

`PagedCache` serves `generate()`, where every row has the same length. The engine runs one forward per step over
requests of different lengths and kinds, so each step packs their new tokens into one `[1, num_tokens]` sequence:

    tokens:  | r0 | r1 | r2 |  r3 (prefill chunk, 5 tokens)  |      decode rows first, then prefill chunks
    row b:   seq_lens[b] cached tokens in blocks tables[b], q_lens[b] new ones at positions seq_lens[b]...

Linear layers, norms and rotary embeddings are per token, so they do not care how the rows are packed; only
attention does. `update` stores every new token in its slot and returns an empty placeholder carrying a `StepPlan`
(attention/step_plan.py), which the "hf_paged" attention hands the whole step to (`StepPlan.attend`):
- the decode rows (one query each) go through the paged decode path as one ragged batch (Triton kernel on the
  pool, or one gather + SDPA, with a per-row length mask where the rows' lengths differ), so no row is padded to
  the longest for storage;
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
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import plan_placeholders, store_backend, store_kv_rows
from ..attention.kernels.launch_config import INDEX_DTYPE
from ..attention.plan import EXPANDED_PLAN_KWARG
from ..attention.step_plan import GroupStep, StepPlan
from ..cache.gather import GatherWorkspace, workspace_for
from ..errors import UnsupportedModel
from ..storage import BlockPool
from ..storage.transfer import to_device


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
        workspace (`GatherWorkspace`, *optional*): where gathers land (default: the pool's workspace of the calling
            thread, `cache.gather.workspace_for`).
        model_type (`str`, *optional*): the model's type, named by the `UnsupportedModel` an update of a layer the
            pool does not hold raises.
        token_ids (`list[int]`, *optional*): the step's new tokens, packed (`sum(q_lens)` of them): `input_ids`
            ([1, num_tokens]) then holds them on the pool's device, copied with the step's other inputs.
        num_logits (`int`, *optional*): `logits_indices` holds this many entries, the rows' then the last row's
            again (a compiled forward's logits of a fixed number of rows); default one per row.
        extra_logits (`Sequence[int]`, *optional*): indices in the packed sequence whose logits are kept after the
            rows' (prompt positions whose log probabilities are recorded); default none.

    Every tensor of the step (positions, slots, lengths, tables, the input ids and the rows' last-token indices)
    reaches the device in one host-to-device copy per dtype that the host does not wait on
    (`storage.transfer.to_device`), made before the forward.
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
        workspace: GatherWorkspace | None = None,
        model_type: str | None = None,
        token_ids: list[int] | None = None,
        num_logits: int | None = None,
        extra_logits: Sequence[int] = (),
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
        if num_logits is not None and num_logits < num_rows:
            raise ValueError(f"num_logits must be at least the number of rows ({num_rows}), got {num_logits}")
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
        self._store_backend = store_backend(pool.device)  # resolved once for the step's layers
        self._groups = self._group_steps(block_tables, first_blocks, token_ids, num_logits, extra_logits)
        self._workspace = workspace_for(pool) if workspace is None else workspace
        # (group, first row, end row) -> (their block ids, row after row; rows; keys of the longest)
        self._row_blocks: dict[tuple[int, int, int], tuple[torch.Tensor, int, int]] = {}
        super().__init__(layers=[StepLayer(self) for _ in range(pool.layout.num_layers)])

    def _group_steps(
        self,
        block_tables: list[list[list[int]]],
        first_blocks: list[list[int]],
        token_ids: list[int] | None,
        num_logits: int | None,
        extra_logits: Sequence[int],
    ) -> list[GroupStep]:
        # Slots, lengths and padded tables are worked out on the host and sent in one copy per dtype: a decode step
        # adds one token per row, and a few Python ints cost less than a chain of tiny tensor ops.
        device, block_size, num_decode = self.pool.device, self.pool.block_size, self.num_decode
        q_lens = self.q_lens
        ends = [n + q for n, q in zip(self.seq_lens, q_lens)]
        positions = [p for n, q in zip(self.seq_lens, q_lens) for p in range(n, n + q)]
        if token_ids is not None and len(token_ids) != len(positions):
            raise ValueError(f"token_ids needs one id per new token ({len(positions)}), got {len(token_ids)}")
        logits_indices = self.last_token_indices
        if num_logits is not None:
            logits_indices += logits_indices[-1:] * (num_logits - len(logits_indices))
        logits_indices += extra_logits
        longs = [positions, token_ids or [], logits_indices]
        ints = [list(itertools.accumulate(q_lens[num_decode:], initial=0))]  # the prefill chunks' cu_seqlens
        hosts = []
        for tables, firsts in zip(block_tables, first_blocks):
            first_positions = [first * block_size for first in firsts]
            num_table_blocks = [-(-(end - first) // block_size) for end, first in zip(ends, first_positions)]
            for table, needed, end in zip(tables, num_table_blocks, ends):
                if len(table) < needed:
                    raise ValueError(f"a block table of {len(table)} blocks cannot hold {end} tokens")
            # Rows padded to the longest table, to an even width: a row's slice of the int64 tables then starts on
            # a 16-byte boundary (the prefill kernel takes the prefill rows' slice). Padding entries are never read.
            decode_width = max(num_table_blocks)  # the decode kernel's split choice reads the tables' width
            width = decode_width + decode_width % 2
            padded = [entry for table in tables for entry in table[:width] + [0] * (width - len(table[:width]))]
            slots = [
                table[(p - first) // block_size] * block_size + (p - first) % block_size
                for table, first, n, q in zip(tables, first_positions, self.seq_lens, q_lens)
                for p in range(n, n + q)
            ]
            host_seq_lens = [end - first for end, first in zip(ends, first_positions)]
            hosts.append((width, decode_width, num_table_blocks, first_positions, host_seq_lens))
            # The decode rows' tables at their own width (the decode kernel's), the prefill rows' lengths on their
            # own (an aligned tensor, where a slice of all the rows' lengths may not start on 16 bytes); tables and
            # lengths in the kernels' `INDEX_DTYPE`, the int64 of the slots and positions.
            decode_tables = [
                entry for row in range(num_decode) for entry in padded[row * width : row * width + decode_width]
            ]
            longs += [padded, slots, host_seq_lens, host_seq_lens[num_decode:], decode_tables]
        longs, ints = to_device(longs, INDEX_DTYPE, device), to_device(ints, torch.int32, device)
        self.position_ids = longs[0].view(1, -1)  # [1, T]: the model's position_ids
        self.input_ids = longs[1].view(1, -1) if token_ids is not None else None  # [1, T]
        self.logits_indices = longs[2]  # [B] (or [num_logits]): where each row's next-token logits are
        self._prefill_cu_seqlens = ints[0]  # [chunks + 1]
        groups = []
        for g, (width, decode_width, num_table_blocks, first_positions, host_seq_lens) in enumerate(hosts):
            tables, slots, seq_lens, prefill_seq_lens, decode_tables = longs[3 + 5 * g : 8 + 5 * g]
            tables = tables.view(-1, width)
            groups.append(
                GroupStep(
                    tables=tables,
                    num_table_blocks=num_table_blocks,
                    first_positions=first_positions,
                    slots=slots,
                    seq_lens=seq_lens,
                    host_seq_lens=host_seq_lens,
                    length_masks={},
                    decode_tables=decode_tables.view(num_decode, decode_width),
                    decode_seq_lens=seq_lens[:num_decode],
                    prefill_tables=tables[num_decode:],
                    prefill_seq_lens=prefill_seq_lens,
                )
            )
        return groups

    @property
    def last_token_indices(self) -> list[int]:
        """Index in the packed sequence of each row's last new token (where its next-token logits are)."""
        return [start + q - 1 for start, q in zip(self.starts, self.q_lens)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens)

    def group_step(self, layer_idx: int) -> GroupStep:
        """The step's share of the layer group of `layer_idx`."""
        return self._groups[self.pool.group_of_layer[layer_idx]]

    def prefill_cu_seqlens(self) -> torch.Tensor:
        """[chunks + 1] int32: where each prefill chunk starts among the chunks' tokens."""
        return self._prefill_cu_seqlens

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
            nhd_views=pool.nhd_views(layer_idx) if self._store_backend == "triton" else None,
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
        key, value = self.gather(layer_idx, 0, len(self.seq_lens))
        if key.shape[1] > 1 or value.shape[1] > 1:  # the model reshapes them: row after row, as a gather once gave
            key, value = key.contiguous(), value.contiguous()
        return key, value

    def gather(self, layer_idx: int, first_row: int, end_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [first_row, end_row): [rows, kv_heads, longest, head_dim] keys and values (V's heads and head_dim may
        differ) from each row's first held block, views into the gather workspace (`GatherWorkspace.gather_heads`,
        valid until the next gather); positions past a row's length are not keys."""
        group_idx = self.pool.group_of_layer[layer_idx]
        rows = self._row_blocks.get((group_idx, first_row, end_row))
        if rows is None:
            group = self._groups[group_idx]
            num_blocks = max(group.num_table_blocks[first_row:end_row])
            length = max(group.host_seq_lens[first_row:end_row])
            blocks = group.tables[first_row:end_row, :num_blocks].flatten()
            rows = self._row_blocks[(group_idx, first_row, end_row)] = (blocks, end_row - first_row, length)
        return self._workspace.gather_heads(self.pool.key_cache[layer_idx], self.pool.value_cache[layer_idx], *rows)
