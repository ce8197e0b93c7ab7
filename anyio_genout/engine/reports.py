"""How the parts of one engine client report on its health, and read it.

Every part that finds something wrong (the reader, the input socket, the watchers, the
liveness check) or an engine come back (:mod:`.rejoin`) holds the client's one
:class:`HealthReports` and reports there; the parts that must know whether the client still
serves (the abort queue, the utility calls, the watchers) read its sticky :attr:`error`
there. The client's :class:`~.health.Health` handles every report (it is attached once,
when the client is built) and is the only one that sets the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..errors import ClientUnhealthyError, EngineDeadError
from ..protocol import EngineCoreReadyResponse

__all__ = ["HealthReports", "ReportHandler", "copy_error"]


def copy_error(error: BaseException) -> BaseException:
    """A fresh instance of a sticky error, so raising it again does not grow one traceback."""
    try:
        copy = type(error)(str(error))
    except Exception:
        return error
    copy.__dict__.update(error.__dict__)  # e.g. EngineDeadError.ranks
    copy.__cause__ = error
    return copy


class ReportHandler(Protocol):
    """What handles the reports (:class:`~.health.Health`)."""

    def fail(self, error: ClientUnhealthyError) -> None:
        """The client (or the engines ``error.ranks`` names) failed with ``error``."""

    def fail_engines(self, ranks: Sequence[int], error: EngineDeadError) -> None:
        """Engines ``ranks`` were found dead."""

    def rejoin(self, rank: int, response: EngineCoreReadyResponse) -> str | None:
        """Engine ``rank``, down, completed its handshake again; why it is refused, or
        None once it is back."""


class HealthReports:
    """The client's sticky error, and where its parts report failures and comebacks."""

    __slots__ = ("_handler", "error")

    def __init__(self) -> None:
        #: The first error that made the client unhealthy (set by its Health only).
        self.error: ClientUnhealthyError | None = None
        self._handler: ReportHandler | None = None

    def handle_with(self, handler: ReportHandler) -> None:
        """Hand every report to ``handler`` (the client's Health, once it is built)."""
        self._handler = handler

    @property
    def healthy(self) -> bool:
        """No sticky error yet."""
        return self.error is None

    def raise_if_unhealthy(self) -> None:
        """Raise (a fresh copy of) the sticky error, if there is one."""
        if self.error is not None:
            raise copy_error(self.error)

    def fail(self, error: ClientUnhealthyError) -> None:
        """Report ``error``: the client fails (or, per ``engine_failure``, the engines it
        names do). Synchronous, idempotent."""
        assert self._handler is not None
        self._handler.fail(error)

    def fail_engines(self, ranks: Sequence[int], error: EngineDeadError) -> None:
        """Report engines ``ranks`` dead with ``error``. Synchronous, idempotent."""
        assert self._handler is not None
        self._handler.fail_engines(ranks, error)

    def rejoin(self, rank: int, response: EngineCoreReadyResponse) -> str | None:
        """Report engine ``rank`` back with ``response``; returns why it is refused (it
        stays down), or None once it rejoined."""
        assert self._handler is not None
        return self._handler.rejoin(rank, response)
