"""External request ids -> the internal ids of their live requests (refcounted)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["InflightGuard", "InflightRequests"]


class InflightRequests:
    """Which internal request ids are live for each user-chosen (external) id.

    Several live requests may share an external id; each :meth:`track` returns a guard whose
    :meth:`InflightGuard.release` removes exactly that edge (refcounted, so the same pair can be
    tracked twice), dropping the external id once it has no internal ids left.
    """

    __slots__ = ("_edges",)

    def __init__(self) -> None:
        self._edges: dict[str, dict[str, int]] = {}

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
