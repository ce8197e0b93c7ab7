"""The OpenAI-compatible server (``create_app``) over ONE real vLLM engine per backend.

The engine and its text client come from ``test_text_real`` (the tiny random Llama with the
bundled tokenizer, the engine loading it too); the server runs under Hypercorn on a real port
in the test's event loop (``tests/server/support``), and the official ``openai`` package
(``AsyncOpenAI``) talks to it. What a user of the server notices: streamed and whole greedy
completions agree and their usage counts the tokens; a chat goes through the bundled chat
template; a stop string cuts the text and frees the engine's request. A client that hangs up
mid-stream is NOT covered here yet (see tests/server/test_openai_client.py for the mock).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import openai
import pytest

from anyio_genout import SamplingParams
from anyio_genout.server import create_app
from anyio_genout.text import CollectedTextOutput, TextRequest
from tests.server.support import serving

from .conftest import GREEDY_16, INTEROP_TIMEOUT, unique_id
from .conftest import PROMPT as PROMPT_IDS
from .test_text_real import PROMPT, Served, generate_text, pick_stop, served, text, text_model

__all__ = ["served", "text", "text_model"]  # the fixtures this module reuses

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(INTEROP_TIMEOUT),
    # openai's AsyncStream leaves its (and httpx's) async generators for the garbage
    # collector after [DONE]; trio's finalizer warns about that. Not this package's code.
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <async_generator object (AsyncStream\._iter_events|"
        r"SSEDecoder\.aiter_bytes|Response\.aiter_bytes|PoolByteStream\.__aiter__)"
        r":pytest.PytestUnraisableExceptionWarning"),
]

MODEL = "tiny"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
async def base_url(served: Served) -> AsyncIterator[str]:
    """The server over the module's real engine, on 127.0.0.1:<free port>, ready."""
    async with serving(create_app(served.text, model_name=MODEL)) as base:
        yield base


@pytest.fixture
async def api(base_url: str, text: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none",
                                  max_retries=0) as client:
        yield client


async def _reference(served: Served, max_tokens: int) -> CollectedTextOutput:
    """The text client's own greedy run of :data:`PROMPT` (no server in between)."""
    return await generate_text(served.text, TextRequest(
        request_id=unique_id("ref"), prompt=PROMPT,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens)))


async def _idle(served: Served) -> None:
    """The client tracks nothing and the engine's scheduler runs and queues nothing."""
    with anyio.fail_after(10):
        while served.client.engine.in_flight:  # noqa: ASYNC110 - polling a counter
            await anyio.sleep(0.01)
    idle = await served.stats.wait_idle()
    assert idle.num_running_reqs == 0 and idle.num_waiting_reqs == 0


async def test_whole_and_streamed_completions_agree_and_count_tokens(
        api: openai.AsyncOpenAI, text: Served) -> None:
    tokenizer = text.text.tokenizer
    whole = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0.0)
    async with await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            stream_options={"include_usage": True}) as stream:
        chunks = [chunk async for chunk in stream]
    choice = whole.choices[0]
    assert choice.text.strip(), whole
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens,
                                                                          MAX_TOKENS)
    assert choice.finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens,
                                                                        MAX_TOKENS)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    # The same greedy tokens as the text client's own run, decoded.
    reference = await _reference(text, MAX_TOKENS)
    assert choice.text == reference.text == tokenizer.decode(reference.token_ids)
    assert len(reference.token_ids) == MAX_TOKENS
    await _idle(text)


async def test_greedy_completions_are_the_same_on_every_run(
        api: openai.AsyncOpenAI, text: Served) -> None:
    """Two requests of the prompt's token ids give the model's known greedy tokens (the
    interop tests' recorded run, so on every engine start too), whole and streamed; the
    ``--workers 2`` test (test_server_workers_real) expects the same text."""
    expected = text.text.tokenizer.decode(list(GREEDY_16))
    answers = []
    for _ in range(2):
        whole = await api.completions.create(model=MODEL, prompt=list(PROMPT_IDS),
                                             max_tokens=len(GREEDY_16), temperature=0.0)
        answers.append(whole.choices[0].text)
        async with await api.completions.create(
                model=MODEL, prompt=list(PROMPT_IDS), max_tokens=len(GREEDY_16),
                temperature=0.0, stream=True) as stream:
            answers.append("".join([c.choices[0].text async for c in stream if c.choices]))
    assert answers == [expected] * 4
    await _idle(text)


async def test_chat_through_the_bundled_template_returns_text(
        api: openai.AsyncOpenAI, text: Served) -> None:
    messages = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
    whole = await api.chat.completions.create(
        model=MODEL, messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=MAX_TOKENS, temperature=0.0)
    streamed = ""
    async with await api.chat.completions.create(
            model=MODEL, messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, temperature=0.0, stream=True) as stream:
        async for chunk in stream:
            if chunk.choices:
                streamed += chunk.choices[0].delta.content or ""
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert message.content and message.content == streamed
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= MAX_TOKENS
    rendered = text.text.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(text.text.tokenizer.encode(
        rendered, add_special_tokens=False)), rendered
    await _idle(text)


#: Tokens the stopped requests may run to (the engines' max_model_len is 512).
LONG = 400


async def test_a_stop_string_cuts_the_text_and_frees_the_engine_request(
        api: openai.AsyncOpenAI, text: Served) -> None:
    client, tokenizer = text.client, text.text.tokenizer
    whole = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                         temperature=0.0)
    full = whole.choices[0].text
    reference = await _reference(text, 30)
    token_ids = list(reference.token_ids)
    assert reference.text == full
    stop, where, kept = pick_stop(tokenizer, token_ids, full)
    assert where > 0 and kept < 30, (stop, full)
    await _idle(text)
    aborts = client.engine.aborts_sent

    # The stopped requests may run far past the stop: the stop is in the first 30 tokens,
    # and with 30 the engine could finish both before the stop was seen (a reader behind a
    # fast CPU engine hands a whole request's outputs over in one pass), so no ABORT was due.
    stopped = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG,
                                           temperature=0.0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[:where]
    assert stopped.usage is not None and stopped.usage.completion_tokens == kept
    async with await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0.0, stop=[stop],
            stream=True) as stream:
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:where]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The engine had not finished either request: one ABORT each, and nothing left running.
    await _idle(text)
    assert client.engine.aborts_sent == aborts + 2
