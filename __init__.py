"""shoal: an LLM inference server in one Python process.

from shoal import Engine, SamplingParams
"""

from shoal.api.engine import Engine
from shoal.params import SamplingParams
from shoal.results import (
    Completion,
    Delta,
    EngineDeadError,
    InternalError,
    RequestError,
    RequestStream,
    Usage,
)

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
