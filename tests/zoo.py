"""The zoo: a tiny random-weight model of every causal LM in transformers, run through each hf_paged path.

Shared by `tests/test_zoo.py` and `python -m tests.zoo` (which writes the supported-models matrix of
docs/models.md and the expectation table `tests/zoo_expected.json`).

Every entry of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` gets a config from its config class by generic shrinking
(`SHRINK`: only the attributes a config has) plus a small per-family override table (`OVERRIDES`). Each model runs
in a forked child with a time limit, so a model that hangs or kills its process is classified, not fatal. In the
child, each path of `PATHS` runs the same left-padded batch of 2 as the reference (the model's default cache) and is
classified by `classify`:

    identical          ran; same greedy tokens and per-step scores (allclose, TOLERANCE) as the reference
    silently wrong     ran; tokens or scores differ
    silently bypassed  ran identical, but hf_paged was never used (no PagedCache.update, or the "hf_paged"
                       attention function never called after enable())
    refused            a typed hf_paged error (hf_paged.errors) or a NotImplementedError raised by hf_paged
    raw error          anything else (a crash, a timeout, an error deep inside the model)
    reference fails    the reference itself fails (or the model cannot be built)

The Engine's path runs each prompt of the batch (its unpadded tokens) through `Engine.generate` in one engine, with
a small token budget per step and small blocks so that prefill chunks, packed prompts and decode rows share steps,
and compares every request with `generate()` of that prompt alone (batch 1, default cache): the same greedy tokens
and, per step, the same raw logits (the Engine applies no logits processors).

A new path is one more entry of `PATHS`: a function `(model, inputs) -> GenerateResult` that `run_architecture`
calls after the others; the reference it compares with is named by its `reference` field.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import multiprocessing
import os
import sys
import textwrap
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_PATH = ROOT / "tests" / "zoo_expected.json"
DOCS_PATH = ROOT / "docs" / "models.md"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
PROMPT_LEN = 8
MAX_NEW_TOKENS = 4
NUM_BEAMS = 3
# Scores of the same K/V through the same attention agree to float32 rounding; a real divergence is orders larger.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)

MAX_PARAMETERS = 60_000_000

OUTCOMES = ("identical", "silently wrong", "silently bypassed", "refused", "raw error", "reference fails")

# Generic shrinking: each attribute is set only where the config class has it.
SHRINK = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim"), 64),
    **dict.fromkeys(
        ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size"),
        128,
    ),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers"), 2),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads", "n_heads"),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 256),
    # MoE
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), 32),
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    # MLA
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_topk": 4,  # DeepSeek Sparse Attention: fewer keys than a prompt, so the indexer's choice masks some
    # what random weights need for non-degenerate greedy output (see DESIGN.md)
    "vocab_size": VOCAB_SIZE,
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "unpadded_vocab_size": VOCAB_SIZE,
    "dim_head": 16,
    "emb_dim": 64,
    "hidden_size_per_layer_input": 16,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "eos_token_id": None,
    "pad_token_id": PAD_TOKEN_ID,
}

# Per family, what generic shrinking gets wrong (applied after it).
OVERRIDES: dict[str, dict] = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "ernie4_5_moe": {"moe_k": 2, "moe_layer_end_index": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "gemma3n_text": {  # two KV-sharing layers, each type produced by an earlier layer
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
    },
    "mamba2": {"num_heads": 8, "head_dim": 16},  # hidden_size * expand == num_heads * head_dim
    # hybrid models: one attention layer next to one mamba / recurrent layer
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # LFM2's default tiny stack is all attention (full_attn_idxs covers every layer): one conv layer, one attention
    **dict.fromkeys(("lfm2", "lfm2_moe"), {"layer_types": ["conv", "full_attention"]}),
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 48]},
    "zaya": {"num_experts_per_tok": 1},
    "longcat_flash": {"expert_ffn_hidden_size": 32, "zero_expert_num": 2},  # defaults: 256 experts of 2048
    "xmod": {"default_language": "en_XX"},  # its forward needs a language adapter to run
    # DBRX's attention reads attn_config.rope_theta, which its attention config does not define, and clamps by clip_qkv
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Qwen4-Exp's QSA indexer (every "indexed_attention" layer has one): a budget of 4 keys in blocks of 2, under
    # the prompt's length, so the indexer's choice masks some keys
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),
        {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 4,
            "indexer_compress_ratio": 2,
        },
    ),
    # Zamba's default stack starts with three fixed layers; one mamba and one hybrid (shared attention) layer
    **dict.fromkeys(("zamba", "zamba2"), {"layers_block_type": ["linear_attention", "hybrid"]}),
    "blt": {"encoder_hash_byte_group_vocab": 64},  # six hash embeddings of 500,002 rows each by default
    "xlstm": {"qk_dim_factor": 1.0},  # its recurrent kernel reads head_dim (16) as the query / key head size
    # An assistant (draft) model: no per-layer inputs, and every layer reads the target model's K/V
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0},
        "backbone_hidden_size": 64,
        "num_centroids": 16,
        "centroid_intermediate_top_k": 4,
    },
    # MusicGen's decoder over one codebook (no delay pattern between codebooks); its generation settings below
    **dict.fromkeys(("musicgen", "musicgen_melody"), {"num_codebooks": 1}),
    # Dory loops its middle layers: one input, one looped and one output layer
    "dory": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
}


# ------------------------------------------------------------------------------------------------- configs
def architectures() -> dict[str, str]:
    """model_type -> model class name, for every causal LM transformers knows."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrunk_kwargs(config) -> dict:
    """The SHRINK attributes `config` (a default config instance) has, its layer pattern cut to one layer of each
    type, and its sub-configs (vision, text, ...) shrunk the same way."""
    defaults = config.to_dict()
    kwargs = {key: value for key, value in SHRINK.items() if key in defaults}
    layer_types = defaults.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        # The smallest stack that keeps the pattern: one layer of each type, in order of first appearance.
        distinct = list(dict.fromkeys(layer_types))
        kwargs["layer_types"] = distinct if len(distinct) > 1 else distinct * 2
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
            if key in kwargs:
                kwargs[key] = len(kwargs["layer_types"])
    window = defaults.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 8:
        kwargs["sliding_window"] = 8  # below prompt + new tokens, so a sliding layer really slides
    chunk = defaults.get("attention_chunk_size")
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 4:
        kwargs["attention_chunk_size"] = 4  # inside the prompt, so a chunked layer really starts a new chunk
    if isinstance(defaults.get("rotary_dim"), int):
        kwargs["rotary_dim"] = 8
    if defaults.get("kv_lora_rank"):  # MLA expands its latent to every head
        kwargs["num_key_value_heads"] = SHRINK["num_attention_heads"]
    for key in getattr(type(config), "sub_configs", None) or {}:
        sub_config = getattr(config, key, None)
        if hasattr(sub_config, "to_dict"):
            kwargs[key] = {"model_type": sub_config.model_type, **_shrunk_kwargs(sub_config)}
    return kwargs


