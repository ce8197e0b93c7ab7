"""Every request field of vLLM's completions and chat bodies is honoured as vLLM does it, or
refused with a 400 naming it (issue 24 item 2), through real HTTP on every backend; what the
engine received is read from the mock engine."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from anyio_genout.server.fields import (
    CHAT_ONLY,
    COMPLETION_ONLY,
    IGNORED,
    IMPLEMENTED,
    REFUSED,
    REQUEST_FIELDS,
    counts,
)
from tests.server.support import MODEL, Served, served
from tests.text.client_support import PROMPT, added, tokenizer

pytestmark = pytest.mark.anyio

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story"}]
#: A chat template that takes any role (the bundled one refuses what it does not know).
ANY_ROLE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if documents %}[{{ documents[0]['text'] }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


async def _post(s: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
        return await http.post(path, json={"model": MODEL, **body})


async def _chat(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/chat/completions", {"messages": MESSAGES, "max_tokens": 3, **body})


async def _completion(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/completions", {"prompt": PROMPT, "max_tokens": 3, **body})


def _refused(answer: httpx.Response, field: str | None) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    return str(error["message"])


def _sent(s: Served) -> Any:
    """The last request the engine received."""
    return added(s.setup.engine)[-1].request


def _prompt_text(s: Served) -> str:
    return tokenizer().decode(list(_sent(s).prompt_token_ids), skip_special_tokens=False)


async def test_logit_bias_and_allowed_token_ids_reach_the_engine() -> None:
    async with served() as s:
        answer = await _completion(s, logit_bias={"5": 200.0, "17": -3.5})
        assert answer.status_code == 200, answer.text
        params = _sent(s).sampling_params
        assert dict(params.logit_bias) == {5: 100.0, 17: -3.5}  # clamped as vLLM's
        answer = await _chat(s, allowed_token_ids=[5, 17, 300])
        assert answer.status_code == 200, answer.text
        assert tuple(_sent(s).sampling_params.allowed_token_ids) == (5, 17, 300)
        assert "not a token id" in _refused(await _completion(s, logit_bias={"x": 1.0}),
                                            "logit_bias")


async def test_completion_logprobs_zero_shows_the_sampled_token() -> None:
    async with served() as s:
        answer = await _completion(s, logprobs=0, temperature=0.0)
    logprobs = answer.json()["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"]) == 3
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert list(top) == [token]


async def test_prompt_logprobs_are_asked_for_and_shown() -> None:
    async with served() as s:
        whole = await _completion(s, prompt_logprobs=1)
        assert _sent(s).sampling_params.prompt_logprobs == 1
        chat = await _chat(s, prompt_logprobs=0)
        streamed = await _completion(s, prompt_logprobs=1, stream=True)
    rows = whole.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) > 1 and all(isinstance(r, dict) for r in rows[1:])
    assert chat.json()["prompt_logprobs"][0] is None
    assert "stream=True" in _refused(streamed, "prompt_logprobs")


async def test_return_tokens_as_token_ids() -> None:
    async with served() as s:
        whole = await _completion(s, logprobs=1, return_tokens_as_token_ids=True)
        chat = await _chat(s, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    tokens = whole.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


async def test_chat_echo_puts_the_last_message_first() -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    async with served() as s:
        plain = await _chat(s, messages=messages, add_generation_prompt=False,
                            continue_final_message=True, temperature=0.0)
        whole = await _chat(s, messages=messages, add_generation_prompt=False,
                            continue_final_message=True, temperature=0.0, echo=True)
        async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
            streamed = await http.post("/chat/completions", json={
                "model": MODEL, "messages": messages, "add_generation_prompt": False,
                "continue_final_message": True, "temperature": 0.0, "max_tokens": 3,
                "echo": True, "stream": True})
        user_last = await _chat(s, echo=True, temperature=0.0)  # the answer's role: none
    text = plain.json()["choices"][0]["message"]["content"]
    assert whole.json()["choices"][0]["message"]["content"] == "Once upon" + text
    assert '"delta":{"content":"Once upon"}' in streamed.text
    assert not user_last.json()["choices"][0]["message"]["content"].startswith("Tell me")


async def test_continue_final_message_and_add_generation_prompt_shape_the_prompt() -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    async with served() as s:
        assert (await _chat(s, messages=messages, add_generation_prompt=False,
                            continue_final_message=True)).status_code == 200
        assert _prompt_text(s).endswith("<|im_start|>assistant\nOnce upon")
        assert (await _chat(s, messages=messages, add_generation_prompt=False)
                ).status_code == 200
        assert _prompt_text(s).endswith("Once upon<|im_end|>\n")
        assert (await _chat(s)).status_code == 200
        assert _prompt_text(s).endswith("<|im_start|>assistant\n")
        plain = list(_sent(s).prompt_token_ids)
        assert (await _chat(s, add_special_tokens=True)).status_code == 200
        assert list(_sent(s).prompt_token_ids)[-len(plain):] == plain  # one more BOS
        assert len(_sent(s).prompt_token_ids) == len(plain) + 1
        both = await _chat(s, messages=messages, continue_final_message=True)
    assert "Cannot set both" in _refused(both, "continue_final_message")


async def test_developer_role_and_documents_reach_the_template() -> None:
    # A template that names the developer role gets it as it is (one that does not gets a
    # system message, as vLLM gives it: tests/server/test_vllm_parity.py).
    named = ANY_ROLE.replace("{{ m['role'] }}",
                             "{{ 'dev' if m['role'] == 'developer' else m['role'] }}")
    async with served(app_options={"trust_request_chat_template": True}) as s:
        answer = await _chat(s, messages=[{"role": "developer", "content": "Be brief"},
                                          *MESSAGES],
                             documents=[{"title": "t", "text": "the doc"}],
                             chat_template=named)
        assert answer.status_code == 200, answer.text
        assert _prompt_text(s).endswith("<dev>Be brief\n<user>Tell me a story\n"
                                        "[the doc]<assistant>")


async def test_n_above_one_with_greedy_sampling_is_refused_as_vllm() -> None:
    async with served() as s:
        greedy = await _completion(s, n=2, temperature=0.0)
        chat = await _chat(s, n=3, temperature=0)
        sampled = await _completion(s, n=2, temperature=0.5)
    # vLLM's SamplingParams names no parameter (param null); the message names n.
    assert "n must be 1 when using greedy sampling" in _refused(greedy, None)
    assert "n must be 1 when using greedy sampling" in _refused(chat, None)
    assert sampled.status_code == 200


@pytest.mark.parametrize(("field", "value", "chat"), [
    ("thinking_token_budget", 8, True),
    ("use_beam_search", True, False), ("suffix", "end", False),
    ("kv_transfer_params", {"a": 1}, True), ("return_token_ids", True, False),
    ("priority", 3, False),
])
async def test_unsupported_fields_are_refused_by_name(field: str, value: Any,
                                                      chat: bool) -> None:
    async with served() as s:
        answer = await (_chat(s, **{field: value}) if chat
                        else _completion(s, **{field: value}))
        assert "not supported" in _refused(answer, field)
        assert not added(s.setup.engine)  # nothing reached the engine


async def test_defaults_of_refused_fields_and_ignored_fields_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    async with served() as s:
        harmless = await _chat(s, tool_choice="none", bad_words=[], use_beam_search=False,
                               parallel_tool_calls=True, include_reasoning=True, user="me",
                               priority=0)
        with caplog.at_level(logging.WARNING, "anyio_genout.server"):
            unknown = await _completion(s, not_a_vllm_field=1)
    assert harmless.status_code == 200, harmless.text
    assert unknown.status_code == 200, unknown.text
    assert "not_a_vllm_field" in caplog.text  # logged, as vLLM's server does


def test_the_table_counts() -> None:
    found = counts()
    assert found == {IMPLEMENTED: 48, IGNORED: 4, REFUSED: 19}
    assert sum(found.values()) == len(REQUEST_FIELDS)
    assert set(REQUEST_FIELDS) >= COMPLETION_ONLY and set(REQUEST_FIELDS) >= CHAT_ONLY


async def test_errors_name_the_fields_as_vllm_names_them() -> None:
    async with served(max_model_len=64) as s:
        too_long = await _completion(s, prompt=[5] * 64)
        chat = await _chat(s, logprobs=True, top_logprobs=50)
        completion = await _completion(s, logprobs=50)
    assert "max_model_len=64" in _refused(too_long, "input_tokens")
    assert "max_logprobs" in _refused(chat, "logprobs")  # vLLM's SamplingParams' name
    assert "max_logprobs" in _refused(completion, "logprobs")
