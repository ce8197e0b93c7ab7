"""Shared helpers for the fault suite: requests, raw peers, and checks (the mock cluster
itself is ``tests/cluster.py``'s).

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

from anyio_genout import Client, EngineCoreRequest, GenerateRequest, SamplingParams
from anyio_genout.transport import ZmqSocket, new_context

__all__ = ["RawPeer", "drain", "engine_request", "generate_request", "raw_pusher",
           "success_total"]


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
