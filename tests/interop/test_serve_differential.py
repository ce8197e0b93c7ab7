"""The field differential: the same requests through ``vllm serve`` and through
``anyio-genout serve``, each over its own real vLLM 0.32 CPU engine (the tiny model, the
bundled tokenizer and chat template, the same engine flags), every field of every answer
compared (issue 24).

One request per implemented field of the completions and chat bodies (``server/fields.py``),
greedy unless the field is about sampling (then seeded), each whole and streamed where vLLM
allows streaming, and a set of bodies both servers must refuse. What is compared:

* a whole answer: its JSON, every key, but ``id``, ``created`` and tool-call ids (random in
  both), and a key that one side sends as ``null`` and the other leaves out (a client of
  either sees ``None``);
* a streamed answer: the same, on the answer assembled from its chunks per choice (text or
  content and reasoning concatenated, logprobs lists joined, the last finish and stop reason,
  the usage chunk). How many chunks carry it is not compared: under load ours merges what
  arrived together into one event (docs/server.md), as vLLM's ``--stream-interval`` does;
* a refusal: the status, and the error's ``type`` and ``param``.

A difference that docs/server.md names with its reason is listed in :data:`KNOWN`; any other
fails the test, all of them in one message.

The servers run one after the other (the machine has two cores); the whole file takes 4-6
minutes, most of it two engine start-ups.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import httpx
import pytest

from tests.support import sse_lines

from .conftest import RealVllm
from .test_metrics_differential import MODEL, ours, vllm_serve
from .test_text_real import text_model

__all__ = ["text_model"]  # the fixture this module reuses

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(1200)]

PROMPT = "The quick brown fox jumps over"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
SEEDED: dict[str, Any] = {"temperature": 0.8, "seed": 1234, "max_tokens": 8}
USER = [{"role": "user", "content": "Tell me about the sea"}]

Case = tuple[str, str, dict[str, Any], bool]  # (name, route, body, also streamed)

#: Completions: one body per implemented field.
COMPLETIONS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("prompt_token_ids", {"prompt": [1, 5, 6, 7, 8]}),
    ("prompt_list", {"prompt": [PROMPT, "Once upon a time"]}),
    ("prompt_id_lists", {"prompt": [[1, 5, 6], [1, 9, 10, 11]]}),
    ("n_seeded", {**SEEDED, "n": 2}),
    ("temperature_seed", SEEDED),
    ("top_p", {**SEEDED, "top_p": 0.5}),
    ("top_k", {**SEEDED, "top_k": 3}),
    ("min_p", {**SEEDED, "min_p": 0.2}),
    ("presence_penalty", {"presence_penalty": 1.5}),
    ("frequency_penalty", {"frequency_penalty": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 1.8}),
    ("min_tokens_ignore_eos", {"min_tokens": 6, "ignore_eos": True, "max_tokens": 10}),
    ("max_tokens", {"max_tokens": 3}),
    ("stop_token_ids", {"stop_token_ids": [7, 139], "max_tokens": 16}),
    ("logprobs_0", {"logprobs": 0}),
    ("logprobs_3", {"logprobs": 3}),
    ("prompt_logprobs", {"prompt_logprobs": 2}),
    ("echo", {"echo": True}),
    ("echo_logprobs", {"echo": True, "logprobs": 1}),
    ("echo_prompt_only", {"echo": True, "max_tokens": 0}),
    ("echo_prompt_only_logprobs", {"echo": True, "max_tokens": 0, "logprobs": 2}),
    ("logit_bias", {"logit_bias": {"139": -100, "7": -100}}),
    ("stream_interval", {"stream_interval": 3, "max_tokens": 10}),
    ("allowed_token_ids", {"allowed_token_ids": [5, 9, 44, 300], "max_tokens": 6}),
    ("add_special_tokens_false", {"add_special_tokens": False}),
    ("skip_special_tokens_false", {"skip_special_tokens": False,
                                   "spaces_between_special_tokens": False}),
    ("return_tokens_as_token_ids", {"logprobs": 1, "return_tokens_as_token_ids": True}),
    ("structured_choice", {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("structured_regex", {"structured_outputs": {"regex": "[a-c]{3}"}}),
    ("response_format_json", {"response_format": {"type": "json_object"}, "max_tokens": 12}),
]

#: Chat: one body per implemented field.
CHATS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("system", {"messages": [{"role": "system", "content": "Be brief."}, *USER]}),
    ("developer", {"messages": [{"role": "developer", "content": "Be brief."}, *USER]}),
    ("multi_turn", {"messages": [*USER, {"role": "assistant", "content": "It is big."},
                                 {"role": "user", "content": "More"}]}),
    ("content_parts", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me"}, {"type": "text", "text": " about the sea"}]}]}),
    ("max_completion_tokens", {"max_completion_tokens": 4}),
    ("n_seeded", {**SEEDED, "n": 2}),
    ("logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("logprobs_0", {"logprobs": True, "top_logprobs": 0}),
    ("prompt_logprobs", {"prompt_logprobs": 1}),
    ("echo", {"echo": True}),
    ("add_generation_prompt_false", {"add_generation_prompt": False}),
    ("continue_final_message", {"add_generation_prompt": False, "continue_final_message": True,
                                "messages": [*USER, {"role": "assistant",
                                                     "content": "The sea is"}]}),
    ("echo_continue", {"echo": True, "add_generation_prompt": False,
                       "continue_final_message": True,
                       "messages": [*USER, {"role": "assistant", "content": "The sea is"}]}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("logit_bias", {"logit_bias": {"139": -100}}),
    ("stop_token_ids", {"stop_token_ids": [7], "max_tokens": 16}),
    ("tool_choice_none", {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "none"}),
    ("structured_choice", {"structured_outputs": {"choice": ["yes", "no"]}}),
    ("stream_usage", {"stream_options": {"include_usage": True}}),
    ("stream_usage_continuous", {"stream_options": {"include_usage": True,
                                                    "continuous_usage_stats": True}}),
]

#: Bodies both servers refuse: the status and the error's type and param must agree.
REFUSALS: list[tuple[str, str, dict[str, Any]]] = [
    ("n_greedy", "completions", {"n": 2}),
    ("max_tokens_negative", "completions", {"max_tokens": -1}),
    ("max_tokens_zero", "completions", {"max_tokens": 0}),
    ("temperature_negative", "completions", {"temperature": -0.5}),
    ("top_p_zero", "completions", {"top_p": 0.0}),
    ("logprobs_too_many", "completions", {"logprobs": 50}),
    ("top_logprobs_too_many", "chat", {"logprobs": True, "top_logprobs": 50}),
    ("prompt_logprobs_stream", "completions", {"prompt_logprobs": 1, "stream": True}),
    ("prompt_too_long", "completions", {"prompt": [5] * 5000}),
    ("max_tokens_too_many", "completions", {"max_tokens": 100000}),
    ("suffix", "completions", {"suffix": "x"}),
    ("bad_model", "completions", {"model": "not-the-model"}),
    ("empty_messages", "chat", {"messages": []}),
    ("bad_role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
]

#: Differences docs/server.md names ("Measured against vllm serve"), by (route, case name):
#: (the reason, the keys left out of both answers before they are compared).
KNOWN: dict[tuple[str, str], tuple[str, frozenset[str]]] = {
    ("completions", "return_tokens_as_token_ids"): (
        "vLLM counts text_offset in the 'token_id:N' strings, not in the text", frozenset(
            {"text_offset"})),
    # Both send one; ours is anyio-genout's (docs/server.md, "system_fingerprint").
    **{(route, name): ("the fingerprint names the server", frozenset({"system_fingerprint"}))
       for route, name in [("completions", "*"), ("chat", "*")]},
}


def _without(value: Any, keys: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without(v, keys) for v in value]
    return value


def _left_out(route: str, name: str) -> frozenset[str]:
    """The keys :data:`KNOWN` leaves out of a case's answers."""
    return (KNOWN.get((route, "*"), ("", frozenset()))[1]
            | KNOWN.get((route, name), ("", frozenset()))[1])


