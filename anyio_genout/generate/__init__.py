"""The generate layer: ``async with client.generate(request) as stream``."""

from .abort_cause import AbortCause, abort_cause
from .client import Client, ClientConfig
from .inflight import InflightGuard, InflightRequests
from .output import (
    CollectedGenerateOutput,
    FinishReason,
    FinishReasonKind,
    GenerateOutput,
    GeneratePromptInfo,
    TokenUsage,
    collect_output,
)
from .request import GenerateRequest
from .stream import GenerateStream

__all__ = [
    "AbortCause",
    "Client",
    "ClientConfig",
    "CollectedGenerateOutput",
    "FinishReason",
    "FinishReasonKind",
    "GenerateOutput",
    "GeneratePromptInfo",
    "GenerateRequest",
    "GenerateStream",
    "InflightGuard",
    "InflightRequests",
    "TokenUsage",
    "abort_cause",
    "collect_output",
]
