"""DecodeRunner: the device side of the Engine's decode-only steps (every row adds one token), after vLLM's and
nano-vllm's model runners.

The packed step (`StepCache`) rebuilds its inputs with `torch.tensor` every step and runs the model's eager forward,
so on a GPU the host is the whole cost. A decode-only step has a shape fixed by its number of rows, so it can be
served from persistent buffers and replayed:

    host (per step)                                   device
    ---------------                                   ------
    ids, positions, and per layer group the           one copy into the persistent buffers
    block tables, slots and lengths of the rows   ->  [forward: embeddings ... the pool's store and the paged decode
    (padded to the bucket: rows repeat a dummy        kernel ... logits]  (a CUDA graph per bucket, replayed)
    row that writes to the runner's own block)        logits of the real rows -> argmax / sampling on the host

Rows are the batch dimension (`input_ids [B, 1]`), not a packed sequence: the attention of each layer is the paged
decode of `FixedDecodePlan` (the Triton kernel on CUDA, one gather and SDPA with a length mask elsewhere), with block
tables `[B, W]` and lengths counted from each row's first held block (W: the longest row's blocks eagerly; under a
graph or a compiled forward, a power of two that holds the longest row so far, the graphs captured again when it
doubles). The cache the forward writes is `RunnerCache` (engine/runner_cache.py).

CUDA graphs (on CUDA, `Engine(cuda_graphs=True)`, the default there): one graph per batch bucket (1, 2, 4, 8, then
multiples of 8 up to `max_num_seqs`), captured the first time a bucket runs; a step with n rows replays the smallest
bucket >= n, its extra rows padded. A model whose forward cannot be captured (it synchronizes with the host) runs
eager, and `capture_error` says why. Padded rows exist only under graphs; without them a step has exactly its rows
(`pad_to_buckets` forces padding, which tests use to check it on CPU).

With asynchronous scheduling (`Engine(async_scheduling=True)`) a step is launched before the host has read the tokens
of the step before it: a row whose input is such a token names its row of that step (`Feed`), and the runner copies
it into the input ids on the device (`_feed`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..attention import store_backend
from ..attention.kernels.dispatch import resolve_backends
from ..cache.gather import GatherWorkspace
from ..errors import UnsupportedModel
from ..storage import BlockPool
from .compiled_step import mark_dynamic_size
from .model_support import never_stored
from .runner_cache import RunnerCache

logger = logging.getLogger(__name__)


class Feed(NamedTuple):
    """The tokens a step still in flight picked (`tokens`: `[rows]` int64 on the pool's device) and, per request id,
    its row there: the next step's rows feed them from the device (asynchronous scheduling)."""

    tokens: torch.Tensor
    rows: dict[int, int]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to `max_num_seqs` (which is
    always one)."""
    buckets = [size for size in (1, 2, 4) if size < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return [*buckets, max_num_seqs]


def runner_reason(model, pool: BlockPool, chunk_sizes: list[int | None]) -> str | None:
    """Why the decode runner cannot serve `model`'s decode steps (they stay packed), or None when it can."""
    if not isinstance(model, torch.nn.Module):  # a stand-in with a forward of its own (bench/replay.py's)
        return "the model is no torch module"
    if pool.layout.latent:
        return "its K/V are latents the model expands after cache.update()"
    if any(size is not None for size in chunk_sizes):
        return "it has chunked-attention layers"
    if "dummy" in pool.layout.layer_types:
        return "its KV-sharing layers attend another layer's K/V"
    return None


def build_decode_runner(
    model,
    pool: BlockPool,
    *,
    max_num_seqs: int,
    cache_keyword: str,
    chunk_sizes: list[int | None],
    max_positions: int | None,
    cuda_graphs: bool | None,
    reason: str | None = None,
) -> tuple[DecodeRunner | None, str | None]:
    """The Engine's decode runner and None, or None and why decode-only steps stay packed (`reason`: the Engine's
    own, else `runner_reason`). `max_positions`: a learned-position model's table size (a row holds no more);
    `cuda_graphs`: None for CUDA graphs on CUDA only."""
    on_cuda = pool.device.type == "cuda"
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
    if cuda_graphs and not on_cuda:
        raise ValueError(f"cuda_graphs=True needs a pool on a CUDA device, this one is on {pool.device}")
    reason = reason if reason is not None else runner_reason(model, pool, chunk_sizes)
    if reason is not None:
        return None, reason
    # A row can hold the whole pool; a model whose positions are a table (learned) no more than the table.
    max_tokens = pool.num_blocks * pool.block_size
    if max_positions is not None:
        max_tokens = min(max_tokens, max_positions)
    max_blocks = -(-max_tokens // pool.block_size)
    graphs = on_cuda if cuda_graphs is None else cuda_graphs
    return DecodeRunner(model, pool, max_num_seqs, max_blocks, cache_keyword, graphs), None


@dataclass
class RunnerStats:
    """What the runner did: steps run eagerly and replayed, graphs captured, their capture time and memory."""

    eager_steps: int = 0
    replayed_steps: int = 0
    padded_rows: int = 0  # rows run for padding to a bucket, all steps together
    # (bucket, block table width, seconds to warm up and capture) of every graph captured
    captures: list[tuple[int, int, float]] = field(default_factory=list)
    capture_bytes: int = 0  # CUDA memory the captured graphs hold (their pool and outputs)


class DecodeRunner:
    """Run decode-only Engine steps from persistent buffers, replaying CUDA graphs per batch bucket on CUDA.

    Args:
        model: the Engine's model (on the "hf_paged" attention).
        pool (`BlockPool`): the Engine's pool.
        max_num_seqs (`int`): the most rows of a step.
        max_blocks_per_seq (`int`): the most blocks a row can hold in one layer group (the buffers' table width, W,
            grows up to it).
        cache_keyword (`str`): the keyword the model's forward takes its cache by.
        cuda_graphs (`bool`): capture and replay a graph per bucket (CUDA only).
    """

    def __init__(
        self, model, pool: BlockPool, max_num_seqs: int, max_blocks_per_seq: int, cache_keyword: str, cuda_graphs: bool
    ):
        self.model, self.pool = model, pool
        self.model_type = getattr(model.config, "model_type", None)
        self.cache_keyword = cache_keyword
        self.cuda_graphs = cuda_graphs
        self.pad_to_buckets = cuda_graphs
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        # W, the buffers' block table width (and the graphs'): a power of two holding the longest row so far (the
        # kernel's split choice, the gather under a graph and the buffers grow with it), doubled, with the buffers
        # made again and the graphs captured again, when a row outgrows it.
        self.graph_width = min(16, max_blocks_per_seq)
        self.stats = RunnerStats()
        self.capture_error: str | None = None
        self.store = store_backend(pool.device)
        self.backends = dict(resolve_backends(pool.device))
        # The shape of the step being run: its rows (the bucket when padded), the block table entries and keys each
        # row's attention spans (the longest row's eagerly, W and W * block_size under a graph or compiled; a compiled
        # forward reads W from the tables' shape instead).
        self.num_rows = self.table_width = self.kv_width = 0
        self.full_rows: list[bool] = []  # per layer group: every row spans all `kv_width` keys (eager steps only)
        # An eager step's rows when enough of them run to read a shared prefix once (`shared_blocks`), else None.
        self.split_rows = None
        self._shared_blocks: dict[int, int] = {}  # layer group -> `shared_blocks`, this step
        # When a shared prefix is read once: at least this many rows share at least this many tokens (on CPU, one
        # thread, 8 q / 4 kv heads of 64: 0.26-0.87x the time of gathering every row's whole context at 8-32 rows
        # sharing 256 tokens before tails of 20-600; up to 5x with 2-4 rows or 16-64 shared tokens;
        # `python -m bench.cascade --layer`).
        self.cascade_min_rows, self.cascade_min_tokens = 8, 256
        # On CPU, a step whose keys and values of one layer exceed `chunk_min_bytes` gathers and attends them
        # `chunk_bytes` at a time, each chunk read while still in the core's caches (`GroupStep.gather_rows`).
        self.chunk_bytes, self.chunk_min_bytes = 4 << 20, 12 << 20
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self._graphs_num_blocks = 0  # the pool's blocks when the graphs were captured
        # The runner's own streams for a capture and its warm-up, on the pool's device (not the current device's).
        self._capture_stream = self._warm_up_stream = None
        self._dummy_block: int | None = None  # where padding rows write (`hold_padding_block`)
        self._copied = None  # a CUDA event after the last host-to-device copy of the staging tensor
        self._gathers = GatherWorkspace()  # K and V of one layer at a time (`gather_buffer`)
        self._forward = model  # the model's forward over the runner's cache, compiled by `compile_forward`
        self.compiled = False  # `compile_forward` was called and its forward has not failed
        self.compile_error: str | None = None  # why the forward runs eagerly after `compile_forward`
        self._allocate(max(self.buckets))
        self._cache = RunnerCache(self)

    def _allocate(self, max_rows: int) -> None:
        """The persistent buffers, views of one int64 device tensor (and a host staging twin, the same tensor on CPU)
        laid out so that each is contiguous, as the kernels read them: a `[3 + 2 * num_groups, rows]` block of per-row
        values (input ids, positions, then per layer group the new token's slot and the row's length from its first
        held block, then where a row's input id comes from on the device: `feed`), then per layer group a `[rows, W]`
        block table."""
        num_groups, width = self.pool.num_groups, self.graph_width
        # An even number of rows: every field's row and every group's tables then start on 16 bytes, as the kernels'
        # compiled variants expect them (Triton specializes a pointer on its alignment; tests/test_launch_variants.py).
        max_rows += max_rows % 2
        self._num_fields = 3 + 2 * num_groups
        size = max_rows * (self._num_fields + num_groups * width)
        # Normal tensors even when a step (under inference mode) widens them: a compiled forward guards on its inputs'
        # dispatch keys, and inference tensors would make it compile again.
        with torch.inference_mode(False):
            self._device = torch.zeros(size, dtype=torch.long, device=self.pool.device)
            # On CPU the buffers are their own staging tensor: nothing to copy.
            on_cpu = self.pool.device.type == "cpu"
            pin = self.pool.device.type == "cuda"
            self._host = self._device if on_cpu else torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self._max_rows = max_rows
        self._host_fields = self._host[: self._num_fields * max_rows].view(self._num_fields, max_rows)
        fields = self._device[: self._num_fields * max_rows].view(self._num_fields, max_rows)
        self.input_ids, self.position_ids = fields[0].view(-1, 1), fields[1].view(-1, 1)  # [rows, 1] each
        self.slots = [fields[2 + g] for g in range(num_groups)]  # [rows]
        self.seq_lens = [fields[2 + num_groups + g] for g in range(num_groups)]  # [rows]
        self.sources = fields[2 + 2 * num_groups]  # [rows]: the fed token's index in `feed`'s tokens, or -1
        tables = self._device[self._num_fields * max_rows :].view(num_groups, max_rows, width)
        self.tables = [tables[g] for g in range(num_groups)]  # [rows, W]
        # Per layer group and row: (request id, its table epoch, table entries staged) of what the staging tensor
        # holds there, so the next step writes only a table's new blocks (`_fill`).
        self._staged: list[list[tuple[int, int, int] | None]] = [[None] * max_rows for _ in range(num_groups)]

    def gather_buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """A grow-only buffer of `numel` values that an eager step gathers one layer's K (or V) into, reused by the
        next layer once this one's attention is done; None while a graph is captured (its own memory then).

        Why: a fresh gather output per layer is a large allocation that the CPU allocator maps anew each time, and
        touching its pages cost more than the copy (3.6 ms of a 4 x 26-block gather of 16 rows, 6.8 MB)."""
        if torch.compiler.is_compiling() or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None  # a traced forward's gathers are its own outputs (`out=` into a view does not trace)
        return self._gathers.buffer(name, (numel,), like)

    # ---------------------------------------------------------------------- step
    def forward(self, rows, feed: Feed | None = None) -> torch.Tensor:
        """rows: `(request, 1)` pairs, each adding its token at position `request.num_computed` -> `[len(rows),
        vocab]` logits of each row's next token. `feed`: the tokens a step still in flight picked, on the device;
        a row whose input is its request's token in flight (`Request.num_inflight`) takes it from there, without
        the host reading it."""
        num_rows = len(rows)
        bucket = next(b for b in self.buckets if b >= num_rows) if self.pad_to_buckets else num_rows
        graphing = self.cuda_graphs and self.capture_error is None
        if self._graphs and self._graphs_num_blocks != self.pool.num_blocks:
            self._drop_graphs()  # a growable pool grew: its K/V are new tensors, which the graphs do not read
        self._fit_width(rows)
        # Padding rows, and a capture, write to the runner's own block; with none held, the step runs its own rows
        # only, replayed only if their number is a captured bucket.
        needs_dummy = bucket > num_rows or (graphing and bucket not in self._graphs)
        dummy = self._dummy_block if needs_dummy else None  # held only if the Engine placed it (hold_padding_block)
        if needs_dummy and dummy is None:
            bucket = num_rows
        graphed = graphing and (bucket in self._graphs or (dummy is not None and self._capture(bucket, dummy)))
        if not graphed:
            self.backends = dict(resolve_backends(self.pool.device))
            if not self.pad_to_buckets:  # a capture that failed just now
                bucket = num_rows
        # A compiled forward reads the buffers at full width whether replayed or not: a width per step would be a size
        # per step for it to compile again.
        fed = self._fill(rows, bucket, dummy, full_width=graphed or self.compiled, feed=feed)
        if fed:
            self._feed(feed.tokens, bucket)
        self.stats.padded_rows += bucket - num_rows
        if graphed:
            graph, logits = self._graphs[bucket]
            with torch.cuda.device(self.pool.device):
                graph.replay()
            self.stats.replayed_steps += 1
            return logits[:num_rows]
        self.stats.eager_steps += 1
        return self._run_model()[:num_rows]

    def _drop_graphs(self) -> None:
        """Forget every captured graph (they are captured again as buckets are used)."""
        self._graphs.clear()
        # A fresh memory pool for the next graphs: capturing again into a pool whose graphs are all gone trips the
        # CUDA caching allocator (its use count is 0 while blocks captured there may still be held).
        self._graph_pool = None

    def _fit_width(self, rows) -> None:
        """Double W until it holds the longest row: new buffers, and the graphs captured again.

        With graphs, W also holds what the rows will grow to (their prompts and `max_new_tokens`), up to twice the
        longest row now: a row about to cross a power of two would otherwise make every graph be captured again a
        few steps later (50-90 ms each on an H200)."""
        longest = max(len(table) for request, _ in rows for table in request.block_tables)
        if self.cuda_graphs and self.capture_error is None:
            block_size = self.pool.block_size
            final = max(-(-request.max_kv_tokens // block_size) for request, _ in rows)
            longest = max(longest, min(final, 2 * longest, self.max_blocks_per_seq))
        if longest > self.graph_width:
            while self.graph_width < longest:
                self.graph_width *= 2
            self.graph_width = min(self.graph_width, self.max_blocks_per_seq)
            self._drop_graphs()
            if self._copied is not None:  # the last copy may still read the old staging tensor
                self._copied.synchronize()
                self._copied = None
            self._allocate(self._max_rows)

    @property
    def pads(self) -> bool:
        """Whether decode steps may run padding rows (padded to buckets, or a graph to capture)."""
        return self.pad_to_buckets or (self.cuda_graphs and self.capture_error is None)

    @property
    def holds_padding_block(self) -> bool:
        return self._dummy_block is not None

    def hold_padding_block(self) -> None:
        """Take the block padding rows write to, if one is free (`holds_padding_block` says whether it did).

        The Engine calls it only while no request runs, before admission (`Engine._place_padding_block`): a block
        taken while requests run would be one admission's lookahead counted on for them. It is kept until the Engine
        has no request left (`release`): taking one per step would cycle the free queue and evict a cached prefix
        block each time. Without one, padded steps run their own rows only."""
        if self._dummy_block is None:
            # Not a cached block where another will do: the waiting request may be about to find it cached.
            self._dummy_block = self.pool.allocator.allocate_spare()

    def release(self) -> None:
        """Give back the padding rows' block (the Engine calls it when no request is left)."""
        if self._dummy_block is not None:
            self.pool.allocator.free([self._dummy_block])
            self._dummy_block = None

    def _feed(self, tokens: torch.Tensor, bucket: int) -> None:
        """Input ids of the rows whose `sources` name one of `tokens` (device ops on the buffers: no host read)."""
        sources = self.sources[:bucket]
        fed = tokens.index_select(0, sources.clamp(min=0))
        ids = self.input_ids[:bucket, 0]
        ids.copy_(torch.where(sources >= 0, fed, ids))

    def _fill(self, rows, bucket: int, dummy: int | None, full_width: bool, feed: Feed | None = None) -> int:
        """Write the rows' inputs (and padding rows up to `bucket`) into the host staging tensor, then copy the rows'
        share of it (one copy of the per-row values, one per layer group of the tables). Table entries past a row's
        blocks keep what an earlier step left there: never read (each row stops at its length), and always a block id
        of the pool. Returns how many rows take their input id from `feed`."""
        block_size, num_groups, width = self.pool.block_size, self.pool.num_groups, self.graph_width
        max_rows, tables_start = self._max_rows, self._num_fields * self._max_rows
        # The last copy may still read the pinned staging tensor (a step that raised). Otherwise it is done: it was
        # queued before the last device-to-host copy the host waited for (the logits read, or with asynchronous
        # scheduling the tokens of the step before), and asking (a query, not a wait) keeps a step free of syncs.
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        fields = [[] for _ in range(self._num_fields)]
        table_index, table_values = [], []
        staging: list[tuple[int, int, tuple[int, int, int] | None]] = []  # (group, row, what `_staged` records)
        longest, num_fed = 1, 0
        lengths = [set() for _ in range(num_groups)]
        sources = fields[2 + 2 * num_groups]
        for row, (request, _) in enumerate(rows):
            position = request.num_computed
            num_prompt, num_known = len(request.prompt_ids), len(request.prompt_ids) + len(request.output_ids)
            if position < num_known:
                fields[0].append(
                    request.prompt_ids[position] if position < num_prompt else request.output_ids[position - num_prompt]
                )
                sources.append(-1)
            else:  # its token in flight
                fields[0].append(0)
                sources.append(feed.rows[request.request_id])
                num_fed += 1
            fields[1].append(position)
            for g in range(num_groups):
                table, first = request.block_tables[g], request.first_blocks[g] * block_size
                offset = position - first
                fields[2 + g].append(table[offset // block_size] * block_size + offset % block_size)
                fields[2 + num_groups + g].append(offset + 1)
                lengths[g].add(offset + 1)
                longest = max(longest, offset + 1)
                # Only what the staging tensor lacks: the blocks appended since this request's last step in this row.
                staged = self._staged[g][row]
                done = (
                    staged[2] if staged is not None and staged[:2] == (request.request_id, request.table_epoch) else 0
                )
                if done < len(table):
                    start = tables_start + (g * max_rows + row) * width
                    table_index += range(start + done, start + len(table))
                    table_values += table[done:]
                    staging.append((g, row, (request.request_id, request.table_epoch, len(table))))
        for row in range(len(rows), bucket):  # padding: token 0 at position 0, in the dummy block only
            for index, value in enumerate([0, 0] + [dummy * block_size] * num_groups + [1] * num_groups + [-1]):
                fields[index].append(value)
            for g in range(num_groups):
                table_index.append(tables_start + (g * max_rows + row) * width)
                table_values.append(dummy)
                staging.append((g, row, None))
        self._host_fields[:, :bucket] = torch.tensor(fields, dtype=torch.long)
        if table_index:
            self._host[torch.tensor(table_index)] = torch.tensor(table_values, dtype=torch.long)
        for g, row, staged in staging:  # recorded once the host tables hold them
            self._staged[g][row] = staged
        if full_width:
            self.table_width, self.kv_width = self.graph_width, self.graph_width * block_size
        else:
            self.table_width, self.kv_width = -(-longest // block_size), longest
        if self._host is not self._device:
            # Asynchronous only from pinned memory (CUDA): a pageable staging tensor (another accelerator) is copied
            # before the host writes it again, as no event then says when the copy is done.
            pinned = self._host.is_pinned()
            self._device[:tables_start].copy_(self._host[:tables_start], non_blocking=pinned)
            host_tables = self._host[tables_start:].view(num_groups, max_rows, width)
            for g in range(num_groups):  # the step's rows, whole: a slice of rows is contiguous on both sides
                # NOTE: a slice of entries too (`[:bucket, :table_width]`) is not, and copying it stages it through a
                # pageable host copy, which blocks the host until the copy is done.
                self.tables[g][:bucket].copy_(host_tables[g, :bucket], non_blocking=pinned)
            if pinned:
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.pool.device))
        self.num_rows = bucket
        self.full_rows = [not full_width and bucket == len(rows) and group == {longest} for group in lengths]
        # Rows whose shared prefix the torch path may read once; how many blocks they share is worked out only when
        # an attention asks (`shared_blocks`: never on the kernel path).
        self.split_rows = rows if not full_width and bucket == len(rows) >= self.cascade_min_rows else None
        self._shared_blocks = {}
        return num_fed

    def shared_blocks(self, group: int) -> int:
        """How many leading blocks of layer group `group` every row of this eager step holds alike (the same block ids
        in the same places, from the same first position: the same keys first in every row's gathered K/V), or 0
        when fewer than `cascade_min_rows` rows run or they share fewer than `cascade_min_tokens` keys, which a shared
        read would not repay. Worked out once per step."""
        shared = self._shared_blocks.get(group)
        if shared is None:
            shared = self._shared_blocks[group] = self._count_shared_blocks(group) if self.split_rows else 0
        return shared

    def _count_shared_blocks(self, group: int) -> int:
        requests = [request for request, _ in self.split_rows]
        if any(request.first_blocks[group] != requests[0].first_blocks[group] for request in requests):
            return 0
        tables = [request.block_tables[group] for request in requests]
        first, shared = tables[0], min(len(table) for table in tables)
        for table in tables[1:]:
            if table[:shared] != first[:shared]:
                shared = next(index for index, (a, b) in enumerate(zip(table, first)) if a != b)
            if shared * self.pool.block_size < self.cascade_min_tokens:
                return 0
        return shared if min(shared * self.pool.block_size, self.kv_width) >= self.cascade_min_tokens else 0

    def compile_forward(self, options: dict) -> None:
        """Run the model's forward over the runner's cache compiled: `torch.compile(model, fullgraph=True,
        **options)`, before any graph is captured (a graph then replays the compiled kernels). The whole forward is
        one graph, the paged store and decode kernel in it as custom ops (`kernels/ops.py`); inductor fuses the rest
        of a layer's small operations (norms, rotary, activations) that an eager forward runs one kernel each."""
        self._drop_graphs()
        self._forward = torch.compile(self.model, **{"fullgraph": True, **options})
        self.compiled = True
        # One graph for every bucket: the batch size is a dynamic size from the first step (`_run_model`), and one
        # row runs as two (torch.compile specializes a size of 1).
        if len(self.buckets) > 1:
            self.buckets = [bucket for bucket in self.buckets if bucket > 1]

    def _run_model(self) -> torch.Tensor:
        cache = self._cache
        input_ids, position_ids = self.input_ids[: self.num_rows], self.position_ids[: self.num_rows]
        if self.compiled:
            cache.make_layers()
            mark_dynamic_size(0, input_ids, position_ids)  # [rows, 1]
            # [max_rows, W]: W doubles as rows grow. Not a strict mark: a model whose code branched on W would
            # compile once per width (a few powers of two) rather than fail and run eagerly from then on.
            for table in self.tables:
                torch._dynamo.maybe_mark_dynamic(table, 1)
        try:
            out = self._call_forward(self._forward, input_ids, position_ids)
        except UnsupportedModel:
            raise
        except Exception as error:
            capturing = self.pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not self.compiled or capturing:
                raise
            # Where the compiled forward raises and the eager one does not (which raises its own error here), the
            # eager one from now on.
            out = self._call_forward(self.model, input_ids, position_ids)
            self._forward, self.compiled = self.model, False
            self.buckets = batch_buckets(self.buckets[-1])  # one row unpadded again
            self.compile_error = f"{type(error).__name__}: {error}"
            self._drop_graphs()  # captured from the compiled forward
            logger.warning("Engine: decode steps run eagerly, their compiled forward failed: %s", error)
        if cache.num_updates == 0:
            raise never_stored(self.model_type, self.cache_keyword)
        return out.logits[:, -1]  # [rows, vocab]

    def _call_forward(self, forward, input_ids: torch.Tensor, position_ids: torch.Tensor):
        cache = self._cache
        cache.start_forward()
        try:
            return forward(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_keyword: cache},
            )
        finally:
            cache.end_forward()

    # ------------------------------------------------------------------ graphs
    def _capture(self, bucket: int, dummy: int) -> bool:
        """Warm up and capture the forward of `bucket` padding rows (they touch only the dummy block); False, with
        `capture_error` set, when the forward cannot be captured."""
        device = self.pool.device
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        self.backends = dict(resolve_backends(device))
        self._fill([], bucket, dummy, full_width=True)
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            try:
                if self._capture_stream is None:  # the runner's two streams, made once (a stream per capture would
                    # leave a cuBLAS workspace behind for each)
                    self._warm_up_stream, self._capture_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
                warm_up = self._warm_up_stream
                warm_up.wait_stream(current)
                with torch.cuda.stream(warm_up):
                    # Triton compiles and allocators settle outside the capture: twice at the first capture, once
                    # after (each warm-up is an eager forward, 20 ms or so on a 1B model).
                    for _ in range(1 if self.stats.captures else 2):
                        self._run_model()
                current.wait_stream(warm_up)
                graph = torch.cuda.CUDAGraph()
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._capture_stream):
                    logits = self._run_model()
            except Exception as error:  # a forward that synchronizes with the host cannot be captured
                # A capture that fails as it ends leaves the capture stream current: give the thread its own back.
                torch.cuda.set_stream(current)
                torch.cuda.synchronize(device)
                self.capture_error = f"{type(error).__name__}: {error}"
                self.pad_to_buckets = False  # padding rows serve graphs only
                logger.warning("Engine: decode steps run without CUDA graphs: %s", self.capture_error)
                return False
        self._graphs[bucket] = (graph, logits)
        self._graphs_num_blocks = self.pool.num_blocks
        self.stats.captures.append((bucket, self.graph_width, time.perf_counter() - start))
        self.stats.capture_bytes += torch.cuda.memory_allocated(device) - before
        return True
