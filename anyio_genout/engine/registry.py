"""Book-keeping of live requests and pending utility calls (no I/O, no awaiting).

The engine-reader task and the request scopes share these structures on one event loop;
every method is synchronous, so no lock is needed and nothing can be interleaved halfway.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import anyio

from ..errors import DuplicateRequestIdError, InvalidRequestError
from ..protocol import EngineCoreOutput, SchedulerStats

__all__ = ["EngineCoreStreamOutput", "EngineLoad", "OutputMailbox", "RequestEntry",
           "RequestRegistry", "StreamItem", "UtilityWaiter"]


class EngineCoreStreamOutput(NamedTuple):
    """One output as a stream yields it: which engine, the engine's step time, the output."""

    engine_index: int
    timestamp: float
    output: EngineCoreOutput


#: What travels through a request's channel: an output, or the one error that ends it.
StreamItem = EngineCoreStreamOutput | BaseException


class OutputMailbox:
    """The buffer between the engine reader and one request's consumer.

    The reader puts items in without ever waiting (the buffer is unbounded, so a stalled
    consumer costs only its own tokens); the consumer drains ``items`` and, when it is
    empty, waits on ``waiter``, an event the next :meth:`put` or :meth:`close` sets. This
    is a leaner stand-in for an anyio memory-object stream with an infinite buffer (one
    deque and at most one event per wait, no exceptions on the hot path), measured as the
    client's single largest cost per token before the change (docs/performance.md).
    """

    __slots__ = ("closed", "items", "new_event", "waiter")

    def __init__(self, new_event: Callable[[], anyio.Event] = anyio.Event) -> None:
        self.items: deque[StreamItem] = deque()
        self.closed = False
        self.waiter: anyio.Event | None = None
        #: Makes the event a waiting consumer parks on.
        self.new_event = new_event

    def put(self, item: StreamItem) -> None:
        """Append ``item`` (ignored once closed) and wake the consumer."""
        if self.closed:
            return
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.set()

    def close(self) -> None:
        """No more items will come; a waiting consumer wakes up to see that."""
        self.closed = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.set()

    def discard(self) -> None:
        """The consumer left: drop what it did not read and refuse more."""
        self.closed = True
        self.items.clear()


class RequestEntry:
    """A live request: where its outputs go and which engine runs it."""

    __slots__ = ("box", "engine", "request_id")

    def __init__(self, request_id: str, engine: int, box: OutputMailbox) -> None:
        self.request_id = request_id
        self.engine = engine
        self.box = box


class EngineLoad:
    """Routing state of one engine: requests in flight and its latest scheduler stats."""

    __slots__ = ("in_flight", "rank", "running", "waiting")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.in_flight = 0
        self.running: int | None = None
        self.waiting: int | None = None

    @property
    def score(self) -> int:
        if self.running is None or self.waiting is None:
            return self.in_flight
        return max(self.in_flight, self.running + self.waiting)


class RequestRegistry:
    """Live requests by id, plus per-engine load for routing."""

    def __init__(self, ranks: Iterable[int]) -> None:
        # ``anyio.Event()`` looks the running backend up on every call; the backend's own
        # event class, taken once here (in the event loop), skips that per wait.
        self._new_event: Callable[[], anyio.Event] = type(anyio.Event())
        self.requests: dict[str, RequestEntry] = {}
        self.engines: dict[int, EngineLoad] = {rank: EngineLoad(rank) for rank in ranks}
        # Tie order: the engines' 2-byte identities compared bytewise.
        self._order = sorted(self.engines, key=lambda r: r.to_bytes(2, "little"))

    def choose_engine(self, data_parallel_rank: int | None) -> int:
        if data_parallel_rank is not None:
            if data_parallel_rank not in self.engines:
                raise InvalidRequestError(
                    "data_parallel_rank",
                    f"no connected engine has rank {data_parallel_rank} (connected ranks: "
                    f"{sorted(self.engines)})",
                )
            return data_parallel_rank
        best = self._order[0]
        best_score = math.inf
        for rank in self._order:
            score = self.engines[rank].score
            if score < best_score:
                best, best_score = rank, score
        return best

    def register(self, request_id: str, engine: int) -> RequestEntry:
        if request_id in self.requests:
            raise DuplicateRequestIdError(request_id)
        entry = RequestEntry(request_id, engine, OutputMailbox(self._new_event))
        self.requests[request_id] = entry
        self.engines[engine].in_flight += 1
        return entry

    def remove(self, request_id: str) -> RequestEntry | None:
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self.engines[entry.engine].in_flight -= 1
        return entry

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        load = self.engines.get(engine)
        if load is not None:
            load.running = stats.num_running_reqs
            load.waiting = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs


class UtilityWaiter:
    """One engine's pending reply to a utility call."""

    __slots__ = ("done", "engine", "error", "failure", "result")

    def __init__(self, engine: int) -> None:
        self.engine = engine
        self.done = anyio.Event()
        self.result: Any = None
        self.failure: str | None = None
        self.error: BaseException | None = None
