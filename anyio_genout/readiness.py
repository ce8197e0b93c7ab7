"""Waiting for a ZeroMQ socket's descriptor to signal, without re-registering it each time.

``anyio.wait_readable`` registers the descriptor with the event loop for one wait and
removes it afterwards. On asyncio that is a selector registration and removal (two
``epoll_ctl`` calls and the selector's Python bookkeeping) per wait, about 10 us, and the
engine reader waits once per message when it keeps up with the engine. So on asyncio (and
uvloop) :class:`FdWaiter` registers the descriptor once, with a callback that resolves the
one parked waiter's future; on trio, whose own wait is already lean, it uses
``anyio.wait_readable``.

ZeroMQ's descriptor is readable while the socket has unprocessed internal commands, and a
``ZMQ_EVENTS`` check processes them. The callers check ``ZMQ_EVENTS`` before every wait,
with no await in between, so a signal can never fall between the check and the wait; and
the loop's level-triggered selector reports a still-readable descriptor again on every
iteration, so none is lost either. The other side of level triggering: a task woken in
one loop iteration that parks again in the next can find that iteration's callback, queued
before it cleared the descriptor, waking it for nothing. ``ready`` (the ``ZMQ_EVENTS``
check) lets the callback tell such a stale signal from a real one; a wake-up without it is
only ever spurious, never missing, and callers re-check anyway.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import anyio

__all__ = ["FdWaiter", "running_library"]


def running_library() -> str:
    """``"asyncio"`` or ``"trio"``: the async library running this task (anyio's two
    backends; asked directly, since anyio 4 names it only through private API and sniffio
    is not a dependency)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return "trio"
    raise RuntimeError("no asyncio or trio event loop is running in this thread")


class FdWaiter:
    """Waits for one descriptor to be readable; one waiting task at a time.

    Create and use it in the event loop that will wait; call :meth:`close` (in that loop)
    before the descriptor is closed: a parked waiter gets :class:`anyio.ClosedResourceError`.
    ``ready``, if given, must not raise, and returns whether the waiter has something to do
    (True when unsure); a signal arriving while it is False does not wake the waiter.
    """

    __slots__ = ("_closed", "_fd", "_future", "_loop", "_ready")

    def __init__(self, fd: int, ready: Callable[[], bool] | None = None) -> None:
        self._fd = fd
        self._ready = ready
        self._closed = False
        self._future: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if running_library() == "asyncio":
            loop = asyncio.get_running_loop()
            try:
                loop.add_reader(fd, self._on_readable)
            except NotImplementedError:  # pragma: no cover - e.g. Windows' proactor loop
                return
            self._loop = loop

    async def wait(self) -> None:
        """Wait until the descriptor is readable (it may be already)."""
        if self._closed:
            raise anyio.ClosedResourceError
        loop = self._loop
        if loop is None:
            await anyio.wait_readable(self._fd)
            return
        if self._future is not None:
            raise anyio.BusyResourceError("waiting on")
        future = self._future = loop.create_future()
        try:
            await future
        finally:
            if self._future is future:
                self._future = None

    def _on_readable(self) -> None:
        future = self._future
        if future is not None and (self._ready is None or self._ready()):
            self._future = None
            if not future.done():
                future.set_result(None)

    def close(self) -> None:
        """Unregister the descriptor and fail a parked waiter. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is None:
            anyio.notify_closing(self._fd)
            return
        if not loop.is_closed():
            loop.remove_reader(self._fd)
        future = self._future
        if future is not None:
            self._future = None
            if not future.done():
                future.set_exception(anyio.ClosedResourceError())

