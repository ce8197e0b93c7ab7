"""``anyio-genout mock-engine``: a mock engine process that a Client serves; a signal stops it."""

from __future__ import annotations

import signal

import anyio
import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
    collect_output,
)
from anyio_genout.mock import greedy_tokens

from .support import cli_process, free_port

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_mock_engine_command_serves_a_client_until_a_signal(
        signum: signal.Signals) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                        ready_timeout=20))
    async with cli_process("mock-engine", "--handshake-address", address, "--rank", "0",
                           "--step-time", "0.001") as (process, output):
        with anyio.fail_after(20):
            async with Client.connect(config) as client:
                for n in (1, 8):
                    request = GenerateRequest(
                        request_id=f"r{n}", prompt_token_ids=[1, 2, 3],
                        sampling_params=SamplingParams(max_tokens=n, temperature=0.0))
                    async with client.generate(request) as stream:
                        result = await collect_output(stream)
                    assert result.token_ids == greedy_tokens([1, 2, 3], n)
                    assert result.finish_reason is not None
        assert process.returncode is None  # the engine outlives its client
        process.send_signal(signum)
        with anyio.fail_after(10):
            code = await process.wait()
    assert code == 0, output.err
    assert "Traceback" not in output.err