def config_class_of(model_type: str):
    """The config class the tiny config of `model_type` is built from: the mapping's, except where that is a
    composite (multimodal) config and the causal-LM class takes another (its text or decoder config)."""
    import transformers
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    model_config_class = getattr(transformers, architectures()[model_type]).config_class
    if getattr(config_class, "sub_configs", None) and not issubclass(config_class, model_config_class):
        return model_config_class
    return config_class


def tiny_config(model_type: str):
    """The tiny config of `model_type`: generic shrinking, then `OVERRIDES[model_type]` (a dict for a sub-config
    updates its shrunk kwargs)."""
    config_class = config_class_of(model_type)
    overrides = OVERRIDES.get(model_type, {})
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    # The default instance gets the sub-config overrides already: a class can refuse its own default sub-config
    # (an assistant model's text config).
    config = config_class(**{key: dict(value) for key, value in overrides.items() if key in sub_configs})
    kwargs = _shrunk_kwargs(config)
    if getattr(config, "is_decoder", None) is False and "is_decoder=True" in _source(architectures()[model_type]):
        kwargs["is_decoder"] = True  # a BERT-style encoder is a causal LM only as a decoder (its class says so)
    for key, value in overrides.items():
        merge = key in sub_configs and isinstance(kwargs.get(key), dict)
        kwargs[key] = {**kwargs[key], **value} if merge else value
    return config_class(**kwargs)


def _source(class_name: str) -> str:
    import transformers

    return inspect.getsource(getattr(transformers, class_name))


