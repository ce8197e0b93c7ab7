"""``anyio-genout serve`` in front of two engine processes, one of them killed with SIGKILL:
the server keeps serving from the other and stays healthy; with none left it says so."""

from __future__ import annotations

import anyio
import httpx
import pytest

from anyio_genout.text import bundled_model_dir
from tests.cli.support import cli_process, free_port, running
from tests.support import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the server is a child process; the test's own loop does not matter


async def test_one_engine_killed_the_server_serves_on_and_reports_health() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}
    async with cli_process("mock-engine", "--handshake-address", address, "--rank", "0",
                           "--step-time", "0.002", "--vocab-size", "1024") as (first, first_out), \
            cli_process("mock-engine", "--handshake-address", address, "--rank", "1",
                        "--step-time", "0.002", "--vocab-size", "1024") as (second, _second_out), \
            cli_process("serve", "--port", str(port), "--handshake-address", address,
                        "--engine-count", "2", "--model", str(bundled_model_dir()),
                        "--served-model-name", "m"
                        ) as (server, out), \
            httpx.AsyncClient(timeout=10) as http:

        async def status() -> int:
            try:
                return (await http.get(f"{base}/health")).status_code
            except httpx.TransportError:
                return 0

        async def until_status(want: int, seconds: float) -> None:
            with anyio.fail_after(seconds):
                while await status() != want:
                    assert running(server, out)
                    await anyio.sleep(0.05)

        await until_status(200, 30)
        second.kill()
        await wait_until(lambda: "engine 1 is down" in out.err, seconds=10)  # and says so
        for _ in range(4):  # every request now goes to engine 0
            answered = await http.post(f"{base}/v1/completions", json=body)
            assert answered.status_code == 200, answered.text
        assert await status() == 200
        assert running(first, first_out)
        first.kill()

        await until_status(503, 10)
        refused = await http.post(f"{base}/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"]
