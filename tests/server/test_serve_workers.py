"""``anyio-genout serve --workers 2`` as a user runs it: one supervisor, two server
processes on one listening port and one (embedded mock) engine; killing any of them."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from contextlib import AbstractContextManager

import httpx
import pytest

from tests.cli.support import CLI
from tests.server.support import ServeProcess, serve_process


def serving(*extra: str, backend: str = "asyncio") -> AbstractContextManager[ServeProcess]:
    """``serve --workers 2`` on a port it picks, up once the supervisor says so; killed at
    the end if it still runs."""
    return serve_process("--workers", "2", "--backend", backend, *extra, port=0, ready=False,
                         stop="kill", announce=r"serving '.*' on (http://\S+) with 2 workers")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _open_stream(port: int) -> socket.socket:
    body = json.dumps({"model": "anyio-genout", "prompt": "Once upon a time", "stream": True,
                       "max_tokens": 3000, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\ncontent-length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    return sock


def _first_event(sock: socket.socket) -> None:
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _each_worker(base: str, name: str, want: float, **labels: str) -> list[float]:
    """Scrape /metrics over new connections (each may reach either worker) until two
    different values that add up to ``want`` were seen (or, the two being equal, one
    value that is half of it, forty times); the two values."""
    seen: list[float] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        seen.append(_metric(httpx.get(f"{base}/metrics").text, name, **labels))
        for value in set(seen):
            if want - value in seen and want - value != value:
                return sorted((value, want - value))
        if len(seen) >= 40 and set(seen) == {want / 2}:
            return [want / 2, want / 2]
        time.sleep(0.01)
    raise AssertionError(f"{name}: the workers' values seen were {sorted(set(seen))}, "
                         f"not two adding up to {want}")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_two_workers_serve_one_port_from_one_engine_and_stop_on_sigint(backend: str) -> None:
    """Both processes take connections from the shared port and stream from the same
    engine at the same time; dropped connections abort once each; SIGINT stops it all."""
    with serving("--mock-step-time", "0.01", backend=backend) as server:
        workers = server.workers()
        assert len(workers) == 2
        answered = httpx.post(f"{server.base}/v1/completions", json={
            "model": "anyio-genout", "prompt": "Once upon a time", "max_tokens": 4,
            "ignore_eos": True})
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["completion_tokens"] == 4
        streams = [_open_stream(server.port) for _ in range(12)]
        for sock in streams:
            _first_event(sock)
        for sock in streams:  # all twelve streamed at once
            sock.close()
        # Each worker counts what it served: both had some of the twelve.
        aborted = _each_worker(server.base, "vllm:request_success_total", 12,
                               finished_reason="abort")
        assert all(value > 0 for value in aborted), aborted
        server.child.send_signal(signal.SIGINT)
        assert server.child.wait(20) == 130, "".join(server.lines)
        assert _wait_gone(workers, 5), "a worker outlived its supervisor"


def test_a_killed_worker_stops_the_server_with_an_error() -> None:
    with serving() as server:
        first, second = server.workers()
        os.kill(second, signal.SIGKILL)
        assert server.child.wait(20) == 1
        assert _wait_gone([first], 5)
        time.sleep(0.5)  # the reader thread takes the last lines
        assert re.search(r"error: .*server worker 1 exited with status -9",
                         "".join(server.lines)), "".join(server.lines)


def test_workers_of_a_killed_supervisor_stop_by_themselves() -> None:
    with serving() as server:
        workers = server.workers()
        server.child.kill()
        server.child.wait(10)
        assert _wait_gone(workers, 15), "workers outlived their SIGKILLed supervisor"


def test_a_bad_workers_value_is_a_usage_error() -> None:
    done = subprocess.run([*CLI, "serve", "--workers", "0"], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 2
    assert "--workers must be at least 1, got 0" in done.stderr


def test_a_port_in_use_is_refused_even_by_a_second_multi_worker_server() -> None:
    """SO_REUSEPORT must not let a second server (same user) share the port silently."""
    with serving() as server:
        done = subprocess.run([*CLI, "serve", "--workers", "2", "--port", str(server.port)],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, check=False)
        assert done.returncode == 2, done.stderr
        assert f"cannot listen on 127.0.0.1:{server.port}" in done.stderr
