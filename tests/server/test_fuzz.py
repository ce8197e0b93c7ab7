"""Hostile clients: every route fuzzed from the app's own OpenAPI schema, plus hand-written
hostile bodies, over real HTTP on every backend. Every answer is a 2xx in the route's
success shape or a 4xx/503 with OpenAI's error body; never a 500, never a hang; and the
server still serves a normal completion afterwards.

The bodies come from a small JSON-schema-to-Hypothesis translation of the subset pydantic
emits (``hypothesis-jsonschema`` 0.23 does not run on current Hypothesis; schemathesis
would add ten packages to every CI install), drawn once, derandomized."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from anyio_genout.server import create_app
from tests.server.support import MODEL, served

pytestmark = pytest.mark.anyio

JSON = Any


@pytest.fixture(autouse=True)
def _no_traceback_in_the_servers_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Nothing a client sends may put an error or a traceback in the log ("Error in ASGI
    Framework" from Hypercorn, a 500's traceback from Starlette, a failed callback)."""
    yield
    records = caplog.get_records("setup") + caplog.get_records("call")
    bad = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, "\n".join(f"{r.name}: {r.getMessage()}" for r in bad[:5])

#: Any JSON value (finite floats, unbounded ints), small.
_JSON_VALUES: st.SearchStrategy[JSON] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)


def _strategy(schema: dict[str, Any], defs: dict[str, Any],
              overrides: dict[str, st.SearchStrategy[JSON]] | None = None
              ) -> st.SearchStrategy[JSON]:
    """Values valid for ``schema`` (the keywords pydantic's OpenAPI schemas use); the top
    level's properties named in ``overrides`` are drawn from there instead."""
    if "$ref" in schema:
        return _strategy(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([_strategy(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=max(schema.get("minLength", 0), 12))
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        low = None if low is None else math.ceil(low) + ("exclusiveMinimum" in schema)
        high = schema.get("maximum")
        return st.integers(min_value=low, max_value=None if high is None else math.floor(high))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                         max_value=schema.get("maximum"),
                         exclude_min="exclusiveMinimum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = _strategy(schema["items"], defs) if "items" in schema else _JSON_VALUES
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, 3))
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        given = overrides or {}
        chosen = {k: given[k] if k in given else _strategy(v, defs) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in chosen.items() if k in required},
            optional={k: v for k, v in chosen.items() if k not in required})
    if kind == "object":
        return st.dictionaries(st.text(max_size=6), _JSON_VALUES, max_size=3)
    return _JSON_VALUES


def _mutated(body: st.SearchStrategy[JSON], fields: list[str]) -> st.SearchStrategy[JSON]:
    """A valid body with one field set to any JSON value (mostly the wrong type)."""
    def put(parts: tuple[dict[str, Any], str, JSON]) -> dict[str, Any]:
        valid, field, value = parts
        return {**valid, field: value}
    return st.tuples(body, st.sampled_from(fields), _JSON_VALUES).map(put)


def _draw(strategy: st.SearchStrategy[JSON], count: int) -> list[JSON]:
    """``count`` examples of ``strategy``, the same on every run."""
    out: list[JSON] = []

    @settings(derandomize=True, database=None, max_examples=count, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: JSON) -> None:
        out.append(value)

    collect()
    return out


class _NoClient:
    """Enough of a TextClient to build the app for its schema (no route is called)."""

    client = tokenizer = None


#: The POST routes.
_POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")

_SMALL = st.integers(min_value=1, max_value=48)
_IDS = st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=6)
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.text(max_size=12)}), min_size=1, max_size=3)

#: Schema-valid bodies that get past the model, n and messages checks, so generation runs:
#: the sampling fields are still drawn from the schema.
_PLAUSIBLE: dict[str, st.SearchStrategy[JSON]] = {
    "model": st.sampled_from([MODEL, None]), "n": st.just(1), "request_id": st.none(),
    "prompt": st.text(min_size=1, max_size=16) | _IDS | _IDS.map(lambda ids: [ids]),
    "messages": _MESSAGES, "max_tokens": _SMALL | st.none(),
    "max_completion_tokens": _SMALL | st.none(), "stop_token_ids": _IDS | st.none(),
    "tokens": _IDS, "echo": st.just(False),
    "logprobs": st.integers(min_value=0, max_value=5) | st.none() | st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5) | st.none(),
}


