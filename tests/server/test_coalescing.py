"""Under load the server sends what arrived together as one event (as vLLM's Rust front
end does), and nothing is lost or reordered by it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.support import MODEL, served
from tests.support import sse_lines
from tests.text.client_support import PROMPT

pytestmark = pytest.mark.anyio


async def test_tokens_that_arrived_together_are_one_event_with_the_same_text() -> None:
    # The mock engine steps back to back in this event loop: several steps' outputs are
    # buffered by the time the response task runs.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0.0,
            "ignore_eos": True}
    async with served(step_time=0.0) as s, httpx.AsyncClient(timeout=20) as http:
        whole = (await http.post(f"{s.v1}/completions", json=body)).json()
        events = []
        async with http.stream("POST", f"{s.v1}/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            async for line in sse_lines(r):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert len(chunks) < 300  # some events carry several tokens
