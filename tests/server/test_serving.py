"""The serving functions called as plain functions, with no ASGI around them (as ``run``'s batch
lines call them): a body in, its JSON body or its SSE chunks out; the request already counted
in the metrics when the answer's last bytes are handed over; a bad choice refused on entering,
before any chunk."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout.server.app import MAX_N
from anyio_genout.server.errors import ApiError
from anyio_genout.server.serving import (
    COMPLETIONS_URL,
    DONE,
    Generation,
    Serving,
    parse_body,
    serve_stream,
    serve_whole,
)
from anyio_genout.text import TextClient
from tests.server.support import MODEL
from tests.text.client_support import text_client

BODY = {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "seed": 7}


def _finished(text: TextClient) -> float:
    """``vllm:request_success_total`` summed over its labels."""
    families = text_string_to_metric_families(
        generate_latest(text.client.metrics.registry).decode())
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == "vllm:request_success_total")


def _serving(text: TextClient) -> Serving:
    return Serving(text_client=text, model_name=MODEL, max_n=MAX_N)


@pytest.mark.anyio
async def test_a_whole_body_is_returned_with_its_requests_counted() -> None:
    async with text_client() as setup:
        plan = _serving(setup.text).plan(parse_body(COMPLETIONS_URL, BODY))
        body = await serve_whole(Generation(setup.text, plan))
        assert _finished(setup.text) == 2  # both choices, before anyone could send the body
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert all(choice["finish_reason"] == "length" for choice in body["choices"])
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.anyio
async def test_a_stream_hands_over_its_chunks_and_then_its_last_bytes() -> None:
    async with text_client() as setup:
        serving = _serving(setup.text)
        whole = await serve_whole(Generation(setup.text, serving.plan(
            parse_body(COMPLETIONS_URL, BODY))))
        counted = _finished(setup.text)
        plan = serving.plan(parse_body(COMPLETIONS_URL, {
            **BODY, "stream": True, "stream_options": {"include_usage": True}}))
        chunks: list[bytes] = []

        async def send_chunk(chunk: bytes) -> None:
            chunks.append(chunk)

        async with Generation(setup.text, plan) as generation:
            last = await serve_stream(generation, send_chunk)
            assert _finished(setup.text) == counted + 2  # closed before [DONE] is handed over
    assert last.endswith(DONE)
    events: list[dict[str, Any]] = [json.loads(chunk.removeprefix(b"data: "))
                                    for chunk in b"".join(chunks).split(b"\n\n") if chunk]
    texts = ["", ""]
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [choice["text"] for choice in whole["choices"]]
    usage = json.loads(last.removesuffix(DONE).removeprefix(b"data: "))["usage"]
    assert usage == whole["usage"]


@pytest.mark.anyio
async def test_a_choice_refused_on_entering_is_an_api_error_before_any_chunk() -> None:
    async with text_client() as setup:
        plan = _serving(setup.text).plan(parse_body(COMPLETIONS_URL, {
            "prompt": [1] * 5000, "max_tokens": 2, "stream": True}))
        with pytest.raises(ApiError) as caught:
            async with Generation(setup.text, plan):
                raise AssertionError("entered")
    assert caught.value.status == 400 and caught.value.param == "input_tokens"


def test_a_bad_body_names_the_field_without_the_union_tag() -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(COMPLETIONS_URL, {"prompt": 5})
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert caught.value.message == "invalid request: prompt: Input should be a valid string"
