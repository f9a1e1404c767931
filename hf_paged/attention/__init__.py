"""The "hf_paged" attention implementation, the plans caches hand it, and the paged kernels (`kernels/`)."""

from .decode_plan import DecodePlan, length_mask
from .interface import enable, paged_attention_forward, register
from .kernels.dispatch import store_backend, store_kv_rows
from .plan import BACKEND_ATTR, PAGED_ATTENTION, AttentionPlan, module_backend, plan_of, plan_placeholders

__all__ = [
    "BACKEND_ATTR",
    "PAGED_ATTENTION",
    "AttentionPlan",
    "DecodePlan",
    "enable",
    "length_mask",
    "module_backend",
    "paged_attention_forward",
    "plan_of",
    "plan_placeholders",
    "register",
    "store_backend",
    "store_kv_rows",
]
