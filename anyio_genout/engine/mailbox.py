"""The buffer between the engine reader and one request's consumer, and how it parks.

The reader puts items in without ever waiting (the buffer is unbounded, so a stalled
consumer costs only its own tokens); the consumer drains ``items`` and, when it is empty,
parks in :meth:`OutputMailbox.wait` until the next :meth:`~OutputMailbox.put` or
:meth:`~OutputMailbox.close`. This is a leaner stand-in for an anyio memory-object stream
with an infinite buffer (docs/performance.md has the measurements).

A mailbox has at most one waiter, woken from the event loop's own thread, so it parks the
way :mod:`.parking` does: on the cheapest primitive each backend has rather than on an
``anyio.Event``. A second task that tries to wait while one waits gets
:class:`anyio.BusyResourceError` at once (two tasks iterating one stream).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from ..protocol import EngineCoreOutput
from ..protocol.outputs import PLAIN_NONES
from .parking import Parking, _AsyncioParking, _trio_parking, running_library

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["EngineCoreStreamOutput", "OutputMailbox", "StreamItem", "mailbox_factory"]


class EngineCoreStreamOutput(NamedTuple):
    """One output as a stream yields it: which engine, the engine's step time, the output."""

    engine_index: int
    timestamp: float
    output: EngineCoreOutput


#: What a request's mailbox holds in ``items``, in order: each output as two entries, the
#: engine batch timestamp (a float) then the output, and at the end possibly the one error
#: that ends it. A *plain* output (a :data:`~anyio_genout.protocol.PlainRow`: new token ids
#: and nothing else) is its number of new tokens, an int, and the tokens themselves are in
#: the mailbox's ``tokens``, in order; the stream makes it an output (or a list of its
#: token ids) when it is taken.
StreamItem = float | int | EngineCoreOutput | BaseException


class OutputMailbox(Parking):
    """Items for one consumer, and the consumer's parking place (one subclass per backend).

    An output goes in as two entries of ``items``, its batch timestamp and itself, rather
    than as one (timestamp, output) object: the reader buffers outputs faster than their
    consumers read them when it falls behind, and every object kept alive meanwhile is one
    more for the garbage collector to scan (docs/performance.md). For the same reason a
    plain output is kept as no object at all: its token count in ``items`` and its tokens
    appended to ``tokens``, one list for every plain output buffered (its row and token
    list are freed with the message once the reader has dispatched it, so no collection
    after that scans them).

    ``waiter`` is not None exactly while the consumer is parked; whoever adds an item or
    closes the mailbox then calls :meth:`wake`. The reader inlines :meth:`put_output` as
    two appends followed by that check, without the ``closed`` check: a mailbox it reaches
    through the request registry is never closed (whoever closes one removes its request
    from the registry in the same synchronous step; see engine/reader.py).
    """

    __slots__ = ("closed", "items", "tokens")

    def __init__(self) -> None:
        super().__init__()
        self.items: deque[StreamItem] = deque()
        #: The new token ids of the plain outputs in ``items``, in order.
        self.tokens: list[int] = []
        self.closed = False

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

    def take_tokens(self, count: int) -> list[int]:
        """The new token ids of the plain output at the head of ``items`` (``count`` of
        them, as its entry there says), taken off ``tokens``; the caller takes the entry."""
        tokens = self.tokens
        if len(tokens) == count:  # all of them (the common case): no copy
            self.tokens = []
            return tokens
        taken = tokens[:count]
        del tokens[:count]
        return taken

    def take_plain(self, limit: int) -> tuple[list[Any], list[int]] | None:
        """Take the plain outputs at the head of ``items``, at most ``limit``: those kept as
        their token counts and the output objects that bring tokens alone (``count(None) ==
        PLAIN_NONES``), as ``(steps, tokens)``: ``[ts, n, ts, n, ...]`` and their token ids
        in order; None if the head is none of them."""
        items = self.items
        n = len(items)
        # Everything buffered, when every output is plain as the reader keeps them (an int)
        # and there are no more than ``limit``: one C pass over the types and two swaps,
        # where the loop below costs about 100 ns a step. Items come in pairs (batch
        # timestamp, output) or as one error that ends the stream, so n / 2 ints among n
        # items mean n / 2 pairs of a timestamp and a token count.
        if 1 < n <= 2 * limit and list(map(type, items)).count(int) * 2 == n:
            steps: list[Any] = list(items)
            items.clear()
            tokens = self.tokens
            self.tokens = []
            return steps, tokens
        steps = []
        taken: list[int] = []
        pending = self.tokens
        at = 0  # how many of `pending` the steps taken so far own
        popleft = items.popleft
        while limit and len(items) > 1 and type(items[0]) is float:
            output: Any = items[1]
            if type(output) is int:
                count = output
                taken += pending[at:at + count]
                at += count
            elif output.count(None) == PLAIN_NONES:
                new = output.new_token_ids
                taken += new
                count = len(new)
            else:
                break
            steps.append(popleft())
            popleft()
            steps.append(count)
            limit -= 1
        if not steps:
            return None
        del pending[:at]
        return steps, taken

    def close(self) -> None:
        """No more items will come; a parked consumer wakes up to see that."""
        self.closed = True
        if self.waiter is not None:
            self.wake()

    def discard(self) -> None:
        """The consumer left: drop what it did not read and refuse more.

        A consumer parked meanwhile (the stream was closed from another task) wakes up to
        see that."""
        self.closed = True
        self.items.clear()
        self.tokens.clear()
        if self.waiter is not None:
            self.wake()

    def busy(self) -> anyio.BusyResourceError:
        error = anyio.BusyResourceError("iterating")
        error.args = ("another task is already iterating this stream (read each request's "
                      "stream from one task only)",)
        return error


class _AsyncioMailbox(OutputMailbox, _AsyncioParking):
    __slots__ = ()


@functools.cache
def _trio_mailbox() -> type[OutputMailbox]:
    class _TrioMailbox(OutputMailbox, _trio_parking()):  # type: ignore[misc]
        __slots__ = ()

    return _TrioMailbox


def mailbox_factory() -> Callable[[], OutputMailbox]:
    """The mailbox class for the running async library (call it in the event loop)."""
    return _AsyncioMailbox if running_library() == "asyncio" else _trio_mailbox()