# Per family, generation settings a random model's generation config lacks and its own generate() needs.
GENERATION_OVERRIDES: dict[str, dict] = {
    # MusicGen's generate() starts from, and filters out, its special token (id vocab_size, never generated)
    **dict.fromkeys(
        ("musicgen", "musicgen_melody"),
        {"decoder_start_token_id": VOCAB_SIZE, "pad_token_id": VOCAB_SIZE, "num_return_sequences": 1},
    ),
}


def tiny_model(model_type: str, class_name: str):
    """The tiny fp32 random-weight model of `model_type` (seed 0), in eval mode, with `GENERATION_OVERRIDES`."""
    import transformers

    config = tiny_config(model_type)
    model_class = getattr(transformers, class_name)
    with torch.device("meta"):  # count first: a default left unshrunk can need gigabytes
        num_parameters = sum(p.numel() for p in model_class(config).parameters())
    if num_parameters > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {num_parameters / 1e6:.0f}M parameters; add an OVERRIDES entry")
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    model.generation_config.update(**GENERATION_OVERRIDES.get(model_type, {}))
    return model


def inputs(batch: int = 2, length: int = PROMPT_LEN) -> dict:
    """A left-padded batch: row i has `i * 2` pad tokens; tokens drawn from `[1, VOCAB_SIZE)`."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB_SIZE, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(batch):
        input_ids[row, : 2 * row] = PAD_TOKEN_ID
        attention_mask[row, : 2 * row] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------------- paths
@dataclasses.dataclass
class GenerateResult:
    sequences: torch.Tensor  # [rows, seq_len] int64
    scores: tuple[torch.Tensor, ...]  # one per new token, [rows, vocab] float32


def generate(model, model_inputs: dict, **options) -> GenerateResult:
    """Greedy `generate()` of MAX_NEW_TOKENS with its per-step scores; `options` go to `generate()`."""
    out = model.generate(
        **model_inputs,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **options,
    )
    return GenerateResult(out.sequences, tuple(out.scores))


def reference(model, model_inputs: dict, **options) -> GenerateResult:
    """`generate()` with the model's default cache. It is the reference also for a model that refuses a cache passed
    in (MiniMax keeps its own, OpenAI GPT takes none) or fills one wrong (MPT's `generate()` feeds every token again
    at each step): hf_paged must refuse such a model to pass."""
    return generate(model, model_inputs, **options)


def prompts_of(model_inputs: dict) -> list[list[int]]:
    """Each row's prompt without its padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(model_inputs["input_ids"], model_inputs["attention_mask"])]


def single_reference(model, model_inputs: dict) -> GenerateResult:
    """Each prompt alone (batch 1, no padding) through greedy `generate()` with the model's default cache, as
    `reference`: [rows, MAX_NEW_TOKENS] new tokens and, per step, [rows, vocab] raw logits
    (`output_logits`: what the Engine's greedy choice reads), with no logits processor."""

    def run(input_ids, **options) -> GenerateResult:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )
        sequences = out.sequences
        if sequences.dim() == 3:  # MusicGen: [batch, codebooks, length], one codebook here
            sequences = sequences.flatten(0, 1)
        return GenerateResult(sequences[:, input_ids.shape[1] :], tuple(out.logits))

    # The Engine applies no logits processors: none that the model's generation config turns on either (BART's
    # forced eos at the last step). generate() fills a None it is passed from the model's config, so the model's
    # generation config itself goes without them here.
    saved = copy.deepcopy(model.generation_config)
    for name in NO_PROCESSORS:
        setattr(model.generation_config, name, None)
    rows = []
    try:
        for prompt in prompts_of(model_inputs):
            input_ids = torch.tensor([prompt])
            rows.append(run(input_ids))
    finally:
        model.generation_config = saved
    return _stack(rows)


# Logits processors a model's generation config can turn on that the Engine does not apply.
NO_PROCESSORS = ("forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens")


def _stack(rows: list[GenerateResult]) -> GenerateResult:
    """One GenerateResult of `rows` (each one row of the same number of steps)."""
    sequences = torch.cat([row.sequences for row in rows])
    scores = tuple(torch.cat(step) for step in zip(*(row.scores for row in rows)))
    return GenerateResult(sequences, scores)


REFERENCES: dict[str, Callable] = {
    "greedy": lambda model, model_inputs: reference(model, model_inputs),
    "beams": lambda model, model_inputs: reference(model, model_inputs, num_beams=NUM_BEAMS),
    "single": single_reference,
}


