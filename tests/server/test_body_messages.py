"""A single choice's finish event goes out with the last bytes, as one body message: the
HTTP server writes every body message with its own send (uvicorn one ``send()``, Hypercorn
an h11 event, a lock and a ``send_all``), and a short request has only three or four.

The app is called directly with a recording ``send``, so what is checked is the messages
the HTTP server would write, not how TCP happened to split them.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from anyio_genout.server import create_app
from tests.server.support import MODEL
from tests.text.client_support import PROMPT, text_client

pytestmark = pytest.mark.anyio


async def _body_messages(body: dict[str, Any]) -> list[bytes]:
    """POST ``body`` to /v1/completions on the app itself; the body messages it sends."""
    sent: list[dict[str, Any]] = []
    raw = json.dumps(body).encode()
    received = False
    done = anyio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    async with text_client(step_time=0.0) as setup:
        app = create_app(setup.text, model_name=MODEL)
        with anyio.fail_after(20):
            await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    return [m["body"] for m in sent[1:] if m["type"] == "http.response.body"]


def _data(body: bytes) -> list[str]:
    """The ``data:`` fields of the SSE events in ``body``, in order."""
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("usage", [False, True])
async def test_the_finish_event_and_done_are_one_body_message(usage: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    messages = [m for m in await _body_messages(body) if m]
    # A one-token request: its one event (which is the finish) and [DONE] in one message.
    assert len(messages) == 1
    events = _data(messages[0])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == (2 if usage else 1)
    if usage:
        assert chunks[1]["usage"]["completion_tokens"] == 1


async def test_the_finish_event_of_a_longer_stream_comes_with_done_and_nothing_is_lost(
        ) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    messages = [m for m in await _body_messages(body) if m]
    last = messages[-1].decode()
    assert '"finish_reason":"length"' in last.replace(" ", "") and last.endswith(
        "data: [DONE]\n\n")
    events = _data(b"".join(messages))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
