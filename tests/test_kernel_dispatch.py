"""Choosing the paged-decode backend (argument, environment variable, what is installed) and dispatch to it.
Compiling the Triton kernels for GPU targets on a machine without one: tests/test_kernel_compile.py."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention.kernels import paged_decode_attention, resolve_backend
from tests.test_kernels import CAN_RUN_TRITON, HAS_TRITON, make_batch


# ------------------------------------------------------------------ backend switch
def test_backend_argument_and_env_var(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    assert resolve_backend(None, cpu) == "torch"
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cuda) == "torch"
    if HAS_TRITON:
        assert resolve_backend("auto", cuda) == "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_backend("triton", cpu) == "triton"
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "torch")
    assert resolve_backend(None, cuda) == "torch"
    assert resolve_backend("auto", cpu) == "torch"  # an explicit argument wins over the variable
    if HAS_TRITON:
        monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
        assert resolve_backend(None, cpu) == "triton"


def test_store_backend_is_resolved_like_the_kernels(monkeypatch):
    from hf_paged.attention import store_backend, store_kv_rows

    cpu = torch.device("cpu")
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    assert store_backend(cpu) == "torch"
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "torch")
    assert store_backend(torch.device("cuda")) == "torch"
    cache = torch.zeros(2, 4, 2, 8)  # [kv_heads, blocks, block_size, head_dim]
    states = torch.randn(1, 2, 3, 8)
    store_kv_rows(cache, cache.clone(), states, states, torch.tensor([0, 5, 7]), backend="torch")
    assert torch.equal(cache[:, 2, 1], states[0, :, 1])  # slot 5 = block 2, offset 1
    with pytest.raises(ValueError, match=r"backend must be None, 'triton' or 'torch' .*got 'auto'"):
        store_kv_rows(cache, cache.clone(), states, states, torch.tensor([0, 5, 7]), backend="auto")


@pytest.mark.parametrize("rows, q_len", [(1, 5), (3, 1), (2, 3)], ids=["one-row", "decode", "rows-of-tokens"])
def test_the_triton_store_writes_states_of_every_layout_as_the_torch_store(rows, q_len):
    """The Triton store takes one row of tokens (the packed step) and one token per row (decode) as strided views of
    the states, RoPE's contiguous [W, heads, q_len, D] output included; several rows of several tokens are copied
    to rows first. Every layout stores what index_copy_ stores."""
    if not CAN_RUN_TRITON:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from hf_paged.attention import store_kv_rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = torch.zeros(2, 6, 4, 16, device=device)  # [kv_heads, blocks, block_size, head_dim]
    keys, values = torch.randn(2, rows, 2, q_len, 16, device=device).unbind(0)  # contiguous, as after RoPE
    slots = torch.randperm(24, device=device)[: rows * q_len]
    expected_k, expected_v = cache.clone(), cache.clone()
    store_kv_rows(expected_k, expected_v, keys, values, slots, backend="torch")
    key_cache, value_cache = cache.clone(), cache.clone()
    store_kv_rows(key_cache, value_cache, keys, values, slots, backend="triton")
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert expected_k.abs().sum() > 0


def test_backend_bad_values(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'triton', 'torch', got 'cuda'"):
        resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"HF_PAGED_ATTENTION_BACKEND must be one of .*'torch', got 'flash'"):
        resolve_backend(None, torch.device("cpu"))
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            resolve_backend("triton", torch.device("cpu"))


def test_backend_triton_not_installed(monkeypatch):
    import hf_paged.attention.kernels.dispatch as dispatch

    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="triton is not installed"):
        resolve_backend("triton", torch.device("cuda"))


def test_dispatch_calls_the_chosen_backend(monkeypatch):
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    import hf_paged.attention.kernels.dispatch as dispatch
    import hf_paged.attention.kernels.triton_decode as triton_decode

    calls = []
    monkeypatch.setattr(dispatch, "paged_decode_attention_torch", lambda *a, **k: calls.append("torch"))
    monkeypatch.setattr(triton_decode, "paged_decode_attention_triton", lambda *a, **k: calls.append("triton"))
    batch = make_batch([3], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    for env in ("torch", "triton"):
        monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", env)
        paged_decode_attention(*batch.args, scale=1.0)
    paged_decode_attention(*batch.args, scale=1.0, backend="torch")
    assert calls == ["torch", "triton", "torch"]
