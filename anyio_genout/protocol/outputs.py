"""Engine -> front end: ``EngineCoreOutputs`` messages on the output socket.

Frame 0 is a 9-element msgpack array ``[engine_index, outputs, scheduler_stats, timestamp,
utility_output, finished_requests, wave_complete, start_wave, weight_version]``; further frames
carry large arrays. Each output is an 18-element array in vLLM 0.32 and 19 in 0.33 (a trailing
``error``); missing trailing fields take their defaults and extra ones are ignored, so both
versions (and their neighbours) decode. The raw frame ``ENGINE_CORE_DEAD`` says the engine died.

:func:`decode_outputs` classifies a message; :func:`encode_outputs` is the engine side.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from itertools import repeat
from typing import Any, Final, NamedTuple

import attrs
import numpy as np

from ..errors import ProtocolError
from .arrays import AuxFrames, decode_array, describe, encode_array
from .logprobs import (
    Logprobs,
    SamplingMask,
    decode_logprobs,
    decode_sampling_mask,
    encode_logprobs,
    encode_sampling_mask,
)
from .packing import pack, unpack

__all__ = [
    "ENGINE_CORE_DEAD",
    "OUTPUTS_FIELDS",
    "OUTPUT_FIELDS",
    "DpControl",
    "BatchFields",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreFinishReason",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineDead",
    "PrefillStats",
    "RequestBatch",
    "RequestError",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityReply",
    "decode_batch_or_other",
    "decode_outputs",
    "encode_outputs",
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


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


_FINISH: Final = {int(r): r for r in EngineCoreFinishReason}
_EVENT: Final = {int(t): t for t in EngineCoreEventType}


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


_new_output: Final = functools.partial(tuple.__new__, EngineCoreOutput)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and np.array_equal(a, b))
    return a == b


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


#: A request batch as :func:`decode_batch_or_other` returns it: ``(engine_index, outputs,
#: scheduler_stats, timestamp, finished_requests)``.
BatchFields = tuple[int, list[EngineCoreOutput], SchedulerStats | None, float,
                    frozenset[str] | None]

#: Every ``EngineCoreOutputs`` field, decoded, in order.
_Fields = tuple[int, list[EngineCoreOutput], SchedulerStats | None, float,
                UtilityOutput | None, frozenset[str] | None, int | None, int | None, str | None]


def decode_outputs(frames: AuxFrames) -> Classified:
    """Decode and classify one output-socket message, raising :class:`ProtocolError`."""
    fields = _decode_frames(frames)
    if fields is None:
        return EngineDead()
    return _classify(EngineCoreOutputs(*fields))


def decode_batch_or_other(frames: AuxFrames) -> BatchFields | Classified:
    """:func:`decode_outputs` for a dispatcher on the hot path: a plain request batch (no
    utility reply, no wave control) comes back as a :data:`BatchFields` tuple rather than a
    :class:`RequestBatch`, saving two objects per message; anything else as
    :func:`decode_outputs` returns it. Same validation, same errors."""
    fields = _decode_frames(frames)
    if fields is None:
        return EngineDead()
    engine_index, outputs, stats, ts, util, finished, wave_complete, start_wave, _ = fields
    if util is None and wave_complete is None and start_wave is None:
        return engine_index, outputs, stats, ts, finished
    return _classify(EngineCoreOutputs(*fields))


def _decode_frames(frames: AuxFrames) -> _Fields | None:
    """The message's fields in order, or None for the ``ENGINE_CORE_DEAD`` sentinel."""
    if not frames:
        raise ProtocolError("EngineCoreOutputs: empty message")
    main = frames[0]
    if len(frames) == 1 and len(main) == len(ENGINE_CORE_DEAD) and bytes(main) == ENGINE_CORE_DEAD:
        return None
    return _decode_fields(unpack(main, "EngineCoreOutputs"), frames)


