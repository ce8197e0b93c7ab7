"""Tool calls and reasoning in chat completions (issue 24 items 3 and 4), through real HTTP
with the official ``openai`` client, on every backend.

The mock engine emits a scripted output: its corpus is the script's token ids (the
server's tokenizer) and then EOS, every greedy request starting at its position 0, so a
request gets exactly the script and ends with finish reason ``stop``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.server.support import MODEL, OPENAI_STREAM_GC, Served, served
from tests.text.client_support import added, tokenizer

pytestmark = [
    pytest.mark.anyio,
    OPENAI_STREAM_GC,
]

EOS = 2  # the bundled tokenizer's </s>
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\u00e9"}}\n</tool_call>'
TWO_CALLS = (CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
             "</tool_call>")
#: A template that renders the tools it is given (as a tool-calling model's does).
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                  "</tools>\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                  "{{ m['content'] }}\n{% endfor %}<assistant>")


@asynccontextmanager
async def scripted(script: str | list[int], **app_options: Any) -> AsyncIterator[Served]:
    """The server over a mock that answers every greedy request with ``script`` (a text,
    or token ids)."""
    if isinstance(script, str):
        ids = tokenizer().encode(script, add_special_tokens=False)
        assert tokenizer().decode(ids) == script
    else:
        ids = script
    options = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes",
               **app_options}
    async with served(corpus_token_ids=(*ids, EOS), corpus_starts=(0,), eos_token_id=EOS,
                      eos_probability=0.0, step_time=0.002, app_options=options) as s:
        yield s


def _client(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.v1, api_key="none", max_retries=0)


async def _both(s: Served, **body: Any) -> tuple[Any, Any, list[Any]]:
    """The whole answer, the openai client's accumulation of the streamed one, and the
    streamed chunks."""
    args = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 200,
            **body}
    async with _client(s) as client:
        whole = await client.chat.completions.create(**args)
        chunks = []
        async with client.chat.completions.stream(**args) as stream:
            async for event in stream:
                if event.type == "chunk":
                    chunks.append(event.chunk)
            final = await stream.get_final_completion()
    return whole, final, chunks


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or ()]


async def test_a_hermes_call_whole_and_streamed_as_vllm_answers_it() -> None:
    async with scripted("Let me check. " + CALL) as s:
        whole, final, chunks = await _both(s, tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    assert _calls(choice.message) == [("get_weather", {"city": "Paris é"})]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert len(call.id) == len("chatcmpl-tool-") + 32
    # Streamed: the openai client's accumulation of delta.tool_calls is the same answer.
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "Let me check. "
    assert _calls(streamed.message) == _calls(choice.message)
    pieces = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    assert pieces[0].id.startswith("chatcmpl-tool-") and pieces[0].type == "function"
    assert pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 3  # the arguments came in several fragments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any("<tool_call>" in (ch.delta.content or "")
                   for c in chunks for ch in c.choices)


async def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    async with scripted(TWO_CALLS) as s:
        every, every_streamed, _ = await _both(s, tools=[WEATHER, TIME])
        first, first_streamed, _ = await _both(s, tools=[WEATHER, TIME],
                                               parallel_tool_calls=False)
    assert [n for n, _ in _calls(every.choices[0].message)] == ["get_weather", "get_time"]
    assert _calls(every_streamed.choices[0].message) == _calls(every.choices[0].message)
    assert every.choices[0].message.content is None  # nothing before the calls
    assert [n for n, _ in _calls(first.choices[0].message)] == ["get_weather"]
    assert _calls(first_streamed.choices[0].message) == _calls(first.choices[0].message)


async def test_tool_choice_none_and_no_tools_leave_the_text_as_content() -> None:
    async with scripted(CALL) as s:
        none, none_streamed, _ = await _both(s, tools=[WEATHER], tool_choice="none")
        plain, _, _ = await _both(s)
    for answer in (none, none_streamed, plain):
        assert answer.choices[0].message.content == CALL
        assert not answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "stop"


async def test_reasoning_is_split_off_whole_and_streamed() -> None:
    script = "<think>Paris is in France.</think>It is sunny."
    async with scripted(script, reasoning_parser="deepseek_r1") as s:
        whole, final, chunks = await _both(s)
        hidden, hidden_streamed, hidden_chunks = await _both(
            s, extra_body={"include_reasoning": False}, logprobs=True)
        shown, _, _ = await _both(s, logprobs=True)
    message = whole.choices[0].message
    assert message.content == "It is sunny."
    assert message.model_extra["reasoning"] == "Paris is in France."
    assert final.choices[0].message.content == "It is sunny."
    streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                                 for c in chunks if c.choices)
    assert streamed_reasoning == "Paris is in France."
    assert hidden.choices[0].message.content == "It is sunny."
    # hidden reasoning hides the logprobs too (their tokens would show it), as vLLM's
    assert hidden.choices[0].logprobs is None and shown.choices[0].logprobs is not None
    assert all(c.choices[0].logprobs is None for c in hidden_chunks if c.choices)
    assert hidden.choices[0].message.model_extra["reasoning"] is None
    assert hidden_streamed.choices[0].message.content == "It is sunny."
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning")
                   for c in hidden_chunks if c.choices)


async def test_reasoning_then_a_call_in_vllms_order() -> None:
    script = "<think>I need the weather tool.</think>" + CALL
    async with scripted(script, reasoning_parser="qwen3") as s:
        whole, final, _ = await _both(s, tools=[WEATHER])
    for answer in (whole, final):
        message = answer.choices[0].message
        assert _calls(message) == [("get_weather", {"city": "Paris é"})]
        assert answer.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.model_extra["reasoning"] == "I need the weather tool."


async def test_tools_reach_the_chat_template_as_transformers_passes_them() -> None:
    async with scripted("Hi.", trust_request_chat_template=True) as s:
        await _both(s, tools=[TIME], extra_body={"chat_template": TOOLS_TEMPLATE})
        prompt = tokenizer().decode(list(added(s.setup.engine)[-1].request.prompt_token_ids),
                                    skip_special_tokens=False)
    rendered = prompt[prompt.index("<tools>") + 7:prompt.index("</tools>")]
    assert json.loads(rendered) == {"type": "function", "function": {
        "name": "get_time", "description": None, "parameters": TIME["function"]["parameters"]}}


async def test_required_and_named_hold_the_engine_to_vllms_schema() -> None:
    # The mock has no grammar backend (it ends a constrained request with an error: 500);
    # what is tested is the constraint it receives. tests/interop/test_tool_calls_real.py
    # runs these on a real engine.
    async with scripted("{}") as s, _client(s) as client:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            with pytest.raises(openai.InternalServerError, match="tool_choice"):
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=5, tools=[WEATHER, TIME],
                    tool_choice=choice, parallel_tool_calls=False)  # type: ignore[arg-type]
        wires = [a.sampling_wire["structured_outputs"]["json"] for a in added(s.setup.engine)]
    assert wires[0]["type"] == "array" and wires[0]["minItems"] == 1
    assert wires[0]["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in wires[0]["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert wires[1] == TIME["function"]["parameters"]


async def _post(s: Served, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
        return await http.post("/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 3, **body})


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name", "non-empty string"),
    ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type", "'function'"),
    ({"tools": [{"function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "JSON schema object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function",
     "Correct usage"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "Only named tools"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "not both"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of"),
])
async def test_hostile_tool_fields_are_400_naming_them(body: dict[str, Any], param: str,
                                                       words: str) -> None:
    async with scripted("Hi.") as s:
        answer = await _post(s, **body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert not added(s.setup.engine)  # nothing reached the engine


async def test_auto_without_the_flag_is_refused_in_vllms_words() -> None:
    async with served(app_options={"tool_call_parser": "hermes"}) as s:
        implicit = await _post(s, tools=[WEATHER])
        explicit = await _post(s, tools=[WEATHER], tool_choice="auto")
        rendered_only = await _post(s, tools=[WEATHER], tool_choice="none")
    for answer in (implicit, explicit):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set")
    assert rendered_only.status_code == 200, rendered_only.text


#: A template that reads an earlier call's arguments as an object (as tool-use ones do).
CALLS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                  "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city="
                  "{{ c.function.arguments.city }}]{% endfor %}\n{% endfor %}<assistant>")


async def test_earlier_calls_reach_the_template_with_their_arguments_as_objects() -> None:
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]
    broken = {**call, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    async with scripted("It is sunny.", trust_request_chat_template=True) as s:
        answer = await _post(s, messages=turns, tools=[WEATHER], chat_template=CALLS_TEMPLATE)
        assert answer.status_code == 200, answer.text
        prompt = tokenizer().decode(list(added(s.setup.engine)[-1].request.prompt_token_ids),
                                    skip_special_tokens=False)
        bad = await _post(s, messages=[*turns[:1], {**turns[1], "tool_calls": [broken]}],
                          chat_template=CALLS_TEMPLATE)
    assert "<assistant>[get_weather city=Paris]<tool>sunny<assistant>" in prompt
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


EFFORT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "[effort={{ reasoning_effort }} thinking={{ enable_thinking }}]<assistant>")


async def test_reasoning_effort_reaches_the_template_and_switches_thinking() -> None:
    script = "<think>hm</think>Sunny."
    async with scripted(script, reasoning_parser="qwen3",
                        trust_request_chat_template=True) as s:
        def prompt() -> str:
            ids = list(added(s.setup.engine)[-1].request.prompt_token_ids)
            return tokenizer().decode(ids, skip_special_tokens=False)

        low = await _post(s, reasoning_effort="low", chat_template=EFFORT_TEMPLATE,
                          max_tokens=50)
        assert "[effort=low thinking=True]" in prompt()
        off = await _post(s, reasoning_effort="none", chat_template=EFFORT_TEMPLATE,
                          max_tokens=50)
        assert "[effort=none thinking=False]" in prompt()
        kept = await _post(s, reasoning_effort="none", chat_template=EFFORT_TEMPLATE,
                           chat_template_kwargs={"enable_thinking": True}, max_tokens=50)
        assert "[effort=none thinking=True]" in prompt()  # the request's own wins
    assert low.json()["choices"][0]["message"]["reasoning"] == "hm"
    # thinking off: the qwen3 parser reads it all as content, as vLLM's does
    message = off.json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == script
    assert kept.json()["choices"][0]["message"]["reasoning"] == "hm"


IM_START = 3  # a special token of the bundled tokenizer


@pytest.mark.parametrize(("options", "kept"), [
    ({}, True),  # hermes with tools: special tokens kept (vLLM's adjust_request)
    ({"reasoning_parser": "qwen3"}, True),  # the engine-based qwen3: always
    ({"tool_call_parser": None, "enable_auto_tool_choice": False}, False),
])
async def test_special_tokens_are_kept_where_vllms_parsers_keep_them(
        options: dict[str, Any], kept: bool) -> None:
    ids = [*tokenizer().encode("Sure.", add_special_tokens=False), IM_START,
           *tokenizer().encode(" ok", add_special_tokens=False)]
    async with scripted(ids, **options) as s:
        tools = {"tools": [WEATHER]} if options.get("tool_call_parser", "hermes") else {}
        answer = await _post(s, max_tokens=20, **tools)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    text = (message.get("reasoning") or "") + (message["content"] or "")  # qwen3: reasoning
    assert text == ("Sure.<|im_start|> ok" if kept else "Sure. ok")
