"""External request ids -> the internal ids of their live requests (refcounted), and the
ids an engine may still send late outputs for (:class:`AbortedIds`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from ..errors import DuplicateRequestIdError

__all__ = ["AbortedIds", "InflightGuard", "InflightRequests"]


class InflightRequests:
    """Which internal request ids are live for each user-chosen (external) id.

    Several live requests may share an external id; each :meth:`track` returns a guard whose
    :meth:`InflightGuard.release` removes exactly that edge (refcounted, so the same pair can be
    tracked twice), dropping the external id once it has no internal ids left.
    """

    __slots__ = ("_edges", "aborted")

    def __init__(self) -> None:
        self._edges: dict[str, dict[str, int]] = {}
        #: Used only with ``ClientConfig(randomize_request_ids=False)`` (see there).
        self.aborted = AbortedIds()

    def track(self, external_id: str, internal_id: str) -> InflightGuard:
        internals = self._edges.setdefault(external_id, {})
        internals[internal_id] = internals.get(internal_id, 0) + 1
        return InflightGuard(self, external_id, internal_id)

    def resolve(self, external_ids: Iterable[str]) -> list[str]:
        """Every live internal id of the given external ids (unknown ids contribute none)."""
        found: dict[str, None] = {}
        for external in external_ids:
            for internal in self._edges.get(external, ()):
                found[internal] = None
        return list(found)

    def all_internal_ids(self) -> list[str]:
        return list({i: None for internals in self._edges.values() for i in internals})

    def __len__(self) -> int:
        """Number of external ids with at least one live request."""
        return len(self._edges)

    def _release(self, external_id: str, internal_id: str) -> None:
        internals = self._edges.get(external_id)
        if internals is None or internal_id not in internals:
            return
        count = internals[internal_id] - 1
        if count:
            internals[internal_id] = count
            return
        del internals[internal_id]
        if not internals:
            del self._edges[external_id]


class InflightGuard:
    """Releases one tracked (external, internal) edge; idempotent."""

    __slots__ = ("_external", "_internal", "_owner")

    def __init__(self, owner: InflightRequests, external_id: str, internal_id: str) -> None:
        self._owner: InflightRequests | None = owner
        self._external = external_id
        self._internal = internal_id

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self._external, self._internal)


class AbortedIds:
    """Request ids that were aborted while an engine ran them, until they are safe to reuse.

    Only for internal ids that are the caller's own (``randomize_request_ids=False``). The
    engine sends nothing for a request it aborts, so outputs it had made before it read the
    ABORT can still arrive, and an output names its request by id alone: a new request with
    the same id would take them for its own. An aborted id is therefore refused
    (:meth:`check`) until the client holds proof that those outputs have all been read:

    1. the ABORT was queued (it is no longer among the engine client's pending aborts) before
       the ADD of some later request R on the same engine; and
    2. R has yielded an output.

    Each engine handles its input in order, so it read the ABORT before R's ADD, and every
    output it made for the old request came before any output for R; its output socket
    keeps that order, and the reader dispatches in order. So when R's first output has been
    read, the old request's late outputs have all arrived, and were dropped: no live stream
    had the id. With no later traffic on that engine the id stays refused: use a new one.

    Each open request is numbered per engine (:meth:`opened`); :meth:`witnessed` is called
    with that number at a request's first output.
    """

    __slots__ = ("_engines", "_ids")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}  # refused id -> its engine
        self._engines: dict[int, _EngineAborts] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def check(self, request_id: str) -> None:
        """Raise :class:`~anyio_genout.DuplicateRequestIdError` if ``request_id`` is refused."""
        if request_id in self._ids:
            error = DuplicateRequestIdError(request_id)
            error.args = (
                f"request id {request_id!r} was aborted while engine {self._ids[request_id]} "
                "was running it, and that engine may still send outputs made before it read "
                "the ABORT, which a new request with this id would receive: with "
                "randomize_request_ids=False give each request a new id (an aborted id is "
                "accepted again once a later request on that engine has produced output)",)
            raise error

    def aborted(self, request_id: str, engine: int) -> None:
        """``request_id`` was aborted (or is being) while ``engine`` ran it."""
        if request_id in self._ids:  # pragma: no cover - a live id is never refused
            return
        self._ids[request_id] = engine
        self._engine(engine).unsent.append(request_id)

    def opened(self, engine: int, abort_queued: Callable[[str], bool]) -> int:
        """A request's ADD was just queued for ``engine``: its number there.

        ``abort_queued(id)`` tells whether an id's ABORT still waits in the engine client's
        abort queue, not yet queued for the engine (:meth:`EngineCoreClient.abort_queued`).
        """
        state = self._engine(engine)
        state.opened += 1
        number = state.opened
        if state.unsent:
            still: list[str] = []
            for request_id in state.unsent:
                if abort_queued(request_id):
                    still.append(request_id)
                else:  # its ABORT went before this request's ADD
                    state.sent.append((number, request_id))
            state.unsent = still
        return number

    def witnessed(self, engine: int, number: int) -> None:
        """Request ``number`` on ``engine`` yielded its first output."""
        sent = self._engines[engine].sent
        while sent and sent[0][0] <= number:
            del self._ids[sent.popleft()[1]]

    def _engine(self, engine: int) -> _EngineAborts:
        state = self._engines.get(engine)
        if state is None:
            state = self._engines[engine] = _EngineAborts()
        return state


class _EngineAborts:
    __slots__ = ("opened", "sent", "unsent")

    def __init__(self) -> None:
        self.opened = 0  # requests opened on this engine so far
        self.unsent: list[str] = []  # refused ids whose ABORT was not seen queued yet
        # (number of the first request opened after the ABORT was queued, id), in order
        self.sent: deque[tuple[int, str]] = deque()
