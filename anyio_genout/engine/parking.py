"""Parking one task until another task on the same event loop wakes it.

The output mailboxes and the input socket's sender each have exactly one waiter, woken
from the event loop's own thread, so they park on the cheapest primitive each backend has
rather than on an ``anyio.Event`` (which costs, per wait, an anyio event, the backend's
event, its waiter list and two more coroutine frames):

* asyncio (and uvloop): a bare future, which is what ``asyncio.Event.wait`` awaits;
  cancelling the task (as anyio's cancel scopes do) cancels the future;
* trio: ``trio.lowlevel.wait_task_rescheduled``, which is what ``trio.Event.wait`` ends in;
  a cancellation calls the abort function, which forgets the task.

Either way cancellation behaves as it does for an event, and tests run every behaviour
that parks on both backends; on asyncio it takes one more step (``_AsyncioParking.wait``).
anyio delivers a cancellation on asyncio by cancelling the task's future, from a callback
that retries every loop pass while the scope holds tasks (``_deliver_cancellation``), and
it skips a task whose future is done (woken, not yet resumed): cancelling that future
would do nothing. A consumer the reader wakes in every pass, before that callback
runs, is always found woken: with the engine in another process and outputs arriving as
fast as the consumer handles them, a ``move_on_after(0.1)`` around the stream fired only
at the stream's end (957-1026 ms late). So a woken task whose scope has been cancelled
meanwhile waits on a future nothing but the cancellation (or, at worst, a short timer)
resolves, where the next retry finds and cancels it.

There is room for one parked task: a second task that tries to park while the first is
parked gets :class:`anyio.BusyResourceError` at once. Letting it in would overwrite the one
slot, and whichever task lost it would never be woken again.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from typing import Any, Final

import anyio

from ..readiness import running_library

__all__ = ["Parking", "parking_factory", "running_library"]

_NEG_INF: Final = -math.inf
_current_effective_deadline: Final = anyio.current_effective_deadline
#: Seconds a woken asyncio task whose scope was cancelled waits for anyio to deliver the
#: cancellation (it comes at the next loop pass; this bound only keeps the wait finite).
DELIVERY_WAIT: Final = 0.05
#: Seconds between two looks for such a pending cancellation by one parking place: a
#: consumer whose scope was cancelled while its wake-up was pending takes outputs for at
#: most this long more. (A timeout is also seen by the stream's own deadline check, see
#: engine/stream.py; this catches ``cancel()`` calls.) A consumer of many streams at once
#: is woken every few milliseconds, so a shorter interval would look at nearly every wake.
CHECK_INTERVAL: Final = 0.01

_clock: Final = time.perf_counter


class Parking:
    """One parked task at most: :meth:`wait` parks it, :meth:`wake` unparks it.

    ``waiter`` is not None exactly while a task is parked; call :meth:`wake` only then.
    A woken task re-checks whatever it waits for: a wake-up promises nothing else.
    """

    __slots__ = ("_next_check", "waiter")

    def __init__(self) -> None:
        self.waiter: Any = None
        # asyncio's: when a woken task next looks for a skipped cancellation (see there):
        # CHECK_INTERVAL after the parking place was made, not at its first wake-up (a
        # short request's stream would pay the look once per request).
        self._next_check = _clock() + CHECK_INTERVAL

    async def wait(self) -> None:
        """Park until :meth:`wake` (or cancellation).

        Raises :class:`anyio.BusyResourceError` (from :meth:`busy`), without waiting, if
        another task is parked here already.
        """
        raise NotImplementedError

    def busy(self) -> anyio.BusyResourceError:
        """The error for a second task that tries to park (subclasses say what for)."""
        return anyio.BusyResourceError("waiting on")

    def wake(self) -> None:
        """Unpark the parked task; only called while ``waiter`` is not None."""
        raise NotImplementedError


class _AsyncioParking(Parking):
    __slots__ = ()

    async def wait(self) -> None:
        waiter = self.waiter
        # A cancelled future whose task has not run since belongs to a task that is
        # leaving: its ``finally`` below will not clear a newer waiter, so take the slot.
        if waiter is not None and not waiter.done():
            raise self.busy()
        future = self.waiter = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            if self.waiter is future:
                self.waiter = None
        # Woken: if a cancellation of this task is pending (a cancelled scope that no shield
        # hides), anyio skipped it while the future was done; wait where it is taken. The
        # lookup (about 1 us, a walk of the task's scopes) is made at most every
        # CHECK_INTERVAL seconds per parking place: a consumer woken for every output
        # would otherwise pay it per output.
        now = _clock()
        if now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL
            if _current_effective_deadline() == _NEG_INF:
                await _take_cancellation()

    def wake(self) -> None:
        future = self.waiter
        self.waiter = None
        if not future.done():  # cancelled, and the task has not run since
            future.set_result(None)


async def _take_cancellation() -> None:
    """Wait, on a future no one else resolves, for the cancellation pending for this task.

    anyio's retry (next loop pass) finds the future not done and cancels it, raising the
    cancellation here. Not a wake-up anyone sees: the ``waiter`` slot stays empty, so the
    reader only buffers meanwhile. Returns after ``DELIVERY_WAIT`` s if it never came (the
    caller then re-checks what it waits for, as after any wake-up).
    """
    await asyncio.sleep(DELIVERY_WAIT)


@functools.cache
def _trio_parking() -> type[Parking]:
    """Made on first use: trio is imported only when it is the running library."""
    from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

    class _TrioParking(Parking):
        __slots__ = ()

        async def wait(self) -> None:
            if self.waiter is not None:  # a cancelled task's abort already cleared it
                raise self.busy()
            self.waiter = current_task()
            await wait_task_rescheduled(self._abort)

        def _abort(self, raise_cancel: object) -> Abort:
            self.waiter = None
            return Abort.SUCCEEDED

        def wake(self) -> None:
            task = self.waiter
            self.waiter = None
            reschedule(task)

    return _TrioParking


def parking_factory() -> type[Parking]:
    """The parking class for the running async library (call it in the event loop)."""
    return _AsyncioParking if running_library() == "asyncio" else _trio_parking()
