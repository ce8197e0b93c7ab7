"""vLLM's rules for the values of request fields, where a hostile audit found ours apart
from them (real HTTP on every backend, vLLM 0.32's request models as the reference): null
where vLLM's type allows it means the default, the response id is vLLM's, the chat fields
of ``/tokenize`` are honoured, ignored fields are still type-checked, and the no-op values
of refused fields pass."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.support import MODEL, Served, served
from tests.text.client_support import PROMPT, added

pytestmark = pytest.mark.anyio

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story"}]
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
#: A request template that renders the tools (the default one does not).
WITH_TOOLS = ("{% if tools %}[{% for t in tools %}{{ t['function']['name'] }} {% endfor %}]"
              "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


async def _post(s: Served, path: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        return await http.post(path, json={"model": MODEL, **body}, headers=headers)


async def _chat(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/v1/chat/completions",
                       {"messages": MESSAGES, "max_tokens": 3, **body})


async def _completion(s: Served, **body: Any) -> httpx.Response:
    return await _post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **body})


def _ok(answer: httpx.Response) -> Any:
    assert answer.status_code == 200, answer.text
    return answer.json()


def _refused(answer: httpx.Response, field: str | None) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field, error
    return str(error["message"])


def _sent(s: Served) -> Any:
    """The last request the engine received."""
    return added(s.setup.engine)[-1].request


async def test_tokenize_renders_messages_as_a_chat_completion_would() -> None:
    """continue_final_message, add_special_tokens and tools shape /tokenize's tokens exactly
    as they shape a chat completion's prompt (they were dropped)."""
    cases: list[dict[str, Any]] = [
        {"messages": CONTINUED, "add_generation_prompt": False,
         "continue_final_message": True},
        {"messages": CONTINUED, "add_generation_prompt": False},
        {"messages": MESSAGES, "add_special_tokens": True},
        {"messages": MESSAGES},
        {"messages": MESSAGES, "chat_template": WITH_TOOLS},
        {"messages": MESSAGES, "tools": TOOLS, "chat_template": WITH_TOOLS},
    ]
    async with served(app_options={"trust_request_chat_template": True}) as s:
        counts = []
        for case in cases:
            chat = dict(case, tool_choice="none") if "tools" in case else case
            _ok(await _chat(s, **chat))
            prompt = list(_sent(s).prompt_token_ids)
            tokens = _ok(await _post(s, "/tokenize", case))["tokens"]
            assert tokens == prompt, case
            counts.append(len(tokens))
        assert counts[0] < counts[1]  # continued: no end of turn after the last message
        assert counts[2] == counts[3] + 1  # the BOS
        assert counts[5] > counts[4]  # the tools are in the prompt
        both = await _post(s, "/tokenize", {"messages": CONTINUED,
                                           "continue_final_message": True})
        assert "add_generation_prompt" in _refused(both, "continue_final_message")
        for field, value in (("tools", TOOLS), ("continue_final_message", False),
                             ("add_generation_prompt", True)):
            message = _refused(await _post(s, "/tokenize", {"prompt": "Once", field: value}),
                               field)
            assert "messages" in message
        for field in ("mm_processor_kwargs", "media_io_kwargs"):
            _refused(await _post(s, "/tokenize", {"messages": MESSAGES, field: {}}), field)
        bad_tool = await _post(s, "/tokenize", {"messages": MESSAGES, "tools": "x"})
        _refused(bad_tool, "tools")
        prompt = _ok(await _post(s, "/tokenize", {"prompt": "Once"}))["count"]
        bare = _ok(await _post(s, "/tokenize", {"prompt": "Once",
                                                "add_special_tokens": False}))["count"]
        assert prompt == bare + 1  # a prompt keeps vLLM's default: with special tokens


async def test_null_means_the_default_where_vllm_types_allow_it() -> None:
    async with served() as s:
        plain = _ok(await _completion(s, temperature=0.0))["choices"][0]["text"]
        nulls = _ok(await _completion(s, temperature=0.0, stream=None, echo=None))
        assert nulls["choices"][0]["text"] == plain
        chat = _ok(await _chat(s, n=None, logprobs=None, top_logprobs=None, stream=None))
        assert len(chat["choices"]) == 1 and chat["choices"][0]["logprobs"] is None
        async with httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
            streamed = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert '"usage":{' not in streamed.text  # include_usage null: false
        strs = _ok(await _post(s, "/tokenize", {"prompt": "Once", "return_token_strs": None}))
        assert "token_strs" not in strs
        # Where vLLM's type has no None, null stays a 400 naming the field.
        for field in ("ignore_eos", "min_tokens", "skip_special_tokens"):
            _refused(await _completion(s, **{field: None}), field)
        _refused(await _completion(s, n=None), "n")  # completions' n is not Optional
        _refused(await _chat(s, echo=None), "echo")
        _refused(await _completion(s, use_beam_search=None), "use_beam_search")


async def test_the_response_id_is_vllms_and_a_request_id_header_names_the_request() -> None:
    async with served() as s:
        body = _ok(await _completion(s, request_id="abc"))
        assert body["id"] == "cmpl-abc" and _sent(s).request_id.startswith("cmpl-abc")
        chat = _ok(await _chat(s, request_id="abc"))
        assert chat["id"] == "chatcmpl-abc"
        header = _ok(await _post(s, "/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 2, "request_id": "abc"},
                                 headers={"X-Request-Id": "hdr1"}))
        assert header["id"] == "cmpl-hdr1" and _sent(s).request_id.startswith("cmpl-hdr1")
        async with httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
            streamed = await http.post("/v1/chat/completions", headers={"x-request-id": "h2"},
                                       json={"model": MODEL, "messages": MESSAGES,
                                             "max_tokens": 2, "stream": True})
        assert streamed.text.count('"id":"chatcmpl-h2"') == streamed.text.count("data: {")
        anonymous = _ok(await _completion(s))["id"]
        assert anonymous.startswith("cmpl-") and len(anonymous) > len("cmpl-") + 8


