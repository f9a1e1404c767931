"""Every registered backend gives the same greedy `generate()` tokens as "dynamic", on tiny random Llama and Gemma3.

Parametrized over the backends of a fresh registry, so an installed third-party backend is held to the same test.
"""

import pytest
import torch
from models import left_padded_batch, random_prompt, tiny_model

from hf_paged import BlockPool
from hf_paged.registry import BackendRegistry

PROMPT_LEN, MAX_NEW_TOKENS = 12, 12
BACKENDS = sorted(BackendRegistry().available_backends())
# Options a backend cannot do without; a backend not listed here must work with none.
REQUIRED_OPTIONS = {"static": {"max_cache_len": PROMPT_LEN + MAX_NEW_TOKENS}}
MODELS = ("llama", "gemma3")  # gemma3: sliding_window 8 < prompt, mixed sliding / full layers


def batch(kind):
    """`(input_ids, attention_mask)` `[2, PROMPT_LEN]`: two full rows, or row 1 left-padded by 2."""
    if kind == "left_padded":
        return left_padded_batch(batch=2, length=PROMPT_LEN)
    input_ids = torch.cat([random_prompt(PROMPT_LEN, seed=0), random_prompt(PROMPT_LEN, seed=1)])
    return input_ids, torch.ones_like(input_ids)


def generate(model, inputs, cache):
    input_ids, attention_mask = inputs
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
        )


@pytest.fixture(scope="module", params=[(m, k) for m in MODELS for k in ("unpadded", "left_padded")], ids="-".join)
def case(request):
    """(model, inputs, reference tokens from "dynamic")."""
    name, kind = request.param
    model, inputs = tiny_model(name), batch(kind)
    reference = generate(model, inputs, BackendRegistry().create_cache("dynamic", model))
    new_tokens = reference[:, PROMPT_LEN:]
    assert new_tokens.shape == (2, MAX_NEW_TOKENS)
    assert all(len(set(row.tolist())) > 1 for row in new_tokens), "degenerate reference: the test would be vacuous"
    return model, inputs, reference


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_matches_dynamic(backend, case):
    model, inputs, reference = case
    cache = BackendRegistry().create_cache(backend, model, **REQUIRED_OPTIONS.get(backend, {}))
    assert torch.equal(generate(model, inputs, cache), reference)


def test_paged_with_shared_pool_matches_dynamic(case):
    model, inputs, reference = case
    registry = BackendRegistry()
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    for _ in range(2):  # two caches, one after the other, on one pool
        cache = registry.create_cache("paged", model, pool=pool)
        assert cache.pool is pool
        assert torch.equal(generate(model, inputs, cache), reference)
    with pytest.raises(ValueError, match="block_size=16 but the shared pool has block_size=4"):
        registry.create_cache("paged", model, pool=pool, block_size=16)
