"""Tool calls on ONE real vLLM engine per backend (``nox -s interop``): the tiny random model
with the bundled tokenizer (``test_text_real``'s engine, which loads the tokenizer, so its
xgrammar backend can constrain outputs), served by ``create_app`` and asked through the
official ``openai`` client with a chat template that renders the tools.

``tool_choice="required"`` and a named function hold the engine to vLLM's JSON schema:
whatever the random model would write, every answer's calls parse and validate against
their tool's parameters, whole and streamed, and the finish reasons are vLLM's
(``tool_calls`` for required, ``stop`` for a named function).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from anyio_genout.server import create_app
from anyio_genout.server.tools import check_tools
from tests.server.support import serving

from .conftest import INTEROP_TIMEOUT
from .test_text_real import Served, served, text, text_model

__all__ = ["served", "text", "text_model"]  # the fixtures this module reuses

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(INTEROP_TIMEOUT),
    pytest.mark.filterwarnings(  # openai's async generators, as in test_server_real
        r"ignore:Exception ignored in. <async_generator object (AsyncStream\._iter_events|"
        r"SSEDecoder\.aiter_bytes|Response\.aiter_bytes|PoolByteStream\.__aiter__)"
        r":pytest.PytestUnraisableExceptionWarning"),
]

MODEL = "tiny"
#: Bounded parameters (enums, booleans): the random model cannot write on for ever.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                     "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"enum": [6, 7, 8]}},
    "required": ["hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                  "</tools>\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                  "{{ m['content'] }}\n{% endfor %}<assistant>")
SEEDS = range(1, 5)


@pytest.fixture(scope="module")
async def base_url(served: Served) -> AsyncIterator[str]:
    app = create_app(served.text, model_name=MODEL, trust_request_chat_template=True)
    async with serving(app) as base:
        yield base


@pytest.fixture
async def api(base_url: str, text: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none",
                                  max_retries=0) as client:
        yield client


async def _answers(api: openai.AsyncOpenAI, tool_choice: Any) -> list[tuple[Any, Any]]:
    """(whole, streamed-and-accumulated) answers, one pair per seed, run concurrently."""
    found: dict[int, tuple[Any, Any]] = {}
    args: dict[str, Any] = {
        "model": MODEL, "max_tokens": 120, "tools": TOOLS, "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "messages": [{"role": "user", "content": "Weather in Paris, and wake me at 7"}],
        "extra_body": {"chat_template": TOOLS_TEMPLATE}}

    async def one(seed: int) -> None:
        whole = await api.chat.completions.create(seed=seed, **args)
        async with api.chat.completions.stream(seed=seed, **args) as stream:
            async for _ in stream:
                pass
            streamed = await stream.get_final_completion()
        found[seed] = (whole, streamed)

    async with anyio.create_task_group() as tg:
        for seed in SEEDS:
            tg.start_soon(one, seed)
    return [found[seed] for seed in SEEDS]


def _valid_calls(answer: Any) -> list[str]:
    """The names of the answer's calls, each call's arguments checked against its tool."""
    message = answer.choices[0].message
    names = []
    for call in message.tool_calls or ():
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


async def test_required_gives_one_valid_call(api: openai.AsyncOpenAI) -> None:
    for whole, streamed in await _answers(api, "required"):
        for answer in (whole, streamed):
            assert len(_valid_calls(answer)) == 1, answer  # maxItems 1: no parallel calls
            assert answer.choices[0].finish_reason == "tool_calls"
        assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == \
            json.loads(streamed.choices[0].message.tool_calls[0].function.arguments)


async def test_a_named_function_gives_its_arguments(api: openai.AsyncOpenAI) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for whole, streamed in await _answers(api, named):
        for answer in (whole, streamed):
            assert _valid_calls(answer) == ["set_alarm"], answer
            assert answer.choices[0].finish_reason == "stop"  # vLLM's: named keeps stop


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f"}},
    {"function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                  "strict": True}},
    {"type": "function", "function": {"name": "f", "extra": 1, "defer_loading": False}},
    {"type": "function", "defer_loading": True, "function": {"name": "f"}},
])
def test_the_template_gets_the_tools_as_vllm_dumps_them(tool: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    theirs = ChatCompletionToolsParam.model_validate(tool).model_dump()
    assert check_tools([tool]) == [theirs]
