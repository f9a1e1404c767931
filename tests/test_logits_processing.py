"""Penalties, logit bias and a minimum length in the Engine's sampler (engine/sampling.py), batched over the rows
that ask for them: against transformers' own logits processors where it has them (repetition penalty, sequence bias,
min_new_tokens), against a per-row reference for OpenAI's presence and frequency penalties."""

from __future__ import annotations

import pytest
import torch
from models import random_prompts, tiny_engine, tiny_model
from transformers import DynamicCache

from hf_paged import SamplingParams
from hf_paged.engine.request import Request
from hf_paged.engine.sampling import apply_logits_processing

PROMPTS = random_prompts((5, 11, 7))
NEW_TOKENS = 12


def generate_each(**options) -> list[list[int]]:
    model = tiny_model("llama", "sdpa")
    return [
        model.generate(
            torch.tensor([prompt]), cache=DynamicCache(), max_new_tokens=NEW_TOKENS, do_sample=False, **options
        )[0, len(prompt) :].tolist()
        for prompt in PROMPTS
    ]


@pytest.mark.parametrize(
    "engine_options, generate_options",
    [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(logit_bias={7: 5.0, 9: -100.0}), dict(sequence_bias={(7,): 5.0, (9,): -100.0})),
        (dict(min_tokens=10), dict(min_new_tokens=10)),  # with an eos that greedy output reaches early
    ],
    ids=["repetition_penalty", "logit_bias", "min_tokens"],
)
def test_greedy_rows_match_transformers_processors(engine_options, generate_options):
    engine, pool = tiny_engine("llama", 64, max_num_seqs=3)
    greedy = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    eos = greedy[0][2]  # the first prompt's third token: an eos it would stop at
    got = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos, **engine_options)
    stopped = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    expected = generate_each(eos_token_id=eos, pad_token_id=0, **generate_options)
    expected = [tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in expected]  # it pads
    assert got == expected and got != stopped
    assert pool.num_used_blocks == 0


def test_presence_and_frequency_penalties_follow_openais_definition():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, generator=generator)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(frequency_penalty=-1.0),
    ]
    outputs = [[1, 1, 4], [1, 2], [3, 3, 3, 0]]
    requests = [Request(i, [5, 6], p, output_ids=o) for i, (p, o) in enumerate(zip(params, outputs))]
    got = apply_logits_processing(logits, requests)
    expected = logits.clone()
    for row, (p, output) in enumerate(zip(params, outputs)):
        for token in set(output):
            expected[row, token] -= p.presence_penalty + p.frequency_penalty * output.count(token)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing is left as it was


def test_a_frequency_penalty_changes_greedy_output_and_repeats_less():
    engine, _ = tiny_engine("llama", 64, max_num_seqs=3)
    plain = engine.generate(PROMPTS, max_new_tokens=24)
    penalized = engine.generate(PROMPTS, max_new_tokens=24, frequency_penalty=2.0)

    def repeats(outputs):
        return sum(len(tokens) - len(set(tokens)) for tokens in outputs)

    assert penalized != plain and repeats(penalized) < repeats(plain)


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(presence_penalty=3.0), "presence_penalty must be a number in [-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
        (dict(logit_bias=((1, "a"),)), "logit_bias must be a tuple of (token id, bias) pairs"),
        (dict(logit_bias=((1, float("nan")),)), "each bias a number (not NaN)"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0"),
    ],
)
def test_bad_values_are_refused_by_name(options, words):
    with pytest.raises(ValueError, match=__import__("re").escape(words)):
        SamplingParams(**options)


@pytest.mark.parametrize("engine_options", [dict(), dict(logit_bias={7: 5.0}), dict(temperature=0.8, seed=3)])
def test_logprobs_are_the_log_softmax_of_the_logits_each_token_is_chosen_from(engine_options):
    """Request.logprobs: per generated token, its log probability and the top k (token id, log probability), from
    the logits after penalties and bias, before temperature: against generate()'s own logits (output_logits) with
    the same bias, fed the tokens the Engine chose."""
    engine, pool = tiny_engine("llama", 64, max_num_seqs=3)
    request_ids = [engine.add_request(p, max_new_tokens=6, logprobs=3, **engine_options) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    finished = {request.request_id: request for request in engine.pop_finished()}
    model = tiny_model("llama", "sdpa")
    bias = {(token,): value for token, value in engine_options.get("logit_bias", {}).items()}
    for request_id, prompt in zip(request_ids, PROMPTS):
        request = finished[request_id]
        assert len(request.logprobs) == len(request.output_ids) == 6
        with torch.inference_mode():  # generate()'s logits at each output position, for the Engine's tokens
            ids = torch.tensor([prompt + request.output_ids])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        logits = logits.clone()  # a tensor made in inference mode is read-only outside it
        for token, recorded, row in zip(request.output_ids, request.logprobs, logits):
            for (biased,), value in bias.items():
                row[biased] += value
            expected = torch.log_softmax(row, dim=-1)
            assert recorded.logprob == pytest.approx(expected[token].item(), abs=1e-4)
            top = torch.topk(expected, 3)
            assert [t for t, _ in recorded.top] == top.indices.tolist()
            assert [lp for _, lp in recorded.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert pool.num_used_blocks == 0
    with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 20\]"):
        SamplingParams(logprobs=21)
