"""``EngineCoreClient``: the raw engine-core client, a facade over the parts it composes.

Every public member is for users and delegates to one part (:mod:`.core` builds them and
says what each is): requests and aborts to :class:`~.core.ClientCore`, health to
:class:`~.health.Health`, utility calls to :class:`~.utility.UtilityCalls`, listeners to
the reader. What the package itself needs (running and closing the client, playing an
engine in-process) is on :class:`~.core.ClientCore`, reached by :class:`~.connection.Connection`
and by :func:`core_of` (:mod:`anyio_genout.testing`), never on this class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ClientUnhealthyError, EngineDeadError
from ..protocol import EngineCoreReadyResponse, EngineCoreRequest
from .config import EngineCoreClientConfig
from .connection import ConnectedClient, Connection
from .core import ClientCore
from .handshake import BoundSockets
from .health import HealthListener
from .reader import BatchListener, DeathExplainer, StatsListener
from .routing import Router
from .stream import CallScope, EngineCoreOutputStream
from .utility import SleepListener

__all__ = ["EngineCoreClient", "HealthListener", "core_of"]


class EngineCoreClient:
    """A connection to one or more vLLM engine cores.

    Create it with ``async with EngineCoreClient.connect(config) as engine:``. Leaving the
    block shuts everything down: every request the engines still run (streams still open in
    other tasks, scopes just left) is aborted, one ABORT frame per engine, before the sockets
    close; tasks are cancelled, and every open stream and waiting call ends with
    :class:`~anyio_genout.ClientClosedError`.
    """

    __slots__ = ("_calls", "_core", "_health", "_reader", "_registry")

    def __init__(self, core: ClientCore) -> None:
        self._core = core
        self._health = core.health
        self._calls = core.calls
        self._registry = core.registry
        self._reader = core.reader

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def connect(cls, config: EngineCoreClientConfig) -> Connection[EngineCoreClient]:
        """Bind, complete the handshake with every engine, and run the client.

        ``async with EngineCoreClient.connect(config) as engine:`` returns once every
        engine is ready; see :class:`EngineCoreClientConfig` for the two connection modes.
        While it waits it logs what it waits for and where (``anyio_genout.engine``; a
        warning after a second if an engine was not heard from).

        Entering raises :class:`~anyio_genout.HandshakeTimeoutError` after
        ``ready_timeout``, :class:`~anyio_genout.HandshakeError` on a bad start-up
        message, :class:`~anyio_genout.EngineDeadError` if an engine dies while starting,
        :class:`~anyio_genout.TransportError` if an address cannot be bound; Ctrl-C while
        waiting raises a plain :class:`KeyboardInterrupt`.
        """
        return Connection(config, _connected)

    # ------------------------------------------------------------------ accessors

    @property
    def config(self) -> EngineCoreClientConfig:
        return self._core.config

    @property
    def engine_ranks(self) -> list[int]:
        """Data-parallel ranks of the connected engines, in engine order."""
        return list(self._core.ranks)

    @property
    def engine_identities(self) -> list[bytes]:
        return list(self._core.identities.values())

    @property
    def engine_count(self) -> int:
        return len(self._core.ranks)

    @property
    def ready_responses(self) -> dict[int, EngineCoreReadyResponse]:
        return dict(self._core.ready)

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def vllm_version(self) -> str:
        return self._core.ready[self._core.ranks[0]].vllm_version

    @property
    def input_address(self) -> str:
        return self._core.sockets.input_address

    @property
    def output_address(self) -> str:
        return self._core.sockets.output_address

    @property
    def in_flight(self) -> int:
        """Requests registered and not yet finished, aborted or failed."""
        return len(self._registry.requests)

    @property
    def wave_state(self) -> tuple[int, bool] | None:
        """``(current_wave, engines_running)`` of the data-parallel group as this client
        knows it; None unless ``data_parallel_waves``."""
        waves = self._core.waves
        return None if waves is None else (waves.state.current_wave,
                                           waves.state.engines_running)

    @property
    def pending_utility_calls(self) -> int:
        """Utility calls waiting for replies (the client's own probes included)."""
        return len(self._core.pending)

    @property
    def output_disconnects(self) -> int:
        """Peers (engines, normally) whose connection to the output socket closed after a
        completed ZeroMQ handshake, since the client started binding."""
        return self._core.watch.output_disconnects

    @property
    def aborts_sent(self) -> int:
        """Request ids sent in ABORT frames so far (for soak checks and monitoring)."""
        return self._core.aborts.sent

    def engine_load(self) -> dict[int, float]:
        """Routing score of each engine: max(in-flight, running + waiting), plus vLLM's
        KV-usage penalty on waiting requests (docs/routing.md)."""
        return {rank: load.score for rank, load in self._registry.engines.items()}

    @property
    def router(self) -> Router:
        """The router choosing each request's engine (``config.routing.mode``); its ``stats``
        count its decisions."""
        return self._registry.router

    # ------------------------------------------------------------------ listeners

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call ``listener(engine_rank, stats)`` for every scheduler-stats update."""
        self._reader.stats_listeners.append(listener)

    def add_batch_listener(self, listener: BatchListener) -> None:
        """Call ``listener(engine_rank, tokens)`` for every batch of outputs (``tokens``: the
        prompt tokens computed for the open requests prefilled in it plus those generated)."""
        self._reader.batch_listeners.append(listener)

    def add_death_explainer(self, explain: DeathExplainer) -> Callable[[], None]:
        """Let whoever owns engines say why one died; returns a function that unregisters.

        ``ENGINE_CORE_DEAD`` is a bare sentinel that names neither the engine nor the cause.
        When one arrives, ``explain()`` is called (synchronously, from the reader) and the
        text it returns, e.g. ``"engine 0 (mock): duplicate request id 'a'"``, is appended
        to the :class:`~anyio_genout.EngineDeadError` every stream and call then gets; None
        or ``""`` adds nothing. An exception from ``explain`` is logged and ignored.
        """
        explainers = self._reader.death_explainers
        explainers.append(explain)

        def unregister() -> None:
            if explain in explainers:
                explainers.remove(explain)

        return unregister

    def add_health_listener(self, listener: HealthListener) -> None:
        """Call ``listener(rank, up)`` (synchronously) when an engine goes down, and for
        every engine still up when the client becomes unhealthy or closes (``up`` False);
        ``listener(rank, True)`` when an engine that was down rejoins."""
        self._health.add_health_listener(listener)

    def add_sleep_listener(self, listener: SleepListener) -> None:
        """Call ``listener(sleep, level)`` after :meth:`sleep` succeeded (``sleep`` 1, its
        ``level``) and after a :meth:`wake_up` every engine says left it fully awake
        (``0, 0``), as vLLM's front end records ``vllm:engine_sleep_state``."""
        self._calls.add_sleep_listener(listener)

    # ------------------------------------------------------------------ health

    @property
    def is_healthy(self) -> bool:
        return self._health.error is None

    @property
    def health_error(self) -> ClientUnhealthyError | None:
        """The first error that made the client unhealthy (sticky), or None."""
        return self._health.error

    @property
    def live_engines(self) -> list[int]:
        """Ranks of the engines up, in engine order: the ones new requests go to (empty
        once the client is unhealthy). With ``engine_failure="engine"`` an engine found
        dead leaves it at once, and rejoins it when restarted (docs/reliability.md)."""
        return self._health.live_engines

    @property
    def engine_health(self) -> dict[int, EngineDeadError | None]:
        """Every connected engine's rank, in engine order, with why it is down (the
        :class:`~anyio_genout.EngineDeadError` that took it out) or None while it is up.
        Once the client is unhealthy, the engines not known dead get its health error."""
        return self._health.engine_health

    def fail(self, error: ClientUnhealthyError) -> None:
        """Mark the client unhealthy with ``error`` (the first error sticks), or, for an
        :class:`~anyio_genout.EngineDeadError` that names its engines (``error.ranks``)
        with ``engine_failure="engine"``, only those engines.

        Every open stream receives the error once, every waiting utility call fails with it,
        and every later call fails with it at once. The requests it ends are aborted on the
        engines still alive (not on a dead one, nor after a transport failure). For process
        watchers (e.g. the managed vLLM engine: ``on_exit``); synchronous and idempotent.
        """
        self._health.fail(error)

    # ------------------------------------------------------------------ requests

    def call(self, request: EngineCoreRequest) -> CallScope:
        """Send ``request`` and stream its outputs: ``async with engine.call(req) as s:``.

        Entering does what :meth:`open_stream` does (and raises what it raises); leaving the
        block before the terminal output aborts the request in the engine exactly once.
        """
        return CallScope(lambda: self._core.open_stream(request))

    def open_stream(self, request: EngineCoreRequest) -> EngineCoreOutputStream:
        """Validate ``request``, resolve its defaults, pick its engine, register and queue
        it; returns its stream (the synchronous half of :meth:`call`, for a layer that
        builds its own scope: it must :meth:`~EngineCoreOutputStream.close` the stream).

        This is where every decision about a new request is made, once: the one validation
        (:meth:`EngineCoreRequest.validate` with this client's ``vocab_size``,
        ``max_model_len`` and ``max_logprobs``), this client's ``client_index``, the
        ``max_tokens`` cap (:meth:`EngineCoreRequest.resolved_max_tokens`, vLLM's rule: above
        ``max_model_len`` refused, None the rest of the context, beyond the prompt's room cut
        to it), the duplicate-id check, and the engine (``data_parallel_rank``, else
        the least loaded). :attr:`EngineCoreOutputStream.request` is the request as sent and
        :attr:`EngineCoreOutputStream.max_tokens` its resolved cap.

        Raises, with nothing sent: :class:`~anyio_genout.InvalidRequestError` naming the
        bad field, :class:`~anyio_genout.DuplicateRequestIdError` if a live request has the
        id, the client's sticky health error if it is unhealthy
        (:class:`~anyio_genout.ClientClosedError` once closed); and
        :class:`~anyio_genout.TransportError` if sending the input queue failed (which makes
        the client unhealthy).
        """
        return self._core.open_stream(request)

    def abort_queued(self, request_id: str) -> bool:
        """Whether the ABORT of a stream closed early with this id waits in the abort queue
        (not yet queued for the engine's input, so a request queued now would reach the
        engine before it; :meth:`open_stream` with that id sends the ABORT first)."""
        return self._core.aborts.is_pending(request_id)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (unknown ids are ignored).

        Each aborted stream first receives a synthesized terminal output with finish reason
        ABORT and no tokens; then one ABORT frame per engine (up to 1024 ids each) is handed
        to ZeroMQ, before this returns. An id whose scope was left and whose ABORT is still
        queued for the abort worker goes in that frame too (and only there).

        Cancellation-safe: a cancelled caller gets the cancellation before anything is
        done; otherwise everything is done and handed over. Raises the client's sticky error
        if it is unhealthy (:class:`~anyio_genout.ClientClosedError` once it is closed), or
        :class:`~anyio_genout.TransportError` if the input socket failed (which makes the
        client unhealthy).
        """
        await self._core.abort(request_ids)

    # ------------------------------------------------------------------ utility calls

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine up (:attr:`live_engines`, all of them
        unless one died); returns their results in engine order.

        Waits for every engine's reply. Cancelling the caller unregisters its waiters.

        Raises:
            UtilityCallError: an engine's method failed, or one of the engines died while
                the call waited (raised after all the others have answered; its
                ``failures`` maps each failed engine's rank to why, ``results`` each other
                engine's rank to its result).
            ClientUnhealthyError: the client's sticky health error, at once or when it
                turns unhealthy while the call waits (:class:`EngineDeadError`,
                :class:`ClientClosedError`, ...); :class:`EngineDeadError` naming every
                engine and why, at once, while none is up (``last_engine_death="wait"``).
        """
        return await self._calls.call_utility(method, *args)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return await self._calls.get_supported_tasks()

    async def is_sleeping(self) -> bool:
        return await self._calls.is_sleeping()

    async def is_scheduler_paused(self) -> bool:
        return await self._calls.is_scheduler_paused()

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return await self._calls.reset_prefix_cache(reset_running_requests, reset_connector)

    async def reset_mm_cache(self) -> None:
        await self._calls.reset_mm_cache()

    async def reset_encoder_cache(self) -> None:
        await self._calls.reset_encoder_cache()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._calls.sleep(level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._calls.wake_up(tags)

    async def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._calls.pause_scheduler(mode, clear_cache)

    async def resume_scheduler(self) -> None:
        await self._calls.resume_scheduler()

    async def add_lora(self, lora: Any) -> bool:
        return await self._calls.add_lora(lora)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._calls.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return await self._calls.list_loras()

    async def start_profile(self, prefix: str | None = None) -> None:
        await self._calls.start_profile(prefix)

    async def stop_profile(self) -> None:
        await self._calls.stop_profile()

    async def collective_rpc(self, method: str, worker_timeout: float | None = None,
                             args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                             ) -> list[Any]:
        """Run ``method`` on every worker of every engine; results flattened in engine order."""
        return await self._calls.collective_rpc(method, worker_timeout, args, kwargs)


def _connected(config: EngineCoreClientConfig, sockets: BoundSockets,
               ready: dict[int, EngineCoreReadyResponse]
               ) -> tuple[ConnectedClient, EngineCoreClient]:
    """The connection's factory: the client's parts, and the facade over them."""
    core = ClientCore(config, sockets, ready)
    return core, EngineCoreClient(core)


def core_of(client: EngineCoreClient) -> ClientCore:
    """The parts ``client`` composes (package-internal: :mod:`anyio_genout.testing`)."""
    return client._core
