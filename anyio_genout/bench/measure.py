"""Meters: the client's CPU and wall time, the engine process's CPU, resident memory.

The client's cost is this process's CPU time (``time.process_time``: every thread, so the
ZeroMQ I/O thread counts too) and its main thread's CPU time (``time.thread_time`` called
from the event loop's thread). The engine's cost is read from ``/proc`` with psutil: its whole
process and its main thread (the one that steps).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import psutil

from ..transport import free_tcp_port
from .spec import CellSpec, Sample

#: Vocabulary and context length of the engine (those of the interop tiny model).
VOCAB_SIZE = 1024
MAX_MODEL_LEN = 2048

__all__ = ["EngineProcess", "Meter", "Snapshot", "free_port", "freeze_gc", "rss_bytes"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (outside the ephemeral range)."""
    return free_tcp_port()


def rss_bytes() -> int:
    """Resident set size of this process."""
    rss: int = psutil.Process().memory_info().rss
    return rss


def freeze_gc() -> int:
    """Collect, then move every live object to the permanent generation (``gc.freeze``).

    Start-up objects (modules, the client, the warm-up's leftovers) are then never traversed
    again, so no full collection can stall a measured round. Returns the frozen count.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


class EngineProcess:
    """The mock engine core in its own process, dialling ``handshake_address``."""

    def __init__(self, handshake_address: str, spec: CellSpec, *,
                 python: str | None = None, extra: Sequence[str] = ()) -> None:
        cmd = [
            python or sys.executable, "-m", "anyio_genout", "mock-engine",
            "--handshake-address", handshake_address, "--rank", "0",
            "--step-time", repr(spec.engine_step_time),
            "--max-num-seqs", str(spec.engine_max_num_seqs),
            "--log-stats" if spec.engine_log_stats else "--no-log-stats",
            "--no-keep-history",
            # The shape of the tiny model the vLLM reference loads, for every implementation.
            "--vocab-size", str(VOCAB_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            *extra,
        ]
        if uvloop_available():
            cmd.append("--uvloop")
        self.command = cmd
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self._ps = psutil.Process(self._proc.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def cpu(self) -> tuple[float, float]:
        """(whole-process CPU seconds, main-thread CPU seconds) so far."""
        try:
            times = self._ps.cpu_times()
            main = 0.0
            for thread in self._ps.threads():
                if thread.id == self._proc.pid:
                    main = thread.user_time + thread.system_time
                    break
            return times.user + times.system, main
        except psutil.Error:
            return 0.0, 0.0

    def check_alive(self) -> None:
        code = self._proc.poll()
        if code is not None:
            raise RuntimeError(f"the mock engine exited with status {code}")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def system_busy() -> float:
    """CPU seconds every process on the machine has used so far (all cores, not idle)."""
    t = psutil.cpu_times()
    busy: float = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + \
        getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    return busy


class Snapshot:
    """Clocks at one instant (take it from the event loop's thread)."""

    __slots__ = ("cpu", "engine_cpu", "engine_main", "main", "system", "wall")

    def __init__(self, engine: EngineProcess | None) -> None:
        self.system = system_busy()
        self.engine_cpu, self.engine_main = engine.cpu() if engine is not None else (0.0, 0.0)
        self.cpu = time.process_time()
        self.main = time.thread_time()
        self.wall = time.perf_counter()

    def until(self, later: Snapshot, *, tokens: int = 0, requests: int = 0) -> Sample:
        cpu = later.cpu - self.cpu
        engine_cpu = later.engine_cpu - self.engine_cpu
        return Sample(
            wall=later.wall - self.wall,
            cpu=cpu,
            main_cpu=later.main - self.main,
            engine_cpu=engine_cpu,
            engine_main_cpu=later.engine_main - self.engine_main,
            others_cpu=max(0.0, later.system - self.system - cpu - engine_cpu),
            tokens=tokens,
            requests=requests,
        )


class Meter:
    """Takes snapshots around rounds and decides when enough rounds were measured.

    Besides the per-round samples it keeps the whole window from the first round's start to
    the last round's end: the engine's and the machine's CPU counters tick in 10 ms steps,
    so busy fractions and other processes' load are read over the window, not summed per
    (possibly millisecond-short) round.
    """

    def __init__(self, spec: CellSpec, engine: EngineProcess | None) -> None:
        self.spec = spec
        self.engine = engine
        self.samples: list[Sample] = []
        self.first: Snapshot | None = None
        self.last: Snapshot | None = None

    def start(self) -> Snapshot:
        snapshot = Snapshot(self.engine)
        if self.first is None:
            self.first = snapshot
        return snapshot

    def window(self) -> Sample | None:
        """The whole measured window (rounds and what happened between them)."""
        if self.first is None or self.last is None:
            return None
        return self.first.until(self.last)

    def stop(self, started: Snapshot, *, tokens: int = 0, requests: int = 0) -> Sample:
        # The engine's clocks are read last on the way out (first on the way in), so the
        # window covers the client's whole round.
        cpu, main, wall = time.process_time(), time.thread_time(), time.perf_counter()
        later = Snapshot.__new__(Snapshot)
        later.cpu, later.main, later.wall = cpu, main, wall
        later.engine_cpu, later.engine_main = (
            self.engine.cpu() if self.engine is not None else (0.0, 0.0))
        later.system = system_busy()
        self.last = later
        sample = started.until(later, tokens=tokens, requests=requests)
        self.samples.append(sample)
        return sample

    def more(self) -> bool:
        """Whether another round is due."""
        n = len(self.samples)
        if n >= self.spec.max_rounds:
            return False
        if n < self.spec.min_rounds:
            return True
        return sum(s.wall for s in self.samples) < self.spec.min_time


def others_load(seconds: float = 0.3, exclude: Sequence[int] = ()) -> float:
    """Cores' worth of CPU that other processes used over the next ``seconds``."""
    mine = [psutil.Process(pid) for pid in (os.getpid(), *exclude)]

    def own() -> float:
        total = 0.0
        for proc in mine:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system + times.children_user + \
                    times.children_system
        return total

    before, busy = own(), system_busy()
    time.sleep(seconds)
    return max(0.0, (system_busy() - busy - (own() - before)) / seconds)


def wait_until_quiet(limit: float, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``limit`` cores.

    Returns the last load seen. A shared machine's other tenants are the main source of
    noise in wall-clock figures (CPU per token is much less sensitive).
    """
    deadline = time.monotonic() + max_wait
    load = others_load()
    while load > limit and time.monotonic() < deadline:
        time.sleep(0.5)
        load = others_load()
    return load


def environment() -> dict[str, Any]:
    """Facts about this machine and interpreter for the JSON report."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cpus": os.cpu_count(),
        "platform": sys.platform,
    }
    with contextlib.suppress(Exception):
        info["load_avg"] = os.getloadavg()
    with contextlib.suppress(Exception):
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    return info
