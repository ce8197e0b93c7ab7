"""Parking one task until another task on the same event loop wakes it.

The output mailboxes and the input socket's sender each have exactly one waiter, woken
from the event loop's own thread, so they park on the cheapest primitive each backend has
rather than on an ``anyio.Event`` (which costs, per wait, an anyio event, the backend's
event, its waiter list and two more coroutine frames):

* asyncio (and uvloop): a bare future, which is what ``asyncio.Event.wait`` awaits;
  cancelling the task (as anyio's cancel scopes do) cancels the future;
* trio: ``trio.lowlevel.wait_task_rescheduled``, which is what ``trio.Event.wait`` ends in;
  a cancellation calls the abort function, which forgets the task.

Either way cancellation behaves exactly as it does for an event, and tests run every
behaviour that parks on both backends.

There is room for one parked task: a second task that tries to park while the first is
parked gets :class:`anyio.BusyResourceError` at once. Letting it in would overwrite the one
slot, and whichever task lost it would never be woken again.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import anyio

from ..readiness import running_library

__all__ = ["Parking", "parking_factory", "running_library"]


class Parking:
    """One parked task at most: :meth:`wait` parks it, :meth:`wake` unparks it.

    ``waiter`` is not None exactly while a task is parked; call :meth:`wake` only then.
    A woken task re-checks whatever it waits for: a wake-up promises nothing else.
    """

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        self.waiter: Any = None

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

    def wake(self) -> None:
        future = self.waiter
        self.waiter = None
        if not future.done():  # cancelled, and the task has not run since
            future.set_result(None)


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
