"""shoal: an LLM inference server in one Python process.

from shoal import Engine, SamplingParams
"""

from shoal.api.engine import Engine
from shoal.params import Bootstrap, SamplingParams
from shoal.results import (
    Completion,
    Delta,
    EngineDeadError,
    FlushResult,
    InternalError,
    RequestError,
    RequestStream,
    UpdateResult,
    Usage,
)

__all__ = [
    "Bootstrap",
    "Completion",
    "Delta",
    "Engine",
    "EngineDeadError",
    "FlushResult",
    "InternalError",
    "RequestError",
    "RequestStream",
    "SamplingParams",
    "UpdateResult",
    "Usage",
]
