"""An engine-core client's health: which engines are up, and what happens when one dies
or comes back (:class:`Health`, a part the client owns; its parts report to it through
:class:`~.reports.HealthReports`).

With ``engine_failure="engine"`` an engine that dies leaves routing and fails its own
requests and utility calls; the client fails as a whole (sticky error, every stream and
call ended once) on the ``"client"`` policy, when the last engine dies (unless
``last_engine_death="wait"``: then it waits, engineless, for rejoins), or on an error that
names no engine. A restarted engine of a rank that is down rejoins (:mod:`.rejoin`).
docs/reliability.md has the rules and their tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..errors import (
    ClientClosedError,
    ClientUnhealthyError,
    EngineDeadError,
    TransportError,
)
from ..protocol import EngineCoreReadyResponse
from .aborts import AbortQueue
from .config import EngineCoreClientConfig
from .reader import OutputReader
from .registry import RequestRegistry
from .rejoin import Rejoins
from .reports import HealthReports, copy_error
from .utility_calls import PendingCalls
from .watchers import EngineWatch

__all__ = ["Health", "HealthListener"]

#: ``listener(rank, up)``: an engine went down (False) or rejoined (True).
HealthListener = Callable[[int, bool], None]

logger = logging.getLogger("anyio_genout.engine")


class Health:
    """Which engines of one client are up, and the policy when one dies or comes back.

    It handles what the client's parts report (:class:`~.reports.HealthReports`, which
    holds the sticky error it sets) and acts on the parts named here: the registry's
    routing set and requests, the abort queue, the utility calls, the reader, the
    handshake's rejoins and the watchers.
    """

    def __init__(self, config: EngineCoreClientConfig, ready: dict[int, EngineCoreReadyResponse],
                 max_model_len: int, reports: HealthReports, registry: RequestRegistry,
                 aborts: AbortQueue, calls: PendingCalls, reader: OutputReader,
                 rejoins: Rejoins, watch: EngineWatch) -> None:
        """``ready``: each engine's ready response (by rank, in engine order; a rejoining
        engine's replaces its own)."""
        self._config = config
        self._ready = ready
        self._ranks = list(ready)
        self._max_model_len = max_model_len
        self._reports = reports
        self._registry = registry
        self._aborts = aborts
        self._calls = calls
        self._reader = reader
        self._rejoins = rejoins
        self._watch = watch
        self._listeners: list[HealthListener] = []
        reports.handle_with(self)

    @property
    def error(self) -> ClientUnhealthyError | None:
        """The first error that made the client unhealthy (sticky), or None."""
        return self._reports.error

    @property
    def live_engines(self) -> list[int]:
        """Ranks of the engines up, in engine order: the ones new requests go to (empty
        once the client is unhealthy). With ``engine_failure="engine"`` an engine found
        dead leaves it at once, and rejoins it when restarted (docs/reliability.md)."""
        if self._reports.error is not None:
            return []
        live = self._registry.live
        return [rank for rank in self._ranks if rank in live]

    @property
    def engine_health(self) -> dict[int, EngineDeadError | None]:
        """Every connected engine's rank, in engine order, with why it is down (the
        :class:`~anyio_genout.EngineDeadError` that took it out) or None while it is up.
        Once the client is unhealthy, the engines not known dead get its health error."""
        down = self._registry.down
        error = self._reports.error
        health: dict[int, EngineDeadError | None] = {}
        for rank in self._ranks:
            why = down.get(rank)
            if why is None and error is not None:
                why = (error if isinstance(error, EngineDeadError)
                       else EngineDeadError(f"the client is unhealthy: {error}"))
            health[rank] = why
        return health

    def add_health_listener(self, listener: HealthListener) -> None:
        """Call ``listener(rank, up)`` (synchronously) when an engine goes down, and for
        every engine still up when the client becomes unhealthy or closes (``up`` False);
        ``listener(rank, True)`` when an engine that was down rejoins."""
        self._listeners.append(listener)

    def fail(self, error: ClientUnhealthyError) -> None:
        """Mark the client unhealthy with ``error`` (the first error sticks), or, for an
        :class:`~anyio_genout.EngineDeadError` that names its engines (``error.ranks``)
        with ``engine_failure="engine"``, only those engines (:meth:`fail_engines`).

        Every open stream receives the error once, every waiting utility call fails with it,
        and every later call fails with it at once. The requests it ends are aborted on the
        engines still alive (not on a dead one, nor after a transport failure). What the
        parts report (:meth:`.reports.HealthReports.fail`) and what
        :meth:`EngineCoreClient.fail <.client.EngineCoreClient.fail>` does for process
        watchers; synchronous and idempotent.
        """
        if (isinstance(error, EngineDeadError) and error.ranks
                and self._config.health.engine_failure == "engine"):
            self.fail_engines(error.ranks, error)
        else:
            self._fail_client(error)

    def fail_engines(self, ranks: Sequence[int], error: EngineDeadError) -> None:
        """Engines ``ranks`` died with ``error`` (synchronous, idempotent).

        With ``engine_failure="engine"``, while another engine lives: each leaves the
        routing set at once (a request pinned to it fails at once), its open streams and
        its share of waiting utility calls get the error once (an error naming it), no
        ABORT is sent to it, and the client stays healthy. Otherwise (the ``"client"``
        policy, or no engine left unless ``last_engine_death="wait"``) the whole client
        fails with ``error``, as :meth:`fail`.
        """
        if self._reports.error is not None:
            return
        registry = self._registry
        dead = [rank for rank in dict.fromkeys(ranks) if rank in registry.live]
        if not dead:
            return
        if error.ranks is None:
            error.ranks = tuple(dead)
        health = self._config.health
        if health.engine_failure == "client" or (registry.live <= set(dead)
                                                 and health.last_engine_death == "fail"):
            self._fail_client(error)
            return
        for rank in dead:
            entries = registry.mark_down(rank, error)
            self._rejoins.engine_down(rank)
            self._aborts.forget_engine(rank)
            self._calls.fail_engine(rank, error)
            for entry in entries:
                entry.box.put_error(copy_error(error))
                entry.box.close()
            # A warning, not an error: the client serves on (and the command line shows
            # warnings, while it leaves errors to the one line that ends a command).
            logger.warning("engine %d is down, %d request(s) failed with it (engines up: "
                           "%s): %s", rank, len(entries), self.live_engines, error)
            self._tell_health(rank, False)
        if not registry.live:  # last_engine_death="wait"
            logger.warning("no engine is up: every request fails at once until one rejoins "
                           "(engines down: %s)", ", ".join(map(str, sorted(registry.down))))

    def _fail_client(self, error: ClientUnhealthyError) -> None:
        if self._reports.error is not None:
            return
        registry = self._registry
        requests = registry.requests
        if not isinstance(error, (ClientClosedError, TransportError)):
            # The engines still alive would run the failed requests on for nobody: ABORT
            # them there (never on a dead engine; if which one died is unknown, nowhere).
            alive = set(registry.live)
            if isinstance(error, EngineDeadError):
                alive = alive - set(error.ranks) if error.ranks is not None else set()
            for rank in registry.live - alive:
                self._aborts.forget_engine(rank)
            self._aborts.abort_all((rid, entry.engine) for rid, entry in requests.items()
                                   if entry.engine in alive)
        self._reports.error = error
        self._reader.stop()
        if isinstance(error, ClientClosedError):
            logger.debug("engine-core client closed")
        else:
            logger.error("engine-core client is unhealthy: %s", error)
        for entry in list(requests.values()):
            entry.box.put_error(copy_error(error))
            entry.box.close()
        for rid in list(requests):
            registry.remove(rid)
        self._calls.fail(error)
        self._aborts.clear()
        for rank in sorted(registry.live):
            self._tell_health(rank, False)

    def rejoin(self, rank: int, response: EngineCoreReadyResponse) -> str | None:
        """Engine ``rank``, down, completed its handshake again (a restarted engine): put it
        back into routing with ``response`` as its ready response; returns why it is
        refused instead (it stays down), or None."""
        if self._reports.error is not None:
            return f"the client is unhealthy: {self._reports.error}"
        registry = self._registry
        if rank in registry.live:
            return f"engine {rank} is up"
        if response.max_model_len < self._max_model_len:
            return (f"its max_model_len {response.max_model_len} is below the "
                    f"{self._max_model_len} the client accepts requests for")
        self._ready[rank] = response
        registry.mark_up(rank)
        self._watch.engine_up()
        if not registry.down:
            self._rejoins.engines_down(False)
        logger.warning("engine %d is back (vLLM %s) and rejoins routing (engines up: %s)",
                       rank, response.vllm_version, self.live_engines)
        self._tell_health(rank, True)
        return None

    def _tell_health(self, rank: int, up: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(rank, up)
            except Exception:
                logger.exception("health listener %r failed", listener)
