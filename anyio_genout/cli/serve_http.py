"""One server process: the HTTP server (uvicorn or Hypercorn) on a listening socket, the
app over a client of the engines (``anyio-genout serve``, and each worker of
``serve --workers``)."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import stat
import sys
from collections.abc import Callable

import anyio
import anyio.abc

from ..errors import UsageError
from ..generate import Client
from ..text.client import TextClient
from ..text.tokenizer import Tokenizer
from .engines import ClientSession, WorkerSockets
from .http_server import LISTEN_BACKLOG, choose_http_server, http_server
from .serve_lifecycle import Lifecycle, rejoin_timeout, watch_engines

__all__ = ["freeze_startup_heap", "http_url", "listen", "listen_unix", "serve",
           "served_model_name"]


def freeze_startup_heap() -> None:
    """Collect, then move every live object to the garbage collector's permanent
    generation (``gc.freeze``), as vLLM's server does once it has started: the modules, the
    tokenizer, the app and its templates are never traversed again, so a full collection
    while serving walks only what requests made since. A full collection of a large start-up
    heap holds the GIL, and so the event loop and every stream, for tenths of a second."""
    gc.collect()
    gc.freeze()


def served_model_name(args: argparse.Namespace) -> str:
    name: str = (args.served_model_name or args.model or args.vllm_model or args.model_name
                 or "anyio-genout")
    return name


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The HTTP listening socket (bound here, so ``--port 0`` can say which port it got);
    with ``reuse_port``, one of several on the same port (``SO_REUSEPORT``: the kernel
    spreads new connections over them). Raises :class:`UsageError` if it cannot be
    bound."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                    else socket.AF_INET, backlog=LISTEN_BACKLOG,
                                    reuse_port=reuse_port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def listen_unix(path: str) -> socket.socket:
    """The listening Unix domain socket of ``--uds`` (a stale socket file there is
    replaced). Raises :class:`UsageError` if it cannot be bound."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
        sock.bind(path)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def http_url(sock: socket.socket, *, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve(args: argparse.Namespace, tokenizer: Tokenizer, http_fd: int, *,
                worker: WorkerSockets | None = None, announce: str | None = None,
                on_ready: Callable[[], None] | None = None,
                stop: anyio.Event | None = None) -> int:
    """Serve the API on the listening socket ``http_fd`` (the HTTP server closes it) until a
    signal or until ``stop`` is set; returns the exit status: 0 after SIGTERM (a drain of
    up to ``--shutdown-timeout`` seconds) or ``stop`` (the open requests aborted), 130
    after SIGINT (aborted at once).

    ``worker``: connect as that worker of a supervisor (no engines are started here).
    ``announce``: print where it serves once the engines are ready; ``on_ready`` is called
    then too. A signal before that stops the start-up (130).

    Raises the engines' start-up errors, and the :class:`~anyio_genout.ClientUnhealthyError`
    that ends it when the engine client fails as a whole or no engine came back within
    ``--engine-rejoin-timeout`` seconds (an :class:`~anyio_genout.EngineDeadError` naming
    the engines down): the command then exits 1.
    """
    from ..server import create_app
    from ..server.generation_defaults import generation_defaults

    server = http_server(choose_http_server(args), args, http_fd)
    lifecycle = Lifecycle(server, args.shutdown_timeout)
    serving = False

    async def on_signal(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if serving:
                    lifecycle.on_signal(signum)  # a second one aborts the drain
                else:
                    lifecycle.signal = signum
                    tg.cancel_scope.cancel()  # still starting: stop waiting for engines
                    return

    async def on_stop() -> None:
        await external.wait()
        lifecycle.begin(0.0)

    async def on_engines(client: Client) -> None:
        lifecycle.fail(await watch_engines(client.engine, rejoin_timeout(args)))

    external = stop or anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(on_signal)
        async with ClientSession(args, tokenizer=tokenizer, worker=worker,
                                 quiet=worker is not None, last_engine_death="wait") as client:
            try:
                text_client = TextClient(client, tokenizer)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            app = create_app(text_client, model_name=served_model_name(args),
                             api_key=args.api_key, api_key_scope=args.api_key_scope,
                             max_n=args.max_n,
                             max_body_size=args.max_body_size,
                             max_concurrent_requests=args.max_concurrent_requests,
                             body_timeout=args.body_timeout,
                             trust_request_chat_template=args.trust_request_chat_template,
                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                             tool_call_parser=args.tool_call_parser,
                             reasoning_parser=args.reasoning_parser,
                             fingerprint_mode=args.fingerprint_mode,
                             fingerprint_value=args.fingerprint_value,
                             stream_interval=args.stream_interval,
                             sampling_defaults=generation_defaults(
                                 args.generation_config, tokenizer.model_dir,
                                 args.override_generation_config))
            app.state.lifecycle = lifecycle  # /health answers 503 while draining
            if args.allowed_origins:  # outermost: a preflight needs no key (as vLLM)
                from starlette.middleware.cors import CORSMiddleware

                app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                                   allow_methods=args.allowed_methods,
                                   allow_headers=args.allowed_headers,
                                   allow_credentials=args.allow_credentials)
            freeze_startup_heap()  # the start-up heap is static from here on
            if announce is not None:
                print(f"serving {served_model_name(args)!r} on {announce}", file=sys.stderr,
                      flush=True)
            if on_ready is not None:
                on_ready()
            serving = True
            async with anyio.create_task_group() as serving_tasks:
                serving_tasks.start_soon(on_stop)
                serving_tasks.start_soon(on_engines, client)
                serving_tasks.start_soon(lifecycle.drain, client)
                await server.serve(app, lifecycle.stop)
                serving_tasks.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    if lifecycle.failure is not None:
        raise lifecycle.failure
    return 130 if lifecycle.signal == signal.SIGINT or not serving else 0
