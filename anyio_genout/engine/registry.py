"""Book-keeping of live requests and pending utility calls (no I/O, no awaiting).

The engine-reader task and the request scopes share these structures on one event loop;
every method is synchronous, so no lock is needed and nothing can be interleaved halfway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from ..errors import DuplicateRequestIdError, InvalidRequestError
from ..protocol import SchedulerStats
from .mailbox import OutputMailbox, mailbox_factory

__all__ = ["EngineLoad", "RequestEntry", "RequestRegistry", "UtilityWaiter"]


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
        # The running backend's mailbox class, looked up once (in the event loop).
        self._new_mailbox: Callable[[], OutputMailbox] = mailbox_factory()
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
        entry = RequestEntry(request_id, engine, self._new_mailbox())
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
