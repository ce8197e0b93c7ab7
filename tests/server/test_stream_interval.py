"""vLLM's stream interval: ``--stream-interval N`` and a request's ``stream_interval`` (the
larger wins). A streamed chunk then holds at least that many tokens, except the first
tokens and the end, which go at once (vLLM 0.32's ``OutputProcessor`` rule). Over real HTTP
with the official ``openai`` client on every backend, and the flag through the CLI as a
subprocess."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.cli.support import cli
from tests.server.support import MODEL, OPENAI_STREAM_GC, Served, serve_process, served
from tests.support import sse_lines_sync
from tests.text.client_support import PROMPT

USAGE: Any = {"include_usage": True, "continuous_usage_stats": True}


def _client(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0)


async def _chunk_tokens(s: Served, **body: Any) -> tuple[list[int], str]:
    """Each content chunk's token count (from the continuous usage) and the whole text."""
    async with _client(s) as client, await client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0.0, stream=True, stream_options=USAGE,
            **body) as stream:
        chunks = [chunk async for chunk in stream if chunk.choices]
    counts = [c.usage.completion_tokens for c in chunks]
    return [b - a for a, b in zip([0, *counts], counts, strict=False)], \
        "".join(c.choices[0].text for c in chunks)


def _check_interval(sizes: list[int], interval: int, total: int, *,
                    first_alone: bool = True) -> None:
    assert sum(sizes) == total
    if first_alone:  # the first tokens go at once (one engine step)
        assert sizes[0] < interval, sizes
    assert all(size >= interval for size in sizes[1:-1]), sizes  # then held to the interval
    assert len(sizes) <= 2 + total // interval


@pytest.mark.anyio
@OPENAI_STREAM_GC
async def test_a_requests_stream_interval_holds_chunks_to_it() -> None:
    async with served(step_time=0.01) as s:
        every, text = await _chunk_tokens(s, max_tokens=21)
        held, same = await _chunk_tokens(s, max_tokens=21, extra_body={"stream_interval": 5})
    assert len(every) > 10  # without it: about a chunk a step
    _check_interval(held, 5, 21)
    assert same == text  # the same answer, fewer chunks


@pytest.mark.anyio
@OPENAI_STREAM_GC
async def test_the_servers_interval_is_the_least_a_request_gets() -> None:
    async with served(step_time=0.01, app_options={"stream_interval": 4}) as s:
        server, _ = await _chunk_tokens(s, max_tokens=17)
        lower, _ = await _chunk_tokens(s, max_tokens=17, extra_body={"stream_interval": 2})
        higher, _ = await _chunk_tokens(s, max_tokens=17, extra_body={"stream_interval": 8})
        async with _client(s) as client, await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                temperature=0.0, max_tokens=13, stream=True,
                stream_options=USAGE) as stream:  # and chat, with its role chunk first
            chat = [c async for c in stream if c.choices]
    _check_interval(server, 4, 17)
    _check_interval(lower, 4, 17)
    _check_interval(higher, 8, 17)
    assert chat[0].choices[0].delta.role == "assistant"
    counts = [c.usage.completion_tokens for c in chat[1:]]
    # (what arrived while the role chunk was written goes with the first tokens)
    _check_interval([b - a for a, b in zip([0, *counts], counts, strict=False)], 4, 13,
                    first_alone=False)


@pytest.mark.anyio
async def test_a_stream_interval_below_1_is_refused() -> None:
    async with served() as s, httpx.AsyncClient(base_url=s.v1) as http:
        for value in (0, -3, "x"):
            r = await http.post("/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "stream": True,
                                                      "stream_interval": value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "stream_interval"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_flag_holds_every_stream_to_it(backend: str) -> None:
    with serve_process("--backend", backend, "--stream-interval", "6",
                       exit_code=130) as server:
        body = {"prompt": "Once", "max_tokens": 19, "temperature": 0.0, "stream": True,
                "stream_options": USAGE}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                          timeout=30) as reply:
            lines = [line for line in sse_lines_sync(reply) if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    # (the embedded engine steps fast: the first delivery may take what a step or two made)
    _check_interval([b - a for a, b in zip([0, *counts], counts, strict=False)], 6, 19,
                    first_alone=False)


def test_a_flag_below_1_is_exit_2() -> None:
    done = cli("serve", "--stream-interval", "0")
    assert done.returncode == 2
    assert "--stream-interval must be at least 1, got 0" in done.stderr
