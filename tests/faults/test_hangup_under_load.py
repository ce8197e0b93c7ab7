"""Hang-ups in front of a fast engine process: ``serve --workers 2`` as a user runs it.

The mock-engine scenario of ``tests/interop/test_server_workers_real.py``'s dropped-stream
test, in the main suite: an engine process stepping every millisecond (as the tiny real
model does), the supervisor and its two worker processes in front of it, and a raw-socket
SSE client that hangs up after a few events, again and again. The engine runs ONE request
at a time (``--max-num-seqs 1``) and each would take it 30 s, so every stream's events
flowing (within 5 s) proves the ABORT of the one dropped before it reached the engine; the
workers' metrics count one abort per hang-up and nothing else, and a short request is then
answered at once. A change in how a consumer the reader keeps waking takes its
cancellation once broke exactly this (3ad82a2, reverted in 75b8bea).
"""

from __future__ import annotations

import re

import anyio
import httpx
import psutil
import pytest

from anyio_genout.text import bundled_model_dir
from tests.cli.support import cli_process, free_port, running
from tests.server.support import open_sse

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SERVING = re.compile(r"serving 'm' on (http://\S+) with 2 workers")
#: Hang-ups in a row (each worker gets some: connections land on either at random).
HANGUPS = 8
#: A dropped stream's length: 30 s of engine steps, far past the test.
TOKENS = 30_000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the server is a child process; the test's own loop does not matter


def _owner(workers: list[int], port: int, client_port: int) -> int | None:
    """The worker holding the server side of the connection from ``client_port``."""
    for pid in workers:
        for conn in psutil.Process(pid).net_connections("tcp"):
            if (conn.laddr and conn.laddr.port == port and conn.raddr
                    and conn.raddr.port == client_port):
                return pid
    return None


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
async def test_hang_ups_mid_stream_each_abort_once_and_the_next_stream_flows(
        backend: str) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address, "--step-time",
                           "0.001", "--max-num-seqs", "1", "--vocab-size", "1024",
                           "--max-model-len", str(TOKENS + 100),
                           "--backend", backend) as (engine, engine_out), \
            cli_process("serve", "--workers", "2", "--port", "0", "--backend", backend,
                        "--handshake-address", address, "--model", str(bundled_model_dir()),
                        "--served-model-name", "m") as (server, out):
        with anyio.fail_after(60):
            while not (found := SERVING.search(out.err)):
                assert running(server, out) and running(engine, engine_out)
                await anyio.sleep(0.05)
        base = found.group(1)
        port = int(base.rsplit(":", 1)[1])
        workers = sorted(child.pid for child in psutil.Process(server.pid).children())
        assert len(workers) == 2, workers
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": TOKENS,
                "ignore_eos": True, "stream": True}
        dropped = dict.fromkeys(workers, 0)
        for n in range(HANGUPS):
            try:
                conn = await open_sse(base, body, events=3)
            except TimeoutError:
                raise AssertionError(f"hang-up {n}: no 3 events within 5 s (the engine "
                                     f"still runs a dropped stream?); the server said:\n"
                                     f"{out.err[-3000:]}") from None
            owner = _owner(workers, port, conn.extra(anyio.abc.SocketAttribute.local_port))
            await conn.aclose()
            assert owner is not None
            dropped[owner] += 1

        async with httpx.AsyncClient(timeout=10) as http:
            # Each worker counts one abort per stream it lost, and nothing else.
            expected = {pid: {"abort": float(count), "stop": 0.0, "length": 0.0, "error": 0.0}
                        for pid, count in dropped.items()}
            seen: dict[int, dict[str, float]] = {}
            with anyio.move_on_after(20):
                while seen != expected:
                    async with httpx.AsyncClient(timeout=10) as one:  # a new connection
                        response = await one.get(f"{base}/metrics")
                        owner = _owner(workers, port, response.extensions[
                            "network_stream"].get_extra_info("client_addr")[1])
                    if owner is not None:
                        seen[owner] = {
                            reason: _sample(response.text, "vllm:request_success_total",
                                            finished_reason=reason)
                            for reason in ("abort", "stop", "length", "error")}
                    await anyio.sleep(0.02)
            assert seen == expected, out.err[-3000:]
            # The engine is free: a short request is answered at once. (ignore_eos: the
            # mock samples ids at random, and id 2, the model's EOS, ends a request at
            # 1/1024 a token: completion_tokens 2 once in a clean-clone run.)
            with anyio.fail_after(5):
                answered = await http.post(f"{base}/v1/completions", json={
                    "model": "m", "prompt": "Once upon a time", "max_tokens": 4,
                    "ignore_eos": True})
            assert answered.status_code == 200, answered.text
            assert answered.json()["usage"]["completion_tokens"] == 4
        assert running(engine, engine_out) and running(server, out)
