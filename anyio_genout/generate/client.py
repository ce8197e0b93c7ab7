"""``Client``: the generate layer over an :class:`~anyio_genout.EngineCoreClient`."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import anyio
import anyio.abc
import attrs
from prometheus_client import CollectorRegistry

from ..engine import EngineCoreClient, EngineCoreClientConfig
from ..errors import keyboard_interrupt_in
from ..metrics import Metrics, log_stats_periodically
from .inflight import InflightRequests
from .request import GenerateRequest, internal_request_id
from .stream import GenerateStream, new_generate_stream

__all__ = ["Client", "ClientConfig"]


@attrs.frozen(kw_only=True)
class ClientConfig:
    """Settings of the generate layer (and, in ``engine``, of the connection).

    ``eos_token_id`` is filled into requests whose sampling parameters name none (the one
    EOS fill, :func:`~anyio_genout.protocol.sampling.fill_eos`; a
    :class:`~anyio_genout.TextClient` fills its tokenizer's EOS first, falling back to this
    one): without it the engine never stops on end-of-sequence (with ``ignore_eos`` it only
    holds back under ``min_tokens``). ``vocab_size`` (also settable on ``engine``; if both
    are set they must agree) makes the client refuse
    out-of-vocabulary token ids, which would kill a real engine. Metrics go to ``registry``,
    or to a private registry if None.

    ``randomize_request_ids=False`` sends the engine each request's own id instead of
    ``"{id}-{8 hex}"``. Then ids must be unique among live requests, and reusing the id of an
    aborted request is hazardous: the engine sends nothing when it aborts a request, so
    outputs it made before reading the ABORT can still arrive and would go to the new request.
    Entering such a request raises :class:`~anyio_genout.DuplicateRequestIdError` until a
    later request on the same engine has produced output (proof that those late outputs have
    all been read); see docs/concepts.md, "Aborting by request id".

    ``migration_limit=N`` (0, the default, is off): when the engine running a request dies
    and the others serve on (``engine.health.engine_failure="engine"``), the request is resubmitted
    to a live engine as a continuation (its prompt plus the tokens already delivered, with
    ``max_tokens`` and ``min_tokens`` reduced by them), up to N times per request; its stream
    goes on without a gap, a duplicate or an error. Then, and for requests pinned to an
    engine (``data_parallel_rank``) or with structured outputs, the
    :class:`~anyio_genout.EngineDeadError` surfaces. Greedy requests continue exactly; a
    seeded one does not (docs/reliability.md, "Request migration").
    """

    engine: EngineCoreClientConfig = attrs.field(factory=EngineCoreClientConfig)
    model_name: str = "anyio-genout"
    randomize_request_ids: bool = True
    eos_token_id: int | None = None
    vocab_size: int | None = None
    registry: CollectorRegistry | None = attrs.field(default=None, eq=False)
    log_stats_interval: float | None = attrs.field(default=None)
    migration_limit: int = attrs.field(default=0)

    @migration_limit.validator
    def _check_migration_limit(self, attribute: attrs.Attribute[int], value: int) -> None:
        if type(value) is not int or value < 0:
            raise ValueError(f"migration_limit must be an int of at least 0, got {value!r}")

    @log_stats_interval.validator
    def _check_interval(self, attribute: attrs.Attribute[float | None],
                        value: float | None) -> None:
        if value is not None and not value > 0:
            raise ValueError(f"log_stats_interval must be positive or None, got {value!r}")


class Client:
    """Generate token ids from vLLM engines, one structured scope per request.

    Usually created with ``async with Client.connect(config) as client``; or wrap an
    already-connected :class:`EngineCoreClient` with ``Client(engine, config)``.
    """

    def __init__(self, engine: EngineCoreClient, config: ClientConfig | None = None) -> None:
        """Wrap a connected engine client (metrics go to ``config.registry``).

        Raises:
            ValueError: ``config.vocab_size`` is set but the engine client's config has
                another one (or none), or the registry already holds these metric families.
        """
        self._config = config or ClientConfig(engine=engine.config)
        _check_vocab_size(self._config.vocab_size, engine.config)
        self._engine = engine
        self._inflight = InflightRequests()
        self._metrics = Metrics(self._config.registry, model_name=self._config.model_name,
                                max_model_len=engine.max_model_len)
        engine.add_stats_listener(self._metrics.observe_scheduler_stats)
        engine.add_batch_listener(self._metrics.observe_iteration)
        engine.add_sleep_listener(self._metrics.record_sleep_state)
        live = engine.live_engines
        for rank in engine.engine_ranks:
            self._metrics.set_engine_up(rank, rank in live)
        engine.add_health_listener(self._metrics.set_engine_up)

    @classmethod
    def connect(cls, config: ClientConfig | None = None) -> _ClientConnection:
        """Connect to the engines described by ``config.engine`` (see
        :meth:`EngineCoreClient.connect`) and yield a :class:`Client`.

        Raises:
            ValueError: at once, when ``config.vocab_size`` and ``config.engine.vocab_size``
                disagree.
            HandshakeError, HandshakeTimeoutError, EngineDeadError: on entering ``async
                with``, as :meth:`EngineCoreClient.connect` raises them.
        """
        return _ClientConnection(config or ClientConfig())

    @property
    def engine(self) -> EngineCoreClient:
        """The engine-core client underneath (utility calls, health, engine accessors)."""
        return self._engine

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    @property
    def config(self) -> ClientConfig:
        return self._config

    @property
    def inflight(self) -> InflightRequests:
        return self._inflight

    def generate(self, request: GenerateRequest, *, per_step: bool = False) -> GenerateStream:
        """Start ``request``: ``async with client.generate(request) as stream:``.

        The request is validated when the ``async with`` block is entered, before anything
        is sent (:class:`~anyio_genout.InvalidRequestError` names the field). See
        :class:`GenerateStream` for what leaving the block early does. Outputs that wait
        while the consumer is busy come merged into one (docs/lifecycle.md, "Coalescing");
        ``per_step=True``: one output per engine step instead.

        Raises:
            InvalidRequestError: ``request.sampling_params`` is not a
                :class:`SamplingParams` (every other check runs on entering the block).
        """
        internal = internal_request_id(request.request_id, self._config.randomize_request_ids)
        engine_request = request.to_engine_request(internal,
                                                   eos_token_id=self._config.eos_token_id)
        return new_generate_stream(self._engine, self._metrics, self._inflight, engine_request,
                                   callers_ids=not self._config.randomize_request_ids,
                                   migration_limit=self._config.migration_limit,
                                   per_step=per_step)

    async def abort(self, request_ids: Sequence[str] = ()) -> None:
        """Abort every live request with one of these external ids (all requests if empty).

        Each aborted stream ends with one output whose finish reason is ABORT and no tokens.
        Returns once the ABORT frames were handed to ZeroMQ.

        Raises:
            ClientUnhealthyError: the client's sticky health error (e.g.
                :class:`EngineDeadError`, :class:`ClientClosedError`).
        """
        if request_ids:
            internal = self._inflight.resolve(request_ids)
        else:
            internal = self._inflight.all_internal_ids()
        if not internal:
            await anyio.lowlevel.checkpoint()
            return
        await self._engine.abort(internal)


def _check_vocab_size(vocab_size: int | None, engine_config: EngineCoreClientConfig) -> None:
    # The engine client runs the one request validation, with its own config's vocab_size:
    # a ClientConfig.vocab_size it does not share would silently go unchecked.
    if vocab_size is not None and engine_config.vocab_size != vocab_size:
        raise ValueError(
            f"ClientConfig.vocab_size={vocab_size}, but the engine client's config has "
            f"vocab_size={engine_config.vocab_size}: set vocab_size on the "
            f"EngineCoreClientConfig (Client.connect does when it is unset there)")


class _ClientConnection:
    def __init__(self, config: ClientConfig) -> None:
        engine_config = config.engine
        if config.vocab_size is not None and engine_config.vocab_size is None:
            engine_config = attrs.evolve(engine_config, vocab_size=config.vocab_size)
        _check_vocab_size(config.vocab_size, engine_config)
        self._config = attrs.evolve(config, engine=engine_config)
        self._connection = EngineCoreClient.connect(engine_config)
        self._tg: anyio.abc.TaskGroup | None = None
        self._client: Client | None = None

    async def __aenter__(self) -> Client:
        engine = await self._connection.__aenter__()
        try:
            client = Client(engine, self._config)
            if self._config.log_stats_interval is not None:
                self._tg = anyio.create_task_group()
                await self._tg.__aenter__()
                interval = self._config.log_stats_interval
                self._tg.start_soon(lambda: log_stats_periodically(
                    client.metrics, interval=interval))
        except BaseException as exc:
            await self._connection.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._client = client
        return client

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                try:
                    await self._tg.__aexit__(None, None, None)
                except BaseExceptionGroup as group:  # trio: Ctrl-C hit the stats logger
                    interrupt = keyboard_interrupt_in(group)
                    if interrupt is None:
                        raise
                    raise interrupt from None
        finally:
            if self._client is not None and self._config.registry is not None:
                # A shared registry must be free for the next connection's metrics.
                self._client.metrics.unregister()
            await self._connection.__aexit__(exc_type, exc, tb)
