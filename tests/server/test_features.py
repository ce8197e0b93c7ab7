"""Server features with the ``openai`` package on a real port, on every backend: ``n``
choices, the limits against hostile clients, structured outputs."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import anyio
import anyio.abc
import httpx
import openai
import pytest

from tests.server.support import (
    MODEL,
    OPENAI_STREAM_GC,
    Served,
    open_sse,
    serve_process,
    served,
    wait_until,
)
from tests.text.client_support import PROMPT, added

pytestmark = [
    pytest.mark.anyio,
    OPENAI_STREAM_GC,
]

MESSAGES: Any = [{"role": "user", "content": "Tell me a story"}]


def _async(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0)


def _param(error: openai.APIStatusError) -> Any:
    assert isinstance(error.body, dict)
    return error.body["param"]


# ---------------------------------------------------------------------------------- n


async def test_n_choices_are_child_requests_with_seeds_and_summed_usage() -> None:
    async with served() as s, _async(s) as client:
        whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                                n=3, seed=7,
                                                extra_body={"request_id": "par"})
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2,
                                                    max_completion_tokens=4)
        adds = added(s.setup.engine)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in whole.choices)
    assert whole.id == "cmpl-par"  # vLLM's: the route's prefix and the body's request_id
    assert whole.usage is not None and whole.usage.completion_tokens == 15
    one_prompt = whole.usage.prompt_tokens
    assert whole.usage.total_tokens == one_prompt + 15  # the prompt counts once
    first = [a.request for a in adds[:3]]
    assert [r.request_id.split("-")[:2] for r in first] == [
        ["0_cmpl", "par"], ["1_cmpl", "par"], ["2_cmpl", "par"]]
    assert [r.sampling_params.seed for r in first] == [7, 8, 9]
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert [a.request.sampling_params.seed for a in adds[3:]] == [None, None]


async def test_n_streamed_choices_interleave_by_index() -> None:
    async with served(step_time=0.002) as s, _async(s) as client:
        async with await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=6, n=3, seed=5, stream=True,
                stream_options={"include_usage": True}) as stream:
            chunks = [chunk async for chunk in stream]
        async with await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True) as chat:
            chat_chunks = [chunk async for chunk in chat]
    indexes = [c.choices[0].index for c in chunks if c.choices]
    assert sorted(set(indexes)) == [0, 1, 2]
    first = {i: indexes.index(i) for i in range(3)}
    last = {i: len(indexes) - 1 - indexes[::-1].index(i) for i in range(3)}
    assert max(first.values()) < min(last.values())  # all under way before any ends
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert all(texts)  # seeds 5, 6, 7 (n > 1 cannot be greedy: vLLM refuses it)
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 18
    roles = [c.choices[0].index for c in chat_chunks if c.choices[0].delta.role]
    assert roles == [0, 1]
    assert sorted(c.choices[0].index for c in chat_chunks if c.choices[0].finish_reason) \
        == [0, 1]


async def test_a_disconnect_aborts_every_choice_exactly_once() -> None:
    async with served(step_time=0.01) as s, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "n": 3, "stream": True,
                "request_id": "drop"}
        async with await open_sse(s.base_url, body, 6):
            pass
        engine = s.setup.engine
        await wait_until(lambda: len(engine.aborted_ids) >= 3)
        await anyio.sleep(0.1)  # nothing more arrives
        assert sorted(engine.aborted_ids) == sorted(r.request.request_id
                                                    for r in added(engine))
        assert len(set(engine.aborted_ids)) == 3
        after = await http.post(f"{s.v1}/completions",
                                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 200


# ----------------------------------------------------------------------------- limits


async def test_n_and_max_tokens_are_bounded_with_400_naming_the_field() -> None:
    async with served(max_model_len=64, app_options={"max_n": 4}) as s, _async(s) as client:
        with pytest.raises(openai.BadRequestError) as many:
            await client.completions.create(model=MODEL, prompt=PROMPT, n=5)
        with pytest.raises(openai.BadRequestError) as long:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=65)
        with pytest.raises(openai.BadRequestError) as long_chat:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_completion_tokens=100)
        ok = await client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=2)
    assert _param(many.value) == "n"
    assert _param(long.value) == "max_tokens"
    assert "max_model_len=64" in long.value.message
    assert _param(long_chat.value) == "max_completion_tokens"
    assert len(ok.choices) == 4


async def test_a_body_beyond_the_limit_is_413_with_or_without_a_length() -> None:
    async with served(app_options={"max_body_size": 2000}) as s, httpx.AsyncClient() as http:
        big = {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 2}
        sized = await http.post(f"{s.v1}/completions", json=big)

        async def chunks() -> Any:
            data = json.dumps(big).encode()
            for i in range(0, len(data), 500):
                yield data[i:i + 500]

        chunked = await http.post(f"{s.v1}/completions", content=chunks(),
                                  headers={"content-type": "application/json"})
        ok = await http.post(f"{s.v1}/completions",
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    for response in (sized, chunked):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == 413
    assert ok.status_code == 200


async def test_a_body_that_trickles_past_the_body_timeout_is_408() -> None:
    async with served(app_options={"body_timeout": 0.3}) as s, httpx.AsyncClient() as http:
        port = int(s.base_url.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                            b"content-type: application/json\r\ncontent-length: 100\r\n"
                            b"\r\n{\"prompt\": ")  # and nothing more
            answer = b""
            with anyio.fail_after(5):
                while b"}}" not in answer:
                    answer += await conn.receive()
        ok = await http.post(f"{s.v1}/completions",
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == 408
    assert ok.status_code == 200


async def test_requests_beyond_max_concurrent_requests_are_429() -> None:
    async with served(step_time=0.01, app_options={"max_concurrent_requests": 1}) as s, \
            _async(s) as client:
        async with await open_sse(s.base_url, {"model": MODEL, "prompt": PROMPT,
                                               "max_tokens": 1000, "stream": True}):
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            models = await client.models.list()  # not a generation: not limited
        engine = s.setup.engine
        await wait_until(lambda: engine.abort_frames >= 1)
        ok = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert refused.value.status_code == 429
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == 429
    assert [m.id for m in models.data] == [MODEL]
    # Served again (two random tokens may end inside a character: then no text).
    assert ok.choices[0].finish_reason == "length"
    assert ok.usage is not None and ok.usage.completion_tokens == 2


# ------------------------------------------------------------------ structured outputs


async def test_response_format_and_structured_outputs_reach_the_engine() -> None:
    # The mock engine has no grammar backend: it refuses every constraint (finish reason
    # error, a 500 naming the field: tests/server/test_mock_model.py); what is tested here
    # is the constraint it receives.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with served() as s, _async(s) as client:
        with pytest.raises(openai.InternalServerError, match="response_format"):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_tokens=2,
                                                 response_format={"type": "json_object"})
        with pytest.raises(openai.InternalServerError, match="response_format"):
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "a", "schema": schema}})
        with pytest.raises(openai.InternalServerError, match="structured_outputs"):
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2,
                extra_body={"structured_outputs": {"regex": "a+"}})
        with pytest.raises(openai.InternalServerError, match="response_format"):
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2,
                extra_body={"response_format": {"type": "json_object"}})
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                             response_format={"type": "text"})
        wires = [a.sampling_wire.get("structured_outputs") for a in added(s.setup.engine)]
    assert wires[0]["json_object"] is True
    assert wires[1]["json"] == schema
    assert wires[2]["regex"] == "a+"
    assert wires[3]["json_object"] is True
    assert wires[4] is None


async def test_invalid_structured_outputs_are_400_naming_the_field() -> None:
    async with served() as s, _async(s) as client:
        refused = []
        for extra in ({"structured_outputs": {"json": "{not json"}},
                      {"structured_outputs": {"bogus": 1}},
                      {"structured_outputs": {"regex": "a", "choice": ["x"]}},
                      {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
                      {"response_format": {"type": "yaml"}}):
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     max_tokens=2, extra_body=extra)
            refused.append(_param(bad.value))
        assert added(s.setup.engine) == []
    assert refused == ["structured_outputs.json", "structured_outputs.bogus",
                       "structured_outputs", "response_format.json_schema",
                       "response_format.type"]


async def test_a_lone_surrogate_is_400_naming_where_it_is() -> None:
    async with served() as s, httpx.AsyncClient() as http:
        answers = [await http.post(f"{s.base_url}{path}", content=body,
                                   headers={"content-type": "application/json"})
                   for path, body in [
                       ("/v1/completions", b'{"prompt":["a\\udc00"]}'),
                       ("/v1/chat/completions",
                        b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
                       ("/tokenize", b'{"prompt":"\\ud800"}')]]
    assert [r.status_code for r in answers] == [400] * 3
    assert [r.json()["error"]["param"] for r in answers] == [
        "prompt[0]", "messages[0].content", "prompt"]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_serve_times_out_a_slow_loris_and_passes_its_limits_on(backend: str) -> None:
    with serve_process("--backend", backend, "--keep-alive-timeout", "0.5", "--max-n", "2",
                       "--max-body-size", "300") as server:
        base, port = server.base, server.port
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never ends
            conn.settimeout(5)
            start = time.monotonic()
            assert conn.recv(1000) == b""  # closed by the server, unanswered
            waited = time.monotonic() - start
        body = {"prompt": "Once upon a time", "max_tokens": 2}
        many = httpx.post(f"{base}/v1/completions", json={**body, "n": 3})
        big = httpx.post(f"{base}/v1/completions", json={**body, "prompt": "x" * 300})
        ok = httpx.post(f"{base}/v1/completions", json={**body, "n": 2})
    assert waited < 3
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    assert big.status_code == 413
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


# ------------------------------------------------------------------------------- echo


async def test_echo_prepends_the_prompt_to_each_choice() -> None:
    async with served() as s, _async(s) as client:
        plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                temperature=0.0)
        echoed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                 temperature=0.0, echo=True)
        ids = (await client.post("/../tokenize", cast_to=httpx.Response,
                                 body={"prompt": PROMPT, "add_special_tokens": False})
               ).json()["tokens"]
        by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=4,
                                                 temperature=0.0, echo=True)
        ids_plain = await client.completions.create(model=MODEL, prompt=ids, max_tokens=4,
                                                    temperature=0.0)
        async with await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True,
                stream=True) as stream:
            streamed = "".join([c.choices[0].text async for c in stream])
    text = plain.choices[0].text
    assert [c.text for c in echoed.choices] == [PROMPT + text]
    assert streamed == PROMPT + text
    assert by_ids.choices[0].text == PROMPT + ids_plain.choices[0].text  # ids decoded
