"""Engine -> front end: the ``EngineCoreOutputs`` message and its parts, as typed values.

Frame 0 is a 9-element msgpack array ``[engine_index, outputs, scheduler_stats, timestamp,
utility_output, finished_requests, wave_complete, start_wave, weight_version]``; further frames
carry large arrays. Each output is an 18-element array in vLLM 0.32 and 19 in 0.33 (a trailing
``error``); missing trailing fields take their defaults and extra ones are ignored, so both
versions (and their neighbours) decode. The raw frame ``ENGINE_CORE_DEAD`` says the engine died.

This module holds the types only: :mod:`.output_decode` turns frames into them (and
classifies a message as one of :data:`Classified`), :mod:`.output_encode` is the engine side.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, cast

import attrs
import numpy as np

from .logprobs import Logprobs, SamplingMask

__all__ = [
    "ENGINE_CORE_DEAD",
    "FINISH_REASON_LABELS",
    "OUTPUTS_FIELDS",
    "OUTPUT_FIELDS",
    "PLAIN_NONES",
    "BatchFields",
    "PlainRow",
    "Classified",
    "DpControl",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreFinishReason",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineDead",
    "PrefillStats",
    "RequestBatch",
    "RequestError",
    "STREAM_FIELDS",
    "StreamFields",
    "stream_fields",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityReply",
    "as_output",
    "plain_output",
    "finish_reason_label",
]

#: Sent as a single raw frame (not msgpack) when an engine dies.
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"

OUTPUTS_FIELDS: Final = (
    "engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output",
    "finished_requests", "wave_complete", "start_wave", "weight_version",
)
OUTPUT_FIELDS: Final = (
    "request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors",
    "pooling_output", "finish_reason", "stop_reason", "events", "kv_transfer_params",
    "ec_transfer_params", "trace_headers", "prefill_stats", "routed_experts",
    "num_nans_in_logits", "mm_cache_miss_hashes", "new_sampling_mask", "spec_decode_metrics",
    "prompt_token_id_logprobs", "error",
)


class EngineCoreFinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


#: The string of each :class:`EngineCoreFinishReason`, indexed by its value: vLLM's
#: ``FINISH_REASON_STRINGS`` (the lower-case names), which are also the ``finished_reason``
#: label values of ``vllm:request_success``. The one list of them in this package.
FINISH_REASON_LABELS: Final[tuple[str, ...]] = tuple(
    r.name.lower() for r in EngineCoreFinishReason)  # definition order: values 0, 1, 2, ...


def finish_reason_label(reason: EngineCoreFinishReason) -> str:
    """vLLM's string for ``reason`` (``LENGTH`` -> ``"length"``)."""
    return FINISH_REASON_LABELS[reason]


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@attrs.frozen
class EngineCoreEvent:
    """A scheduling event with the engine's ``time.monotonic()`` timestamp."""

    type: EngineCoreEventType
    timestamp: float


@attrs.frozen
class PrefillStats:
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


@attrs.frozen
class RequestError:
    """vLLM 0.33's per-request error object (``finish_reason == ERROR``)."""

    code: str
    message: str
    retryable: bool = False


@attrs.frozen
class SchedulerStats:
    """The subset of vLLM's ``SchedulerStats`` the client uses; ``raw`` keeps the whole map."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def to_wire(self) -> dict[str, Any]:
        wire = dict(self.raw)
        wire.update(
            num_running_reqs=self.num_running_reqs,
            num_waiting_reqs=self.num_waiting_reqs,
            num_skipped_waiting_reqs=self.num_skipped_waiting_reqs,
            step_counter=self.step_counter,
            current_wave=self.current_wave,
            kv_cache_usage=float(self.kv_cache_usage),
        )
        pcs = dict(wire.get("prefix_cache_stats") or {})
        pcs.update(queries=self.prefix_cache_queries, hits=self.prefix_cache_hits)
        wire["prefix_cache_stats"] = pcs
        return wire


@attrs.frozen
class UtilityOutput:
    """A utility call's reply: ``failure_message`` set on failure, else ``result``."""

    call_id: int
    failure_message: str | None = None
    result: Any = None
    has_result: bool = False