def _cases() -> list[Case]:
    cases: list[Case] = []
    for name, extra in COMPLETIONS:
        cases.append((name, "completions", {"model": MODEL, "prompt": PROMPT, **GREEDY,
                                            **extra}, "prompt_logprobs" not in extra))
    for name, extra in CHATS:
        cases.append((name, "chat", {"model": MODEL, "messages": USER, **GREEDY, **extra},
                      "prompt_logprobs" not in extra))
    return cases


def _path(route: str) -> str:
    return "/v1/completions" if route == "completions" else "/v1/chat/completions"


def normalized(value: Any) -> Any:
    """``value`` without ids, timestamps and ``null`` keys (absent and null are one)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()
                if v is not None and k not in ("id", "created")}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def _join(into: dict[str, Any], piece: dict[str, Any]) -> None:
    """Add a streamed choice's (or delta's) fields to what was assembled so far."""
    for key, value in piece.items():
        if value is None or key == "index":
            continue
        if isinstance(value, str) and key in ("text", "content", "reasoning"):
            into[key] = into.get(key, "") + value
        elif isinstance(value, list) and key in ("content", "tool_calls"):
            into.setdefault(key, []).extend(value)
        elif isinstance(value, dict) and key in ("logprobs", "delta"):
            _join(into.setdefault(key, {}), value)
        elif isinstance(value, list) and key in ("tokens", "token_logprobs", "top_logprobs",
                                                  "text_offset"):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = value


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one answer: per choice index, everything joined; the usage."""
    choices: dict[int, dict[str, Any]] = {}
    answer: dict[str, Any] = {}
    running: dict[int, Any] = {}  # continuous usage: each choice's last chunk's
    for event in events:
        for choice in event.get("choices") or []:
            _join(choices.setdefault(choice["index"], {}), choice)
            if event.get("usage") is not None:
                running[choice["index"]] = event["usage"]
        if event.get("usage") is not None:
            answer["usage"] = event["usage"]
    if running:
        answer["running_usage"] = [running[i] for i in sorted(running)]
        for key in ("object", "model", "error", "system_fingerprint"):
            if key in event:
                answer[key] = event[key]
    answer["choices"] = [choices[i] for i in sorted(choices)]
    result: dict[str, Any] = normalized(answer)
    return result


