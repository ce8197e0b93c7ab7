"""An HTTP client that hangs up mid-stream, with the server in front of a REAL vLLM engine.

The server, engine and text client are ``test_server_real``'s (one real engine per backend);
the HTTP client is a plain TCP socket (no client library) that posts a streamed completion
with ``ignore_eos`` and a ``max_tokens`` the engine cannot reach before the hang-up, reads a
few SSE events and closes. What the issue promises: the engine gets exactly one ABORT for
that request, ``vllm:request_success_total{finished_reason="abort"}`` counts one (and no
other reason moves), and the request is gone from the engine's scheduler. It runs twice in a
row, after the module's ordinary completions (the lead that started this failed only after
other tests of its module had run).
"""

from __future__ import annotations

import json
import logging

import anyio
import httpx
import pytest

from tests.server.support import open_sse
from tests.support import sse_lines

from .conftest import INTEROP_TIMEOUT, unique_id
from .test_server_real import MODEL, _idle, base_url
from .test_text_real import PROMPT, Served, metric, served, text, text_model

__all__ = ["base_url", "served", "text", "text_model"]  # the fixtures this module reuses

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]

#: Far more than the engine makes before the hang-up is noticed, and within max_model_len
#: (512) with the prompt; the test checks that the engine had not finished it.
MAX_TOKENS = 480
REASONS = ("abort", "stop", "length", "error")


def _counts(served: Served) -> dict[str, float]:
    return {reason: metric(served.client, "vllm:request_success_total",
                           finished_reason=reason) for reason in REASONS}


async def _drop_after_events(base: str, text: Served, caplog: pytest.LogCaptureFixture,
                             events: int) -> None:
    """Post a long streamed completion, hang up after ``events`` events, and check the one
    ABORT, the metrics and the engine."""
    client = text.client.engine
    await _idle(text)
    aborts, counts = client.aborts_sent, _counts(text)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="anyio_genout"):
        for _ in range(3):  # a starved test process may let the engine finish first
            rid = unique_id("dropped")
            conn = await open_sse(base, {"model": MODEL, "prompt": PROMPT, "stream": True,
                                         "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                         "temperature": 0.0, "request_id": rid}, events)
            running = client.in_flight == 1  # the engine has not finished it
            await conn.aclose()
            if running:
                break
            await _idle(text)
            aborts, counts = client.aborts_sent, _counts(text)
            caplog.clear()
        assert running, "the engine finished every request before the hang-up"
        with anyio.fail_after(5):  # the ABORT goes out from the client's abort worker
            while client.aborts_sent < aborts + 1:  # noqa: ASYNC110 - polling a counter
                await anyio.sleep(0.005)
        await _idle(text)
        await anyio.sleep(0.2)  # nothing more is sent
    assert client.aborts_sent == aborts + 1
    left = [r.getMessage() for r in caplog.records if "scope was left early" in r.getMessage()]
    assert len(left) == 1 and rid in left[0], left
    after = _counts(text)
    assert after == {**counts, "abort": counts["abort"] + 1}, (counts, after)


async def test_completions_before_the_disconnects(base_url: str, text: Served) -> None:
    """The module's ordinary traffic first: whole and streamed completions to the end."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        whole = await http.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["finish_reason"] == "length"
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}
                               ) as streamed:
            events = [line async for line in sse_lines(streamed) if line]
    assert events[-1] == "data: [DONE]", events
    # Tokens that arrived together come as one event; the text is the whole one's.
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        whole.json()["choices"][0]["text"]
    await _idle(text)


@pytest.mark.parametrize("attempt", [1, 2])
async def test_a_dropped_connection_aborts_the_engine_request_once(
        base_url: str, text: Served, caplog: pytest.LogCaptureFixture, attempt: int) -> None:
    await _drop_after_events(base_url, text, caplog, events=3)