async def test_logprob_counts_as_vllm_checks_them() -> None:
    async with served() as s:
        # top_logprobs 0 without logprobs is vLLM's default: accepted, no logprobs shown.
        assert _ok(await _chat(s, top_logprobs=0))["choices"][0]["logprobs"] is None
        assert "logprobs" in _refused(await _chat(s, top_logprobs=2), "top_logprobs")
        # -1 (vLLM's whole vocabulary) is refused by name (it came back as empty rows),
        # prompt_logprobs too; below -1 is the body's 400.
        for answer, field in ((await _completion(s, logprobs=-1), "logprobs"),
                              (await _chat(s, logprobs=True, top_logprobs=-1), "top_logprobs"),
                              (await _completion(s, prompt_logprobs=-1), "prompt_logprobs")):
            assert "every token of the vocabulary" in _refused(answer, field)
        _refused(await _completion(s, logprobs=-2), "logprobs")
        _refused(await _chat(s, logprobs=True, top_logprobs=-2), "top_logprobs")


async def test_values_vllm_refuses_are_refused() -> None:
    async with served() as s:
        _refused(await _completion(s, seed=2**63), "seed")
        _refused(await _completion(s, seed=-(2**63) - 1), "seed")
        _ok(await _completion(s, seed=2**63 - 1))
        assert _sent(s).sampling_params.seed == 2**63 - 1
        assert "non-empty" in _refused(await _completion(s, prompt=""), "prompt")
        # Ignored fields (vLLM ignores them too) keep vLLM's types.
        for field, value in (("user", 5), ("length_penalty", "abc"), ("mm_payload", "bogus"),
                             ("routed_experts_prompt_start", -1), ("length_penalty", None)):
            _refused(await _completion(s, **{field: value}), field)
        _ok(await _completion(s, user="alice", length_penalty=2.0, mm_payload="none",
                              routed_experts_prompt_start=3))


async def test_an_empty_model_name_is_the_served_model() -> None:
    async with served() as s:
        assert _ok(await _completion(s, model=""))["model"] == MODEL
        answer = await _completion(s, model="other")
        assert answer.status_code == 404


async def test_no_op_values_of_refused_fields_pass_and_others_are_refused() -> None:
    async with served() as s:
        for field, value in (("watermarking", False), ("vllm_xargs", {}),
                             ("kv_transfer_params", {}), ("ec_transfer_params", {}),
                             ("logprob_token_ids", []), ("watermarking", None)):
            _ok(await _completion(s, **{field: value}))
        for field, value in (("watermarking", True), ("vllm_xargs", {"a": 1}),
                             ("kv_transfer_params", {"a": 1}), ("logprob_token_ids", [1])):
            message = _refused(await _completion(s, **{field: value}), field)
            assert "not supported" in message and "(not supported)" not in message


async def test_a_lone_surrogate_in_documents_is_named() -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
            "documents": [{"title": "t", "text": "\ud800"}]}
    async with served() as s, httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        answer = await http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    assert _refused(answer, "documents[0].text")


async def test_at_most_vllms_four_stop_strings_are_taken() -> None:
    # vLLM's StopParam: a list of at most VLLM_MAX_STOP_STRINGS (4) items; each is searched
    # at every token, so a hostile list of thousands made every token of the request costly.
    async with served() as s:
        four = ["zq1", "zq2", "zq3", "zq4"]
        for answer in (await _completion(s, stop=four), await _chat(s, stop=four),
                       await _completion(s, stop="one string")):
            _ok(answer)
        for answer in (await _completion(s, stop=[*four, "zq5"]),
                       await _chat(s, stop=[f"s{i}" for i in range(5000)])):
            message = _refused(answer, "stop")
            assert "at most 4 items" in message, message


async def test_echo_with_max_tokens_0_answers_the_prompt_alone() -> None:
    # vLLM's echo without generation: the engine generates one token (counted in the
    # usage, with its finish), the answer shows the prompt's text and logprobs alone.
    async with served() as s:
        body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 2}
        whole = _ok(await _completion(s, **body))
        assert _sent(s).sampling_params.max_tokens == 1
        choice = whole["choices"][0]
        assert choice["text"] == PROMPT
        prompt_ids = list(_sent(s).prompt_token_ids)
        assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert "".join(choice["logprobs"]["tokens"]).endswith(PROMPT)  # after the BOS
        assert choice["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 1
        assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
        streamed = await _post(s, "/v1/completions", {"prompt": PROMPT, "echo": True,
                                                      "max_tokens": 0, "stream": True,
                                                      "stream_options": {
                                                          "include_usage": True}})
        assert streamed.status_code == 200, streamed.text
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        texts = [c["text"] for e in events for c in e["choices"]]
        assert "".join(texts) == PROMPT
        assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 1
        assert streamed.text.endswith("data: [DONE]\n\n")
        # Without echo, 0 is refused, naming the field.
        assert "greater than or equal to 1" in _refused(
            await _completion(s, max_tokens=0), "max_tokens")
