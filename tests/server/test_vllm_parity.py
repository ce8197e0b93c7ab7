"""Chat and completions answers that the side-by-side differential with ``vllm serve``
(tests/interop/test_serve_differential.py, issue 24) found different, now answered as
vLLM 0.32 answers them, through real HTTP against the mock engine on every backend."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from tests.server.support import MODEL, Served, served
from tests.support import sse_lines
from tests.text.client_support import PROMPT, added, tokenizer

pytestmark = pytest.mark.anyio

USER: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the sea"}]


async def _post(s: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
        return await http.post(path, json={"model": MODEL, "max_tokens": 3, **body})


async def _chat(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/chat/completions", {"messages": USER, **body})


async def _completion(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/completions", {"prompt": PROMPT, **body})


async def _events(s: Served, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer (200), without ``[DONE]``."""
    async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http, http.stream(
            "POST", path, json={"model": MODEL, "max_tokens": 3, **body,
                                "stream": True}) as reply:
        assert reply.status_code == 200, await reply.aread()
        return [json.loads(line[len("data: "):]) async for line in sse_lines(reply)
                if line.startswith("data: ") and line != "data: [DONE]"]


def _error(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 400, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == "BadRequestError"
    return error


def _prompt_text(s: Served) -> str:
    ids = added(s.setup.engine)[-1].request.prompt_token_ids
    return tokenizer().decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------- 1. the answer's role


async def test_the_role_chunk_comes_with_the_first_output_as_vllm_sends_it() -> None:
    """vLLM sends a streamed chat's role chunk in its first iteration over the outputs, so
    a client's first chunk comes with the first token: while the engine's scheduler is
    paused (requests kept), nothing but the headers may arrive."""
    lines: list[str] = []
    async with served() as s, httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
        await s.setup.client.engine.pause_scheduler(mode="keep")
        # Greedy: two sampled tokens may both be ones without text (a special token, half
        # a character), and the text check below failed a run so.
        body = {"model": MODEL, "max_tokens": 2, "ignore_eos": True, "stream": True,
                "temperature": 0.0, "messages": USER}

        async def read() -> None:
            async with http.stream("POST", "/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                async for line in sse_lines(reply):
                    if line:
                        lines.append(line)  # as each arrives

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.5)
            early = list(lines)
            await s.setup.client.engine.resume_scheduler()
    assert early == []  # before the change: the role chunk at once
    assert json.loads(lines[0][len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines[1:-1])


async def test_without_a_generation_prompt_the_answer_has_the_last_messages_role() -> None:
    async with served() as s:
        whole = await _chat(s, add_generation_prompt=False)
        streamed = await _events(s, "/chat/completions", {"messages": USER,
                                                          "add_generation_prompt": False})
        usual = await _chat(s)
        usual_streamed = await _events(s, "/chat/completions", {"messages": USER})
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["role"] == "user"
    assert streamed[0]["choices"][0]["delta"] == {"role": "user", "content": ""}
    assert [c for e in streamed for c in e["choices"] if "role" in c["delta"]] == \
        [streamed[0]["choices"][0]]  # the first chunk alone carries it
    assert usual.json()["choices"][0]["message"]["role"] == "assistant"
    assert usual_streamed[0]["choices"][0]["delta"]["role"] == "assistant"


# ------------------------------------------------------ 2. stream_options needs a stream


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
async def test_stream_options_without_stream_are_refused_as_vllm(path: str) -> None:
    body: dict[str, Any] = {"messages": USER} if path == "/chat/completions" else {
        "prompt": PROMPT}
    async with served() as s:
        refused = [await _post(s, path, {**body, **extra}) for extra in (
            {"stream_options": {"include_usage": True}},
            {"stream_options": {"include_usage": False}, "stream": False})]
        empty = await _post(s, path, {**body, "stream_options": {}})  # vLLM: falsy, passes
        streamed = await _events(s, path, {**body, "stream_options": {"include_usage": True}})
    for answer in refused:
        error = _error(answer)
        assert error["param"] == "stream_options"
        assert "Stream options can only be defined when `stream=True`." in error["message"]
    assert empty.status_code == 200, empty.text
    assert 1 <= streamed[-1]["usage"]["completion_tokens"] <= 3  # (sampled: EOS may come first)


# ------------------------------------------------ 3. chat echo shows the prompt's logprobs


async def test_chat_echo_asks_for_and_shows_the_prompts_logprobs_as_vllm() -> None:
    async with served() as s:
        echo = await _chat(s, echo=True)
        asked = added(s.setup.engine)[-1].request.sampling_params.prompt_logprobs
        prompt_ids = list(added(s.setup.engine)[-1].request.prompt_token_ids)
        top = await _chat(s, echo=True, logprobs=True, top_logprobs=2)
        asked_top = added(s.setup.engine)[-1].request.sampling_params.prompt_logprobs
        own = await _chat(s, echo=True, prompt_logprobs=1)
        plain = await _chat(s)
        streamed = await _events(s, "/chat/completions", {"messages": USER, "echo": True})
    assert echo.status_code == 200, echo.text
    assert asked == 0 and asked_top == 2  # top_logprobs of them (0 unset), as vLLM's
    rows = echo.json()["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt_ids) == echo.json()["usage"][
        "prompt_tokens"]
    for token, row in zip(prompt_ids[1:], rows[1:], strict=True):
        assert list(row) == [str(token)]  # the prompt's own token alone
        assert set(row[str(token)]) == {"logprob", "rank", "decoded_token"}
    assert all(1 <= len(row) <= 3 for row in top.json()["prompt_logprobs"][1:])
    assert all(1 <= len(row) <= 2 for row in own.json()["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in plain.json()
    assert not any("prompt_logprobs" in event for event in streamed)  # never streamed


# ------------------------------------- 4. a streamed completions echo sends the prompt ids


async def test_a_streamed_completion_echo_sends_the_prompts_ids_on_each_first_chunk() -> None:
    second = "The sea is"
    async with served() as s:
        events = await _events(s, "/completions", {"prompt": [PROMPT, second], "echo": True,
                                                   "n": 2, "temperature": 0.5, "seed": 1})
        plain = await _events(s, "/completions", {"prompt": PROMPT})
    expected = {i: tokenizer().encode(text) for i, text in ((0, PROMPT), (1, PROMPT),
                                                            (2, second), (3, second))}
    seen: dict[int, list[Any]] = {}
    for event in events:
        for choice in event["choices"]:
            seen.setdefault(choice["index"], []).append(choice.get("prompt_token_ids"))
    assert sorted(seen) == [0, 1, 2, 3]
    for index, ids in seen.items():
        assert ids[0] == expected[index]  # the choice's first chunk, with its prompt
        assert all(later is None for later in ids[1:])
    assert not any("prompt_token_ids" in c for e in plain for c in e["choices"])


# ------------------------------------------------------------- 5. the errors' params


async def test_errors_carry_vllms_params_and_name_the_field_in_the_message() -> None:
    async with served() as s:
        greedy = _error(await _completion(s, n=2, temperature=0.0))
        empty = _error(await _chat(s, messages=[]))
        wizard = _error(await _chat(s, messages=[{"role": "wizard", "content": "hi"}]))
        top = _error(await _chat(s, logprobs=True, top_logprobs=50))
        too_many = _error(await _completion(s, logprobs=50))
    assert greedy["param"] is None
    assert greedy["message"] == "n must be 1 when using greedy sampling, got 2."
    assert empty["param"] is None
    assert empty["message"] == ("invalid request: messages: Cannot apply chat template to an "
                                "empty conversation. Provide at least one message.")
    assert wizard["param"] is None
    assert "messages[0].role" in wizard["message"] and "'wizard'" in wizard["message"]
    assert top["param"] == too_many["param"] == "logprobs"  # vLLM's SamplingParams' name
    assert "max_logprobs=20" in top["message"]


# ---------------------------------------------------- 6. the developer role, as vLLM's


async def test_developer_messages_reach_a_template_without_the_role_as_system() -> None:
    async with served() as s:  # the bundled template refuses roles it does not know
        alone = await _chat(s, messages=[{"role": "developer", "content": "Be brief."},
                                         *USER])
        alone_prompt = _prompt_text(s)
        merged = await _chat(s, messages=[{"role": "system", "content": "You are a sailor."},
                                          *USER, {"role": "developer", "content": "Be brief."}])
        merged_prompt = _prompt_text(s)
        streamed = await _events(s, "/chat/completions", {"messages": [
            {"role": "developer", "content": "Be brief."}, *USER]})
    assert alone.status_code == 200, alone.text
    assert alone_prompt == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                            "Tell me about the sea<|im_end|>\n<|im_start|>assistant\n")
    assert merged.status_code == 200, merged.text
    assert merged_prompt.startswith("<s><|im_start|>system\nYou are a sailor.\n\nBe brief."
                                    "<|im_end|>\n<|im_start|>user\n")
    assert merged_prompt.count("system") == 1
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
