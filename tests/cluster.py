"""The one mock cluster of the test suite: in-process mock engines behind one client.

:func:`mock_cluster` starts ``engines`` :class:`MockEngine` s in this event loop (each in a
cancel scope of its own, with its own :class:`MockFaults` and settings) and an
:class:`EngineCoreClient` over them, through the handshake or bootstrapped; it yields a
:class:`MockCluster`, which can kill an engine and start a new one of the same rank.
:func:`generate_client` puts the generate-layer :class:`Client` on top. Every test that needs
mock engines in-process uses these (a scripted fake engine is ``tests/engine/fake.py``'s;
mock engines in their own processes are ``tests/support.mock_engine_process`` and
``tests/cli/support.cli_process``).

Every address is 127.0.0.1 with an ephemeral port; nothing leaves the machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import attrs

from anyio_genout import (
    BootstrappedTransport,
    Client,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
)
from anyio_genout.mock import MockEngine, MockEngineConfig, MockFaults
from anyio_genout.mock.waves import WaveGroup
from anyio_genout.transport import free_tcp_address
from tests.support import wait_until

__all__ = ["MockCluster", "generate_client", "mock_cluster"]

#: The ways :meth:`MockCluster.kill` kills an engine.
KILL_WAYS = ("sentinel", "sockets closed")


@attrs.define(eq=False)
class MockCluster:
    """Mock engines by rank (the latest one of each) and the client over them.

    ``client`` is the engine-core client; :attr:`front` the generate-layer client when
    :func:`generate_client` made the cluster. ``health`` records every ``(rank, up)`` the
    client's health listeners were told, in order."""

    client: EngineCoreClient
    #: The engine-side settings every new engine gets (addresses, step time, ...).
    settings: dict[str, Any]
    _tg: anyio.abc.TaskGroup
    engines: list[MockEngine] = attrs.field(factory=list)
    scopes: list[anyio.CancelScope] = attrs.field(factory=list)
    health: list[tuple[int, bool]] = attrs.field(factory=list)
    #: The data-parallel wave group every engine is one of (None: no waves).
    waves: WaveGroup | None = None
    _front: Client | None = None

    @property
    def engine(self) -> MockEngine:
        """Engine 0 (the one engine of a one-engine cluster)."""
        return self.engines[0]

    @property
    def front(self) -> Client:
        """The generate-layer :class:`Client` (clusters made by :func:`generate_client`)."""
        if self._front is None:
            raise AttributeError("this cluster has no generate Client: use generate_client()")
        return self._front

    def new_engine(self, rank: int, **overrides: Any) -> MockEngine:
        """A mock engine of ``rank`` with the cluster's settings and ``overrides``, not
        started (for a test that serves it itself)."""
        return MockEngine(MockEngineConfig(rank=rank, **{**self.settings, **overrides}),
                          waves=self.waves)

    async def start(self, rank: int, **overrides: Any) -> MockEngine:
        """Start a new engine of ``rank`` (replacing the one the cluster had) in a cancel
        scope of its own; does not wait for the client to take it."""
        engine = self.new_engine(rank, **overrides)
        scope = anyio.CancelScope()
        if rank < len(self.engines):
            self.engines[rank], self.scopes[rank] = engine, scope
        else:
            assert rank == len(self.engines), "engines start in rank order"
            self.engines.append(engine)
            self.scopes.append(scope)

        async def serve() -> None:
            with scope:
                await engine.serve()

        self._tg.start_soon(serve)
        return engine

    async def kill(self, rank: int, way: str) -> None:
        """Kill engine ``rank`` ``way`` (``"sentinel"``: it sends ENGINE_CORE_DEAD first;
        ``"sockets closed"``: its task is cancelled and its sockets close, as a killed
        process's do) and wait until the client has it down."""
        if way not in KILL_WAYS:
            raise ValueError(f"way: {way!r} is not one of {KILL_WAYS}")
        if way == "sentinel":
            self.engines[rank].die("killed by the test")
            await wait_until(lambda: rank not in self.client.live_engines, 5)
        # A real engine exits after the sentinel; the mock would stay connected.
        self.scopes[rank].cancel()
        await wait_until(lambda: rank not in self.client.live_engines, 5)

    async def restart(self, rank: int, **overrides: Any) -> MockEngine:
        """Start a new engine of ``rank`` and wait until the client has it up again."""
        engine = await self.start(rank, **overrides)
        await wait_until(lambda: rank in self.client.live_engines, 5)
        return engine