@functools.cache
def _fuzz_requests() -> list[tuple[str, str, JSON]]:
    """(method, path, body) for every route of the schema: valid bodies and mutated ones."""
    app = create_app(_NoClient(), model_name=MODEL)  # type: ignore[arg-type]
    spec = app.openapi()
    defs = spec["components"]["schemas"]
    requests: list[tuple[str, str, JSON]] = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if "requestBody" not in op:
                requests.append((method.upper(), path, None))
                continue
            ref = op["requestBody"]["content"]["application/json"]["schema"]
            schema = defs[ref["$ref"].rsplit("/", 1)[1]]
            valid = _strategy(schema, defs)
            requests += [("POST", path, b) for b in _draw(valid, 15)]
            plausible = _strategy(schema, defs, _PLAUSIBLE)
            requests += [("POST", path, b) for b in _draw(plausible, 15)]
            requests += [("POST", path, b)
                         for b in _draw(_mutated(plausible, list(schema["properties"])), 15)]
    assert {p for _, p, _ in requests} >= set(_POSTS) | {"/v1/models", "/health", "/metrics"}
    return requests


def _check_error(status: int, body: JSON) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, error


def _check_events(path: str, text: str) -> None:
    events = [e for e in text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", text[-200:]
    for event in events[:-1]:
        assert event.startswith("data: "), event
        chunk = json.loads(event[len("data: "):])
        if "error" in chunk:  # an error after the stream started: OpenAI's body
            _check_error(chunk["error"]["code"], chunk)
            continue
        want = "text_completion" if path == "/v1/completions" else "chat.completion.chunk"
        assert chunk["object"] == want and isinstance(chunk["choices"], list), chunk


def _check_success(path: str, response: httpx.Response) -> None:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        _check_events(path, response.text)
        return
    if path in ("/health", "/metrics"):
        return
    body = response.json()
    if path == "/v1/completions":
        assert body["object"] == "text_completion", body
        assert isinstance(body["choices"][0]["text"], str), body
        assert isinstance(body["usage"]["completion_tokens"], int), body
    elif path == "/v1/chat/completions":
        assert body["object"] == "chat.completion", body
        assert isinstance(body["choices"][0]["message"]["content"], str), body
    elif path == "/tokenize":
        assert body["count"] == len(body["tokens"]), body
        assert all(isinstance(t, int) for t in body["tokens"]), body
    elif path == "/detokenize":
        assert isinstance(body["prompt"], str), body
    elif path == "/v1/models":
        assert body["object"] == "list" and body["data"][0]["id"] == MODEL, body
    elif path.startswith("/v1/models/"):
        assert body["object"] == "model" and body["id"] == MODEL, body
    elif path == "/version":
        assert isinstance(body["version"], str) and body["version"], body
    else:
        raise AssertionError(f"no success shape known for {path}")


def check(path: str, response: httpx.Response, sent: object) -> None:
    """``response`` is a success in ``path``'s shape or a 4xx/503 in OpenAI's error shape."""
    status = response.status_code
    where = f"{status} for {sent!r:.300}: {response.text[:300]}"
    if 200 <= status < 300:
        _check_success(path, response)
        return
    assert 400 <= status < 500 or status == 503, where
    assert response.headers.get("content-type", "").startswith("application/json"), where
    _check_error(status, response.json())


async def _send(http: httpx.AsyncClient, method: str, path: str, content: bytes | None,
                headers: dict[str, str] | None = None) -> httpx.Response:
    # Every request is bounded: a hang fails the test here, not at the 60 s timeout.
    with anyio.fail_after(10):
        return await http.request(method, path, content=content, headers=headers)


async def _still_serves(http: httpx.AsyncClient) -> None:
    response = await _send(http, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4,
         "ignore_eos": True}).encode(),
        {"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert (await _send(http, "GET", "/health", None)).status_code == 200


async def test_every_route_fuzzed_from_the_openapi_schema_answers_well_formed() -> None:
    requests = _fuzz_requests()
    async with served() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        for method, path, body in requests:
            content = None if body is None else json.dumps(body).encode()
            headers = None if body is None else {"content-type": "application/json"}
            check(path, await _send(http, method, path, content, headers), body)
        await _still_serves(http)


_CHAT = '"messages":[{"role":"user","content":"hi"}]'

#: Raw bodies a hostile client sends: (path, body, content type).
HOSTILE: list[tuple[str, bytes, str | None]] = [
    ("/v1/completions", b"", "application/json"),
    ("/v1/completions", b"not json", "application/json"),
    ("/v1/completions", b"\xff\xfe\x00", "application/json"),
    ("/v1/completions", b'{"prompt": "hi"', "application/json"),
    ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, "application/json"),
    ("/v1/completions", b'{"prompt":' + b'{"a":' * 5_000 + b"1" + b"}" * 5_001,
     "application/json"),
    ("/v1/completions", b"[]", "application/json"),
    ("/v1/completions", b"null", "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":4}', "text/plain"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":4}', None),
    ("/v1/completions", b'{"prompt":"hi","temperature":NaN}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","temperature":Infinity}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","top_p":-Infinity}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","top_k":1e999}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":' + b"9" * 400 + b"}",
     "application/json"),
    ("/v1/completions", b'{"prompt":"hi","seed":-' + b"9" * 40 + b"}", "application/json"),
    ("/v1/completions", b'{"prompt":[' + b"9" * 40 + b"]}", "application/json"),
    ("/v1/completions", b'{"prompt":"hi","stop_token_ids":[-1]}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":0}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":-5}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":"16"}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":4.5}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","model":"no-such-model"}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","n":0}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","logprobs":100000}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","min_tokens":9,"max_tokens":2}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","stop":"\\udfff","max_tokens":2}', "application/json"),
    ("/v1/completions", b'{"prompt":"hi","request_id":"\\ud800"}', "application/json"),
    ("/v1/completions", b'{"prompt":[[1],[2]]}', "application/json"),
    ("/v1/completions", b'{"prompt":[]}', "application/json"),
    ("/v1/completions", b'{"prompt":[[]]}', "application/json"),
    ("/v1/completions", json.dumps({"prompt": "x" * 300_000, "max_tokens": 2}).encode(),
     "application/json"),
    ("/v1/completions", b'{"prompt":"hi","stream":true,"max_tokens":3,"logprobs":2}',
     "application/json"),
    ("/v1/chat/completions", b'{"messages":[]}', "application/json"),
    ("/v1/chat/completions", b'{"messages":[{}]}', "application/json"),
    ("/v1/chat/completions", b'{"messages":[{"role":5,"content":[1]}]}', "application/json"),
    ("/v1/chat/completions", b'{"messages":"hi"}', "application/json"),
    ("/v1/chat/completions", ("{" + _CHAT + ',"top_logprobs":3}').encode(), "application/json"),
    ("/v1/chat/completions", ("{" + _CHAT + ',"chat_template_kwargs":{"messages":1}}').encode(),
     "application/json"),
    # Template variables named as the rendering's own parameters (max_chars was a 500).
    *[(path, ("{" + _CHAT + f',"chat_template_kwargs":{kwargs}' + extra + "}").encode(),
       "application/json")
      for path in ("/v1/chat/completions", "/tokenize")
      for extra in ("", ',"stream":true,"max_tokens":2')
      for kwargs in ('{"max_chars":5,"max_seconds":-1,"variables":7}',
                     '{"chat_template":5}', '{"tools":5,"documents":{"a":1}}',
                     '{"add_generation_prompt":"x","continue_final_message":3}')
      if not (path == "/tokenize" and extra)],
    ("/v1/chat/completions", ("{" + _CHAT + ',"stream":true,"max_tokens":3,'
                              '"stream_options":{"include_usage":true}}').encode(),
     "application/json"),
    ("/tokenize", b"{}", "application/json"),
    ("/tokenize", ("{" + _CHAT + ',"prompt":"x"}').encode(), "application/json"),
    ("/detokenize", b'{"tokens":[' + b"9" * 40 + b"]}", "application/json"),
    ("/detokenize", b'{"tokens":[-1]}', "application/json"),
    ("/detokenize", b'{"tokens":"abc"}', "application/json"),
]


