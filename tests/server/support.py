"""Helpers for the server tests: ``create_app`` over a text client and a corpus-mode mock
engine (real ZeroMQ), served by Hypercorn on a real port in the test's event loop."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from hypercorn.config import Config

from anyio_genout.server import create_app
from anyio_genout.transport import free_tcp_port
from tests.support import wait_until
from tests.text.client_support import TextSetup, text_client

__all__ = ["MODEL", "Served", "open_sse", "served", "serving", "wait_for_health", "wait_until"]

MODEL = "test-model"


class Served:
    def __init__(self, setup: TextSetup, base_url: str) -> None:
        self.setup = setup
        self.base_url = base_url

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


#: For tests that stream with the official ``openai`` client: its AsyncStream leaves its (and
#: httpx's) async generators to the garbage collector after [DONE], and trio's finalizer
#: warns about that. Not this package's code.
OPENAI_STREAM_GC = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <async_generator object (AsyncStream\._iter_events|"
    r"SSEDecoder\.aiter_bytes|Response\.aiter_bytes|PoolByteStream\.__aiter__)"
    r":pytest.PytestUnraisableExceptionWarning")


async def _serve(app: Any, config: Config, shutdown: anyio.Event) -> None:
    try:
        import trio
        from hypercorn.trio import serve as trio_serve

        trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown.wait)
        return
    await trio_serve(app, config, shutdown_trigger=shutdown.wait)


def wait_for_health(base: str, child: subprocess.Popen[str]) -> None:
    """Block until the ``serve`` process ``child`` answers ``/health`` at ``base`` (20 s at
    most); fail at once, with its output, if it exits first."""
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)


async def open_sse(base_url: str, body: dict[str, Any], events: int = 3, *,
                   path: str = "/v1/completions") -> anyio.abc.SocketStream:
    """A raw TCP connection (no HTTP client library) that POSTed ``body`` to ``path`` and
    received at least ``events`` SSE events (5 s at most); closing it is a real disconnect."""
    data = json.dumps(body).encode()
    port = int(base_url.rsplit(":", 1)[1])
    conn = await anyio.connect_tcp("127.0.0.1", port)
    try:
        await conn.send(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: "
                        + str(len(data)).encode() + b"\r\n\r\n" + data)
        seen = b""
        with anyio.fail_after(5):
            while seen.count(b"data: ") < events:
                seen += await conn.receive()
    except BaseException:
        await anyio.aclose_forcefully(conn)
        raise
    return conn


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` served by Hypercorn on 127.0.0.1:<free port> in this event loop; yields its
    base URL once ``/health`` answers 200, and shuts Hypercorn down on exit."""
    port = free_tcp_port("127.0.0.1")
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    shutdown = anyio.Event()
    base = f"http://127.0.0.1:{port}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve, app, config, shutdown)
        async with httpx.AsyncClient() as http:
            async def ready() -> bool:
                try:
                    return (await http.get(f"{base}/health")).status_code == 200
                except httpx.TransportError:
                    return False

            with anyio.fail_after(10):
                while not await ready():  # noqa: ASYNC110 - polling a server
                    await anyio.sleep(0.01)
        try:
            yield base
        finally:
            shutdown.set()


@asynccontextmanager
async def served(*, api_key: str | None = None, app_options: dict[str, Any] | None = None,
                 **mock: Any) -> AsyncIterator[Served]:
    """The server on 127.0.0.1:<free port>, ready (``/health`` answered) when yielded;
    ``app_options`` go to ``create_app`` (its limits)."""
    async with text_client(**mock) as setup:
        app = create_app(setup.text, model_name=MODEL, api_key=api_key, **(app_options or {}))
        async with serving(app) as base:
            yield Served(setup, base)


