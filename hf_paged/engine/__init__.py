"""Continuous batching on one BlockPool: scheduler, per-step cache views, sampling and the Engine."""

from ..errors import RequestFailed
from .engine import Engine
from .request import Request
from .sampling import SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats
from .step_cache import StepCache

__all__ = ["Engine", "EngineStats", "Request", "RequestFailed", "SamplingParams", "Scheduler", "StepCache"]
