"""``--tool-call-parser mistral`` served: Mistral's ``[TOOL_CALLS]`` is a special token, so the
answer is decoded with special tokens kept when tools are in play (vLLM 0.32's
``MistralToolParser.adjust_request``) and the call is read; without tools it is dropped as
any special token is. Real HTTP on every backend, over a mock that answers with a script in
a tokenizer (the shipped one plus ``[TOOL_CALLS]``, as Mistral's have it) whose ids it
emits."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers

from anyio_genout.server import create_app
from anyio_genout.text.bundled import bundled_model_dir
from anyio_genout.text.client import TextClient
from anyio_genout.text.tokenizer import Tokenizer
from tests.cluster import generate_client
from tests.server.support import MODEL, serving

pytestmark = pytest.mark.anyio

EOS = 2  # the shipped tokenizer's </s>
MARK = "[TOOL_CALLS]"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _mistral_like(folder: Path) -> Tokenizer:
    """The shipped tokenizer with ``[TOOL_CALLS]`` added as a special token."""
    shutil.copytree(bundled_model_dir(), folder)
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([MARK])
    backend.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_model_dir(folder)


@asynccontextmanager
async def _scripted(tmp_path: Path, script: list[str]) -> AsyncIterator[str]:
    """The server (mistral parser) over a mock whose greedy answer is ``script`` (texts, and
    the marker as its one token); yields the base URL."""
    tok = _mistral_like(tmp_path / "model")
    (mark,) = tok.encode(MARK, add_special_tokens=False)
    assert mark in tok.special_token_ids
    ids = [t for piece in script for t in (
        [mark] if piece == MARK else tok.encode(piece, add_special_tokens=False))]
    mock = {"corpus_token_ids": (*ids, EOS), "corpus_starts": (0,), "eos_token_id": EOS,
            "eos_probability": 0.0, "vocab_size": 32000}
    async with generate_client(mock=mock, vocab_size=32000) as (client, _):
        app = create_app(TextClient(client, tok), model_name=MODEL,
                         enable_auto_tool_choice=True, tool_call_parser="mistral")
        async with serving(app) as base:
            yield base


async def _chat(base: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"{base}/v1", timeout=10) as http:
        return await http.post("/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 100,
            **body})


@pytest.mark.parametrize("form", ["json", "v11"])
async def test_the_tool_calls_token_survives_detokenizing_and_is_read(
        tmp_path: Path, form: str) -> None:
    args = '{"city": "Paris"}'
    script = (["Sure. ", MARK, f'[{{"name": "get_weather", "arguments": {args}}}]']
              if form == "json" else ["Sure. ", MARK, "get_weather[ARGS]" + args])
    async with _scripted(tmp_path, script) as base:
        whole = await _chat(base, tools=[WEATHER])
        streamed = await _chat(base, tools=[WEATHER], stream=True)
        plain = await _chat(base)  # no tools: the special token is skipped, as vLLM does
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert len(call["id"]) == 9 and call["id"].isalnum()  # Mistral's ids
    assert MARK not in (choice["message"]["content"] or "")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    pieces = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls")
              or ()]
    assert pieces[0]["function"]["name"] == "get_weather" and len(pieces[0]["id"]) == 9
    assert json.loads("".join(p["function"].get("arguments") or "" for p in pieces)) == {
        "city": "Paris"}
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "tool_calls"
    message = plain.json()["choices"][0]["message"]
    assert not message.get("tool_calls")
    assert message["content"] == "".join(p for p in script if p != MARK)
