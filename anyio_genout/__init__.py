"""anyio-genout: a structured-concurrency client for vLLM engine cores.

Layers, bottom up: :mod:`anyio_genout.protocol` (the wire format, sans I/O),
:mod:`anyio_genout.transport` (ZeroMQ on AnyIO), :mod:`anyio_genout.engine` (the raw
engine-core client), the generate layer (:class:`Client`), :mod:`anyio_genout.mock` (an engine
core emulator) and the ``anyio-genout`` command line.
"""

from .engine import (
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineCoreOutputStream,
    EngineCoreStreamOutput,
)
from .errors import (
    ClientClosedError,
    DuplicateRequestIdError,
    EngineDeadError,
    GenoutError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompleteStreamError,
    InconsistentUtilityResultsError,
    InvalidRequestError,
    OperationalError,
    ProtocolError,
    RequestStreamClosed,
    SamplingMaskMismatchError,
    TransportError,
    UnsupportedVersionError,
    UsageError,
    UtilityCallError,
)
from .generate import (
    AbortCause,
    Client,
    ClientConfig,
    CollectedGenerateOutput,
    FinishReason,
    FinishReasonKind,
    GenerateOutput,
    GeneratePromptInfo,
    GenerateRequest,
    GenerateStream,
    TokenUsage,
    abort_cause,
    collect_output,
)
from .metrics import Metrics
from .protocol import EngineCoreRequest, LoRARequest, SamplingParams

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
    "Metrics",
    "TokenUsage",
    "TransportError",
    "abort_cause",
    "collect_output",
    "ClientClosedError",
    "DuplicateRequestIdError",
    "EngineCoreClient",
    "EngineCoreClientConfig",
    "EngineCoreOutputStream",
    "EngineCoreRequest",
    "EngineCoreStreamOutput",
    "EngineDeadError",
    "GenoutError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "IncompleteStreamError",
    "InconsistentUtilityResultsError",
    "InvalidRequestError",
    "LoRARequest",
    "OperationalError",
    "ProtocolError",
    "RequestStreamClosed",
    "SamplingMaskMismatchError",
    "SamplingParams",
    "UnsupportedVersionError",
    "UsageError",
    "UtilityCallError",
]
