"""A client that hangs up mid-stream, on a raw socket (no client library), on every backend:
the engine gets exactly one ABORT for that request, the metrics count one abort and nothing
else, the request is gone from the client, and the server still serves."""

from __future__ import annotations

import anyio
import httpx
import pytest

from tests.server.support import MODEL, open_sse, served, wait_until
from tests.text.client_support import PROMPT, added, success_total

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("events", [1, 5])
async def test_a_hang_up_mid_stream_aborts_once_and_counts_one_abort(events: int) -> None:
    async with served(step_time=0.002) as s, httpx.AsyncClient() as http:
        engine, client = s.setup.engine, s.setup.client
        conn = await open_sse(s.base_url, {"model": MODEL, "prompt": PROMPT, "stream": True,
                                           "max_tokens": 1000, "ignore_eos": True,
                                           "request_id": "hangup"}, events)
        assert client.engine.in_flight == 1  # still generating when the client goes
        await conn.aclose()
        await wait_until(lambda: engine.abort_frames >= 1)
        await anyio.sleep(0.1)  # nothing more arrives
        assert engine.abort_frames == 1
        assert engine.aborted_ids == [r.request.request_id for r in added(engine)]
        assert client.engine.in_flight == 0
        assert success_total(client) == {"abort": 1.0}
        after = await http.post(f"{s.v1}/completions",
                                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 200