@dataclasses.dataclass
class Counts:
    """How often hf_paged ran during one path (see `_instrument`)."""

    updates: int = 0  # PagedCache.update calls
    step_updates: int = 0  # StepCache.update calls (the Engine's)
    row_updates: int = 0  # RowCache.update calls (the Engine's per-request step, with the model's own attention)
    fixed_updates: int = 0  # ReservedSteps.update calls (a compileable PagedCache's fixed-width steps)
    attention_calls: int = 0  # calls of the "hf_paged" attention function
    plans: int = 0  # of those, calls that read K/V through a decode plan


@dataclasses.dataclass(frozen=True)
class ZooPath:
    """One way of running a model through hf_paged, compared with the reference named `reference`.

    `run(model, model_inputs)` returns a GenerateResult; it may change the model (enable() does), so paths run in
    the order of PATHS, each after the ones before it. `used(counts)` says whether hf_paged really ran.
    """

    name: str
    title: str
    run: Callable
    reference: str
    used: Callable[[Counts], bool]


def _paged(model, model_inputs, **options) -> GenerateResult:
    import hf_paged

    return generate(model, model_inputs, cache=hf_paged.create_cache("paged", model), **options)


def _attention(model, model_inputs) -> GenerateResult:
    import hf_paged

    hf_paged.enable(model, backend="torch")
    return _paged(model, model_inputs)


# A compileable cache's width: room for the prompt and the new tokens.
FIXED_CACHE_LEN = 64


def _fixed(model, model_inputs) -> GenerateResult:
    """Eager generate() on a compileable cache: every step after the prompt a fixed-width (reserved) step."""
    from hf_paged import PagedCache

    return generate(model, model_inputs, cache=PagedCache(config=model.config, max_cache_len=FIXED_CACHE_LEN))


# The Engine's shapes: blocks of 4 tokens (a prompt spans several, a sliding window of 8 releases some) and 6
# tokens per step, so prompts are prefilled in chunks over cached tokens, packed two to a step, and share steps
# with decode rows.
ENGINE_OPTIONS = dict(max_num_seqs=2, max_num_batched_tokens=6)
ENGINE_BLOCK_SIZE = 4


