"""``anyio-genout serve`` as a user runs it: a child process, the embedded mock engine."""

from __future__ import annotations

import httpx
import pytest

from tests.server.support import serve_process


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_serve_answers_completions_and_stops_on_sigint(backend: str) -> None:
    with serve_process("--backend", backend, "--api-key", "k", "--served-model-name", "m",
                       exit_code=130) as server:
        base = server.base
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4,
                "temperature": 0}
        ok = httpx.post(f"{base}/v1/completions", json=body,
                        headers={"authorization": "Bearer k"})
        denied = httpx.post(f"{base}/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == 401
    assert "Bearer k" not in server.err  # the key is never logged


def test_port_0_serves_on_a_free_port_and_says_which() -> None:
    announce = r"serving 'anyio-genout' on (http://127\.0\.0\.1:(\d+))$"
    with serve_process(port=0, announce=announce, ready=False, exit_code=130) as server:
        assert server.port > 0, server.err
        answered = httpx.post(f"{server.base}/v1/completions", json={
            "model": "anyio-genout", "prompt": "Once", "max_tokens": 2})
        assert answered.status_code == 200, answered.text
