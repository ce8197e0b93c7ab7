"""The vLLM engine-core wire protocol, sans I/O.

Pure functions and attrs classes that turn ZeroMQ frames into typed values and back, for
both directions (the client and the mock engine share them). Nothing here imports anyio or
zmq: the I/O shell lives in :mod:`anyio_genout.transport` and :mod:`anyio_genout.engine`.

Modules: :mod:`.arrays` (numeric arrays and aux frames), :mod:`.packing` (msgpack),
:mod:`.validation` (the field checks of the client's request validation), :mod:`.sampling`
(SamplingParams, its validation and wire map), :mod:`.structured_outputs` (its
structured-output constraint), :mod:`.requests` (the request types and
ADD/ABORT/UTILITY encoding), :mod:`.request_decode` (the engine side's strict decoding),
:mod:`.outputs` (the EngineCoreOutputs types), :mod:`.output_decode` and :mod:`.output_encode`
(its two directions), :mod:`.logprobs`, :mod:`.handshake`.
"""

from .arrays import INLINE_THRESHOLD, decode_array, encode_array
from .handshake import (
    SUPPORTED_VERSIONS,
    EngineCoreReadyResponse,
    EngineStatus,
    HandshakeAddresses,
    StatusMessage,
    check_version,
    decode_init,
    decode_ready_response,
    decode_status,
    encode_init,
    encode_ready_response,
    encode_status,
    engine_identity,
    identity_rank,
)
from .logprobs import LogprobEntry, LogprobPosition, Logprobs, SamplingMask
from .output_decode import decode_batch_or_other, decode_outputs
from .output_encode import encode_outputs
from .outputs import (
    ENGINE_CORE_DEAD,
    FINISH_REASON_LABELS,
    BatchFields,
    Classified,
    DpControl,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    PlainRow,
    PrefillStats,
    RequestBatch,
    RequestError,
    SchedulerStats,
    UtilityOutput,
    UtilityReply,
    as_output,
    finish_reason_label,
    plain_output,
)
from .request_decode import AbortRequest, AddRequest, UtilityRequest, decode_request
from .requests import (
    EngineCoreRequest,
    LoRARequest,
    RequestType,
    encode_abort,
    encode_add,
    encode_utility,
)
from .sampling import SamplingParams
from .structured_outputs import StructuredOutputsParams

__all__ = [
    "ENGINE_CORE_DEAD", "FINISH_REASON_LABELS", "INLINE_THRESHOLD", "SUPPORTED_VERSIONS",
    "AbortRequest", "AddRequest", "BatchFields", "Classified", "DpControl", "EngineCoreEvent",
    "EngineCoreEventType", "EngineCoreFinishReason", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineCoreReadyResponse", "EngineCoreRequest", "EngineDead",
    "EngineStatus", "HandshakeAddresses", "LoRARequest", "LogprobEntry", "LogprobPosition",
    "Logprobs", "PlainRow", "PrefillStats", "RequestBatch", "RequestError", "RequestType",
    "SamplingMask", "SamplingParams", "SchedulerStats", "StatusMessage",
    "StructuredOutputsParams", "UtilityOutput",
    "UtilityReply", "UtilityRequest", "as_output", "check_version", "decode_array", "decode_init",
    "decode_batch_or_other", "decode_outputs", "decode_ready_response", "decode_request",
    "decode_status", "encode_abort", "encode_add", "encode_array", "encode_init",
    "encode_outputs", "encode_ready_response", "encode_status", "encode_utility",
    "engine_identity", "finish_reason_label", "identity_rank", "plain_output",
]
