"""shoal: an LLM inference server in one Python process.

from shoal import Engine, SamplingParams
"""

from shoal.api.engine import Engine
from shoal.api.stream import (
    Completion,
    Delta,
    EngineDeadError,
    InternalError,
    RequestError,
    RequestStream,
    Usage,
)
from shoal.params import SamplingParams

__all__ = [
    "Completion",
    "Delta",
    "Engine",
    "EngineDeadError",
    "InternalError",
    "RequestError",
    "RequestStream",
    "SamplingParams",
    "Usage",
]
