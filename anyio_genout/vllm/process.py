"""One running ``vllm serve`` process: its process group, its log tail, its exit.

:class:`ManagedProcess` forwards the process's output lines to a logger and keeps the last
50, stops its whole process group (SIGTERM, then SIGKILL), and turns its exit into an
:class:`EngineProcessExitedError`. The process groups not known to be gone are killed at
interpreter exit as a last resort (an :mod:`atexit` hook). :class:`~.engines.VllmEngines`
starts the processes and tells its callbacks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import anyio
import anyio.abc

from ..errors import EngineDeadError

__all__ = ["DRAIN_TIMEOUT", "KILL_WAIT", "LOG_TAIL_LINES", "MESSAGE_TAIL_LINES",
           "EngineProcessExitedError", "ManagedProcess", "group_alive", "live_groups",
           "signal_group"]

#: Output lines kept per process.
LOG_TAIL_LINES: Final = 50
#: Output lines an error message shows.
MESSAGE_TAIL_LINES: Final = 10
_MAX_LINE_BYTES: Final = 64 * 1024
#: Seconds an exited process's output may take to be read to its end.
DRAIN_TIMEOUT: Final = 0.5
#: Seconds to wait for a process group after SIGKILL.
KILL_WAIT: Final = 3.0

# Process groups started by any VllmEngines that are not known to be gone yet; killed at
# interpreter exit as a last resort (e.g. an event loop torn down without running __aexit__).
live_groups: set[int] = set()


class EngineProcessExitedError(EngineDeadError):
    """A managed vLLM engine process exited.

    ``pid`` and ``exit_code`` describe the process (a negative code is the signal that killed
    it); ``log_tail`` holds its last output lines; ``expected`` is true when the manager itself
    stopped it.
    """

    def __init__(self, pid: int, exit_code: int | None, log_tail: Sequence[str], *,
                 expected: bool = False) -> None:
        shown = "\n".join(log_tail[-MESSAGE_TAIL_LINES:]) or "(none)"
        verb = "was stopped" if expected else "exited"
        super().__init__(f"vLLM engine process {pid} {verb} with code {exit_code}; "
                         f"last log lines:\n{shown}")
        self.pid = pid
        self.exit_code = exit_code
        self.log_tail: tuple[str, ...] = tuple(log_tail)
        self.expected = expected


def group_alive(pgid: int) -> bool:
    """Whether a non-zombie process is left in process group ``pgid``."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``, if it is there and ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@atexit.register
def _kill_leftover_groups() -> None:
    for pgid in list(live_groups):
        signal_group(pgid, signal.SIGKILL)
    live_groups.clear()


class ManagedProcess:
    """One ``vllm serve`` process and what the manager knows about it.

    Its output lines go to ``logger`` (at INFO, as ``[vllm PID] line``) and to ``tail``.
    """

    def __init__(self, process: anyio.abc.Process, logger: logging.Logger) -> None:
        self.process = process
        self.pid = process.pid
        self.pgid = process.pid  # start_new_session=True: it leads its own group
        self.logger = logger
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.drained = anyio.Event()
        self.open_streams = 0
        self.exited = anyio.Event()
        self.error: EngineProcessExitedError | None = None

    async def terminate(self, grace_period: float) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, wait until it is empty."""
        if not await self.wait_group_gone(0):
            signal_group(self.pgid, signal.SIGTERM)
            if not await self.wait_group_gone(grace_period):
                self.logger.warning("vLLM engine process %d ignored SIGTERM for %.1f s; "
                                    "killing its process group", self.pid, grace_period)
                signal_group(self.pgid, signal.SIGKILL)
                await self.wait_group_gone(KILL_WAIT)

    async def wait_group_gone(self, limit: float) -> bool:
        """Poll until the process was reaped and its group is empty; False after ``limit`` s."""
        with anyio.move_on_after(limit):
            while self.process.returncode is None or group_alive(self.pgid):
                if limit == 0:
                    return False
                await anyio.sleep(0.05)
            return True
        return False

    async def pump(self, stream: anyio.abc.ByteReceiveStream) -> None:
        """Forward one output stream line by line to the logger and the tail."""
        pending = b""
        try:
            async for chunk in stream:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(line)
                if len(pending) > _MAX_LINE_BYTES:
                    self._emit(pending)
                    pending = b""
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass
        finally:
            if pending:
                self._emit(pending)
            self.open_streams -= 1
            if self.open_streams <= 0:
                self.drained.set()

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if "\r" in line:  # progress bars redraw with \r: keep the last state
            line = line.rsplit("\r", 1)[-1]
        self.tail.append(line)
        self.logger.info("[vllm %d] %s", self.pid, line)

    async def wait_exit(self, stopping: Callable[[], bool]) -> EngineProcessExitedError:
        """Wait for the process to exit, then describe it in :attr:`error` (and return it).

        Unless ``stopping()`` says the manager stopped it, the rest of its group is killed
        at once: whatever the process started cannot be used any more.
        """
        code: int | None
        try:
            code = await self.process.wait()
        except Exception:  # pragma: no cover - wait() does not fail on a started process
            self.logger.exception("waiting for vLLM engine process %d failed", self.pid)
            code = self.process.returncode
        expected = stopping()
        if not expected:
            # The supervisor is gone: whatever it started cannot be used any more.
            signal_group(self.pgid, signal.SIGKILL)
        with anyio.move_on_after(DRAIN_TIMEOUT):
            await self.drained.wait()
        error = EngineProcessExitedError(self.pid, code, list(self.tail), expected=expected)
        self.error = error
        return error
