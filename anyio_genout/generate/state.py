"""The life of a :class:`~anyio_genout.GenerateStream` as one state and a transition table.

As in h11's ``_state.py``: a stream is in exactly one :class:`Phase`; everything that happens
to it is an :class:`Event`; :data:`TRANSITIONS` says which phase each (phase, event) pair
leads to, and a pair it does not list is a misuse or a bug, raised as
:class:`StreamStateError` naming the phase. Every receive path consults the table first (the
``RECEIVE`` event), so no path can read outputs in a phase that has none to give.

::

    IDLE --ENTER--> FIRST --OUTPUT--> STREAMING --TERMINAL--> FINISHED --RECORD--> ENDED
                     |  ^                |    ^                  |
                     |  +-----MOVE-------+    +--MOVE-- CONTINUING (after the prompt info)
                     +--TERMINAL--> FINISHED
    FIRST, CONTINUING, STREAMING --ERROR--> ENDED;  any phase but IDLE --CLOSE--> CLOSED

``FIRST`` and ``CONTINUING`` both wait for the first output of the engine request running
now; in ``FIRST`` the prompt info is still to be delivered (with that output), in
``CONTINUING`` it was delivered before the request moved to another engine. ``FINISHED``:
the terminal output was returned and its metrics record waits for the caller's next touch
(a layer above may still re-label it by ``close(cause)``). ``ENDED``: the iteration is over
(the terminal output recorded, or the error that ended it raised). ``CLOSED``: the caller
left (``close()``, ``cancel()``, the ``async with`` exit), aborting a live request once.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["TRANSITIONS", "Event", "Phase", "StreamStateError", "transition"]


class Phase(enum.IntEnum):
    """Where a stream is in its life (see the module docstring's diagram)."""

    IDLE = 0
    FIRST = 1
    CONTINUING = 2
    STREAMING = 3
    FINISHED = 4
    ENDED = 5
    CLOSED = 6

    @property
    def label(self) -> str:
        return self.name.lower()


class Event(enum.IntEnum):
    """What happens to a stream."""

    #: ``async with``: the request was sent.
    ENTER = 0
    #: A receive call (``__anext__``, ``receive``, ``receive_buffered``) begins.
    RECEIVE = 1
    #: An output without a finish reason was delivered.
    OUTPUT = 2
    #: The terminal output was delivered.
    TERMINAL = 3
    #: The terminal output's metrics were recorded (the caller touched the stream again).
    RECORD = 4
    #: The engine died and the request moved to another one as a continuation.
    MOVE = 5
    #: The error that ends the stream was raised to the caller.
    ERROR = 6
    #: The caller left or closed the stream.
    CLOSE = 7

    @property
    def label(self) -> str:
        return self.name.lower()


_P = Phase
_E = Event
_RULES: Final[dict[Phase, dict[Event, Phase]]] = {
    _P.IDLE: {_E.ENTER: _P.FIRST, _E.CLOSE: _P.IDLE},
    _P.FIRST: {_E.RECEIVE: _P.FIRST, _E.OUTPUT: _P.STREAMING, _E.TERMINAL: _P.FINISHED,
               _E.MOVE: _P.FIRST, _E.ERROR: _P.ENDED, _E.CLOSE: _P.CLOSED},
    _P.CONTINUING: {_E.RECEIVE: _P.CONTINUING, _E.OUTPUT: _P.STREAMING,
                    _E.TERMINAL: _P.FINISHED, _E.MOVE: _P.CONTINUING, _E.ERROR: _P.ENDED,
                    _E.CLOSE: _P.CLOSED},
    _P.STREAMING: {_E.RECEIVE: _P.STREAMING, _E.OUTPUT: _P.STREAMING,
                   _E.TERMINAL: _P.FINISHED, _E.MOVE: _P.CONTINUING, _E.ERROR: _P.ENDED,
                   _E.CLOSE: _P.CLOSED},
    _P.FINISHED: {_E.RECEIVE: _P.FINISHED, _E.RECORD: _P.ENDED, _E.CLOSE: _P.CLOSED},
    _P.ENDED: {_E.RECEIVE: _P.ENDED, _E.CLOSE: _P.CLOSED},
    _P.CLOSED: {_E.RECEIVE: _P.CLOSED, _E.ERROR: _P.CLOSED, _E.CLOSE: _P.CLOSED},
}

#: ``TRANSITIONS[phase][event]``: the phase it leads to, or None where it is illegal. A
#: tuple of tuples indexed by the enums' values: one lookup costs two index operations.
TRANSITIONS: Final[tuple[tuple[Phase | None, ...], ...]] = tuple(
    tuple(_RULES[phase].get(event) for event in Event) for phase in Phase)

#: What to tell the caller for the illegal pairs a caller (not a bug) can cause.
_HINTS: Final[dict[tuple[Phase, Event], str]] = {
    (_P.IDLE, _E.RECEIVE): "use `async with client.generate(...) as stream` first",
}


class StreamStateError(RuntimeError):
    """An event the stream's phase does not allow (like h11's ``LocalProtocolError``).

    ``phase`` and ``event`` say which; the message names both. Raised for a misuse (reading a
    stream before entering it, entering it twice) and, for an internal inconsistency, by the
    checks that guard every transition."""

    def __init__(self, phase: Phase, event: Event) -> None:
        self.phase = phase
        self.event = event
        hint = _HINTS.get((phase, event))
        if event is Event.ENTER:
            hint = "a GenerateStream can be entered only once"
        message = f"GenerateStream: {event.label} is not allowed in state {phase.label}"
        super().__init__(f"{message} ({hint})" if hint else message)


def transition(phase: Phase, event: Event) -> Phase:
    """The phase ``event`` leads to from ``phase``.

    Raises:
        StreamStateError: ``TRANSITIONS`` does not allow ``event`` in ``phase``.
    """
    new = TRANSITIONS[phase][event]
    if new is None:
        raise StreamStateError(phase, event)
    return new