def _classify(message: EngineCoreOutputs) -> Classified:
    if message.utility_output is not None:
        if message.outputs:
            raise ProtocolError("EngineCoreOutputs: a utility reply must not carry outputs")
        return UtilityReply(message)
    if (message.wave_complete is not None or message.start_wave is not None) and \
            not message.outputs:
        return DpControl(message)
    return RequestBatch(message)


def _decode_fields(value: object, frames: AuxFrames) -> _Fields:
    where = "EngineCoreOutputs"
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
    if len(value) != 9:
        if len(value) < 9:
            value = value + [0, [], None, 0.0, None, None, None, None, None][len(value):]
        else:
            value = value[:9]
    engine_index, rows, stats, ts, util, finished, wave_complete, start_wave, wv = value
    if type(engine_index) is not int:
        raise ProtocolError(f"{where}.engine_index: expected int")
    if type(rows) is not list:
        raise ProtocolError(f"{where}.outputs: expected an array")
    if type(ts) is not float:
        if type(ts) is not int:
            raise ProtocolError(f"{where}.timestamp: expected a number")
        ts = float(ts)
    decoded = _decode_rows(rows, frames)
    if finished is not None:
        if type(finished) is not list or not all(type(r) is str for r in finished):
            raise ProtocolError(f"{where}.finished_requests: expected an array of str")
        finished = frozenset(finished)
    if wave_complete is not None and type(wave_complete) is not int:
        raise ProtocolError(f"{where}.wave_complete: expected int or nil")
    if start_wave is not None and type(start_wave) is not int:
        raise ProtocolError(f"{where}.start_wave: expected int or nil")
    if wv is not None and type(wv) is not str:
        raise ProtocolError(f"{where}.weight_version: expected str or nil")
    return (
        engine_index,
        decoded,
        None if stats is None else _decode_scheduler_stats(stats),
        ts,
        None if util is None else _decode_utility(util),
        finished,
        wave_complete,
        start_wave,
        wv,
    )


_PAD: Final[list[Any]] = [None, None, None, None, None, None, None, None, None, None, None,
                          None, None, 0, None, None, None, None, None]


_tuple_new: Final = tuple.__new__


def _decode_rows(rows: list[Any], frames: AuxFrames) -> list[EngineCoreOutput]:
    """Decode every output row; plain rows take an inlined fast path.

    A plain row is an 18- (0.32) or 19-field (0.33) array with ``request_id`` (str),
    ``new_token_ids`` (an array of non-negative ints) and ``num_nans_in_logits`` (int) set,
    and otherwise at most the fields that start and end a request: ``finish_reason``,
    ``stop_reason`` and ``prefill_stats`` (see :func:`_convert_plain_extras`). Counting the
    nils tells which: with 16 nils after padding to 19 fields and non-nil types at fields 0,
    1 and 13, every other field is nil and there is nothing to convert. Any other row is
    replaced in place by :func:`_decode_output`, which validates every field and names the
    bad one. All outputs are then built in one C-level pass (no Python call per row).
    """
    index = 0
    for row in rows:
        if type(row) is list:
            n = len(row)
            if n == 18:
                row.append(None)
                n = 19
            if n == 19 and type(row[0]) is str and type(row[13]) is int:
                tokens = row[1]
                if type(tokens) is list:
                    for t in tokens:
                        if type(t) is not int or t < 0:
                            break
                    else:
                        nils = row.count(None)
                        if nils == 16 or (nils >= 13 and _convert_plain_extras(row, 16 - nils)):
                            index += 1
                            continue
        rows[index] = _decode_output(row, frames, index)
        index += 1
    # A replaced row is already an EngineCoreOutput; tuple.__new__ copies it unchanged.
    if index == 1:  # one request in the step: skip the map's set-up
        return [_tuple_new(EngineCoreOutput, rows[0])]
    return list(map(_tuple_new, repeat(EngineCoreOutput), rows))


