"""An engine's timestamps are finite: a NaN or infinite one is a protocol error naming the field.

vLLM's engine stamps each ``EngineCoreOutputs`` and each scheduling event with its
``time.monotonic()``, always a finite number. The metrics compute ITL and the phase times
from these, so a non-finite one is refused at decode, like any other malformed field, rather
than turned into NaN or infinite latencies (or numpy warnings in a scrape). The frames are
built by hand: plain msgpack, one 18-field (vLLM 0.32) output row.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from anyio_genout import ProtocolError
from anyio_genout.protocol import (
    EngineCoreEventType,
    RequestBatch,
    decode_batch_or_other,
    decode_outputs,
)

NON_FINITE = [pytest.param(math.inf, id="inf"), pytest.param(-math.inf, id="-inf"),
              pytest.param(math.nan, id="nan")]
DECODERS = [pytest.param(decode_outputs, id="decode_outputs"),
            pytest.param(decode_batch_or_other, id="decode_batch_or_other")]


def row(request_id: str = "r1", *, events: list[dict[str, Any]] | None = None) -> list[Any]:
    """An 18-field output row with one new token (plus ``events`` if given)."""
    fields: list[Any] = [None] * 18
    fields[0], fields[1], fields[13] = request_id, [7], 0
    fields[7] = events
    return fields


def frames(timestamp: object, rows: list[list[Any]]) -> list[bytes]:
    message = [0, rows, None, timestamp, None, None, None, None, None]
    return [msgpack.packb(message, use_bin_type=True)]


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("timestamp", NON_FINITE)
def test_a_non_finite_batch_timestamp_is_refused(decode: Any, timestamp: float) -> None:
    with pytest.raises(ProtocolError,
                       match=r"^EngineCoreOutputs\.timestamp: expected a finite number, got "
                             r"float (inf|-inf|nan)$"):
        decode(frames(timestamp, [row()]))


@pytest.mark.parametrize("timestamp", NON_FINITE)
def test_a_non_finite_batch_timestamp_is_refused_without_outputs(timestamp: float) -> None:
    """A stats-only step (no outputs) is checked the same way."""
    with pytest.raises(ProtocolError, match=r"EngineCoreOutputs\.timestamp"):
        decode_outputs(frames(timestamp, []))


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("timestamp", NON_FINITE)
@pytest.mark.parametrize("kind", list(EngineCoreEventType), ids=lambda k: k.name)
def test_a_non_finite_event_timestamp_is_refused(decode: Any, timestamp: float,
                                                 kind: EngineCoreEventType) -> None:
    events = [{"type": int(EngineCoreEventType.QUEUED), "timestamp": 10.0},
              {"type": int(kind), "timestamp": timestamp}]
    with pytest.raises(ProtocolError,
                       match=r"^EngineCoreOutput\(r2\)\.events\[1\]\.timestamp: expected a "
                             r"finite number, got float (inf|-inf|nan)$"):
        decode(frames(12.5, [row("r1"), row("r2", events=events)]))


@pytest.mark.parametrize("timestamp", [0, 12, 12.5, 1e300, -3.0])
def test_finite_timestamps_still_decode_as_floats(timestamp: float) -> None:
    events = [{"type": int(EngineCoreEventType.SCHEDULED), "timestamp": timestamp}]
    decoded = decode_outputs(frames(timestamp, [row(), row("r2", events=events)]))
    assert isinstance(decoded, RequestBatch)
    assert decoded.message.timestamp == timestamp
    assert type(decoded.message.timestamp) is float
    event = decoded.message.outputs[1].events[0]  # type: ignore[index]
    assert (event.type, event.timestamp) == (EngineCoreEventType.SCHEDULED, timestamp)
    assert type(event.timestamp) is float
