"""Utility calls in flight: sending one to each engine, and pairing each reply with its caller.

The engine client owns one :class:`PendingCalls`; the reader hands it every reply
(:meth:`PendingCalls.resolve`), the client's failure path fails every waiting call
(:meth:`PendingCalls.fail`). Synchronous book-keeping plus the one wait in :meth:`call`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from ..errors import EngineDeadError, UtilityCallError
from ..protocol import UtilityOutput, encode_utility
from .registry import RequestRegistry, UtilityWaiter
from .reports import HealthReports, copy_error

__all__ = ["PendingCalls"]

logger = logging.getLogger("anyio_genout.engine")


class PendingCalls:
    """Each engine's pending replies, by call id; the client's own probes kept apart."""

    __slots__ = ("_abandoned", "_client_index", "_ids", "_internal", "_registry", "_reports",
                 "_send", "_waiters")

    def __init__(self, client_index: int, send: Callable[[int, list[bytes]], None],
                 reports: HealthReports, registry: RequestRegistry) -> None:
        """``send(rank, frames)`` queues a message for an engine; ``reports`` holds the
        client's sticky error; ``registry`` says why an engine is down
        (:meth:`~.registry.RequestRegistry.why_down_now`): a call to it is not sent, and ends
        as if it had died meanwhile."""
        self._client_index = client_index
        self._send = send
        self._reports = reports
        self._registry = registry
        self._ids = itertools.count(1)
        self._waiters: dict[int, UtilityWaiter] = {}
        self._internal: set[int] = set()  # call ids of the client's own probes
        # Probes of the client's own left before their answer (call id -> engine): a late
        # answer is expected, and dropped without a warning.
        self._abandoned: dict[int, int] = {}

    def __len__(self) -> int:
        """Replies still awaited (the client's own probes included)."""
        return len(self._waiters)

    @property
    def callers(self) -> int:
        """Replies still awaited by callers (not by the client's own probes)."""
        return len(self._waiters) - len(self._internal)

    async def call(self, ranks: Sequence[int], method: str, args: Sequence[Any], *,
                   internal: bool = False) -> list[Any]:
        """Call ``method(*args)`` on each of ``ranks``; the results in that order.

        ``internal``: the client's own probe, not counted as work in flight. Raises the
        client's sticky error (before sending, or when it fails meanwhile),
        :class:`~anyio_genout.UtilityCallError` once every engine answered if one answered
        with a failure or one of several died meanwhile (its ``failures`` and ``results``
        say which), the engine's :class:`~anyio_genout.EngineDeadError` if every engine of
        the call died, and :class:`~anyio_genout.TransportError` if sending failed.
        Cancelling the caller unregisters its waiters.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._reports.raise_if_unhealthy()
        waiters: dict[int, UtilityWaiter] = {}
        try:
            for rank in ranks:
                call_id = next(self._ids)
                waiter = UtilityWaiter(rank)
                waiters[call_id] = waiter
                down = self._registry.why_down_now(rank)
                if down is not None:
                    waiter.dead = down
                    continue
                self._waiters[call_id] = waiter
                if internal:
                    self._internal.add(call_id)
                self._send(rank, encode_utility(self._client_index, call_id, method, args))
            for waiter in waiters.values():
                if waiter.dead is None:
                    await waiter.done.wait()
        finally:
            for call_id in waiters:
                left = self._waiters.pop(call_id, None)
                if call_id in self._internal:
                    self._internal.discard(call_id)
                    if left is not None:
                        self._abandoned[call_id] = left.engine
        results = []
        answers: dict[int, Any] = {}
        failures: dict[int, str] = {}
        failure: str | None = None
        deaths: list[EngineDeadError] = []
        for waiter in waiters.values():
            if waiter.error is not None:
                raise copy_error(waiter.error)
            if waiter.dead is not None:
                deaths.append(waiter.dead)
                failures[waiter.engine] = f"engine {waiter.engine} died: {waiter.dead}"
                continue
            if waiter.failure is not None:
                failures[waiter.engine] = waiter.failure
                if failure is None:
                    failure = waiter.failure
            else:
                answers[waiter.engine] = waiter.result
            results.append(waiter.result)
        if deaths and len(deaths) == len(waiters):
            raise copy_error(deaths[0])  # no engine of the call is left to answer
        if deaths:
            answered = ", ".join(map(str, sorted(answers))) or "none"
            raise UtilityCallError(
                method, f"{'; '.join(failures[r] for r in sorted(failures))} (engines that "
                f"answered: {answered})", failures=failures, results=answers)
        if failure is not None:
            raise UtilityCallError(method, failure, failures=failures, results=answers)
        return results

    def probe_engine(self, call_id: int) -> int | None:
        """The engine a probe of the client's own with this call id waits on, else None."""
        if call_id not in self._internal:
            return None
        waiter = self._waiters.get(call_id)
        return None if waiter is None else waiter.engine

    def engine_of(self, call_id: int) -> int | None:
        """The engine whose reply the call with this id waits for, else None."""
        waiter = self._waiters.get(call_id)
        return None if waiter is None else waiter.engine

    def resolve(self, output: UtilityOutput) -> None:
        """Hand an engine's reply to the call waiting for it (an unexpected one is logged)."""
        waiter = self._waiters.pop(output.call_id, None)
        if waiter is None:
            if self._abandoned.pop(output.call_id, None) is None:
                logger.warning("dropping a reply to unexpected utility call %d",
                               output.call_id)
            return
        waiter.failure = output.failure_message
        waiter.result = output.result
        waiter.done.set()

    def fail_engine(self, rank: int, error: EngineDeadError) -> None:
        """Engine ``rank`` died (the client lives): its waiters end with ``error`` (a call
        to several engines raises once the others answered)."""
        for call_id, waiter in list(self._waiters.items()):
            if waiter.engine == rank:
                waiter.dead = error
                waiter.done.set()
                del self._waiters[call_id]
                self._internal.discard(call_id)
        for call_id in [c for c, engine in self._abandoned.items() if engine == rank]:
            del self._abandoned[call_id]

    def fail(self, error: BaseException) -> None:
        """Every waiting call fails with ``error``."""
        for waiter in self._waiters.values():
            waiter.error = error
            waiter.done.set()
        self._waiters.clear()
        self._abandoned.clear()