def _convert_plain_extras(row: list[Any], others: int) -> bool:
    """Convert ``finish_reason`` and ``prefill_stats`` of ``row`` in place if they and
    ``stop_reason`` are its only ``others`` non-nil fields beyond the plain three and all
    three are valid; otherwise leave ``row`` untouched and return False, so that
    :func:`_decode_output` decodes it (and names what is wrong)."""
    finish, stop, prefill = row[5], row[6], row[11]
    if (finish is not None) + (stop is not None) + (prefill is not None) != others:
        return False
    if finish is not None:
        finish = _FINISH.get(finish) if type(finish) is int else None
        if finish is None:
            return False
    if stop is not None and type(stop) is not int and type(stop) is not str:
        return False
    if prefill is not None:
        prefill = _plain_prefill(prefill)
        if prefill is None:
            return False
    row[5] = finish
    row[11] = prefill
    return True


def _decode_output(row: object, frames: AuxFrames, index: int) -> EngineCoreOutput:
    if type(row) is not list or len(row) < 2:
        raise ProtocolError(f"EngineCoreOutput[{index}]: expected an array of at least 2 "
                            f"fields, got {describe(row)}")
    n = len(row)
    if n != 19:
        if n < 19:
            row.extend(_PAD[n:])
        else:
            del row[19:]
    rid = row[0]
    tokens = row[1]
    if type(rid) is not str:
        raise ProtocolError(f"EngineCoreOutput[{index}].request_id: expected str, got "
                            f"{describe(rid)}")
    w = f"EngineCoreOutput({rid if len(rid) <= 80 else rid[:77] + '...'})"
    if type(tokens) is not list:
        raise ProtocolError(f"{w}.new_token_ids: expected an array, got {describe(tokens)}")
    for i, t in enumerate(tokens):
        if type(t) is not int or t < 0:
            raise ProtocolError(
                f"{w}.new_token_ids[{i}]: expected a non-negative int, got {describe(t)}"
            )
    # Hot path: a plain decode step (only the id, the tokens and num_nans_in_logits set).
    if row.count(None) == 16 and type(row[13]) is int:
        return _new_output(row)
    (rid, tokens, lp, plp, pooling, finish, stop, events, kv, ec, trace, prefill, routed,
     nans, mm, mask, spec, ptl, error) = row
    if finish is not None:
        finish = _FINISH.get(finish) if type(finish) is int else None
        if finish is None:
            raise ProtocolError(f"{w}.finish_reason: unknown value {describe(row[5])}")
    if nans is None:
        nans = 0
    if stop is not None and type(stop) is not int and type(stop) is not str:
        raise ProtocolError(f"{w}.stop_reason: expected int, str or nil, got {describe(stop)}")
    if type(nans) is not int:
        raise ProtocolError(f"{w}.num_nans_in_logits: expected int, got {describe(nans)}")
    # A mask whose row count differs from the tokens is one request's problem, not the
    # message's: the generate layer raises SamplingMaskMismatchError for that request only.
    new_mask = decode_sampling_mask(mask, frames, f"{w}.new_sampling_mask")
    return EngineCoreOutput(
        rid,
        tokens,
        decode_logprobs(lp, frames, f"{w}.new_logprobs"),
        decode_logprobs(plp, frames, f"{w}.new_prompt_logprobs_tensors"),
        None if pooling is None else decode_array(pooling, frames, f"{w}.pooling_output"),
        finish,
        stop,
        None if events is None else _decode_events(events, w),
        _optional_map(kv, f"{w}.kv_transfer_params"),
        _optional_map(ec, f"{w}.ec_transfer_params"),
        _optional_str_map(trace, f"{w}.trace_headers"),
        None if prefill is None else _decode_prefill(prefill, w),
        None if routed is None else decode_array(routed, frames, f"{w}.routed_experts"),
        nans,
        _optional_str_list(mm, f"{w}.mm_cache_miss_hashes"),
        new_mask,
        _optional_map(spec, f"{w}.spec_decode_metrics"),
        None if ptl is None else decode_array(ptl, frames, f"{w}.prompt_token_id_logprobs"),
        None if error is None else _decode_error(error, w),
    )


