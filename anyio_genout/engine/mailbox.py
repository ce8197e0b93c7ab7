"""The buffer between the engine reader and one request's consumer, and how it parks.

The reader puts items in without ever waiting (the buffer is unbounded, so a stalled
consumer costs only its own tokens); the consumer drains ``items`` and, when it is empty,
parks in :meth:`OutputMailbox.wait` until the next :meth:`~OutputMailbox.put` or
:meth:`~OutputMailbox.close`. This is a leaner stand-in for an anyio memory-object stream
with an infinite buffer (docs/performance.md has the measurements).

A mailbox has at most one waiter, woken from the event loop's own thread, so it parks on
the cheapest primitive each backend has rather than on an ``anyio.Event`` (which costs, per
wait, an anyio event, the backend's event, its waiter list and two more coroutine frames):

* asyncio (and uvloop): a bare future, which is what ``asyncio.Event.wait`` awaits;
  cancelling the task (as anyio's cancel scopes do) cancels the future;
* trio: ``trio.lowlevel.wait_task_rescheduled``, which is what ``trio.Event.wait`` ends in;
  a cancellation calls the abort function, which forgets the task.

Either way cancellation behaves exactly as it does for an event, and tests run every
behaviour of the streams on both backends.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import sniffio

from ..protocol import EngineCoreOutput

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["EngineCoreStreamOutput", "OutputMailbox", "StreamItem", "mailbox_factory"]


class EngineCoreStreamOutput(NamedTuple):
    """One output as a stream yields it: which engine, the engine's step time, the output."""

    engine_index: int
    timestamp: float
    output: EngineCoreOutput


#: What a request's mailbox holds, in order: each output as two entries, the engine batch
#: timestamp (a float) then the output, and at the end possibly the one error that ends it.
StreamItem = float | EngineCoreOutput | BaseException


class OutputMailbox:
    """Items for one consumer, and the consumer's parking place (one subclass per backend).

    An output goes in as two entries of ``items``, its batch timestamp and itself, rather
    than as one (timestamp, output) object: the reader buffers outputs faster than their
    consumers read them when it falls behind, and every object kept alive meanwhile is one
    more for the garbage collector to scan (docs/performance.md).

    ``waiter`` is not None exactly while the consumer is parked; whoever adds an item or
    closes the mailbox then calls :meth:`wake`. The reader inlines :meth:`put_output` as
    two appends followed by that check.
    """

    __slots__ = ("closed", "items", "waiter")

    def __init__(self) -> None:
        self.items: deque[StreamItem] = deque()
        self.closed = False
        self.waiter: Any = None

    def put_output(self, timestamp: float, output: EngineCoreOutput) -> None:
        """Append an output and its batch timestamp (ignored once closed); wake the
        consumer."""
        if self.closed:
            return
        self.items.append(timestamp)
        self.items.append(output)
        if self.waiter is not None:
            self.wake()

    def put_error(self, error: BaseException) -> None:
        """Append the error that ends the stream (ignored once closed); wake the consumer."""
        if self.closed:
            return
        self.items.append(error)
        if self.waiter is not None:
            self.wake()

    def close(self) -> None:
        """No more items will come; a parked consumer wakes up to see that."""
        self.closed = True
        if self.waiter is not None:
            self.wake()

    def discard(self) -> None:
        """The consumer left: drop what it did not read and refuse more."""
        self.closed = True
        self.items.clear()

    async def wait(self) -> None:
        """Park until :meth:`wake` (callers re-check ``items`` and ``closed`` after)."""
        raise NotImplementedError

    def wake(self) -> None:
        """Unpark the consumer; only called while ``waiter`` is not None."""
        raise NotImplementedError


class _AsyncioMailbox(OutputMailbox):
    __slots__ = ()

    async def wait(self) -> None:
        future = self.waiter = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            if self.waiter is future:
                self.waiter = None

    def wake(self) -> None:
        future = self.waiter
        self.waiter = None
        if not future.done():  # cancelled, and the consumer has not run since
            future.set_result(None)


@functools.cache
def _trio_mailbox() -> type[OutputMailbox]:
    """Made on first use: trio is imported only when it is the running library."""
    from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

    class _TrioMailbox(OutputMailbox):
        __slots__ = ()

        async def wait(self) -> None:
            self.waiter = current_task()
            await wait_task_rescheduled(self._abort)

        def _abort(self, raise_cancel: object) -> Abort:
            self.waiter = None
            return Abort.SUCCEEDED

        def wake(self) -> None:
            task = self.waiter
            self.waiter = None
            reschedule(task)

    return _TrioMailbox


def mailbox_factory() -> Callable[[], OutputMailbox]:
    """The mailbox class for the running async library (call it in the event loop)."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return _AsyncioMailbox
    if library == "trio":
        return _trio_mailbox()
    raise RuntimeError(f"unsupported async library {library!r}")  # pragma: no cover
