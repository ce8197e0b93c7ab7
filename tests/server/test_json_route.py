"""The completions and chat routes read their bodies themselves (``JsonRoute``), and what
they do not take goes to FastAPI's routes: differentially, the app answers every body,
hostile or not, exactly as the same app without ``JsonRoute`` does (status, content type,
and for every refusal the body to the byte), over real HTTP on every backend; and a
well-formed body is served without FastAPI's route ever seeing it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

import anyio_genout.server.json_route as json_route
from anyio_genout.server import create_app
from anyio_genout.server.json_route import JsonRoute
from tests.server.support import MODEL, serving
from tests.server.test_fuzz import _fuzz_requests
from tests.text.client_support import text_client

pytestmark = pytest.mark.anyio

_PATHS = ("/v1/completions", "/v1/chat/completions")
_JSON = "application/json"

#: Bodies and content types FastAPI's own rules decide: (path, content type, body).
_HOSTILE: list[tuple[str, str | None, bytes]] = [
    (path, content_type, body)
    for path in _PATHS
    for content_type, body in [
        (_JSON, b""), (_JSON, b"{"), (_JSON, b"[]"), (_JSON, b"null"), (_JSON, b'"x"'),
        (_JSON, b"{}"), (_JSON, b"[" * 5000 + b"]" * 5000),
        (_JSON, b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "temperature": NaN}'),
        (_JSON, b'{"prompt": "a", "prompt": 7, "max_tokens": 2}'),
        (_JSON, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        (_JSON, b'{"prompt": "\\ud800", "max_tokens": 2}'),
        (_JSON, b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 2}'),
        (_JSON, json.dumps({"prompt": "a", "max_tokens": 2}).encode("utf-16")),
        (_JSON, b'{"prompt": "a", "max_tokens": 1e400}'),
        (_JSON, b'{"prompt": "a", "max_tokens": 99999999999999999999999999}'),
        (_JSON, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} x'),
        (None, b'{"prompt": "a", "max_tokens": 2}'),
        ("text/plain", b'{"prompt": "a", "max_tokens": 2}'),
        ("application/x-www-form-urlencoded", b"prompt=a&max_tokens=2"),
        ("application/vnd.api+json", b'{"prompt": "a", "max_tokens": 2}'),
        ("application/jsonx", b'{"prompt": "a", "max_tokens": 2}'),
        ("APPLICATION/JSON; charset=latin-1", b'{"prompt": "a", "max_tokens": 2}'),
        ("application/json ; x=1", b'{"prompt": "a", "max_tokens": 2}'),
        ('"application/json"', b'{"prompt": "a", "max_tokens": 2}'),
        ("multipart/form-data; boundary=x", b"--x--"),
    ]
]


def _fuzzed() -> list[tuple[str, str | None, bytes]]:
    return [(path, _JSON, json.dumps(body).encode())
            for method, path, body in _fuzz_requests() if path in _PATHS and body is not None]


@pytest.fixture
def reroutes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths of the requests a JsonRoute handed to FastAPI's routes."""
    seen: list[str] = []
    reroute = json_route._reroute

    async def counted(scope: Any, *args: Any) -> None:
        seen.append(scope["path"])
        await reroute(scope, *args)

    monkeypatch.setattr(json_route, "_reroute", counted)
    yield seen


@asynccontextmanager
async def _both() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Clients of two apps over one text client: ours, and the same without JsonRoute."""
    async with text_client() as setup:
        ours = create_app(setup.text, model_name=MODEL)
        plain = create_app(setup.text, model_name=MODEL)
        before = len(plain.router.routes)
        plain.router.routes[:] = [r for r in plain.router.routes if not isinstance(r, JsonRoute)]
        assert len(plain.router.routes) == before - 2
        async with serving(ours) as a, serving(plain) as b, \
                httpx.AsyncClient(base_url=a, timeout=10) as http_a, \
                httpx.AsyncClient(base_url=b, timeout=10) as http_b:
            yield http_a, http_b


def _comparable(response: httpx.Response) -> Any:
    """What must agree: the status and content type; a refusal's body to the byte, a
    success's body without what differs per request (ids, times, sampled text)."""
    kind = response.headers.get("content-type")
    if response.status_code >= 300:
        return response.status_code, kind, response.content
    if kind == _JSON:
        body = response.json()
        return response.status_code, kind, body["object"], len(body["choices"])
    return response.status_code, kind, response.text.endswith("data: [DONE]\n\n")


async def _send(http: httpx.AsyncClient, path: str, content_type: str | None,
                body: bytes) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    with anyio.fail_after(10):
        return await http.post(path, content=body, headers=headers)


async def test_every_body_is_answered_as_fastapi_answers_it(reroutes: list[str]) -> None:
    cases = _HOSTILE + _fuzzed()
    async with _both() as (ours, plain):
        for path, content_type, body in cases:
            got = await _send(ours, path, content_type, body)
            want = await _send(plain, path, content_type, body)
            assert _comparable(got) == _comparable(want), (path, content_type, body[:200])
    assert len(reroutes) < len(cases)  # most fuzzed bodies are served directly


async def test_a_chunked_body_is_read_whole(reroutes: list[str]) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time " * 300,
                       "max_tokens": 3, "ignore_eos": True}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    async with _both() as (ours, _):
        with anyio.fail_after(10):
            response = await ours.post("/v1/completions", content=chunks(),
                                       headers={"content-type": _JSON})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert reroutes == []


async def test_a_well_formed_request_never_reaches_fastapis_route(reroutes: list[str]) -> None:
    async with _both() as (ours, _):
        completion = await _send(ours, "/v1/completions", _JSON, json.dumps(
            {"model": MODEL, "prompt": "Once", "max_tokens": 2, "ignore_eos": True}).encode())
        chat = await _send(ours, "/v1/chat/completions", "application/json; charset=utf-8",
                           json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2, "stream": True}).encode())
        refused = await _send(ours, "/v1/completions", _JSON, b'{"prompt": 5}')
        other_route = await _send(ours, "/tokenize", _JSON, b'{"prompt": "Once"}')
    assert completion.status_code == chat.status_code == other_route.status_code == 200
    assert completion.json()["usage"]["completion_tokens"] == 2
    assert chat.text.endswith("data: [DONE]\n\n")
    assert refused.status_code == 400 and "prompt" in refused.json()["error"]["message"]
    assert reroutes == ["/v1/completions"]  # the refused one only


async def test_the_request_id_header_names_the_response() -> None:
    async with _both() as (ours, plain):
        for http in (ours, plain):
            response = await http.post(
                "/v1/completions", headers={"x-request-id": "caller-7"},
                json={"model": MODEL, "prompt": "Once", "max_tokens": 1})
            assert response.json()["id"] == "cmpl-caller-7"