def _faults_by_rank(engines: int, faults: MockFaults | Sequence[MockFaults] | None
                    ) -> list[MockFaults]:
    if faults is None:
        return [MockFaults()] * engines
    if isinstance(faults, MockFaults):
        return [faults] * engines
    if len(faults) != engines:
        raise ValueError(f"faults: {len(faults)} given for {engines} engines")
    return list(faults)


@asynccontextmanager
async def mock_cluster(engines: int = 1, *,
                       faults: MockFaults | Sequence[MockFaults] | None = None,
                       mock: Mapping[str, Any] | None = None,
                       overrides: Mapping[int, Mapping[str, Any]] | None = None,
                       bootstrapped: bool = False, waves: WaveGroup | None = None,
                       host: str = "127.0.0.1",
                       **client_config: Any) -> AsyncIterator[MockCluster]:
    """``engines`` mock engines and an :class:`EngineCoreClient` over them.

    ``faults``: every engine's, or one per rank; ``mock``: MockEngineConfig settings of every
    engine (``linger`` 0.5 unless given); ``overrides``: by rank, more settings of that
    engine only (the first start; a restart takes its own). ``bootstrapped``: the engines
    bind the input and output sockets the client was given, no handshake. ``waves``: every
    engine is one of this wave group (``data_parallel_waves=True`` for the client). The rest:
    EngineCoreClientConfig settings (``ready_timeout`` 10 s unless given; ``health=``,
    ``routing=`` take its sub-configs; the transport is the cluster's). ``host``: the
    address every socket binds (another loopback address keeps out the peers of other
    tests that still reconnect to a port this cluster happens to get).

    The engines start before the client connects; the client is closed before they stop
    (as a front end shutting down).
    """
    transport: BootstrappedTransport | HandshakeTransport
    if bootstrapped:
        inp, out = free_tcp_address(host), free_tcp_address(host)
        side: dict[str, Any] = {"input_address": inp, "output_addresses": (out,)}
        transport = BootstrappedTransport(input_address=inp, output_address=out)
    else:
        address = free_tcp_address(host)
        side = {"handshake_address": address}
        transport = HandshakeTransport(address, advertised_host=host)
    by_rank = _faults_by_rank(engines, faults)
    config = EngineCoreClientConfig(engine_count=engines, transport=transport,
                                    **{"ready_timeout": 10.0, **client_config})
    async with anyio.create_task_group() as tg:
        cluster = MockCluster(None, {"linger": 0.5, **(mock or {}), **side},  # type: ignore[arg-type]
                              tg, waves=waves)
        for rank in range(engines):
            own = {"faults": by_rank[rank], **(overrides or {}).get(rank, {})}
            await cluster.start(rank, **own)
        async with EngineCoreClient.connect(config) as client:
            cluster.client = client
            client.add_health_listener(lambda rank, up: cluster.health.append((rank, up)))
            yield cluster
        tg.cancel_scope.cancel()


@asynccontextmanager
async def generate_client(engines: int = 1, *,
                          faults: MockFaults | Sequence[MockFaults] | None = None,
                          mock: Mapping[str, Any] | None = None,
                          overrides: Mapping[int, Mapping[str, Any]] | None = None,
                          bootstrapped: bool = False, model_name: str = "faults",
                          randomize_request_ids: bool = True,
                          client_vocab_size: int | None = None,
                          generate: Mapping[str, Any] | None = None,
                          **client_config: Any) -> AsyncIterator[tuple[Client, MockCluster]]:
    """A generate-layer :class:`Client` (private metrics registry, unregistered at the end)
    over :func:`mock_cluster`'s engines; the cluster's :attr:`MockCluster.front` is it.

    ``client_vocab_size``, ``model_name``, ``randomize_request_ids`` and ``generate`` (more
    settings) go to :class:`ClientConfig`; the rest as for :func:`mock_cluster` (the
    engine-core client's ``vocab_size`` too)."""
    async with mock_cluster(engines, faults=faults, mock=mock, overrides=overrides,
                            bootstrapped=bootstrapped, **client_config) as cluster:
        config = ClientConfig(engine=cluster.client.config, model_name=model_name,
                              randomize_request_ids=randomize_request_ids,
                              vocab_size=client_vocab_size, **(generate or {}))
        client = cluster._front = Client(cluster.client, config)
        try:
            yield client, cluster
        finally:
            client.metrics.unregister()
