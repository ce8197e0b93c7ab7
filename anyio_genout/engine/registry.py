"""Book-keeping of live requests and pending utility calls (no I/O, no awaiting).

The engine-reader task and the request scopes share these structures on one event loop;
every method is synchronous, so no lock is needed and nothing can be interleaved halfway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio

from ..errors import DuplicateRequestIdError, EngineDeadError, InvalidRequestError
from ..protocol import EngineCoreRequest, PrefillStats, SchedulerStats
from .mailbox import OutputMailbox, mailbox_factory
from .routing import EngineLoad, LoadRouter, Router

__all__ = ["EngineLoad", "RequestEntry", "RequestRegistry", "UtilityWaiter", "why_down"]


def why_down(engines: Mapping[int, Exception | None]) -> str:
    """``"engine 0: <why>; engine 1: <why>"`` for engines by rank and why each is down
    (a reason that already starts with its engine is not prefixed again)."""
    parts = []
    for rank, error in engines.items():
        text = "" if error is None else str(error)
        named = text.startswith((f"engine {rank}:", f"engine {rank} "))
        parts.append(text if named else f"engine {rank}: {text}" if text else f"engine {rank}")
    return "; ".join(parts)


class RequestEntry:
    """A live request: where its outputs go and which engine runs it."""

    __slots__ = ("box", "engine", "request_id", "ticket")

    def __init__(self, request_id: str, engine: int, box: OutputMailbox,
                 ticket: Any = None) -> None:
        self.request_id = request_id
        self.engine = engine
        self.box = box
        #: The router's expectation for this request, until its prefill stats arrive.
        self.ticket = ticket


class RequestRegistry:
    """Live requests by id, plus per-engine load and health for routing.

    ``live`` is the set of engines up (routing picks among them only); :meth:`mark_down`
    takes one out, with its requests, and :meth:`mark_up` puts it back.
    """

    def __init__(self, ranks: Iterable[int], router: Router | None = None) -> None:
        # The running backend's mailbox class, looked up once (in the event loop).
        self._new_mailbox: Callable[[], OutputMailbox] = mailbox_factory()
        self.requests: dict[str, RequestEntry] = {}
        self.engines: dict[int, EngineLoad] = {rank: EngineLoad(rank) for rank in ranks}
        #: The engines up, the only ones routing picks (see :meth:`mark_down`).
        self.live: set[int] = set(self.engines)
        #: Why each engine down is down.
        self.down: dict[int, EngineDeadError] = {}
        # Tie order: the engines' 2-byte identities compared bytewise.
        self._order = sorted(self.engines, key=lambda r: r.to_bytes(2, "little"))
        self.router: Router = LoadRouter() if router is None else router
        #: Whether the reader hands the first output's prefill stats to :meth:`note_prefill`.
        self.learns = self.router.learns

    def choose_engine(self, request: EngineCoreRequest) -> tuple[int, Any]:
        """The engine for ``request`` and the router's ticket (for :meth:`register`):
        its ``data_parallel_rank`` if it names one, else the router's choice among the
        engines in tie order.

        Raises :class:`InvalidRequestError` naming ``data_parallel_rank`` if no connected
        engine has that rank, and :class:`EngineDeadError` (naming the rank and why) if
        that engine is down, or if none is up."""
        rank = request.data_parallel_rank
        engines = self.engines
        pinned = None
        if rank is not None:
            pinned = engines.get(rank)
            if pinned is None:
                raise InvalidRequestError(
                    "data_parallel_rank",
                    f"no connected engine has rank {rank} (connected ranks: "
                    f"{sorted(engines)})",
                )
        live = self.live
        if rank is not None and rank not in live:
            raise self.down_error(rank)
        if not live:
            raise self.none_up_error()
        return self.router.choose(request, [engines[r] for r in self._order if r in live],
                                  pinned)

    def none_up_error(self) -> EngineDeadError:
        """The error for a request while no engine is up: each engine down and why."""
        ranks = sorted(self.engines)
        why = why_down({rank: self.down.get(rank) for rank in ranks})
        return EngineDeadError(f"every engine is down ({why})", ranks=ranks)

    def down_error(self, rank: int) -> EngineDeadError:
        """The error for a request pinned (``data_parallel_rank``) to a down engine."""
        error = self.down.get(rank)
        why = f": {error}" if error is not None else ""
        return EngineDeadError(f"data_parallel_rank={rank}: engine {rank} is down{why}",
                               ranks=(rank,))

    def why_down_now(self, rank: int) -> EngineDeadError | None:
        """Why engine ``rank`` is down, or None while it is up."""
        return self.down.get(rank) if rank not in self.live else None

    def in_flight_on(self, rank: int) -> int:
        """Requests registered on engine ``rank`` and not yet ended (0 for an unknown one)."""
        load = self.engines.get(rank)
        return 0 if load is None else load.in_flight

    def mark_down(self, rank: int, error: EngineDeadError) -> list[RequestEntry]:
        """Take engine ``rank`` out of routing (``error`` says why); removes its live
        requests and returns them (the caller fails them). Idempotent: a second call
        returns nothing and keeps the first error."""
        load = self.engines.get(rank)
        if load is None or rank not in self.live:
            return []
        self.live.discard(rank)
        self.down[rank] = error
        load.running = load.waiting = None
        mine = [entry for entry in self.requests.values() if entry.engine == rank]
        for entry in mine:
            del self.requests[entry.request_id]
        load.in_flight = 0
        self.router.engine_reset(rank)  # its prefix cache went with it
        return mine

    def mark_up(self, rank: int) -> None:
        """Put engine ``rank`` back into routing (it came back: a new engine, its cache
        empty, nothing running; its load is unknown until its first stats)."""
        load = self.engines.get(rank)
        if load is not None and rank not in self.live:
            self.down.pop(rank, None)
            load.running = load.waiting = None
            load.in_flight = 0
            self.router.engine_reset(rank)
            self.live.add(rank)

    def register(self, request_id: str, engine: int, ticket: Any = None) -> RequestEntry:
        if request_id in self.requests:
            raise DuplicateRequestIdError(request_id)
        entry = RequestEntry(request_id, engine, self._new_mailbox(), ticket)
        self.requests[request_id] = entry
        load = self.engines[engine]
        load.in_flight += 1
        if load.waiting is not None:
            # Until the engine's next stats, count the request as waiting there (vLLM's
            # DPLBAsyncMPClient does the same between coordinator updates).
            load.waiting += 1
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
            load.kv_cache_usage = stats.kv_cache_usage
            if self.learns:
                prefix = stats.raw.get("prefix_cache_stats")
                if type(prefix) is dict and prefix.get("reset") is True:
                    self.router.engine_reset(engine)

    def note_prefill(self, entry: RequestEntry, prefill: PrefillStats) -> None:
        """The first output of ``entry``'s request carried ``prefill``: tell the router
        what its engine had cached (once per request)."""
        ticket = entry.ticket
        if ticket is not None:
            entry.ticket = None
            self.router.note_cached(entry.engine, ticket, prefill.num_cached_tokens)


class UtilityWaiter:
    """One engine's pending reply to a utility call."""

    __slots__ = ("dead", "done", "engine", "error", "failure", "result")

    def __init__(self, engine: int) -> None:
        self.engine = engine
        self.done = anyio.Event()
        self.result: Any = None
        self.failure: str | None = None
        self.error: BaseException | None = None  # the client failed
        self.dead: EngineDeadError | None = None  # this engine died (the client lives)
