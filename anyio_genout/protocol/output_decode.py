"""Engine -> front end: decoding and classifying an ``EngineCoreOutputs`` message.

:func:`decode_outputs` turns a message's frames into the types of :mod:`.outputs` and says
what it is (a request batch, a utility reply, data-parallel wave control, or the
``ENGINE_CORE_DEAD`` sentinel); :func:`decode_batch_or_other` is the same for the client's
reader on the hot path. Every malformed field raises :class:`ProtocolError` naming it.

The engine stamps the message and each scheduling event with its ``time.monotonic()``,
always a finite number: a NaN or infinite timestamp is refused here, so that what the
metrics compute from them (ITL, queue, prefill and decode times) is always a number.
"""

from __future__ import annotations

from math import isfinite
from typing import Any, Final

import attrs

from ..errors import ProtocolError
from .arrays import AuxFrames, decode_array, describe
from .logprobs import decode_logprobs, decode_sampling_mask
from .outputs import (
    ENGINE_CORE_DEAD,
    OUTPUT_FIELDS,
    OUTPUTS_FIELDS,
    PLAIN_NONES,
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
)
from .packing import unpack

__all__ = ["decode_batch_or_other", "decode_outputs"]

_FINISH: Final = {int(r): r for r in EngineCoreFinishReason}
_EVENT: Final = {int(t): t for t in EngineCoreEventType}

#: Every ``EngineCoreOutputs`` field, decoded, in order.
_Fields = tuple[int, list[EngineCoreOutput | PlainRow], SchedulerStats | None, float,
                UtilityOutput | None, frozenset[str] | None, int | None, int | None, str | None]

#: Fields of a message (frame 0's array), and what missing trailing ones decode as.
_MESSAGE_LEN: Final = len(OUTPUTS_FIELDS)  # 9
_MESSAGE_DEFAULTS: Final[list[Any]] = [0, [], None, 0.0, None, None, None, None, None]

# ------------------------------------------------------------------ the shape of an output row
#: Fields of an output row in vLLM 0.33's layout, to which every row is padded (or cut);
#: a vLLM 0.32 row has one fewer (no trailing ``error``).
_ROW_LEN: Final = len(OUTPUT_FIELDS)  # 19
_ROW_LEN_0_32: Final = _ROW_LEN - 1  # 18
#: Positions of the fields the fast path looks at.
_FINISH_REASON: Final = OUTPUT_FIELDS.index("finish_reason")  # 5
_STOP_REASON: Final = OUTPUT_FIELDS.index("stop_reason")  # 6
_PREFILL_STATS: Final = OUTPUT_FIELDS.index("prefill_stats")  # 11
_NUM_NANS: Final = OUTPUT_FIELDS.index("num_nans_in_logits")  # 13
#: A plain decode row sets exactly three fields (``request_id``, ``new_token_ids``,
#: ``num_nans_in_logits``), so its other 16 are nil: counting the nils (one C-level pass)
#: proves that every optional field is unset without looking at each.
_PLAIN_NILS: Final = PLAIN_NONES  # 16
#: A row that starts or ends a request may also set ``finish_reason``, ``stop_reason`` and
#: ``prefill_stats`` (the "plain extras"), so it has between 13 and 16 nils.
_PLAIN_EXTRAS: Final = (_FINISH_REASON, _STOP_REASON, _PREFILL_STATS)
_FEWEST_PLAIN_NILS: Final = _PLAIN_NILS - len(_PLAIN_EXTRAS)  # 13
# _decode_rows spells these as literals (see there); a new row layout fails here, at import,
# rather than decoding rows wrongly.
if (_ROW_LEN, _ROW_LEN_0_32, _NUM_NANS, _PLAIN_NILS, _FEWEST_PLAIN_NILS) != (19, 18, 13, 16, 13):
    raise ImportError("output_decode: the output row layout changed; update _decode_rows")
#: Defaults of missing trailing row fields: nil, but 0 for ``num_nans_in_logits``.
_PAD: Final[list[Any]] = [0 if i == _NUM_NANS else None for i in range(_ROW_LEN)]

_tuple_new: Final = tuple.__new__


def decode_outputs(frames: AuxFrames) -> Classified:
    """Decode and classify one output-socket message, raising :class:`ProtocolError`."""
    fields = _decode_frames(frames)
    if fields is None:
        return EngineDead()
    return _classify(_message(fields))


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
    return _classify(_message(fields))


