"""``anyio-genout serve`` as a user runs it: a child process, the embedded mock engine."""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import pytest

from tests.cli.support import CLI, free_port
from tests.server.support import wait_for_health


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_serve_answers_completions_and_stops_on_sigint(backend: str) -> None:
    port = free_port("127.0.0.1")
    child = subprocess.Popen([*CLI, "serve", "--port", str(port), "--backend", backend,
                              "--api-key", "k", "--served-model-name", "m"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(base, child)
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4,
                "temperature": 0}
        ok = httpx.post(f"{base}/v1/completions", json=body,
                        headers={"authorization": "Bearer k"})
        denied = httpx.post(f"{base}/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == 401
    finally:
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=20)
    assert child.returncode == 130, err
    assert "Bearer k" not in err  # the key is never logged


def test_port_0_serves_on_a_free_port_and_says_which() -> None:
    child = subprocess.Popen([*CLI, "serve", "--port", "0"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert child.stderr is not None
        line = child.stderr.readline()
        while line and "serving" not in line:
            line = child.stderr.readline()
        found = re.search(r"serving 'anyio-genout' on (http://127\.0\.0\.1:(\d+))$", line.strip())
        assert found and int(found.group(2)) > 0, line
        answered = httpx.post(f"{found.group(1)}/v1/completions", json={
            "model": "anyio-genout", "prompt": "Once", "max_tokens": 2})
        assert answered.status_code == 200, answered.text
    finally:
        child.send_signal(signal.SIGINT)
        child.communicate(timeout=20)
    assert child.returncode == 130
