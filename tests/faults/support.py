"""Shared helpers for the fault suite: mock engines in-process, raw peers, and checks.

Every helper binds on 127.0.0.1 with ephemeral ports; nothing leaves the machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineCoreRequest,
    GenerateRequest,
    SamplingParams,
)
from anyio_genout.mock import MockEngine, MockEngineConfig, MockFaults
from anyio_genout.transport import ZmqSocket, new_context
from tests.engine.fake import free_port


def engine_request(rid: str, *, max_tokens: int = 8, prompt: Sequence[int] = (11, 22),
                   **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=tuple(prompt),
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens),
                             arrival_time=42.5, **kw)


def generate_request(rid: str, *, max_tokens: int = 8, prompt: Sequence[int] = (11, 22),
                     **params: Any) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt),
                           sampling_params=SamplingParams(temperature=0.0,
                                                          max_tokens=max_tokens, **params))


class MockCluster:
    """Mock engines (in this event loop) dialing a client's handshake socket."""

    def __init__(self, engines: Sequence[MockEngine], client: EngineCoreClient) -> None:
        self.engines = list(engines)
        self.client = client
        self.stopped: list[anyio.CancelScope] = []

    @property
    def engine(self) -> MockEngine:
        return self.engines[0]


@asynccontextmanager
async def mock_cluster(engines: int = 1, *,
                       faults: MockFaults | Sequence[MockFaults] | None = None,
                       mock: dict[str, Any] | None = None, ready_timeout: float = 10.0,
                       **client_config: Any) -> AsyncIterator[MockCluster]:
    """``engines`` mock engines with ``faults`` and an :class:`EngineCoreClient` over them.

    The client is closed before the engines are stopped (as a front end shutting down).
    """
    address = f"tcp://127.0.0.1:{free_port()}"
    if faults is None:
        faults = MockFaults()
    by_rank = [faults] * engines if isinstance(faults, MockFaults) else list(faults)
    mocks = [
        MockEngine(MockEngineConfig(handshake_address=address, rank=rank,
                                    faults=by_rank[rank], linger=0.5, **(mock or {})))
        for rank in range(engines)
    ]
    config = EngineCoreClientConfig(handshake_address=address, engine_count=engines,
                                    ready_timeout=ready_timeout, **client_config)
    async with anyio.create_task_group() as tg:
        for engine in mocks:
            tg.start_soon(_serve, engine)
        async with EngineCoreClient.connect(config) as client:
            yield MockCluster(mocks, client)
        tg.cancel_scope.cancel()


async def _serve(engine: MockEngine) -> None:
    await engine.serve()


@asynccontextmanager
async def generate_client(engines: int = 1, *, faults: MockFaults | None = None,
                          mock: dict[str, Any] | None = None,
                          randomize_request_ids: bool = True,
                          client_vocab_size: int | None = None,
                          **client_config: Any) -> AsyncIterator[tuple[Client, MockCluster]]:
    """A generate-layer :class:`Client` (private metrics registry) over mock engines.

    ``client_vocab_size`` goes to :class:`ClientConfig`; other keywords to the engine-core
    client's config (``vocab_size`` there, too)."""
    async with mock_cluster(engines, faults=faults, mock=mock, **client_config) as cluster:
        config = ClientConfig(engine=cluster.client.config, model_name="faults",
                              randomize_request_ids=randomize_request_ids,
                              vocab_size=client_vocab_size)
        client = Client(cluster.client, config)
        try:
            yield client, cluster
        finally:
            client.metrics.unregister()


def success_total(client: Client) -> dict[str, float]:
    """``vllm:request_success_total`` summed over engines, by ``finished_reason``."""
    text = generate_latest(client.metrics.registry).decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total" and sample.value:
                reason = sample.labels["finished_reason"]
                counts[reason] = counts.get(reason, 0.0) + sample.value
    return counts


class RawPeer:
    """A raw ZeroMQ socket of any kind: a third party on the client's sockets."""

    def __init__(self, kind: int, *, identity: bytes | None = None,
                 max_message_size: int | None = None) -> None:
        self._ctx = new_context()
        self.socket = ZmqSocket(self._ctx, kind, identity=identity,
                                max_message_size=max_message_size)

    def connect(self, address: str) -> RawPeer:
        self.socket.connect(address)
        return self

    async def send(self, frames: Sequence[bytes]) -> None:
        with anyio.fail_after(5):
            await self.socket.send(list(frames))

    def close(self) -> None:
        self.socket.close()
        self._ctx.term()


@asynccontextmanager
async def raw_pusher(address: str) -> AsyncIterator[RawPeer]:
    peer = RawPeer(zmq.PUSH).connect(address)
    try:
        yield peer
    finally:
        peer.close()


async def drain(stream: Any) -> tuple[list[Any], BaseException | None]:
    """Every item of ``stream`` and the one error that ended it (or None); then checks the
    stream is over (StopAsyncIteration)."""
    items: list[Any] = []
    error: BaseException | None = None
    try:
        async for item in stream:
            items.append(item)
    except Exception as exc:
        error = exc
    try:
        await stream.__anext__()
    except StopAsyncIteration:
        pass
    else:  # pragma: no cover - the check this helper exists for
        raise AssertionError("the stream yielded after its end")
    return items, error