def _message(fields: _Fields) -> EngineCoreOutputs:
    """The decoded message, every plain row made an :class:`EngineCoreOutput`."""
    outputs = fields[1]
    return EngineCoreOutputs(fields[0], list(map(as_output, outputs)), *fields[2:])


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
    if len(value) != _MESSAGE_LEN:
        if len(value) < _MESSAGE_LEN:
            value = value + _MESSAGE_DEFAULTS[len(value):]
        else:
            value = value[:_MESSAGE_LEN]
    engine_index, rows, stats, ts, util, finished, wave_complete, start_wave, wv = value
    if type(engine_index) is not int:
        raise ProtocolError(f"{where}.engine_index: expected int")
    if type(rows) is not list:
        raise ProtocolError(f"{where}.outputs: expected an array")
    if type(ts) is not float:
        if type(ts) is not int:
            raise ProtocolError(f"{where}.timestamp: expected a number")
        ts = float(ts)
    if not isfinite(ts):
        raise ProtocolError(f"{where}.timestamp: expected a finite number, got {describe(ts)}")
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


def _decode_rows(rows: list[Any], frames: AuxFrames) -> list[EngineCoreOutput | PlainRow]:
    """Decode every output row; plain rows take an inlined fast path.

    A plain row is an 18- (0.32) or 19-field (0.33) array with ``request_id`` (str),
    ``new_token_ids`` (an array of non-negative ints) and ``num_nans_in_logits`` (int) set,
    and otherwise at most the fields that start and end a request: ``finish_reason``,
    ``stop_reason`` and ``prefill_stats`` (see :func:`_convert_plain_extras`). Counting the
    nils tells which: padded to 19 fields, with those three set, :data:`_PLAIN_NILS` (16)
    nils mean every other field is nil and, with no NaNs counted in the logits, there is
    nothing to convert (with some, the row is made an output); 13 to 15 nils mean
    up to three others are set, which :func:`_convert_plain_extras` converts if they are the
    plain extras. Any other row is replaced in place by :func:`_decode_output`, which
    validates every field and names the bad one.

    What comes back: a row with every optional field nil and no NaNs counted stays the
    decoded list (a :data:`~.outputs.PlainRow`: an :class:`EngineCoreOutput`'s fields in
    order; the reader keeps only its token ids, ``as_output`` makes its output where one is
    asked for); every other row is an :class:`EngineCoreOutput`.
    """
    # The shape constants are spelled as literals here, the cheapest load on this per-token
    # loop (a local measured 1-2 % slower, a global slower still); checked at import.
    index = 0
    for row in rows:
        if type(row) is list:
            n = len(row)
            if n == 18:  # _ROW_LEN_0_32
                row.append(None)
                n = 19  # _ROW_LEN
            if n == 19 and type(row[0]) is str and type(row[13]) is int:  # 13: _NUM_NANS
                tokens = row[1]
                if type(tokens) is list:
                    for t in tokens:
                        if type(t) is not int or t < 0:
                            break
                    else:
                        nils = row.count(None)
                        if nils == 16 and not row[13]:  # _PLAIN_NILS, and no NaNs:
                            # a plain row stays the list it is
                            index += 1
                            continue
                        if nils >= 13 and _convert_plain_extras(row, 16 - nils):
                            rows[index] = _tuple_new(EngineCoreOutput, row)
                            index += 1
                            continue
        rows[index] = _decode_output(row, frames, index)
        index += 1
    return rows


def _convert_plain_extras(row: list[Any], others: int) -> bool:
    """Convert ``finish_reason`` and ``prefill_stats`` of ``row`` in place if they and
    ``stop_reason`` are its only ``others`` non-nil fields beyond the plain three and all
    three are valid; otherwise leave ``row`` untouched and return False, so that
    :func:`_decode_output` decodes it (and names what is wrong)."""
    finish, stop, prefill = row[_FINISH_REASON], row[_STOP_REASON], row[_PREFILL_STATS]
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
    row[_FINISH_REASON] = finish
    row[_PREFILL_STATS] = prefill
    return True


def _decode_output(row: object, frames: AuxFrames, index: int) -> EngineCoreOutput:
    if type(row) is not list or len(row) < 2:
        raise ProtocolError(f"EngineCoreOutput[{index}]: expected an array of at least 2 "
                            f"fields, got {describe(row)}")
    n = len(row)
    if n != _ROW_LEN:
        if n < _ROW_LEN:
            row.extend(_PAD[n:])
        else:
            del row[_ROW_LEN:]
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
    if row.count(None) == _PLAIN_NILS and type(row[_NUM_NANS]) is int:
        return as_output(row)
    (rid, tokens, lp, plp, pooling, finish, stop, events, kv, ec, trace, prefill, routed,
     nans, mm, mask, spec, ptl, error) = row
    if finish is not None:
        finish = _FINISH.get(finish) if type(finish) is int else None
        if finish is None:
            raise ProtocolError(f"{w}.finish_reason: unknown value "
                                f"{describe(row[_FINISH_REASON])}")
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
        ts = float(ts)
        if not isfinite(ts):
            raise ProtocolError(f"{where}.events[{i}].timestamp: expected a finite number, "
                                f"got {describe(ts)}")
        events.append(EngineCoreEvent(event_type, ts))
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
