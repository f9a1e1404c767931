"""The packed step: every row of an Engine step in one forward, packed into one sequence.

    step rows:  | d0 | d1 | p0: prompt chunk, 5 tokens |        decode rows first
    forward:    model([d0, d1, p0 ... p0], cache=StepCache)     [1, 7]: attention through "hf_paged" reads the pool
    logits:     at each row's last token -> [num_rows, vocab]   (`logits_to_keep`)

A step whose rows all add one token goes to the decode runner instead (decode_runner.py: persistent buffers, CUDA
graphs), when the model has one. `PerRequestStep` (per_request.py) is the other step behind the same `forward(rows)`.

`compile_forward` runs the forward compiled, one graph for every token count (compiled_step.py); a forward that
cannot be compiled runs eagerly from then on, and `compile_error` says why.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from ..errors import UnsupportedModel
from ..storage import BlockPool
from .compiled_step import CompiledStepCache, attention_modules, mark_dynamic_size, running
from .decode_runner import DecodeRunner
from .model_support import never_stored
from .request import Request
from .step_cache import StepCache

logger = logging.getLogger(__name__)


class PackedStep:
    """Runs the rows of an Engine step in one forward (see the module docstring).

    Args:
        model: the transformers causal LM, on the "hf_paged" attention.
        pool (`BlockPool`): the Engine's pool.
        cache_keyword (`str`): the keyword the model's forward takes its cache by.
        chunk_sizes (`list[int | None]`): per layer, its chunked-attention size or None.
        runner (`DecodeRunner`, *optional*): what runs decode-only steps (None: they are packed too).
    """

    def __init__(
        self, model, pool: BlockPool, cache_keyword: str, chunk_sizes: list[int | None], runner: DecodeRunner | None
    ):
        self.model, self.pool = model, pool
        self.cache_keyword = cache_keyword
        self.chunk_sizes = chunk_sizes
        self.runner = runner
        self.model_type = getattr(model.config, "model_type", None)
        # The compiled forward (`compile_forward`), its cache, the layers' attention modules and its logits rows.
        self._compiled = self._compiled_cache = None
        self._attention_modules: dict[int, torch.nn.Module] = {}
        self.num_logits = 0
        self.num_compiled_steps = 0  # forwards run compiled
        self.compile_error: str | None = None  # why the forward runs eagerly after `compile_forward`

    def compile_forward(self, options: dict, num_logits: int) -> None:
        """Run the forward compiled (`torch.compile(model, fullgraph=True, **options)`), the step's token count a
        dynamic size, every step's logits computed for `num_logits` rows (the most a step has) and cut to its own.
        Raises `ValueError` when a layer of the pool has no attention module to hand its plan."""
        modules = attention_modules(self.model)
        missing = [layer for layer in range(self.pool.layout.num_layers) if layer not in modules]
        if missing:
            raise ValueError(
                f"compile_prefill needs the attention module of every layer (a module with that layer_idx whose class "
                f"name says attention), and finds none for layers {missing}"
            )
        self._compiled = torch.compile(self.model, **{"fullgraph": True, **options})
        self._compiled_cache = CompiledStepCache(self.pool.layout.num_layers, self.model_type)
        self._attention_modules = modules
        self.num_logits = num_logits

    def forward(self, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """rows (request, new tokens), decode rows first -> [len(rows), vocab] logits at each row's last new token."""
        if self.runner is not None and all(num_tokens == 1 for _, num_tokens in rows):
            return self.runner.forward(rows)
        if self._compiled is not None and self.compile_error is None:
            return self._compiled_forward(rows)
        return self._eager_forward(rows)

    def forward_with_prompt_logits(
        self, rows: list[tuple[Request, int]], positions: dict[int, range]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows, and per row index positions of its new tokens -> ([len(rows), vocab] logits at each row's last new
        token, [sum of the positions, vocab] logits at those positions, row by row in `positions`' order). Runs the
        eager packed forward (not the decode runner's graphs, not the compiled forward: their logits rows are
        fixed)."""
        starts = list(itertools.accumulate((num_tokens for _, num_tokens in rows), initial=0))
        kept = [
            starts[row] + position - rows[row][0].num_computed for row, span in positions.items() for position in span
        ]
        logits = self._eager_forward(rows, kept)
        return logits[: len(rows)], logits[len(rows) :]

    def _eager_forward(self, rows: list[tuple[Request, int]], kept: Sequence[int] = ()) -> torch.Tensor:
        """The eager forward -> [len(rows) + len(kept), vocab] logits at each row's last new token, then at the
        packed sequence's indices `kept`."""
        cache = self._step_cache(rows, extra_logits=kept)
        device = self.model.device
        input_ids, logits_to_keep = cache.input_ids, cache.logits_indices
        if input_ids.device != device:  # a model whose embeddings are elsewhere than the pool (device_map)
            input_ids, logits_to_keep = input_ids.to(device), logits_to_keep.to(device)
        out = self.model(
            input_ids=input_ids,
            position_ids=cache.position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_keyword: cache},
        )
        # A model that ran on a cache of its own computed something else than this step (a stand-in that is no torch
        # module, bench/replay.py's, computes no attention at all).
        if cache.num_updates == 0 and isinstance(self.model, torch.nn.Module):
            raise never_stored(self.model_type, self.cache_keyword)
        return out.logits[0]

    def _compiled_forward(self, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """The compiled forward over the rows -> `[len(rows), vocab]` logits. Where it raises and the eager forward of
        the same rows does not (it cannot be traced or compiled, it recompiles past torch.compile's limit, the model
        asks the cache what a compiled step cannot say), the eager forward's logits, and every later step runs eagerly
        (`compile_error`); where the eager forward raises too, its error (a row's, not the compiler's). Running the
        rows again stores the same K/V in the same slots."""
        cache = self._step_cache(rows, self.num_logits)
        input_ids, position_ids = cache.input_ids, cache.position_ids
        mark_dynamic_size(1, input_ids, position_ids)  # [1, T]
        try:
            with running(cache, self._attention_modules):
                out = self._compiled(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    use_cache=True,
                    logits_to_keep=cache.logits_indices,
                    **{self.cache_keyword: self._compiled_cache},
                )
        except UnsupportedModel:
            raise
        except Exception as error:
            logits = self._eager_forward(rows)  # raises the rows' own error where they fail eagerly too
            self.compile_error = f"{type(error).__name__}: {error}"
            logger.warning("Engine: steps that prefill run eagerly, their compiled forward failed: %s", error)
            return logits
        if cache.num_updates == 0:
            raise never_stored(self.model_type, self.cache_keyword)
        self.num_compiled_steps += 1
        return out.logits[0, : len(rows)]

    def _step_cache(
        self, rows: list[tuple[Request, int]], num_logits: int | None = None, extra_logits: Sequence[int] = ()
    ) -> StepCache:
        """The step's `StepCache`: the rows' new tokens, positions, slots and tables on the device (`extra_logits`:
        as `StepCache`'s)."""
        groups = range(self.pool.num_groups)
        token_ids = [
            token
            for request, num_tokens in rows
            for token in request.token_ids[request.num_computed : request.num_computed + num_tokens]
        ]
        return StepCache(
            self.pool,
            [[request.block_tables[g] for request, _ in rows] for g in groups],
            [request.num_computed for request, _ in rows],
            [num_tokens for _, num_tokens in rows],
            first_blocks=[[request.first_blocks[g] for request, _ in rows] for g in groups],
            chunk_sizes=self.chunk_sizes,
            model_type=self.model_type,
            token_ids=token_ids,
            num_logits=num_logits,
            extra_logits=extra_logits,
        )
