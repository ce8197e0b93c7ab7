"""Helpers for the server tests: ``create_app`` over a text client and a corpus-mode mock
engine (real ZeroMQ), served by Hypercorn (asyncio) or the builtin server (trio) on a real
port in the test's event loop (:func:`served`, :func:`serving`); and ``anyio-genout serve``
as a child process (:func:`serve_process`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

import anyio
import attrs
import httpx
import pytest
from hypercorn.config import Config

from anyio_genout.cli.http_server import MAX_HEAD_BYTES
from anyio_genout.server import create_app
from anyio_genout.server.http1 import Http1Server
from anyio_genout.transport import free_tcp_port
from tests.cli.support import CLI, free_port
from tests.support import wait_until
from tests.text.client_support import TextSetup, text_client

__all__ = ["MODEL", "ServeProcess", "Served", "open_sse", "serve_process", "served", "serving",
           "wait_for_health", "wait_until"]

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
    """Serve as ``serve`` does by default on this backend's side of the test matrix: the
    builtin server on trio (its default there), Hypercorn on asyncio."""
    try:
        import trio

        trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown.wait)
        return
    host, port = config.bind[0].rsplit(":", 1)
    server = Http1Server(socket.create_server((host, int(port))), keep_alive_timeout=5.0,
                         read_timeout=None, max_head_bytes=MAX_HEAD_BYTES)
    server.graceful_timeout = config.graceful_timeout
    await server.serve(app, shutdown)


#: Seconds a ``serve`` child may take to come up (its embedded engine included).
STARTUP: Final = 30.0


@attrs.define(eq=False)
class ServeProcess:
    """``anyio-genout serve`` running as a child of the test (:func:`serve_process`)."""

    child: subprocess.Popen[str]
    #: ``http://127.0.0.1:<port>`` (empty for a server on a unix socket alone).
    base: str
    #: Its stderr, line by line, as read so far (all of it once :func:`serve_process` ended).
    lines: list[str] = attrs.field(factory=list)

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    @property
    def err(self) -> str:
        """Its stderr so far (all of it once :func:`serve_process` ended)."""
        return "".join(self.lines)

    def alive(self) -> None:
        """Fail, with what it wrote, if it has exited."""
        assert self.child.poll() is None, self.err

    def wait_ready(self, client: httpx.Client | None = None) -> None:
        """Block until ``/health`` answers 200 (at :attr:`base`, or through ``client``: TLS,
        a unix socket), ``STARTUP`` seconds at most; fail at once if it exits first."""
        deadline = time.monotonic() + STARTUP
        while True:
            try:
                answer = (client.get("/health") if client is not None
                          else httpx.get(f"{self.base}/health"))
                if answer.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            self.alive()
            assert time.monotonic() < deadline, f"the server did not come up: {self.err}"
            time.sleep(0.05)

    def workers(self) -> list[int]:
        """The supervisor's child processes (``--workers``; trio starts them from a thread)."""
        pids = []
        for task in os.listdir(f"/proc/{self.child.pid}/task"):
            with open(f"/proc/{self.child.pid}/task/{task}/children") as f:
                pids.extend(int(pid) for pid in f.read().split())
        return sorted(pids)


def _read_stderr(child: subprocess.Popen[str], lines: list[str]) -> None:
    assert child.stderr is not None
    for line in child.stderr:
        lines.append(line)


@contextmanager
def serve_process(*args: str, port: int | None = None, ready: bool = True,
                  env: Mapping[str, str] | None = None, stop: str = "sigint",
                  exit_code: int | None = None,
                  announce: str = r"serving '.*' on (http://\S+)") -> Iterator[ServeProcess]:
    """``anyio-genout serve ARGS --port PORT`` as a child (stdin and stdout closed, stderr
    read into :attr:`ServeProcess.lines` as it comes).

    ``port``: None picks a free one; 0 lets the server pick and reads the one it says it
    serves on; with ``--uds`` in ``args`` no port is added unless given. ``ready``: wait
    for ``/health`` before yielding. ``env``: more environment variables. At the end,
    ``stop="sigint"`` interrupts it and waits (20 s), ``"kill"`` kills it; either way only
    if it still runs. ``exit_code``: what its exit status must then be (when the block
    raised nothing)."""
    if stop not in ("sigint", "kill"):
        raise ValueError(f"stop: {stop!r} is neither 'sigint' nor 'kill'")
    own: tuple[str, ...] = ()
    if "--port" in args:  # the line names it
        port = int(args[args.index("--port") + 1])
    elif port is not None or "--uds" not in args:
        port = free_port("127.0.0.1") if port is None else port
        own = ("--port", str(port))
    line = [*CLI, "serve", *args, *own]
    child = subprocess.Popen(line, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL,
                             env=None if env is None else {**os.environ, **env})
    server = ServeProcess(child, f"http://127.0.0.1:{port}" if port else "")
    reader = threading.Thread(target=_read_stderr, args=(child, server.lines), daemon=True)
    reader.start()
    try:
        if port == 0:
            server.base = _announced(server, announce)
        if ready and server.base:
            server.wait_ready()
        yield server
    finally:
        if child.poll() is None:
            if stop == "sigint":
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(20)
                except subprocess.TimeoutExpired:
                    child.kill()
            else:
                child.kill()
        child.wait(10)
        reader.join(10)  # it reads to the end of the output
        assert child.stderr is not None
        child.stderr.close()
    if exit_code is not None:
        assert child.returncode == exit_code, server.err


def _announced(server: ServeProcess, announce: str) -> str:
    """The URL a ``serve --port 0`` says it serves on (``STARTUP`` seconds at most)."""
    deadline = time.monotonic() + STARTUP
    while True:
        for line in list(server.lines):
            found = re.search(announce, line)
            if found:
                return found.group(1)
        server.alive()
        assert time.monotonic() < deadline, f"the server did not say its port: {server.err}"
        time.sleep(0.02)


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
    """``app`` served on 127.0.0.1:<free port> in this event loop (Hypercorn on asyncio, the
    builtin server on trio); yields its base URL once ``/health`` answers 200, and shuts
    the server down on exit."""
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

