"""The official ``openai`` package against the server on a real port, on every backend."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from tests.server.support import MODEL, OPENAI_STREAM_GC, Served, served, wait_until
from tests.text.client_support import PROMPT, added

pytestmark = [
    pytest.mark.anyio,
    OPENAI_STREAM_GC,
]


def _async(s: Served, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key=key, max_retries=0)


async def test_completions_whole_and_streamed_give_the_same_greedy_text() -> None:
    async with served() as s, _async(s) as client:
        whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                temperature=0.0)
        async with await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True,
                stream_options={"include_usage": True}) as stream:
            chunks = [chunk async for chunk in stream]
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_completions_take_token_ids_and_stop_strings() -> None:
    async with served() as s, _async(s) as client:
        ids = (await client.post("/../tokenize", cast_to=httpx.Response,
                                 body={"prompt": PROMPT})).json()["tokens"]
        by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                                 temperature=0.0)
        by_text = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                  temperature=0.0)
        text = by_text.choices[0].text
        stop = text[2:4]
        stopped = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                  temperature=0.0, stop=[stop])
    assert by_ids.choices[0].text == text
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


async def test_chat_with_the_sync_client_streamed_and_not() -> None:
    async with served() as s:
        def chat() -> tuple[str, str]:
            with openai.OpenAI(base_url=s.v1, api_key="none", max_retries=0) as client:
                messages = [{"role": "user", "content": "Tell me a story"}]
                whole = client.chat.completions.create(
                    model=MODEL, messages=messages,  # type: ignore[arg-type]
                    max_completion_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
                assert whole.choices[0].logprobs is not None
                assert whole.choices[0].logprobs.content is not None
                assert len(whole.choices[0].logprobs.content) == 6
                streamed = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in client.chat.completions.create(
                        model=MODEL, messages=messages,  # type: ignore[arg-type]
                        max_tokens=6, temperature=0.0, stream=True))
                return whole.choices[0].message.content or "", streamed

        whole, streamed = await anyio.to_thread.run_sync(chat)
    assert whole and whole == streamed


async def test_a_bad_field_is_400_naming_it_and_an_unknown_model_404() -> None:
    async with served() as s, _async(s) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-3)
        with pytest.raises(openai.BadRequestError) as bad_stop:
            await client.completions.create(model=MODEL, prompt=PROMPT, stop=[""])
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt=PROMPT)
        ok = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert bad.value.status_code == 400
    body = bad.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens"
    assert isinstance(bad_stop.value.body, dict) and bad_stop.value.body["param"] == "stop[0]"
    assert ok.choices[0].finish_reason == "length"


async def test_a_wrong_api_key_is_401_and_health_needs_none() -> None:
    async with served(api_key="sekrit") as s:
        async with _async(s, "wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        async with _async(s, "sekrit") as client:
            models = await client.models.list()
        async with httpx.AsyncClient() as http:
            health = await http.get(f"{s.base_url}/health")
            metrics = await http.get(f"{s.base_url}/metrics",
                                     headers={"authorization": "Bearer sekrit"})
    assert [m.id for m in models.data] == [MODEL]
    assert health.status_code == 200
    assert "vllm:" in metrics.text


async def test_a_client_that_disconnects_mid_stream_aborts_the_request_once() -> None:
    async with served(step_time=0.01) as s, httpx.AsyncClient() as http:
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1000,
                           "stream": True, "request_id": "dropped"}).encode()
        port = int(s.base_url.rsplit(":", 1)[1])
        # A raw connection, dropped after three events: a real disconnect.
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                            b"content-type: application/json\r\ncontent-length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
            seen = b""
            with anyio.fail_after(5):
                while seen.count(b"data: ") < 3:
                    seen += await conn.receive()
        engine = s.setup.engine
        await wait_until(lambda: engine.abort_frames >= 1)
        await anyio.sleep(0.1)  # nothing more arrives
        assert engine.abort_frames == 1
        assert len(engine.aborted_ids) == 1
        assert engine.aborted_ids[0].startswith("cmpl-dropped")
        assert [r.request.request_id for r in added(engine)] == engine.aborted_ids
        # The server still serves.
        after = await http.post(f"{s.v1}/completions",
                                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 200