def _optional_map(value: object, where: str) -> Any:
    if value is not None and (type(value) is not dict
                              or not all(type(k) is str for k in value)):
        raise ProtocolError(f"{where}: expected a map with str keys or nil, got "
                            f"{describe(value)}")
    return value


def _optional_str_map(value: object, where: str) -> Any:
    if value is not None and (type(value) is not dict or not all(
            type(k) is str and type(v) is str for k, v in value.items())):
        raise ProtocolError(f"{where}: expected a map of str to str or nil, got "
                            f"{describe(value)}")
    return value


def _optional_str_list(value: object, where: str) -> list[str] | None:
    if value is None:
        return None
    if type(value) is not list or not all(type(v) is str for v in value):
        raise ProtocolError(f"{where}: expected an array of str, got {describe(value)}")
    return value


def _decode_events(value: object, where: str) -> list[EngineCoreEvent]:
    if type(value) is not list:
        raise ProtocolError(f"{where}.events: expected an array")
    events = []
    for i, item in enumerate(value):
        if type(item) is not dict:
            raise ProtocolError(f"{where}.events[{i}]: expected a {{type, timestamp}} map, got "
                                f"{describe(item)}")
        kind = item.get("type")
        ts = item.get("timestamp")
        # Exact int: a bool or a float must not pass for an event type (msgspec rejects them).
        event_type = _EVENT.get(kind) if type(kind) is int else None
        if event_type is None:
            raise ProtocolError(f"{where}.events[{i}].type: unknown event type {describe(kind)}")
        if type(ts) is not float and type(ts) is not int:
            raise ProtocolError(f"{where}.events[{i}].timestamp: expected a number, got "
                                f"{describe(ts)}")
        events.append(EngineCoreEvent(event_type, float(ts)))
    return events


_PREFILL_KEYS: Final = tuple(a.name for a in attrs.fields(PrefillStats))


def _plain_prefill(value: object) -> PrefillStats | None:
    """``prefill_stats`` decoded, or None if it is not a map of ints (missing keys are 0)."""
    if type(value) is not dict:
        return None
    args = [value.get(key, 0) for key in _PREFILL_KEYS]
    for v in args:
        if type(v) is not int:
            return None
    return PrefillStats(*args)


def _decode_prefill(value: object, where: str) -> PrefillStats:
    stats = _plain_prefill(value)
    if stats is not None:
        return stats
    if type(value) is not dict:
        raise ProtocolError(f"{where}.prefill_stats: expected a map")
    for key in _PREFILL_KEYS:
        if type(value.get(key, 0)) is not int:
            raise ProtocolError(f"{where}.prefill_stats.{key}: expected int")
    raise AssertionError("unreachable")  # pragma: no cover


def _decode_error(value: object, where: str) -> RequestError:
    if type(value) is not dict or type(value.get("code")) is not str \
            or type(value.get("message", "")) is not str \
            or type(value.get("retryable", False)) is not bool:
        raise ProtocolError(f"{where}.error: expected {{code: str, message: str, retryable: "
                            f"bool}}, got {describe(value)}")
    return RequestError(value["code"], value.get("message", ""), value.get("retryable", False))


def _decode_scheduler_stats(value: object) -> SchedulerStats:
    where = "EngineCoreOutputs.scheduler_stats"
    if type(value) is not dict:
        raise ProtocolError(f"{where}: expected a map, got {describe(value)}")
    get = value.get
    running, waiting, skipped = (get("num_running_reqs", 0), get("num_waiting_reqs", 0),
                                 get("num_skipped_waiting_reqs", 0))
    step, wave, usage = get("step_counter", 0), get("current_wave", 0), get("kv_cache_usage", 0.0)
    pcs = get("prefix_cache_stats")
    if pcs is None:
        pcs = {}
    elif type(pcs) is not dict:
        raise ProtocolError(f"{where}.prefix_cache_stats: expected a map, got {describe(pcs)}")
    queries, hits = pcs.get("queries", 0), pcs.get("hits", 0)
    if type(running) is not int or type(waiting) is not int or type(skipped) is not int \
            or type(step) is not int or type(wave) is not int \
            or (type(usage) is not float and type(usage) is not int) \
            or type(queries) is not int or type(hits) is not int:
        for key, v in (("num_running_reqs", running), ("num_waiting_reqs", waiting),
                       ("num_skipped_waiting_reqs", skipped), ("step_counter", step),
                       ("current_wave", wave), ("prefix_cache_stats.queries", queries),
                       ("prefix_cache_stats.hits", hits)):
            if type(v) is not int:
                raise ProtocolError(f"{where}.{key}: expected int, got {describe(v)}")
        raise ProtocolError(f"{where}.kv_cache_usage: expected a number, got {describe(usage)}")
    return SchedulerStats(running, waiting, skipped, step, wave, float(usage), queries, hits,
                          value)