async def _ask(http: httpx.AsyncClient, base: str, route: str, body: dict[str, Any],
               stream: bool) -> Any:
    body = {**body, "stream": stream} if stream else body
    if not stream:
        reply = await http.post(f"{base}{_path(route)}", json=body)
        data = reply.json()
        if reply.status_code != 200:
            return {"status": reply.status_code, "error": _error(data)}
        return normalized(data)
    events: list[dict[str, Any]] = []
    async with http.stream("POST", f"{base}{_path(route)}", json=body) as reply:
        if reply.status_code != 200:
            return {"status": reply.status_code,
                    "error": _error(json.loads(await reply.aread()))}
        async for line in sse_lines(reply):
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return assembled(events)


def _error(data: dict[str, Any]) -> dict[str, Any]:
    error = data.get("error", data)
    return {"type": error.get("type"), "param": error.get("param")}


async def _answers(base: str) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=180) as http:
        for name, route, body, streams in _cases():
            answers[f"{route}/{name}"] = await _ask(http, base, route, body, False)
            if streams:
                answers[f"{route}/{name}/stream"] = await _ask(http, base, route, body, True)
        for name, route, extra in REFUSALS:
            body = ({"model": MODEL, "prompt": PROMPT, **GREEDY} if route == "completions"
                    else {"model": MODEL, "messages": USER, **GREEDY})
            body.update(extra)
            answers[f"{route}/refused/{name}"] = await _ask(
                http, base, route, body, bool(body.pop("stream", False)))
    return answers


async def test_every_field_of_every_answer_equals_vllm_serve(
        real_vllm: RealVllm, text_model: Any, anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("one run: the servers are subprocesses, the backend does not matter")
    async with vllm_serve(real_vllm, text_model) as base:
        theirs = await _answers(base)
    async with ours(real_vllm, text_model) as base:
        mine = await _answers(base)
    dump = os.environ.get("ANYIO_GENOUT_SERVE_DIFF_DUMP")
    if dump:  # both sides' answers, for reading a difference whole
        await anyio.Path(dump).write_text(json.dumps({"vllm": theirs, "ours": mine}, indent=1))
    differences = []
    for key, expected in theirs.items():
        route, name = key.split("/")[0], key.split("/")[1]
        left_out = _left_out(route, name)
        if "system_fingerprint" in left_out and "status" not in expected:
            # Sent by both wherever vLLM sends it (a whole answer; a stream's last chunk).
            assert ("system_fingerprint" in expected) == ("system_fingerprint" in mine[key]), key
        expected, got = _without(expected, left_out), _without(mine[key], left_out)
        if got != expected:
            differences.append(f"{key}:\n  vllm serve: {json.dumps(expected)[:1500]}\n"
                               f"  ours:       {json.dumps(got)[:1500]}")
    assert not differences, (f"{len(differences)} of {len(theirs)} answers differ:\n"
                             + "\n".join(differences))
    # The cases are what they say: the refusals refused, every other case answered (but
    # stream_options without stream, which both refuse: the chat stream_usage cases whole).
    refused = {key for key, answer in mine.items() if "status" in answer}
    assert refused == {f"{route}/refused/{name}" for name, route, _ in REFUSALS} | {
        "chat/stream_usage", "chat/stream_usage_continuous"}, refused
