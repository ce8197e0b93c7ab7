"""``anyio-genout serve --workers N``: N server processes in front of the same engines.

The model is vLLM's ``--api-server-count``. The process the user started is the
supervisor; it serves no HTTP itself:

1. It binds, for each worker, an HTTP listening socket (all on the same port, with
   ``SO_REUSEPORT``, so the kernel spreads new connections evenly over the workers) and an
   input and an output TCP listening socket on ``--advertised-host`` (the kernel picks
   their ports, so nothing can take one between choosing and binding).
2. It starts worker ``i`` (``anyio-genout serve-worker``, the options as one JSON line on
   its stdin) with its three sockets inherited. The worker adopts
   them as a bootstrapped client with ``client_index = i`` and waits for the engines to
   register on its input socket, then serves HTTP on its listening socket.
3. It starts the engines (embedded mock engines run in the supervisor; ``--vllm-model``
   engines are its children; remote ones dial in) and performs the handshake: the INIT
   names every worker's pair, so each engine connects to all of them and answers each
   request on the output socket of the ``client_index`` it came with.
4. Once every worker says it is connected, it prints where it serves, then runs until
   SIGINT/SIGTERM or until a worker exits, its handshake socket still open: a restarted
   engine's HELLO gets the same INIT, so it registers with every worker again, and each
   worker that has its rank down takes it back. On SIGTERM it forwards SIGTERM (each
   worker drains for up to ``--shutdown-timeout`` seconds, then aborts what is left) and
   exits 0; on SIGINT, or when a worker exited (e.g. no engine came back within
   ``--engine-rejoin-timeout``: each worker exits 1 naming the engines), it sends SIGINT
   (abort at once). It kills a worker still there :data:`WORKER_STOP_GRACE` seconds
   after its drain, and stops the engines.

Workers run in their own sessions (a terminal's Ctrl-C reaches only the supervisor, which
stops them once), and a worker whose supervisor vanished (its stdin closes: the supervisor
was killed) stops by itself. Each worker has its own metrics: ``/metrics`` shows the
worker that answered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from functools import partial
from typing import IO, Any, Final

import anyio
import anyio.abc

from ..engine.handshake import serve_handshake
from ..engine.rejoin import answer_restarted_engines
from ..errors import GenoutError, OperationalError, UsageError
from ..text.tokenizer import Tokenizer
from .engines import EngineSession, WorkerSockets
from .serve_http import http_url, listen, serve, served_model_name
from .serve_lifecycle import DRAIN_SLACK
from .serve_vllm import serve_tokenizer

__all__ = ["WORKER_COMMAND", "WORKER_STOP_GRACE", "read_worker_spec", "supervise"]

#: The internal command a supervisor starts its workers with (``anyio-genout serve-worker``).
WORKER_COMMAND: Final = "serve-worker"

#: Seconds a worker has to stop, beyond its drain (``--shutdown-timeout`` and
#: :data:`~.serve_lifecycle.DRAIN_SLACK`), before the supervisor kills it.
WORKER_STOP_GRACE: Final = 10.0
#: Seconds the workers have, beyond ``--ready-timeout``, to start (import, load the
#: tokenizer) and connect once the engines are ready.
WORKER_START_SLACK: Final = 60.0


def _listener(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, 0), family=family, backlog=256)
    except OSError as exc:
        raise UsageError(f"cannot bind a socket for the engines on --advertised-host "
                         f"{host}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _zmq_address(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Worker:
    def __init__(self, index: int, process: anyio.abc.Process) -> None:
        self.index = index
        self.process = process


async def supervise(args: argparse.Namespace, tokenizer: Tokenizer) -> int:
    """Run ``args.workers`` server processes on the same engines until SIGINT (exit
    status 130) or SIGTERM (the workers drain; 0).

    Raises :class:`UsageError` when a socket cannot be bound, the engines' start-up errors
    (:class:`~anyio_genout.errors.HandshakeTimeoutError`, ...), and
    :class:`OperationalError` when a worker exits by itself (the others are stopped).
    """
    count: int = args.workers
    workers: list[_Worker] = []
    session = EngineSession(args, tokenizer=tokenizer)
    with ExitStack() as owned:
        # One listening socket per worker on the same port (SO_REUSEPORT): the kernel
        # spreads connections over them evenly. With one socket shared by all, the worker
        # that happens to be awake takes nearly every new connection.
        if args.port:
            # A port someone else listens on with SO_REUSEPORT too (another `serve
            # --workers` of this user) would be shared with it silently: refuse it, as a
            # plain bind does.
            listen(args.host, args.port).close()
        http = [owned.enter_context(listen(args.host, args.port, reuse_port=True))]
        port = http[0].getsockname()[1]
        http += [owned.enter_context(listen(args.host, port, reuse_port=True))
                 for _ in range(count - 1)]
        listeners = [(owned.enter_context(_listener(args.advertised_host)),
                      owned.enter_context(_listener(args.advertised_host)))
                     for _ in range(count)]
        pairs = [(_zmq_address(args.advertised_host, inp),
                  _zmq_address(args.advertised_host, out)) for inp, out in listeners]
        url = http_url(http[0], tls=args.ssl_certfile is not None)
        ready_read, ready_write = os.pipe()
        owned.callback(os.close, ready_read)
        async with session as config:
            try:
                for index, ((inp, out), (inp_address, out_address)) in enumerate(
                        zip(listeners, pairs, strict=True)):
                    spec = {"options": _options(args), "worker": {
                        "client_index": index, "input_address": inp_address,
                        "output_address": out_address, "input_fd": inp.fileno(),
                        "output_fd": out.fileno(), "http_fd": http[index].fileno(),
                        "ready_fd": ready_write}}
                    process = await anyio.open_process(
                        [sys.executable, "-m", "anyio_genout", WORKER_COMMAND],
                        stdin=subprocess.PIPE, stdout=None, stderr=None,
                        pass_fds=(http[index].fileno(), inp.fileno(), out.fileno(),
                                  ready_write),
                        start_new_session=True)
                    workers.append(_Worker(index, process))
                    assert process.stdin is not None
                    await process.stdin.send(json.dumps(spec).encode() + b"\n")
                # The workers hold the sockets now (and the pipe's writing end).
                os.close(ready_write)
                ready_write = -1
                for sock in http:
                    sock.close()
                for inp, out in listeners:
                    inp.close()
                    out.close()
                return await _run(args, config.engine, session, workers, pairs, ready_read,
                                  url)
            finally:
                if ready_write >= 0:
                    os.close(ready_write)
                with anyio.CancelScope(shield=True):
                    await _stop_workers(workers)


async def _run(args: argparse.Namespace, engine_config: Any, session: EngineSession,
               workers: list[_Worker], pairs: list[tuple[str, str]], ready_fd: int,
               url: str) -> int:
    stop = anyio.Event()
    failure: list[BaseException] = []
    received: list[signal.Signals] = []

    def fail(error: BaseException) -> None:
        if not failure:
            failure.append(error)
        stop.set()

    async def on_signal(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                received.append(signum)
                stop.set()
                return

    async def watch(worker: _Worker) -> None:
        status = await worker.process.wait()
        why = " (it said why above)" if status == 1 else ""
        fail(OperationalError(f"server worker {worker.index} exited with status {status}"
                              f"{why}; stopping the others"))

    async def start_up() -> None:
        try:
            # The handshake socket stays open: restarted engines are told every worker's
            # sockets again, and rejoin each worker (docs/server.md, --workers).
            await tg.start(partial(serve_handshake, engine_config, [i for i, _ in pairs],
                                   [o for _, o in pairs], after_start=partial(
                                       answer_restarted_engines, engine_config)))
            with anyio.fail_after(WORKER_START_SLACK):
                await _wait_ready(ready_fd, len(workers))
        except TimeoutError:
            fail(OperationalError(f"the server workers did not connect within "
                                  f"{WORKER_START_SLACK:g} s of the engines' READY"))
            return
        except GenoutError as exc:
            fail(exc)
            return
        print(f"serving {served_model_name(args)!r} on {url} with {len(workers)} workers",
              file=sys.stderr, flush=True)

    unregister = None
    if session.managed_engines is not None:
        unregister = session.managed_engines.on_exit(fail)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(on_signal)
            for worker in workers:
                tg.start_soon(watch, worker)
            tg.start_soon(start_up)
            await stop.wait()
            tg.cancel_scope.cancel()
    finally:
        if unregister is not None:
            unregister()
    if failure:
        raise failure[0]
    # SIGTERM: the workers drain (up to --shutdown-timeout) and stop; SIGINT: at once.
    signum = received[0]
    await _stop_workers(workers, signum, args.shutdown_timeout + DRAIN_SLACK)
    return 130 if signum == signal.SIGINT else 0


async def _wait_ready(fd: int, count: int) -> None:
    """Wait until ``count`` workers wrote their byte to the readiness pipe."""
    got = 0
    while got < count:
        await anyio.wait_readable(fd)
        data = os.read(fd, 64)
        if not data:
            raise OperationalError("every server worker exited before it was ready")
        got += len(data)


async def _stop_workers(workers: list[_Worker], signum: signal.Signals = signal.SIGINT,
                        drain: float = DRAIN_SLACK) -> None:
    """Send ``signum`` to each worker still running (SIGTERM: drain; SIGINT: abort what is
    open); SIGKILL one that outlives ``drain`` + :data:`WORKER_STOP_GRACE` seconds."""
    running = [w for w in workers if w.process.returncode is None]
    for worker in running:
        try:
            worker.process.send_signal(signum)
        except ProcessLookupError:
            pass
    with anyio.move_on_after(drain + WORKER_STOP_GRACE):
        for worker in running:
            await worker.process.wait()
    for worker in running:
        if worker.process.returncode is None:
            worker.process.kill()
            await worker.process.wait()
        if worker.process.stdin is not None:
            await worker.process.stdin.aclose()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {key: value for key, value in vars(args).items() if key != "command"}


# ---------------------------------------------------------------------- the worker side


def read_worker_spec(stream: IO[bytes]) -> argparse.Namespace:
    """The options a supervisor wrote on this worker's stdin (one JSON line)."""
    spec = json.loads(stream.readline())
    args = argparse.Namespace(**spec["options"])
    args.worker = spec["worker"]
    args.command = _run_worker
    return args


async def _run_worker(args: argparse.Namespace) -> int:
    spec = args.worker
    tokenizer = serve_tokenizer(args)  # with --chat-template's
    sockets = WorkerSockets(client_index=spec["client_index"],
                            input_address=spec["input_address"],
                            output_address=spec["output_address"],
                            input_fd=spec["input_fd"], output_fd=spec["output_fd"])
    stop = anyio.Event()
    ready = False
    status = 0

    def on_ready() -> None:
        nonlocal ready
        ready = True
        os.write(spec["ready_fd"], b"r")
        os.close(spec["ready_fd"])

    async def watch_supervisor() -> None:
        """The supervisor holds this process's stdin open while it lives."""
        while True:
            await anyio.wait_readable(sys.stdin.fileno())
            if not os.read(sys.stdin.fileno(), 4096):
                break
        if ready:
            stop.set()
        else:
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_supervisor)
        status = await serve(args, tokenizer, spec["http_fd"], worker=sockets,
                             on_ready=on_ready, stop=stop)
        tg.cancel_scope.cancel()
    return status
