"""``system_fingerprint`` as vLLM 0.32 sends it (``--fingerprint-mode``): on whole responses;
streamed, on each chunk with a finish reason, or with ``include_usage`` on the usage chunk
alone; ``custom`` sends the value, ``none`` nothing; ``serve`` and ``run`` take the flags."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from anyio_genout.errors import InvalidRequestError
from anyio_genout.server import create_app
from anyio_genout.server.fingerprint import system_fingerprint
from anyio_genout.text.client import TextClient
from tests.cli.support import cli, read_results, write_lines
from tests.cluster import generate_client
from tests.support import sse_lines
from tests.text.client_support import corpus, text_client, tokenizer

from .support import MODEL, serve_process, served

pytestmark = pytest.mark.anyio

#: ``full`` with one engine: our version, then the setup's hash.
FULL = re.compile(r"^anyio-genout-[^-\s]+(-[^-\s]+)*-[0-9a-f]{8}$")

COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4,
              "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the lighthouse?"}],
        "max_tokens": 4, "temperature": 0}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


async def whole(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{base}{path}", json=body)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


async def streamed(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a streamed answer to ``body``, parsed, up to ``[DONE]``."""
    async with httpx.AsyncClient(timeout=30) as http, \
            http.stream("POST", f"{base}{path}", json={**body, "stream": True}) as answer:
        assert answer.status_code == 200
        lines = [line async for line in sse_lines(answer) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def carrying(events: list[dict[str, Any]]) -> list[int]:
    """The positions of the events that carry a fingerprint."""
    return [i for i, event in enumerate(events) if "system_fingerprint" in event]


def terminal(event: dict[str, Any]) -> bool:
    return any(choice["finish_reason"] is not None for choice in event["choices"])


async def test_whole_responses_carry_the_servers_fingerprint() -> None:
    async with served() as server:
        found = [(await whole(server.base_url, path, body))["system_fingerprint"]
                 for path, body in ROUTES]
        expected = system_fingerprint(server.setup.text, model_name=MODEL)
        # the same setup gives the same value (a restart), another served name another
        again = system_fingerprint(TextClient(server.setup.client, tokenizer()),
                                   model_name=MODEL)
        other = system_fingerprint(server.setup.text, model_name="other-model")
    assert found == [expected, expected]
    assert expected is not None and FULL.match(expected), expected
    assert "-dp" not in expected  # one engine
    assert again == expected and other != expected


async def test_a_stream_without_usage_stamps_each_terminal_chunk_and_no_other() -> None:
    async with served(step_time=0.02) as server:  # a token a step: chunks of text alone
        fingerprint = system_fingerprint(server.setup.text, model_name=MODEL)
        n2 = {**COMPLETION, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 8}
        completions = await streamed(server.base_url, "/v1/completions", n2)
        chat = await streamed(server.base_url, "/v1/chat/completions", CHAT)
    for events, choices in ((completions, 2), (chat, 1)):
        stamped = carrying(events)
        assert len(stamped) == choices, events
        assert stamped == [i for i, event in enumerate(events) if terminal(event)]
        assert {events[i]["system_fingerprint"] for i in stamped} == {fingerprint}
        assert len(events) > choices  # there were chunks without it
    assert chat[0]["choices"][0]["delta"].get("role") == "assistant"  # the role chunk: none


async def test_with_include_usage_only_the_usage_chunk_carries_it() -> None:
    async with served(step_time=0.02) as server:
        fingerprint = system_fingerprint(server.setup.text, model_name=MODEL)
        answers = [await streamed(server.base_url, path,
                                  {**body, "stream_options": {"include_usage": True}})
                   for path, body in ROUTES]
    for events in answers:
        assert carrying(events) == [len(events) - 1], events
        last = events[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        assert last["system_fingerprint"] == fingerprint
        assert any(terminal(event) for event in events)  # the finish chunk has none


async def test_mode_none_sends_no_fingerprint_anywhere() -> None:
    async with served(app_options={"fingerprint_mode": "none"}) as server:
        for path, body in ROUTES:
            assert "system_fingerprint" not in await whole(server.base_url, path, body)
            for options in ({}, {"stream_options": {"include_usage": True}}):
                events = await streamed(server.base_url, path, {**body, **options})
                assert carrying(events) == [], events


async def test_custom_sends_the_value_as_given() -> None:
    app_options = {"fingerprint_mode": "custom", "fingerprint_value": "fp-deploy 7"}
    async with served(app_options=app_options) as server:
        body = await whole(server.base_url, "/v1/chat/completions", CHAT)
        events = await streamed(server.base_url, "/v1/completions", COMPLETION)
    assert body["system_fingerprint"] == "fp-deploy 7"
    assert [events[i]["system_fingerprint"] for i in carrying(events)] == ["fp-deploy 7"]


async def test_full_names_several_engines_and_hash_does_not() -> None:
    config = {"corpus_token_ids": corpus(), "vocab_size": 32000}
    async with generate_client(2, mock=config, vocab_size=32000) as (client, _):
        text = TextClient(client, tokenizer())
        full = system_fingerprint(text, model_name=MODEL)
        hashed = system_fingerprint(text, model_name=MODEL, mode="hash")
    async with text_client() as setup:  # one engine: another setup, another hash
        single = system_fingerprint(setup.text, model_name=MODEL, mode="hash")
    assert full is not None and hashed is not None and single is not None
    assert re.match(r"^anyio-genout-.+-dp2-[0-9a-f]{8}$", full), full
    assert "-dp" not in hashed and FULL.match(hashed), hashed
    assert full[-8:] == hashed[-8:] != single[-8:]


@pytest.mark.parametrize(("options", "field"), [
    ({"fingerprint_mode": "bogus"}, "fingerprint_mode"),
    ({"fingerprint_mode": "custom"}, "fingerprint_value"),
    ({"fingerprint_value": "x"}, "fingerprint_value"),
])
async def test_create_app_refuses_a_bad_fingerprint_option(options: dict[str, Any],
                                                           field: str) -> None:
    async with text_client() as setup:
        with pytest.raises(InvalidRequestError) as refused:
            create_app(setup.text, model_name=MODEL, **options)
    assert refused.value.field == field


def test_serve_sends_the_flags_fingerprint() -> None:
    with serve_process("--served-model-name", "m", "--fingerprint-mode", "custom",
                       "--fingerprint-value", "fp-cli", exit_code=130) as server:
        answer = httpx.post(f"{server.base}/v1/completions",
                            json={**COMPLETION, "model": "m"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["system_fingerprint"] == "fp-cli"


@pytest.mark.parametrize(("line", "message"), [
    (["--fingerprint-mode", "bogus"], "argument --fingerprint-mode: invalid choice: 'bogus'"),
    (["--fingerprint-mode", "custom"], "--fingerprint-mode custom needs --fingerprint-value"),
    (["--fingerprint-value", "x"], "--fingerprint-value is used only with --fingerprint-mode "
                                   "custom (the mode is full)"),
])
def test_bad_fingerprint_flags_are_exit_2(line: list[str], message: str) -> None:
    done = cli("serve", *line)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


def test_run_batch_lines_carry_the_flags_fingerprint(tmp_path: Path) -> None:
    line = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions",
                       "body": {**COMPLETION, "model": "my-model"}})
    requests = write_lines(tmp_path / "batch.jsonl", [line])
    output = tmp_path / "out.jsonl"
    done = cli("run", str(requests), "-o", str(output), "--no-progress",
               "--fingerprint-mode", "custom", "--fingerprint-value", "fp-run")
    assert done.returncode == 0, done.stderr
    (result,) = read_results(output)
    assert result["response"]["body"]["system_fingerprint"] == "fp-run"
    refused = cli("run", str(requests), "-o", str(output), "--fingerprint-mode", "nope")
    assert refused.returncode == 2 and "--fingerprint-mode" in refused.stderr