async def test_hostile_bodies_get_well_formed_answers_and_the_server_serves_on() -> None:
    async with served() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        for path, body, content_type in HOSTILE:
            headers = {} if content_type is None else {"content-type": content_type}
            check(path, await _send(http, "POST", path, body, headers), body)
        for method, path in [("GET", "/v1/completions"), ("PUT", "/tokenize"),
                             ("GET", "/no/such/route"), ("DELETE", "/v1/models")]:
            response = await _send(http, method, path, None)
            assert response.status_code in (404, 405), response.text
            _check_error(response.status_code, response.json())
        await _still_serves(http)


#: Lone surrogates (valid JSON escapes, not valid Unicode) in text the tokenizer encodes:
#: the tokenizer raises TypeError, a 500 (see /work/briefs/s4-to-s2.md).
SURROGATES = [
    ("/v1/completions", b'{"prompt":"\\ud800","max_tokens":2}'),
    ("/v1/completions", b'{"prompt":["a\\udc00"],"max_tokens":2}'),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
    ("/tokenize", b'{"prompt":"\\ud800"}'),
    ("/tokenize", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
]


async def test_lone_surrogates_in_prompts_are_400() -> None:
    async with served() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        answers = [(path, body, await _send(http, "POST", path, body,
                                            {"content-type": "application/json"}))
                   for path, body in SURROGATES]
        await _still_serves(http)
    for path, body, response in answers:
        check(path, response, body)
        assert response.status_code == 400


async def _hang_up_on_the_answer(port: int, head: bytes) -> bytes:
    """A chunked body growing 256 bytes at a time, until an answer starts; then the client
    reads that and hangs up in the middle of its body. Returns the answer's start."""
    got = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as conn:
        try:
            await conn.send(head + b"transfer-encoding: chunked\r\n\r\n")
            for _ in range(200):
                await conn.send(b"100\r\n" + b"x" * 256 + b"\r\n")
                with anyio.move_on_after(0.002):
                    got = await conn.receive()
                if got:
                    break
        except (anyio.BrokenResourceError, anyio.EndOfStream):
            pass
    return got


async def test_clients_hanging_up_mid_body_on_an_early_answer_log_nothing() -> None:
    """401 (no key) and 413 (past the limit) answered while the client still sends, which
    then hangs up: 40 times each on every backend, and no traceback in the log (Hypercorn's
    trio worker used to log a ``trio.BusyResourceError`` for about one in four)."""
    options = {"max_body_size": 1000}
    async with served(api_key="k", app_options=options) as s, httpx.AsyncClient(
            base_url=s.base_url, timeout=10) as http:
        port = int(s.base_url.rsplit(":", 1)[1])
        seen: set[bytes] = set()
        for _ in range(40):
            for key in (b"authorization: Bearer k\r\n", b""):
                with anyio.fail_after(10):
                    answer = await _hang_up_on_the_answer(
                        port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + key)
                seen.add(answer[:12])
        response = await _send(http, "POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}).encode(),
            {"content-type": "application/json", "authorization": "Bearer k"})
    assert response.status_code == 200, response.text
    assert seen <= {b"HTTP/1.1 401", b"HTTP/1.1 413", b""}, seen
    assert {b"HTTP/1.1 401", b"HTTP/1.1 413"} <= seen