class EngineCoreOutput(NamedTuple):
    """One request's new tokens (and more) from one engine step.

    A named tuple rather than an attrs class: the reader builds one per token on the hot
    path, and a tuple made straight from the decoded msgpack row is several times cheaper.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    pooling_output: np.ndarray[Any, Any] | None = None
    finish_reason: EngineCoreFinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: np.ndarray[Any, Any] | None = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None
    new_sampling_mask: SamplingMask | None = None
    spec_decode_metrics: dict[str, Any] | None = None
    prompt_token_id_logprobs: np.ndarray[Any, Any] | None = None
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def same_as(self, other: EngineCoreOutput) -> bool:
        """Field-by-field equality that also compares numpy arrays."""
        return all(_same(a, b) for a, b in zip(self, other, strict=True))


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and np.array_equal(a, b))
    return a == b


#: How many fields of a *plain* :class:`EngineCoreOutput` are None: every one but
#: ``request_id``, ``new_token_ids`` and ``num_nans_in_logits`` (which never are), so a step
#: that brings tokens alone (no finish, logprobs, prefill stats, events, mask, transfer
#: parameters or anything else) is ``output.count(None) == PLAIN_NONES``, one C call.
PLAIN_NONES: Final = len(EngineCoreOutput._fields) - 3

#: A *plain* output as the hot-path decoder leaves it: the decoded row, a list of an
#: :class:`EngineCoreOutput`'s fields in order (19) with every optional one None
#: (``count(None) == PLAIN_NONES``) and no NaNs in the logits (``num_nans_in_logits`` 0),
#: so its request id and new token ids are all it says. Indexing it gives what indexing
#: the output would; ``as_output(row)`` makes the output.
PlainRow = list[Any]

_tuple_new: Final = tuple.__new__  # EngineCoreOutput(...) without its Python __new__
#: A plain output's fields after ``request_id`` and ``new_token_ids``: their defaults.
_PLAIN_TAIL: Final = tuple(EngineCoreOutput._field_defaults.values())


def plain_output(request_id: str, new_token_ids: list[int]) -> EngineCoreOutput:
    """The plain :class:`EngineCoreOutput` of a step that brought ``new_token_ids`` alone
    (what a :data:`PlainRow` of them stands for), without the constructor's Python code."""
    return _tuple_new(EngineCoreOutput, (request_id, new_token_ids, *_PLAIN_TAIL))


def as_output(output: EngineCoreOutput | PlainRow) -> EngineCoreOutput:
    """The :class:`EngineCoreOutput` a :data:`PlainRow` stands for; an output as it is."""
    if isinstance(output, list):
        return _tuple_new(EngineCoreOutput, output)
    return output


#: The fields of an :class:`EngineCoreOutput` a stream reads from every output, in the
#: order :data:`stream_fields` gives them.
STREAM_FIELDS: Final = (
    "request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason",
    "stop_reason", "kv_transfer_params", "ec_transfer_params", "prefill_stats",
    "new_sampling_mask", "spec_decode_metrics", "prompt_token_id_logprobs",
)

#: What :data:`stream_fields` returns: the :data:`STREAM_FIELDS` of an output, in order.
StreamFields = tuple[
    str, list[int], Logprobs | None, Logprobs | None, EngineCoreFinishReason | None,
    int | str | None, dict[str, Any] | None, dict[str, Any] | None, PrefillStats | None,
    SamplingMask | None, dict[str, Any] | None, np.ndarray[Any, Any] | None,
]

#: ``stream_fields(output)``: an output's :data:`STREAM_FIELDS` by name, in one C call
#: (an ``operator.itemgetter`` whose positions come from the field names here, so the
#: position of a wire field is known only in the protocol): the per-token path of a stream
#: reads them with one call instead of an attribute lookup each.
stream_fields: Final = cast(
    "Callable[[EngineCoreOutput | PlainRow], StreamFields]",
    operator.itemgetter(*(EngineCoreOutput._fields.index(name) for name in STREAM_FIELDS)))



@attrs.frozen(eq=False)
class EngineCoreOutputs:
    """One output-socket message, decoded."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = attrs.field(factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: frozenset[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineCoreOutputs):
            return NotImplemented
        return all(
            getattr(self, f) == getattr(other, f) for f in OUTPUTS_FIELDS if f != "outputs"
        ) and len(self.outputs) == len(other.outputs) and all(
            a.same_as(b) for a, b in zip(self.outputs, other.outputs, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------- classification
# What :func:`~.output_decode.decode_outputs` says a message is.


@attrs.frozen
class RequestBatch:
    """Request outputs (possibly none: a stats-only step) and finished ids."""

    message: EngineCoreOutputs


@attrs.frozen
class UtilityReply:
    message: EngineCoreOutputs

    @property
    def reply(self) -> UtilityOutput:
        assert self.message.utility_output is not None
        return self.message.utility_output


@attrs.frozen
class DpControl:
    """Data-parallel wave control, which belongs on the coordinator socket."""

    message: EngineCoreOutputs


@attrs.frozen
class EngineDead:
    """The ``ENGINE_CORE_DEAD`` sentinel."""


Classified = RequestBatch | UtilityReply | DpControl | EngineDead


#: A request batch as :func:`~.output_decode.decode_batch_or_other` returns it:
#: ``(engine_index, outputs, scheduler_stats, timestamp, finished_requests)``; its plain
#: outputs are :data:`PlainRow` lists, the others :class:`EngineCoreOutput`.
BatchFields = tuple[int, list[EngineCoreOutput | PlainRow], SchedulerStats | None, float,
                    frozenset[str] | None]
