"""Tensor parallelism: each rank's share of a model's kv heads, and one block count for every rank.

A model loaded with `from_pretrained(path, tp_plan="auto")` under `torchrun --nproc-per-node N` runs on N ranks;
each rank's attention sees `num_key_value_heads / N` kv heads when the plan shards the K/V projections, so each
rank's pool holds that many heads per layer. Every rank runs the same cache operations (the same requests, the
same steps), so ranks that start from the same block count hand out the same block ids.

    rank 0 pool: key_cache[l] [kv_heads / N, num_blocks, block_size, head_dim]   heads 0 .. kv_heads/N - 1
    rank 1 pool: key_cache[l] [kv_heads / N, num_blocks, block_size, head_dim]   the next kv_heads/N heads
    ...                       same num_blocks, same block ids per sequence on every rank
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UnsupportedModel


def model_tp_size(model) -> int:
    """How many tensor-parallel ranks run `model` (1 for a model loaded without a TP plan)."""
    return getattr(model, "_tp_size", None) or 1


def tp_process_group(model):
    """The process group of `model`'s tensor-parallel ranks: the "tp" dimension of the device mesh transformers
    loaded it on, else the default group. None when no process group is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None:
        names = mesh.mesh_dim_names
        if names is None:
            return mesh.get_group()
        if "tp" in names:
            return mesh["tp"].get_group()
    return dist.group.WORLD


def kv_shard_factors(model, num_kv_heads: tuple[int, ...]) -> tuple[int, ...]:
    """Per layer: how many ranks share its kv heads (each rank holds `num_kv_heads[l] // factor[l]` of them).

    NOTE: the source is each layer's K projection weight (`self_attn.k_proj`), the global against the local
    (this rank's) shape of its DTensor: it is exactly the K features the rank computes, whatever the plan calls the
    sharding style or the module path, and it holds per layer (a model whose layers have different kv heads).
    transformers' continuous-batching cache instead looks for `layers.*.self_attn.k_proj` / `v_proj` keys in the
    plan and divides every layer by the TP size; that rule is kept as the fallback for a layer whose K projection
    is not a DTensor (a fused QKV projection, another name). Either way a `PagedCache` checks every `update`'s
    key_states against the pool, so a wrong count raises `PoolMismatch` instead of storing wrong K/V.
    """
    tp_size = model_tp_size(model)
    if tp_size == 1:
        return (1,) * len(num_kv_heads)
    k_weights = {}
    for module in model.modules():
        layer_idx, k_proj = getattr(module, "layer_idx", None), getattr(module, "k_proj", None)
        if isinstance(layer_idx, int) and isinstance(getattr(k_proj, "weight", None), torch.Tensor):
            k_weights.setdefault(layer_idx, k_proj.weight)
    plan_factor = tp_size if _plan_shards_kv(model) else 1
    factors = []
    for layer_idx, heads in enumerate(num_kv_heads):
        weight = k_weights.get(layer_idx)
        if weight is None or not hasattr(weight, "to_local"):
            factor = plan_factor
        else:
            num_global, num_local = weight.shape[0], weight.to_local().shape[0]
            if num_local == 0 or num_global % num_local:
                raise UnsupportedModel(
                    getattr(model.config, "model_type", None),
                    f"layer {layer_idx}'s K projection is split unevenly over {tp_size} tensor-parallel ranks "
                    f"({num_local} of {num_global} output features on this rank); the pool needs every rank to hold "
                    "the same number of kv heads: use a TP size that divides num_key_value_heads",
                    "PagedCache under tensor parallelism",
                )
            factor = num_global // num_local
        if heads % factor:
            raise UnsupportedModel(
                getattr(model.config, "model_type", None),
                f"layer {layer_idx} has {heads} kv heads, which do not split over {factor} tensor-parallel ranks; "
                "use a TP size that divides num_key_value_heads",
                "PagedCache under tensor parallelism",
            )
        factors.append(factor)
    return tuple(factors)


def _plan_shards_kv(model) -> bool:
    """Whether the model's TP plan names both the K and the V projections (transformers' own rule)."""
    plan = getattr(model, "_tp_plan", None) or getattr(model.config, "base_model_tp_plan", None) or {}
    return all(any(key.endswith(f"self_attn.{name}") for key in plan) for name in ("k_proj", "v_proj"))


def agree_num_blocks(num_blocks: int, group=None) -> int:
    """The smallest `num_blocks` over the ranks of `group` (all ranks must call this together): ranks whose
    `max_memory` fits different counts (other free memory, other head counts) hold one block count, so one block id
    means the same token range on every rank. A no-op without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return num_blocks
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())
