"""``stream_options.continuous_usage_stats``: every streamed chunk carries its choice's usage
so far, as vLLM's do (its ``should_include_usage``: only together with ``include_usage``).
Through the official ``openai`` client on a real port, on every backend."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.server.support import MODEL, OPENAI_STREAM_GC, Served, served
from tests.text.client_support import PROMPT

pytestmark = [pytest.mark.anyio, OPENAI_STREAM_GC]

#: The openai client's types know include_usage alone: the bodies are typed as Any.
MESSAGES: Any = [{"role": "user", "content": PROMPT}]
BOTH: Any = {"include_usage": True, "continuous_usage_stats": True}


def _async(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0)


def _by_choice(chunks: list[Any]) -> dict[int, list[Any]]:
    found: dict[int, list[Any]] = {}
    for chunk in chunks:
        if chunk.choices:
            found.setdefault(chunk.choices[0].index, []).append(chunk)
    return found


def _check_running(chunks: list[Any], prompt: int, tokens: int) -> None:
    """Every chunk has the usage so far: the prompt, counts that only grow, ending at the
    choice's tokens; total = prompt + completion."""
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert {c.usage.prompt_tokens for c in chunks} == {prompt}
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == tokens
    assert counts[0] < tokens  # running figures, not the final one on every chunk


async def test_completions_stream_the_usage_so_far_on_every_chunk() -> None:
    async with served(step_time=0.002) as s, _async(s) as client, \
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=6, n=2, seed=3, stream=True,
                stream_options=BOTH) as stream:
        chunks = [chunk async for chunk in stream]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 12
    by_choice = _by_choice(chunks)
    assert sorted(by_choice) == [0, 1]
    for choice in by_choice.values():
        _check_running(choice, final.usage.prompt_tokens, 6)


async def test_chat_streams_the_usage_so_far_from_the_role_chunk_on() -> None:
    async with served(step_time=0.002) as s, _async(s) as client, \
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
                stream_options=BOTH) as stream:
        chunks = [chunk async for chunk in stream]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 5
    choice = _by_choice(chunks)[0]
    assert choice[0].choices[0].delta.role == "assistant"
    assert choice[0].usage.completion_tokens == 0  # the role chunk, before any token
    _check_running(choice, final.usage.prompt_tokens, 5)


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True},
                                     {"include_usage": False, "continuous_usage_stats": True}])
async def test_continuous_usage_without_include_usage_adds_nothing(
        options: Any) -> None:
    """vLLM's rule: continuous stats ride on include_usage; alone they change nothing."""
    async with served() as s, _async(s) as client, await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
            stream_options=options) as stream:
        chunks = [chunk async for chunk in stream]
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # and no usage chunk at the end
