"""anyio_genout.testing: playing the engine in the client's own event loop.

The hooks a benchmark or test uses instead of a real engine, kept off EngineCoreClient:
what the client sends goes to a function, and output messages handed to it reach streams
exactly as if its reader had received them.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import zmq

from anyio_genout import (
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
    ProtocolError,
    SamplingParams,
)
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    decode_request,
    encode_outputs,
    engine_identity,
)
from anyio_genout.protocol.request_decode import AddRequest
from anyio_genout.testing import capture_input, deliver_output, input_junk, input_queued
from anyio_genout.transport import free_tcp_address

pytestmark = pytest.mark.anyio


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=(11, 22),
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=3),
                             arrival_time=42.5)


def _frames(*outputs: EngineCoreOutput) -> list[Any]:
    return [zmq.Frame(bytes(part)) for part in
            encode_outputs(EngineCoreOutputs(0, list(outputs), timestamp=7.0))]


async def test_an_engine_played_in_process_gets_the_add_and_its_outputs_reach_the_stream(
        ) -> None:
    address = free_tcp_address()
    engine = MockEngine(MockEngineConfig(handshake_address=address, step_time=0.01, linger=0.0))
    async with anyio.create_task_group() as tg:
        config = EngineCoreClientConfig(transport=HandshakeTransport(address))
        tg.start_soon(engine.serve)
        async with EngineCoreClient.connect(config) as client:
            sent: list[list[Any]] = []
            capture_input(client, sent.append)
            async with client.call(_request("r")) as stream:
                assert input_queued(client) == 0  # handed to the sink, not queued
                [(identity, *frames)] = sent
                assert identity == engine_identity(0)
                add = decode_request([bytes(f) for f in frames])
                assert isinstance(add, AddRequest) and add.request.request_id == "r"
                deliver_output(client, _frames(EngineCoreOutput("r", [5, 6])))
                deliver_output(client, _frames(EngineCoreOutput(
                    "r", [7], finish_reason=EngineCoreFinishReason.LENGTH)))
                received = [out async for out in stream]
            assert [o.output.new_token_ids for o in received] == [[5, 6], [7]]
            assert [o.timestamp for o in received] == [7.0, 7.0]
            assert client.in_flight == 0 and client.is_healthy
            assert input_junk(client) == 0
        assert engine.added_ids == []  # the real engine never saw the request
        tg.cancel_scope.cancel()


async def test_an_undecodable_output_delivered_makes_the_client_unhealthy() -> None:
    address = free_tcp_address()
    engine = MockEngine(MockEngineConfig(handshake_address=address, step_time=0.01, linger=0.0))
    async with anyio.create_task_group() as tg:
        config = EngineCoreClientConfig(transport=HandshakeTransport(address))
        tg.start_soon(engine.serve)
        async with EngineCoreClient.connect(config) as client:
            deliver_output(client, [zmq.Frame(b"\xc1 not msgpack")])
            assert isinstance(client.health_error, ProtocolError)
            with pytest.raises(ProtocolError):
                client.open_stream(_request("r"))
        tg.cancel_scope.cancel()
