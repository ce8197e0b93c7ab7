"""Long prompts never freeze the server, through real HTTP on every backend: a prompt that
cannot fit the context is refused with vLLM's too-long error before it is tokenized (at
once, while the other streams go on), and one that can is tokenized in a worker thread
while ``/health`` answers."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest

from tests.server.support import MODEL, served
from tests.support import sse_lines
from tests.text.client_support import PROMPT, tokenizer

# Each bounds how long the event loop may be held: no full collection of the earlier
# tests' heap may fall in it (conftest.py, frozen_heap).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("frozen_heap")]

#: About 1 MiB, under the body limit: 1.3-2.2 s to tokenize with the shipped tokenizer.
HUGE = "The keeper wrote the weather in the ledger. " * 22_000
TOO_LONG = ("Please reduce the length of the input prompt.", "which is the upper bound for",
            "This model's maximum context length is 4096 tokens")


class _Gaps:
    """The longest wait between two events of one stream, and between /health answers."""

    def __init__(self) -> None:
        self.stream = 0.0
        self.health = 0.0
        self.events = 0

    async def stream_from(self, http: httpx.AsyncClient, started: anyio.Event) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as answer:
            last = time.perf_counter()
            async for line in sse_lines(answer):
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                self.events += 1
                if self.events > 1:
                    self.stream = max(self.stream, now - last)
                last = now
                started.set()

    async def poll_health(self, http: httpx.AsyncClient, done: anyio.Event) -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            self.health = max(self.health, time.perf_counter() - start)
            await anyio.sleep(0.01)


async def _while_streaming(s: Any, post: Any) -> tuple[_Gaps, httpx.Response, float]:
    gaps = _Gaps()
    async with httpx.AsyncClient(base_url=s.base_url, timeout=30) as http, \
            anyio.create_task_group() as tg:
        started, done = anyio.Event(), anyio.Event()
        tg.start_soon(gaps.stream_from, http, started)
        tg.start_soon(gaps.poll_health, http, done)
        with anyio.fail_after(10):
            await started.wait()
        start = time.perf_counter()
        answer = await post(http)
        took = time.perf_counter() - start
        done.set()
        tg.cancel_scope.cancel()
    return gaps, answer, took


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    limit = 4096 * getattr(tokenizer(), "max_chars_per_token", 0)  # 0: the code before
    async with served(step_time=0.005) as s:
        for path, body, param in (
                ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 4},
                 "prompt"),
                ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
                    {"role": "user", "content": HUGE}]}, "messages"),
                ("/tokenize", {"prompt": HUGE}, "prompt")):
            gaps, answer, took = await _while_streaming(
                s, lambda http, path=path, body=body: http.post(path, json=body))
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == param
            assert all(part in error["message"] for part in TOO_LONG), error["message"]
            assert f"more than {limit} characters, which is the upper bound" in error["message"]
            # Refused without tokenizing it (1.3-2.2 s): the other stream and /health
            # never waited long. Generous bounds: the machine may be loaded.
            assert took < 0.5, f"{path}: refused after {took:.2f} s"
            assert gaps.stream < 0.5, f"{path}: the other stream waited {gaps.stream:.2f} s"
            assert gaps.health < 0.5, f"{path}: /health took {gaps.health:.2f} s"


async def test_a_long_prompt_that_fits_is_tokenized_off_the_event_loop() -> None:
    expected = tokenizer().encode(HUGE)
    async with served(step_time=0.005, max_model_len=len(expected) + 100) as s:
        gaps, answer, took = await _while_streaming(
            s, lambda http: http.post("/tokenize", json={"prompt": HUGE}))
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens"] == expected
        # Tokenizing took about a second or more, in a worker thread: the stream and
        # /health went on meanwhile (on the event loop, each waited the whole time). The
        # bound follows the machine's load: half of what the request took.
        bound = max(0.5, took / 2)
        assert gaps.health < bound, f"/health took {gaps.health:.2f} s (request: {took:.2f} s)"
        assert gaps.stream < bound, f"the stream waited {gaps.stream:.2f} s ({took:.2f} s)"
