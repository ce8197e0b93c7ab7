"""The API key, over real HTTP on every backend: checked from the headers before anything of
the body is read (401 whatever the body), on vLLM's routes by default (``/v1/...``) or on
every route but the liveness ones (``api_key_scope="all"``)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import anyio
import httpx
import pytest

from anyio_genout.server import create_app
from tests.cli.support import CLI
from tests.server.support import MODEL, serve_process, served, serving
from tests.text.client_support import text_client

pytestmark = pytest.mark.anyio

KEY = "sekrit"
GOOD = {"authorization": f"Bearer {KEY}"}


def _is_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {"error": {"message": "invalid API key",
                                         "type": "AuthenticationError", "param": None,
                                         "code": 401}}
    assert response.headers["www-authenticate"] == "Bearer"


async def _raw(base_url: str, head: bytes, body: bytes = b"") -> bytes:
    """``head`` (a request head without its blank line) and ``body`` on a raw connection;
    the answer's status line and body, read until the server closes (5 s at most)."""
    port = int(base_url.rsplit(":", 1)[1])
    async with await anyio.connect_tcp("127.0.0.1", port) as conn:
        await conn.send(head + b"connection: close\r\n\r\n" + body)
        answer = b""
        with anyio.fail_after(5):
            try:
                while True:
                    answer += await conn.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    return answer


async def test_without_the_key_any_body_is_401_before_it_is_read() -> None:
    options = {"max_body_size": 1000}
    async with served(api_key=KEY, app_options=options) as s, httpx.AsyncClient() as http:
        invalid = await http.post(f"{s.v1}/completions", content=b"{not json",
                                  headers={"content-type": "application/json"})
        wrong = await http.post(f"{s.v1}/completions", content=b"{not json",
                                headers={"authorization": "Bearer wrong"})
        basic = await http.post(f"{s.v1}/completions", content=b"{}",
                                headers={"authorization": f"Basic {KEY}"})
        # A chunked body far past the limit, never ended (a client that gets an answer
        # while still sending sees its connection closed, as from vLLM's server).
        chunked = await _raw(s.base_url, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                             b"transfer-encoding: chunked\r\n",
                             (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 20)
        # A content-length of 10 MB and only a byte of it: answered from the head alone.
        huge = await _raw(s.base_url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                          b"content-type: application/json\r\ncontent-length: 10000000\r\n",
                          b"{")
        # The key, with the scheme in any case: the body is read (and judged) as usual.
        authorized_invalid = await http.post(
            f"{s.v1}/completions", content=b"{not json",
            headers={"authorization": f"bearer {KEY}", "content-type": "application/json"})
        authorized_huge = await http.post(f"{s.v1}/completions", content=b"x" * 2000,
                                          headers=GOOD)
        ok = await http.post(f"{s.v1}/completions", headers=GOOD, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2})
    for response in (invalid, wrong, basic):
        _is_401(response)
    for answer in (chunked, huge):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), answer[:200]
        assert json.loads(body)["error"]["code"] == 401
    assert authorized_invalid.status_code == 400
    assert "not valid JSON" in authorized_invalid.json()["error"]["message"]
    assert authorized_huge.status_code == 413
    assert ok.status_code == 200, ok.text


async def test_the_default_scope_is_vllms_v1_routes() -> None:
    async with served(api_key=KEY) as s, httpx.AsyncClient(base_url=s.base_url) as http:
        models = await http.get("/v1/models")
        other_v1 = await http.get("/v1/no/such/route")
        health = await http.get("/health")
        metrics = await http.get("/metrics")
        tokenize = await http.post("/tokenize", json={"prompt": "Once upon"})
        detokenize = await http.post("/detokenize", json={"tokens": [1, 2]})
        unknown = await http.get("/no/such/route")
        preflight = await http.options("/v1/models")  # CORS preflights carry no key
        websocket = await _raw(s.base_url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"
                               b"upgrade: websocket\r\nconnection: upgrade\r\n"
                               b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                               b"sec-websocket-version: 13\r\n")
        models_ok = await http.get("/v1/models", headers=GOOD)
    _is_401(models)
    _is_401(other_v1)
    assert health.status_code == 200
    assert metrics.status_code == 200 and "vllm:" in metrics.text
    assert tokenize.status_code == 200 and tokenize.json()["count"] > 0
    assert detokenize.status_code == 200
    assert unknown.status_code == 404
    assert preflight.status_code == 405
    assert websocket.startswith(b"HTTP/1.1 401"), websocket[:200]
    assert models_ok.json()["data"][0]["id"] == MODEL


async def test_scope_all_guards_metrics_and_tokenize_but_not_health() -> None:
    options = {"api_key_scope": "all"}
    async with served(api_key=KEY, app_options=options) as s, httpx.AsyncClient(
            base_url=s.base_url) as http:
        denied = [await http.get("/metrics"), await http.get("/v1/models"),
                  await http.post("/tokenize", content=b"{not json"),
                  await http.post("/detokenize", json={"tokens": [1]}),
                  await http.get("/no/such/route")]
        health = await http.get("/health")
        metrics = await http.get("/metrics", headers=GOOD)
        tokenize = await http.post("/tokenize", json={"prompt": "Once"}, headers=GOOD)
    for response in denied:
        _is_401(response)
    assert health.status_code == 200
    assert metrics.status_code == 200 and "vllm:" in metrics.text
    assert tokenize.status_code == 200


async def test_a_root_path_is_taken_off_before_the_scope_is_checked() -> None:
    """Behind a proxy that mounts the server under /api (ASGI ``root_path``)."""
    async with text_client() as setup:
        inner = create_app(setup.text, model_name=MODEL, api_key=KEY)

        async def mounted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"].startswith("/api"):
                scope = {**scope, "root_path": "/api"}
            await inner(scope, receive, send)

        async with serving(mounted) as base, httpx.AsyncClient(base_url=base) as http:
            denied = await http.get("/api/v1/models")
            health = await http.get("/api/health")
            allowed = await http.get("/api/v1/models", headers=GOOD)
    _is_401(denied)
    assert health.status_code == 200
    assert allowed.status_code == 200


def test_create_app_refuses_an_empty_key_and_an_unknown_scope() -> None:
    for options in ({"api_key": ""}, {"api_key": KEY, "api_key_scope": "v2"},
                    {"api_key_scope": "everything"}):
        with pytest.raises(ValueError, match="api_key") as raised:
            create_app(None, model_name=MODEL, **options)  # type: ignore[arg-type]
        assert KEY not in str(raised.value)


def test_serve_reads_vllm_api_key_and_guards_all_with_the_flag() -> None:
    with serve_process("--api-key-scope", "all", env={"VLLM_API_KEY": KEY}) as server:
        base = server.base
        denied = httpx.get(f"{base}/metrics")
        allowed = httpx.get(f"{base}/metrics", headers=GOOD)
        body = {"prompt": "Once upon a time", "max_tokens": 2}
        completion = httpx.post(f"{base}/v1/completions", json=body, headers=GOOD)
    assert denied.status_code == 401
    assert allowed.status_code == 200
    assert completion.status_code == 200, completion.text
    assert KEY not in server.err
    refused = subprocess.run([*CLI, "serve", "--api-key", ""], capture_output=True,
                             text=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
    assert refused.returncode != 0 and "--api-key must not be empty" in refused.stderr
