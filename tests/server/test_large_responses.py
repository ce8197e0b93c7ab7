"""A large response is rendered off the event loop with the same bytes, through real HTTP
on every backend: a whole completions or chat response, or a streamed event, with more than
``INLINE_RENDER_VALUES`` values (long echoed prompts, many logprobs) is rendered and
encoded in the text client's worker thread, its JSON a slice at a time; a small one stays
on the event loop (no thread hop)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout.server import serving
from anyio_genout.server.chat_format import ChatFormat
from anyio_genout.server.formats import CompletionFormat, Format
from anyio_genout.server.json_encoding import dumps, dumps_in_slices
from tests.server.support import MODEL, Served, served
from tests.text.client_support import tokenizer

pytestmark = pytest.mark.anyio

#: About 1,500 prompt tokens: echoed with 5 logprobs each, 9,000 values and more.
LONG_PROMPT = "The keeper wrote the weather in the ledger. " * 150


@contextmanager
def _rendering_threads() -> Iterator[list[bool]]:
    """Whether each whole response and each event with logprobs was rendered on the main
    thread (True) or in a worker (False)."""
    seen: list[bool] = []
    whole, event = CompletionFormat.whole, Format.event
    chat_whole = ChatFormat.whole

    def recorded(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = args[0]
            if original is not event or out.logprobs is not None \
                    or out.prompt_logprobs is not None:
                seen.append(threading.current_thread() is threading.main_thread())
            return original(self, *args, **kwargs)
        return call

    with mock.patch.object(CompletionFormat, "whole", recorded(whole)), \
            mock.patch.object(ChatFormat, "whole", recorded(chat_whole)), \
            mock.patch.object(Format, "event", recorded(event)):
        yield seen


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def _post(s: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.v1, timeout=30) as http:
        answer = await http.post(path, json={"model": MODEL, **body})
    assert answer.status_code == 200, answer.text
    return answer


def _joined(events: list[Any]) -> tuple[Any, ...]:
    """A completion stream's text, logprobs lists and finish, joined over its events."""
    choices = [event["choices"][0] for event in events if event["choices"]]
    lists = tuple([item for choice in choices for item in (choice["logprobs"] or {}).get(key, [])]
                  for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    return ("".join(choice["text"] for choice in choices), *lists,
            [choice["finish_reason"] for choice in choices][-1])


def _events(answer: httpx.Response) -> list[Any]:
    return [json.loads(line[6:]) for line in answer.text.splitlines()
            if line.startswith("data: {")]


async def test_a_large_whole_response_is_rendered_in_a_worker_with_the_same_body() -> None:
    big = {"prompt": LONG_PROMPT, "echo": True, "logprobs": 5, "prompt_logprobs": 5,
           "max_tokens": 40, "n": 2, "seed": 7}
    chat = {"messages": [{"role": "user", "content": LONG_PROMPT}], "logprobs": True,
            "top_logprobs": 20, "max_tokens": 300, "seed": 7}
    async with served(max_model_len=4096) as s:
        with _rendering_threads() as seen:
            answers = [await _post(s, "/completions", big),
                       await _post(s, "/chat/completions", chat)]
        assert seen == [False, False]
        with _rendering_threads() as seen, \
                mock.patch.object(serving, "INLINE_RENDER_VALUES", 10**9):
            inline = [await _post(s, "/completions", big),
                      await _post(s, "/chat/completions", chat)]
        assert seen == [True, True]
        for off, on in zip(answers, inline, strict=True):
            assert _without_ids(off.json()) == _without_ids(on.json())
        choice = answers[0].json()["choices"][0]
        assert choice["text"].startswith(LONG_PROMPT)
        assert len(choice["prompt_logprobs"]) == len(tokenizer().encode(LONG_PROMPT))
        # A small one stays on the event loop.
        with _rendering_threads() as seen:
            await _post(s, "/completions", {"prompt": "Once", "logprobs": 2, "max_tokens": 5})
        assert seen == [True]


async def test_a_large_streamed_event_is_rendered_in_a_worker_with_the_same_bytes() -> None:
    big = {"prompt": LONG_PROMPT, "echo": True, "logprobs": 5, "max_tokens": 20, "seed": 7,
           "stream": True}
    async with served(max_model_len=4096) as s:
        with _rendering_threads() as seen:
            off = _events(await _post(s, "/completions", big))
        assert seen[0] is False  # the first event echoes the prompt, with its logprobs
        assert all(seen[1:])  # the others have a token's row or a few: on the loop
        with mock.patch.object(serving, "INLINE_RENDER_VALUES", 10**9):
            on = _events(await _post(s, "/completions", big))
        # The same stream, whatever arrived together (rendering off the loop takes longer).
        assert _joined(off) == _joined(on)
        first = off[0]["choices"][0]
        assert first["text"].startswith(LONG_PROMPT)
        assert len(first["logprobs"]["tokens"]) >= len(tokenizer().encode(LONG_PROMPT))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=7) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=4),
    max_leaves=40)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(value=_JSON, slice_items=st.integers(1, 4))
def test_json_in_slices_is_the_same_bytes(value: Any, slice_items: int) -> None:
    assert dumps_in_slices(value, slice_items=slice_items) == dumps(value)
