"""Pipeline-style placement: a model split over devices with `device_map` gets each layer's pool storage on the
device its attention runs on (`BlockPool.for_model`), and generate() with a shared PagedCache gives DynamicCache's
tokens. On CPU the device map has one device; the mixed-device tests need CUDA (one GPU: CPU + cuda:0 layers with
accelerate's `dispatch_model`; two GPUs: `device_map="auto"`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_paged import BlockPool, Engine, PagedCache, PoolMismatch
from tests.models import random_prompt, tiny_model


def saved(tmp_path, name: str = "llama") -> str:
    path = str(tmp_path / name)
    tiny_model(name, "sdpa").save_pretrained(path)
    return path


def attention_devices_of(model) -> list[torch.device]:
    return [layer.self_attn.q_proj.weight.device for layer in model.model.layers]


def check_generate(model, pool) -> None:
    input_ids = random_prompt(length=10).to(model.model.embed_tokens.weight.device)
    expected = model.generate(input_ids, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False)
    with PagedCache(config=model.config, pool=pool) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.tolist() == expected.tolist()
    assert pool.num_used_blocks == 0


def test_pool_storage_follows_each_layers_attention_device(tmp_path):
    from accelerate import dispatch_model

    model = AutoModelForCausalLM.from_pretrained(saved(tmp_path)).eval()
    device_map = {name: "cpu" for name in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(2)})
    model = dispatch_model(model, device_map, main_device="cpu")  # what device_map= does over several devices
    assert model.hf_device_map == device_map
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    assert list(pool.devices) == attention_devices_of(model)
    assert [cache.device for cache in pool.key_cache] == attention_devices_of(model)
    assert not pool.is_multi_device and pool.num_groups == 1
    check_generate(model, pool)


def test_per_layer_devices_are_checked():
    layout = BlockPool.for_model(tiny_model("llama"), num_blocks=4).layout
    with pytest.raises(ValueError, match="device needs one entry per layer \\(2\\) when given as a list, got 3"):
        BlockPool(layout, num_blocks=4, device=["cpu"] * 3)
    assert BlockPool(layout, num_blocks=4, device=["cpu", "cpu"]).devices == (torch.device("cpu"),) * 2


def split_over_cpu_and_cuda(path: str):
    """Layer 0 (and the embeddings) on the CPU, layer 1 and the head on cuda:0, each running where it lives."""
    from accelerate import dispatch_model

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": 0,
        "model.norm": 0,
        "lm_head": 0,
    }
    return dispatch_model(model, device_map, main_device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layers_on_cpu_and_cuda_get_their_own_storage_and_generate(tmp_path):
    model = split_over_cpu_and_cuda(saved(tmp_path))
    pool = BlockPool.for_model(model, max_memory="1MiB", block_size=4)
    assert pool.devices == (torch.device("cpu"), torch.device("cuda", 0)) == tuple(attention_devices_of(model))
    assert pool.key_cache[0].device.type == "cpu" and pool.value_cache[1].device.type == "cuda"
    assert pool.is_multi_device
    check_generate(model, pool)
    with pytest.raises(PoolMismatch, match="the Engine runs a pool on one device"):
        Engine(model, pool)
    # A private pool (built from the first layer's key_states) cannot follow: the error names the fix.
    with pytest.raises(PoolMismatch, match="BlockPool.for_model\\(model\\), which also places each layer"):
        model.generate(random_prompt(length=6), past_key_values=PagedCache(config=model.config), max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="pipeline placement over GPUs needs 2 CUDA devices")
def test_device_map_auto_over_two_gpus(tmp_path):
    path = saved(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={0: "60KiB", 1: "10GiB"}
    ).eval()  # a tiny budget on GPU 0 pushes later layers to GPU 1
    pool = BlockPool.for_model(model, max_memory="1MiB", block_size=4)
    assert list(pool.devices) == attention_devices_of(model)
    assert len(set(pool.devices)) == 2, model.hf_device_map
    check_generate(model, pool)


def test_an_accelerate_hook_decides_where_a_layer_runs(monkeypatch):
    """An offloaded layer's weights live elsewhere than where it runs: the hook's execution device wins. The meta
    device stands in for a second device on a CPU-only host (storage on it allocates nothing)."""
    from types import SimpleNamespace

    from hf_paged.storage.pool import attention_devices

    model = tiny_model("gemma3")  # sliding and full layers: two layer groups on one device
    assert attention_devices(model) == [torch.device("cpu")] * 2
    monkeypatch.setattr(model.model.layers[1], "_hf_hook", SimpleNamespace(execution_device="meta"), raising=False)
    assert attention_devices(model) == [torch.device("cpu"), torch.device("meta")]
    pool = BlockPool.for_model(model, num_blocks=8, block_size=4)
    assert pool.devices == (torch.device("cpu"), torch.device("meta")) and pool.is_multi_device
    assert pool.key_cache[0].device.type == "cpu" and pool.value_cache[1].device.type == "meta"
    # Layers of two groups at one slot would alias one tensor: on two devices they cannot, so one group.
    assert pool.num_groups == 1
    with pytest.raises(PoolMismatch, match="the Engine runs a pool on one device"):
        Engine(model, pool)