def _engine(model, model_inputs) -> GenerateResult:
    """Every prompt of `model_inputs` through one Engine's `generate()`; per step, each request's raw logits."""
    from hf_paged import BlockPool, Engine

    def scored_forward(rows):
        """The step's forward, keeping the logits each request's next token is chosen from."""
        logits = forward(rows)
        for (request, num_tokens), row_logits in zip(rows, logits):
            if request.num_pending == num_tokens:  # the row ends its input: its logits pick a token
                scores.setdefault(request.request_id, []).append(row_logits.float().clone())
        return logits

    scores: dict[int, list[torch.Tensor]] = {}
    pool = BlockPool.for_model(model, num_blocks=64, block_size=ENGINE_BLOCK_SIZE)
    engine = Engine(model, pool, **ENGINE_OPTIONS)
    forward = engine.step_runner.forward
    engine.step_runner.forward = scored_forward
    if engine.runner is not None:  # every decode step padded to max_num_seqs rows, as under CUDA graphs
        engine.runner.pad_to_buckets, engine.runner.buckets = True, [ENGINE_OPTIONS["max_num_seqs"]]
    outputs = engine.generate(prompts_of(model_inputs), max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    # generate() issues request ids 0, 1, ... in input order on a new engine.
    steps = [scores.get(request_id, []) for request_id in range(len(outputs))]
    if any(len(output) != MAX_NEW_TOKENS or len(step) != MAX_NEW_TOKENS for output, step in zip(outputs, steps)):
        return GenerateResult(torch.tensor([output[:1] for output in outputs]), ())  # compare() names the miss
    return _stack(
        [GenerateResult(torch.tensor([output]), tuple(s[None] for s in step)) for output, step in zip(outputs, steps)]
    )


PATHS: list[ZooPath] = [
    ZooPath(
        "paged",
        'generate(cache=create_cache("paged", model))',
        _paged,
        "greedy",
        lambda counts: counts.updates > 0,
    ),
    ZooPath(
        "beams",
        f"same with num_beams={NUM_BEAMS}",
        lambda model, model_inputs: _paged(model, model_inputs, num_beams=NUM_BEAMS),
        "beams",
        lambda counts: counts.updates > 0,
    ),
    ZooPath(
        "attention",
        'after hf_paged.enable(model) ("hf_paged" attention, torch backend)',
        _attention,
        "greedy",
        lambda counts: counts.updates > 0 and counts.attention_calls > 0,
    ),
    ZooPath(
        "fixed",
        f"PagedCache(max_cache_len={FIXED_CACHE_LEN}), eager (the compileable cache's steps)",
        _fixed,
        "greedy",
        lambda counts: counts.fixed_updates > 0,
    ),
    ZooPath(
        "engine",
        "Engine.generate (each prompt vs generate() of it alone)",
        _engine,
        "single",
        # The packed step attends through "hf_paged"; the per-request step through the model's own attention.
        lambda counts: counts.step_updates > 0 and (counts.attention_calls > 0 or counts.row_updates > 0),
    ),
]


# ---------------------------------------------------------------------------------------------- classifying
def _instrument(counts: Counts) -> None:
    """In a zoo child: count PagedCache.update calls and calls of the "hf_paged" attention function."""
    from hf_paged.attention import interface, plan_of
    from hf_paged.cache import PagedCache
    from hf_paged.cache.fixed_width import ReservedSteps
    from hf_paged.engine import StepCache
    from hf_paged.engine.per_request import RowCache

    update, step_update, row_update = PagedCache.update, StepCache.update, RowCache.update
    fixed_update = ReservedSteps.update

    def counted_update(self, *args, **kwargs):
        counts.updates += 1
        return update(self, *args, **kwargs)

    def counted_fixed_update(self, *args, **kwargs):
        counts.fixed_updates += 1
        return fixed_update(self, *args, **kwargs)

    def counted_step_update(self, *args, **kwargs):
        counts.step_updates += 1
        return step_update(self, *args, **kwargs)

    def counted_row_update(self, *args, **kwargs):
        counts.row_updates += 1
        return row_update(self, *args, **kwargs)

    attend = interface.paged_attention_forward

    def counted_attention(module, query, key, *args, **kwargs):
        counts.attention_calls += 1
        counts.plans += plan_of(key) is not None
        return attend(module, query, key, *args, **kwargs)

    PagedCache.update = counted_update
    ReservedSteps.update = counted_fixed_update
    StepCache.update = counted_step_update
    RowCache.update = counted_row_update
    # register() (called by enable()) registers whatever this module name holds.
    interface.paged_attention_forward = counted_attention
    interface.register()


def classify_error(error: BaseException) -> tuple[str, str]:
    """(outcome, detail) of a path that raised: `refused` for a typed hf_paged error or a NotImplementedError
    raised inside hf_paged, `raw error` for anything else."""
    import hf_paged
    from hf_paged import errors

    message = " ".join(str(error).split())
    detail = f"{type(error).__name__}: {message}"
    typed = isinstance(error, errors.UnsupportedModel)
    frames = traceback.extract_tb(error.__traceback__)
    package = str(Path(hf_paged.__file__).parent)
    from_hf_paged = bool(frames) and frames[-1].filename.startswith(package)
    if typed or (isinstance(error, NotImplementedError) and from_hf_paged):
        return "refused", detail
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return "raw error", detail[:300] + where


def compare(got: GenerateResult, expected: GenerateResult) -> str | None:
    """None when `got` matches `expected` (equal tokens, per-step scores allclose), else how it differs."""
    if got.sequences.shape != expected.sequences.shape:
        return f"sequences of shape {tuple(got.sequences.shape)} vs {tuple(expected.sequences.shape)}"
    if not torch.equal(got.sequences, expected.sequences):
        row, column = (got.sequences != expected.sequences).nonzero()[0].tolist()
        step = column - (expected.sequences.shape[1] - len(expected.scores))
        got_token, expected_token = got.sequences[row, column].item(), expected.sequences[row, column].item()
        return f"tokens differ from step {step} (row {row}: {got_token} vs {expected_token})"
    if len(got.scores) != len(expected.scores):
        return f"{len(got.scores)} steps of scores vs {len(expected.scores)}"
    for step, (a, b) in enumerate(zip(got.scores, expected.scores)):
        if a.shape != b.shape or not torch.allclose(a, b, **TOLERANCE):
            diff = (a - b).abs().nan_to_num(0).max().item() if a.shape == b.shape else float("nan")
            return f"scores differ at step {step}: max |diff| {diff:.3g}"
    return None


def run_architecture(model_type: str, class_name: str, report: Callable[[str, dict], None]) -> None:
    """Build the tiny model of `model_type` and run every path; `report(path_name, {"outcome", "detail"})` as each
    finishes (so a parent learns what ran before a crash)."""
    counts = Counts()
    _instrument(counts)
    try:
        model = tiny_model(model_type, class_name)
    except Exception as error:
        for path in PATHS:
            report(path.name, {"outcome": "reference fails", "detail": f"model not built: {_short(error)}"})
        return
    model_inputs = inputs()
    references = {}
    for name in dict.fromkeys(path.reference for path in PATHS):
        try:
            references[name] = REFERENCES[name](model, model_inputs)
        except Exception as error:
            references[name] = error
    for path in PATHS:
        reference = references[path.reference]
        if isinstance(reference, Exception):
            report(path.name, {"outcome": "reference fails", "detail": _short(reference)})
            continue
        counts.updates = counts.step_updates = counts.row_updates = counts.fixed_updates = 0
        counts.attention_calls = counts.plans = 0
        try:
            got = path.run(model, model_inputs)
        except Exception as error:
            outcome, detail = classify_error(error)
            report(path.name, {"outcome": outcome, "detail": detail})
            continue
        difference = compare(got, reference)
        if difference is not None:
            report(path.name, {"outcome": "silently wrong", "detail": difference})
        elif not path.used(counts):
            report(path.name, {"outcome": "silently bypassed", "detail": f"hf_paged not used: {counts}"})
        else:
            report(path.name, {"outcome": "identical", "detail": ""})


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


# ------------------------------------------------------------------------------------------- the forked runs
def _child(connection, model_type: str, class_name: str) -> None:
    if not os.environ.get("ZOO_VERBOSE"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:
        run_architecture(model_type, class_name, lambda name, result: connection.send((name, result)))
    except Exception as error:  # a bug of the harness itself: reported on the paths not done
        connection.send(("", {"outcome": "raw error", "detail": f"zoo harness: {_short(error)}"}))
    connection.send(None)
    connection.close()


def run_zoo(
    model_types: list[str] | None = None,
    jobs: int = 2,
    time_limit: float = 60.0,
    progress: Callable[[str, dict], None] | None = None,
) -> dict[str, dict[str, dict]]:
    """model_type -> path name -> {"outcome", "detail"}, each architecture in its own forked process (at most
    `jobs` at once, each killed after `time_limit` seconds)."""
    import hf_paged  # noqa: F401  (imported once here, inherited by every child)

    names = architectures()
    pending = list(model_types if model_types is not None else names)
    context = multiprocessing.get_context("fork")
    running: dict[str, tuple] = {}
    results: dict[str, dict[str, dict]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(sender, model_type, names[model_type]), daemon=True)
            process.start()
            sender.close()
            running[model_type] = (process, receiver, time.monotonic())
            results[model_type] = {}
        time.sleep(0.02)
        for model_type, (process, receiver, started) in list(running.items()):
            done, reason = _drain(receiver, results[model_type])
            if not done and not process.is_alive():
                done, reason = _drain(receiver, results[model_type])
                reason = reason or f"the process died (exit code {process.exitcode})"
                done = True
            if not done and time.monotonic() - started > time_limit:
                process.kill()
                done, reason = True, f"timed out after {time_limit:.0f} s"
            if done:
                process.join()
                receiver.close()
                del running[model_type]
                _fill_missing(results[model_type], reason)
                if progress is not None:
                    progress(model_type, results[model_type])
    return {model_type: results[model_type] for model_type in (model_types or names)}


def _drain(receiver, results: dict) -> tuple[bool, str | None]:
    """Read what a child reported; (finished, None) once it sent its end marker."""
    try:
        while receiver.poll():
            message = receiver.recv()
            if message is None:
                return True, None
            name, result = message
            if not name:  # the harness failed: the paths not reported fail with its message
                return True, result["detail"]
            results[name] = result
    except (EOFError, OSError):
        return True, "the process died"
    return False, None


def _fill_missing(results: dict, reason: str | None) -> None:
    """The paths a dead or killed child never reported: the first one was running when it stopped."""
    missing = [path.name for path in PATHS if path.name not in results]
    if not missing:
        return
    if not results:  # it stopped while building the model or running the references
        for name in missing:
            results[name] = {"outcome": "reference fails", "detail": f"model or reference: {reason}"}
        return
    results[missing[0]] = {"outcome": "raw error", "detail": reason or "no result"}
    for name in missing[1:]:
        results[name] = {"outcome": "raw error", "detail": f"not run: {missing[0]} stopped the process"}


# -------------------------------------------------------------------------------------------- the matrix
def counts_by_path(results: dict[str, dict[str, dict]]) -> dict[str, dict[str, int]]:
    """path name -> outcome -> number of architectures."""
    counts = {path.name: dict.fromkeys(OUTCOMES, 0) for path in PATHS}
    for by_path in results.values():
        for name, result in by_path.items():
            counts[name][result["outcome"]] += 1
    return counts


def expectations(results: dict[str, dict[str, dict]]) -> dict[str, dict[str, str]]:
    """model_type -> path name -> outcome: what tests/zoo_expected.json holds."""
    return {model_type: {name: r["outcome"] for name, r in by_path.items()} for model_type, by_path in results.items()}


def _cell(result: dict) -> str:
    outcome, detail = result["outcome"], result["detail"]
    if outcome == "identical":
        return "identical"
    if "does not support model type" in detail:  # UnsupportedModel: "<path> does not support model type 'x': why"
        refuser = detail.split(": ", 1)[1].split(" does not support", 1)[0]
        detail = f"({refuser}) {detail.split(': ', 2)[-1]}"
    detail = detail.replace("|", "\\|").replace("`", "'")
    return f"{outcome} {detail[:220]}" if detail.startswith("(") else f"{outcome}: {detail[:220]}"


def matrix_markdown(results: dict[str, dict[str, dict]], command: str) -> str:
    """The generated part of docs/models.md: the counts per path and the architecture x path table."""
    names = architectures()
    counts = counts_by_path(results)
    summary = (
        f"Generated by `{command}` with transformers {_transformers_version()} and torch {torch.__version__} on CPU "
        f"(fp32, a left-padded batch of 2, {PROMPT_LEN}-token prompts, {MAX_NEW_TOKENS} new tokens; tokens equal and "
        f"per-step scores allclose with atol={TOLERANCE['atol']}, rtol={TOLERANCE['rtol']})."
    )
    lines = [
        *textwrap.wrap(summary, width=120, break_on_hyphens=False),
        "",
        "| path | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for path in PATHS:
        lines.append(f"| {path.title} | " + " | ".join(str(counts[path.name][o]) for o in OUTCOMES) + " |")
    lines += ["", "| model type | class | " + " | ".join(path.name for path in PATHS) + " |"]
    lines.append("|---|---|" + "---|" * len(PATHS))
    for model_type in sorted(results):
        cells = [_cell(results[model_type][path.name]) for path in PATHS]
        lines.append(f"| {model_type} | {names.get(model_type, '?')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


BEGIN, END = "<!-- zoo matrix: begin (generated by python -m tests.zoo --write) -->", "<!-- zoo matrix: end -->"


def write_docs(markdown: str, path: Path = DOCS_PATH) -> None:
    """Replace the generated part of docs/models.md (between BEGIN and END) with `markdown`."""
    text = path.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + markdown + text[stop:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="architectures run at once (default 2)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per architecture (default 120)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--json", type=Path, help="write the full results (outcome and detail) here")
    parser.add_argument(
        "--write", action="store_true", help="update docs/models.md's matrix and tests/zoo_expected.json"
    )
    parser.add_argument("--from-json", type=Path, help="take the results from a --json file instead of running")
    args = parser.parse_args(argv)
    model_types = [name for name in args.only.split(",") if name] or None
    started = time.monotonic()

    def progress(model_type, by_path):
        outcomes = ", ".join(f"{name}: {r['outcome']}" for name, r in by_path.items())
        print(f"{model_type:28s} {outcomes}", file=sys.stderr, flush=True)

    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        results = run_zoo(model_types, jobs=args.jobs, time_limit=args.time_limit, progress=progress)
        print(f"{len(results)} architectures in {time.monotonic() - started:.0f} s", file=sys.stderr)
    for name, counts in counts_by_path(results).items():
        print(name, counts)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if args.write:
        if model_types is not None:
            parser.error("--write needs the whole zoo (no --only)")
        write_docs(matrix_markdown(results, "python -m tests.zoo --write"))
        table = expectations(results)  # one line per architecture, so a change in support is a one-line diff
        lines = [
            f"{json.dumps(model_type)}: {json.dumps(table[model_type], sort_keys=True)}" for model_type in sorted(table)
        ]
        EXPECTED_PATH.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
