"""``usage.completion_tokens_details.reasoning_tokens``: with a reasoning parser served,
every chat usage counts the output's reasoning tokens as vLLM 0.32 counts them (its
``count_reasoning_tokens``, over token ids: the think markers must be tokens of the
vocabulary), whole, streamed and with continuous usage. Through the official ``openai``
client on a real port, on every backend; the rule itself against vLLM's own parsers in
``tests/interop/test_parsers_differential.py``.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import tokenizers

from anyio_genout.text.bundled import bundled_tokenizer
from anyio_genout.text.tokenizer import Tokenizer
from tests.server.support import MODEL, OPENAI_STREAM_GC, Served, served

pytestmark = [pytest.mark.anyio, OPENAI_STREAM_GC]

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MESSAGES: Any = [{"role": "user", "content": "Where is Paris?"}]
THOUGHT = "Paris is in France, so"
SCRIPT = f"<think>{THOUGHT}</think>It is in France."
CONTINUOUS: Any = {"include_usage": True, "continuous_usage_stats": True}


@functools.cache
def thinking_tokenizer(folder: str) -> Tokenizer:
    """The bundled tokenizer with the think and tool-call markers as added tokens (as a
    reasoning model's vocabulary has them)."""
    source = Path(bundled_tokenizer().model_dir or "")
    target = Path(folder)
    shutil.copytree(source, target, dirs_exist_ok=True)
    backend = tokenizers.Tokenizer.from_file(str(target / "tokenizer.json"))
    backend.add_tokens(list(MARKERS))  # added, not special: decoding keeps them (as R1's)
    backend.save(str(target / "tokenizer.json"))
    return Tokenizer.from_model_dir(target)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return thinking_tokenizer(str(tmp_path_factory.mktemp("thinking")))


@asynccontextmanager
async def scripted(tokenizer: Tokenizer, script: str, **app: Any) -> AsyncIterator[Served]:
    """The server (with ``app`` options) over a mock answering every greedy request with
    ``script``'s tokens, then EOS."""
    ids = tokenizer.encode(script, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert eos is not None
    async with served(text_tokenizer=tokenizer, corpus_token_ids=(*ids, eos),
                      corpus_starts=(0,), eos_token_id=eos, eos_probability=0.0,
                      step_time=0.002, vocab_size=32000,
                      app_options=app) as s:
        yield s


def _thought(tokenizer: Tokenizer) -> int:
    """The tokens between the markers, as the script is tokenized."""
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    start, end = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    return ids.index(end) - ids.index(start) - 1


async def _answers(s: Served, **body: Any) -> tuple[Any, list[Any]]:
    args = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 100,
            **body}
    async with openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0) as client:
        whole = await client.chat.completions.create(**args)
        async with await client.chat.completions.create(
                **args, stream=True, stream_options=CONTINUOUS) as stream:
            chunks = [chunk async for chunk in stream]
    return whole, chunks


def _details(usage: Any) -> Any:
    return (usage.model_dump().get("completion_tokens_details") or {}).get("reasoning_tokens")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_the_usage_counts_the_reasoning_tokens(tokenizer: Tokenizer, parser: str) -> None:
    async with scripted(tokenizer, SCRIPT, reasoning_parser=parser) as s:
        whole, chunks = await _answers(s)
    thought = _thought(tokenizer)
    assert thought > 1
    assert whole.choices[0].message.model_extra["reasoning"] == THOUGHT
    assert _details(whole.usage) == thought
    final = chunks[-1]
    assert final.choices == [] and _details(final.usage) == thought
    assert final.usage.completion_tokens == whole.usage.completion_tokens
    running = [_details(c.usage) for c in chunks if c.choices]
    assert running[0] == 0  # the role chunk, before any token
    assert running == sorted(running) and running[-1] == thought


async def test_thinking_off_counts_none_and_no_parser_shows_no_details(
        tokenizer: Tokenizer) -> None:
    async with scripted(tokenizer, SCRIPT, reasoning_parser="qwen3") as s:
        off, off_chunks = await _answers(
            s, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    async with scripted(tokenizer, SCRIPT) as s:
        plain, plain_chunks = await _answers(s)
    assert off.choices[0].message.content == SCRIPT  # no reasoning read, none counted
    assert _details(off.usage) == 0 and _details(off_chunks[-1].usage) == 0
    # vLLM sends the details only when it serves a reasoning parser
    assert plain.usage.completion_tokens_details is None
    assert all(c.usage.completion_tokens_details is None for c in plain_chunks)


async def test_markers_that_are_not_tokens_give_no_details() -> None:
    """The bundled tokenizer spells ``<think>`` in pieces: vLLM's think parsers cannot be
    made for it; ours reads the reasoning from the text and leaves the count out."""
    tokenizer = bundled_tokenizer()
    assert tokenizer.token_id("<think>") is None
    async with scripted(tokenizer, SCRIPT, reasoning_parser="deepseek_r1") as s:
        whole, chunks = await _answers(s)
    assert whole.choices[0].message.model_extra["reasoning"] == THOUGHT
    assert whole.usage.completion_tokens_details is None
    assert all(c.usage.completion_tokens_details is None for c in chunks)