def _decode_utility(value: object) -> UtilityOutput:
    where = "EngineCoreOutputs.utility_output"
    if type(value) is not list or not 1 <= len(value) <= 3:
        raise ProtocolError(f"{where}: expected [call_id, failure_message, result]")
    value = value + [None] * (3 - len(value))
    call_id, failure, result = value
    if type(call_id) is not int:
        raise ProtocolError(f"{where}.call_id: expected int")
    if failure is not None and type(failure) is not str:
        raise ProtocolError(f"{where}.failure_message: expected str or nil")
    if result is None:
        return UtilityOutput(call_id, failure)
    if type(result) is not list or len(result) != 2:
        raise ProtocolError(f"{where}.result: expected [type_info, value]")
    if result[0] is not None:
        raise ProtocolError(f"{where}.result: typed (pickled) results are refused")
    return UtilityOutput(call_id, failure, result[1], True)


# ---------------------------------------------------------------- engine side


def encode_outputs(message: EngineCoreOutputs, *, fields: int = 18) -> list[bytes | memoryview]:
    """Frames for ``message`` as a vLLM engine writes them (``fields``: 18 = 0.32, 19 = 0.33)."""
    aux: list[bytes | memoryview] = [b""]
    util = message.utility_output
    wire = [
        message.engine_index,
        [_encode_output(o, aux, fields) for o in message.outputs],
        None if message.scheduler_stats is None else message.scheduler_stats.to_wire(),
        float(message.timestamp),
        None if util is None else [
            util.call_id, util.failure_message, [None, util.result] if util.has_result else None
        ],
        None if message.finished_requests is None else sorted(message.finished_requests),
        message.wave_complete,
        message.start_wave,
        message.weight_version,
    ]
    aux[0] = pack(wire)
    return aux


def _encode_output(o: EngineCoreOutput, aux: list[bytes | memoryview],
                   fields: int) -> list[Any]:
    row: list[Any] = [
        o.request_id,
        o.new_token_ids,
        None if o.new_logprobs is None else encode_logprobs(o.new_logprobs, aux),
        None if o.new_prompt_logprobs is None else encode_logprobs(
            o.new_prompt_logprobs, aux, prompt=True),
        None if o.pooling_output is None else encode_array(o.pooling_output, aux),
        None if o.finish_reason is None else int(o.finish_reason),
        o.stop_reason,
        None if o.events is None else [
            {"type": int(e.type), "timestamp": e.timestamp} for e in o.events
        ],
        o.kv_transfer_params,
        o.ec_transfer_params,
        o.trace_headers,
        None if o.prefill_stats is None else attrs.asdict(o.prefill_stats),
        None if o.routed_experts is None else encode_array(o.routed_experts, aux),
        o.num_nans_in_logits,
        o.mm_cache_miss_hashes,
        None if o.new_sampling_mask is None else encode_sampling_mask(o.new_sampling_mask, aux),
        o.spec_decode_metrics,
        None if o.prompt_token_id_logprobs is None else encode_array(
            o.prompt_token_id_logprobs, aux),
        None if o.error is None else attrs.asdict(o.error),
    ]
    return row[:fields]

