"""Several front ends on the same engine, as ``serve --workers`` (and vLLM's
``--api-server-count``) run them: one handshake owner hands the engine every front end's
input/output pair; each front end adopts listening sockets bound for it and is answered on
its own output socket (its ``client_index``)."""

from __future__ import annotations

import socket

import anyio
import pytest

from anyio_genout import (
    BootstrappedTransport,
    EngineCoreClientConfig,
    HandshakeTimeoutError,
    HandshakeTransport,
)
from anyio_genout.engine.handshake import serve_handshake
from anyio_genout.generate import Client, ClientConfig, GenerateRequest
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.protocol import SamplingParams
from anyio_genout.transport import free_tcp_address

pytestmark = pytest.mark.anyio


def _listener() -> tuple[str, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    return f"tcp://127.0.0.1:{sock.getsockname()[1]}", sock.detach()


def _adopted_listeners() -> BootstrappedTransport:
    (inp, inp_fd), (out, out_fd) = _listener(), _listener()
    return BootstrappedTransport(input_address=inp, output_address=out,
                                 input_listener_fd=inp_fd, output_listener_fd=out_fd)


async def test_two_front_ends_are_each_answered_on_their_own_sockets() -> None:
    handshake = free_tcp_address()
    transports = [_adopted_listeners(), _adopted_listeners()]
    front = [EngineCoreClientConfig(transport=t, client_index=i, ready_timeout=10)
             for i, t in enumerate(transports)]
    engine = MockEngine(MockEngineConfig(handshake_address=handshake, step_time=0.001,
                                         linger=0.0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_handshake,
                      EngineCoreClientConfig(transport=HandshakeTransport(handshake),
                                             ready_timeout=10),
                      [t.input_address for t in transports],
                      [t.output_address for t in transports])
        tg.start_soon(engine.serve)
        with anyio.fail_after(20):
            async with (Client.connect(ClientConfig(engine=front[0], registry=None)) as a,
                        Client.connect(ClientConfig(engine=front[1], registry=None)) as b):
                results: dict[str, int] = {}

                async def run(client: Client, rid: str, tokens: int) -> None:
                    request = GenerateRequest(
                        request_id=rid, prompt_token_ids=[11, 22],
                        sampling_params=SamplingParams(max_tokens=tokens, ignore_eos=True))
                    async with client.generate(request) as stream:
                        results[rid] = len((await stream.collect_output()).token_ids)

                async with anyio.create_task_group() as inner:
                    for n in range(3):
                        inner.start_soon(run, a, f"a{n}", 5 + n)
                        inner.start_soon(run, b, f"b{n}", 9 + n)
                # Utility calls are answered to the caller too.
                assert await a.engine.call_utility("is_sleeping") == [False]
                assert await b.engine.call_utility("is_sleeping") == [False]
                assert a.engine.in_flight == b.engine.in_flight == 0
        tg.cancel_scope.cancel()
    assert results == {"a0": 5, "a1": 6, "a2": 7, "b0": 9, "b1": 10, "b2": 11}
    assert not engine.errors  # every request named a client the engine knew


async def test_the_handshake_owner_says_which_engines_never_dialled_in() -> None:
    config = EngineCoreClientConfig(transport=HandshakeTransport(free_tcp_address()),
                                    engine_count=2, ready_timeout=0.3)
    with pytest.raises(HandshakeTimeoutError, match=r"waiting for HELLO from engine\(s\) 0, 1"):
        await serve_handshake(config, ["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:2"])


def test_a_listener_fd_needs_the_tcp_address_it_is_bound_at() -> None:
    with pytest.raises(ValueError, match="input_listener_fd needs the tcp:// input_address"):
        BootstrappedTransport(input_address="ipc:///tmp/x", output_address="ipc:///tmp/y",
                              input_listener_fd=5)
    with pytest.raises(ValueError, match="output_listener_fd needs the tcp:// output_address"):
        BootstrappedTransport(input_address="tcp://127.0.0.1:5555",
                              output_address="ipc:///tmp/y", output_listener_fd=5)
