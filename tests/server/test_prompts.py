"""Completions with several prompts, and ``echo`` with ``logprobs``, through the ``openai``
package on a real port, on every backend: vLLM's choice numbering (prompt index * n + i),
usage summed over prompts and choices, leaving early aborting every child request, the
prompt's logprobs in front of the completion's (the first prompt token has none)."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.server.support import MODEL, Served, served, wait_until
from tests.text.client_support import PROMPT, added

pytestmark = [
    pytest.mark.anyio,
    # See test_openai_client.py: openai's AsyncStream leaves async generators to the GC
    # (its __aiter__ too, when a test leaves the iteration early: a disconnect).
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <async_generator object (AsyncStream\._iter_events|"
        r"AsyncStream\.__aiter__|"
        r"SSEDecoder\.aiter_bytes|Response\.aiter_bytes|PoolByteStream\.__aiter__)"
        r":pytest.PytestUnraisableExceptionWarning"),
]

OTHER = "The lighthouse keeper"


def _async(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0)


def _param(error: openai.APIStatusError) -> Any:
    assert isinstance(error.body, dict)
    return error.body["param"]


async def _tokenize(client: openai.AsyncOpenAI, prompt: str) -> dict[str, Any]:
    answer = await client.post("/../tokenize", cast_to=httpx.Response,
                               body={"prompt": prompt, "return_token_strs": True})
    return answer.json()  # type: ignore[no-any-return]


async def test_several_prompts_are_numbered_as_vllm_and_usage_sums_them() -> None:
    async with served() as s, _async(s) as client:
        alone = [(await client.completions.create(model=MODEL, prompt=p, max_tokens=5,
                                                  seed=7)).choices[0].text
                 for p in (PROMPT, OTHER)]
        lengths = [(await _tokenize(client, p))["count"] for p in (PROMPT, OTHER)]
        both = await client.completions.create(model=MODEL, prompt=[PROMPT, OTHER],
                                               max_tokens=5, seed=7, n=2,
                                               extra_body={"request_id": "many"})
        ids = [(await _tokenize(client, p))["tokens"] for p in (PROMPT, OTHER)]
        by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=5,
                                                 seed=7)
        one_list = await client.completions.create(model=MODEL, prompt=[OTHER], max_tokens=5,
                                                   seed=7)
        adds = added(s.setup.engine)
    assert both.id == "cmpl-many"
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    # index = prompt index * n + i: the two choices of PROMPT, then the two of OTHER (the
    # first of each with the seed, as alone; n > 1 cannot be greedy: vLLM refuses it).
    assert [c.text for c in both.choices][::2] == alone
    assert alone[0] != alone[1]
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(lengths)  # each prompt once
    assert both.usage.completion_tokens == 20  # every choice
    assert both.usage.total_tokens == sum(lengths) + 20
    # vLLM's ids: "{id}-{prompt}" per prompt, "{i}_" before it per choice.
    assert sorted(a.request.external_req_id for a in adds[2:6]) \
        == ["0_cmpl-many-0", "0_cmpl-many-1", "1_cmpl-many-0", "1_cmpl-many-1"]
    assert [c.text for c in by_ids.choices] == alone  # lists of token ids
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == sum(lengths)
    assert [c.text for c in one_list.choices] == [alone[1]]


async def test_streamed_prompts_interleave_by_index_and_usage_sums_them() -> None:
    async with served(step_time=0.002) as s, _async(s) as client:
        whole = await client.completions.create(model=MODEL, prompt=[PROMPT, OTHER],
                                                max_tokens=6, seed=7, n=2)
        async with await client.completions.create(
                model=MODEL, prompt=[PROMPT, OTHER], max_tokens=6, seed=7, n=2,
                stream=True, stream_options={"include_usage": True}) as stream:
            chunks = [chunk async for chunk in stream]
    indexes = [c.choices[0].index for c in chunks if c.choices]
    assert sorted(set(indexes)) == [0, 1, 2, 3]
    assert indexes != sorted(indexes)  # not one choice after the other
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(4)]
    assert texts == [c.text for c in whole.choices]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and whole.usage is not None
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # both prompts, once each


async def test_prompt_lists_are_bounded_and_checked_naming_prompt() -> None:
    async with served(app_options={"max_n": 4}) as s, _async(s) as client:
        with pytest.raises(openai.BadRequestError) as empty:
            await client.completions.create(model=MODEL, prompt=[], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as empty_ids:
            await client.completions.create(model=MODEL, prompt=[[5, 6], []], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as too_many:
            await client.completions.create(model=MODEL, prompt=[PROMPT] * 3, n=2,
                                            max_tokens=2)
        with pytest.raises(openai.BadRequestError) as vocab:
            await client.completions.create(model=MODEL, prompt=[[5, 6], [7, 10**9]],
                                            max_tokens=2)
        ok = await client.completions.create(model=MODEL, prompt=[PROMPT] * 2, n=2,
                                             max_tokens=2)
        sent = len(added(s.setup.engine))
    assert _param(empty.value) == "prompt"
    assert _param(empty_ids.value) == "prompt[1]"
    assert _param(too_many.value) == "prompt"
    assert "6 choices" in str(too_many.value) and "at most 4" in str(too_many.value)
    assert _param(vocab.value) == "prompt[1][1]"
    assert len(ok.choices) == 4
    assert sent == 4  # nothing of the refused requests reached the engine


async def test_leaving_a_stream_of_several_prompts_aborts_every_choice_once() -> None:
    async with served(step_time=0.01) as s, _async(s) as client:
        async with await client.completions.create(
                model=MODEL, prompt=[PROMPT, OTHER, PROMPT], max_tokens=1000, n=2,
                stream=True, extra_body={"request_id": "drop"}) as stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 8:
                    break
        engine = s.setup.engine
        await wait_until(lambda: len(engine.aborted_ids) >= 6)
        await anyio.sleep(0.1)  # nothing more arrives
        sent = sorted(a.request.request_id for a in added(engine))
        after = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert len(sent) == 6
    assert sorted(engine.aborted_ids) == sent  # each child once
    # The server serves on (two random tokens may end inside a character: then no text).
    assert after.choices[0].finish_reason == "length"
    assert after.usage is not None and after.usage.completion_tokens == 2


async def test_echo_with_logprobs_puts_the_prompts_logprobs_first() -> None:
    async with served() as s, _async(s) as client:
        plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                temperature=0.0, logprobs=2)
        echoed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                 temperature=0.0, logprobs=2, echo=True)
        prompt = await _tokenize(client, PROMPT)
        first = (await client.post("/../detokenize", cast_to=httpx.Response,
                                   body={"tokens": prompt["tokens"][:1]})).json()["prompt"]
        raw = (await client.post("/completions", cast_to=httpx.Response,
                                 body={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                       "temperature": 0.0, "logprobs": 2, "echo": True})
               ).json()
        wire = added(s.setup.engine)[1].request.sampling_params
    count = prompt["count"]
    assert count >= 2
    assert wire.prompt_logprobs == 2  # asked of the engine, as vLLM does
    choice, alone = echoed.choices[0], plain.choices[0]
    assert choice.text == PROMPT + alone.text
    lp, alone_lp = choice.logprobs, alone.logprobs
    assert lp is not None and alone_lp is not None
    assert lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == count + 4
    # The prompt's tokens first: the first one has no logprob, the others the engine's.
    assert lp.tokens[0] == first and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert lp.tokens[1:count] == prompt["token_strs"][1:]
    assert all(isinstance(v, float) and v <= 0.0 for v in lp.token_logprobs[1:count])
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:count])
    # Then the completion's, as without echo.
    assert lp.tokens[count:] == alone_lp.tokens
    assert lp.token_logprobs[count:] == alone_lp.token_logprobs
    offsets = lp.text_offset
    assert offsets[0] == 0
    assert offsets == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # vLLM's prompt_logprobs: None, then per position the token ids with logprob and rank.
    prompt_lp = raw["choices"][0]["prompt_logprobs"]
    assert len(prompt_lp) == count and prompt_lp[0] is None
    for position, entries in enumerate(prompt_lp[1:], 1):
        token = str(prompt["tokens"][position])
        assert token in entries
        assert set(entries[token]) == {"logprob", "rank", "decoded_token"}


async def test_echo_with_logprobs_streamed_and_with_several_prompts() -> None:
    async with served() as s, _async(s) as client:
        whole = await client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], n=2,
                                                max_tokens=3, seed=7, logprobs=0,
                                                echo=True)
        async with await client.completions.create(
                model=MODEL, prompt=[PROMPT, OTHER], n=2, max_tokens=3, seed=7,
                logprobs=0, echo=True, stream=True) as stream:
            chunks = [chunk async for chunk in stream]
        counts = [(await _tokenize(client, p))["count"] for p in (PROMPT, OTHER)]
    assert [c.text[:len(p)] for c, p in zip(whole.choices, [PROMPT, PROMPT, OTHER, OTHER],
                                              strict=True)] == [PROMPT, PROMPT, OTHER, OTHER]
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        # The first chunk of a choice is its prompt and its first token (or the first few,
        # when they arrived together), with their logprobs.
        head = mine[0].logprobs
        assert head is not None and head.token_logprobs is not None
        assert head.token_logprobs[0] is None
        assert counts[i // 2] + 1 <= len(head.token_logprobs) <= counts[i // 2] + 3
        assert "".join(c.text for c in mine) == choice.text
        tokens = [t for c in mine if c.logprobs and c.logprobs.tokens for t in c.logprobs.tokens]
        assert choice.logprobs is not None and tokens == choice.logprobs.tokens
        offsets = [o for c in mine if c.logprobs and c.logprobs.text_offset
                   for o in c.logprobs.text_offset]
        assert offsets == choice.logprobs.text_offset
