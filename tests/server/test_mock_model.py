"""``anyio-genout serve`` on its embedded mock, through real HTTP with the ``openai`` client:
what the mock cannot do is refused clearly, what it shows is real.

* A structured-output request (``response_format`` json_object or json_schema, or vLLM's
  ``structured_outputs``) is never a 200 whose text breaks the constraint: the mock ends it
  with finish reason ERROR on the wire, as an engine without a grammar backend does, and the
  server answers 500 (an error event when streamed) naming structured outputs and the field.
  The engine stays up: the next plain request is answered.
* Top-logprob alternatives are tokens of the tokenizer the mock runs with: distinct,
  readable strings (not ``''`` from ids beyond its 1024 tokens, nor U+FFFD).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.support import serve_process

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
MESSAGES: Any = [{"role": "user", "content": "Tell me about the lighthouse"}]


@pytest.fixture(scope="module", params=["asyncio", "uvloop", "trio"])
def server(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    """``anyio-genout serve`` (embedded mock, shipped tokenizer) on a free port."""
    with serve_process("--backend", request.param, exit_code=130) as server, \
            openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0,
                          timeout=20) as client:
        yield client
    assert "Traceback" not in server.err


def _says_why(error: openai.APIError, field: str) -> None:
    assert "structured outputs" in error.message, error.message
    assert field in error.message, error.message


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
], ids=["json_object", "json_schema"])
def test_a_structured_chat_is_refused_naming_response_format(
        server: openai.OpenAI, response_format: Any) -> None:
    with pytest.raises(openai.InternalServerError) as refused:
        server.chat.completions.create(model="anyio-genout", messages=MESSAGES,
                                       max_tokens=16, response_format=response_format)
    _says_why(refused.value, "response_format")
    with pytest.raises(openai.APIError) as streamed:  # the SSE stream ends with the error
        for _ in server.chat.completions.create(model="anyio-genout", messages=MESSAGES,
                                                max_tokens=16, stream=True,
                                                response_format=response_format):
            pass
    _says_why(streamed.value, "response_format")
    # ignore_eos: the mock samples at random, and an EOS first (1/256) answers "".
    plain = server.chat.completions.create(model="anyio-genout", messages=MESSAGES,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content  # the engine is still up


def test_a_structured_outputs_completion_is_refused_naming_the_field(
        server: openai.OpenAI) -> None:
    for constraint in ({"regex": "[a-z]+"}, {"choice": ["yes", "no"]}):
        with pytest.raises(openai.InternalServerError) as refused:
            server.completions.create(model="anyio-genout", prompt="Once upon a time",
                                      max_tokens=8,
                                      extra_body={"structured_outputs": constraint})
        _says_why(refused.value, "structured_outputs")
    done = server.completions.create(model="anyio-genout", prompt="Once upon a time",
                                     max_tokens=8)
    assert done.choices[0].finish_reason in ("length", "stop")  # the engine is still up


def _check_tops(rows: list[tuple[str, list[str]]]) -> None:
    """Each position's top tokens have distinct, readable strings. Positions whose sampled
    token is part of a character (the corpus has several scripts) are left out: their row
    is decoded in the context of the tokens before, as vLLM decodes it, which changes what
    the alternatives show. Most positions are whole tokens."""
    whole = [(sampled, tops) for sampled, tops in rows if sampled and sampled.isprintable()]
    assert len(whole) >= len(rows) // 2, rows
    for _, tops in whole:
        assert all(s and (s.isprintable() or s.strip(" \n\t") == "") for s in tops), tops
        assert len(set(tops)) == len(tops), tops


def test_chat_top_logprobs_are_distinct_readable_tokens(server: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        done = server.chat.completions.create(
            model="anyio-genout", messages=MESSAGES, max_tokens=24, logprobs=True,
            top_logprobs=5, temperature=temperature, seed=3)
        assert done.choices[0].logprobs is not None
        content = done.choices[0].logprobs.content
        assert content is not None and len(content) == 24
        assert all(len(position.top_logprobs) == 5 for position in content)
        _check_tops([(position.token, [top.token for top in position.top_logprobs])
                     for position in content])


def test_completion_top_logprobs_are_distinct_readable_tokens(server: openai.OpenAI) -> None:
    done = server.completions.create(model="anyio-genout", prompt="Once upon a time",
                                     max_tokens=24, logprobs=4, temperature=1.0, seed=11)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.top_logprobs) == 24
    assert logprobs.tokens is not None
    # The sampled token is among them (vLLM adds it when its rank is beyond 4).
    assert all(4 <= len(tops) <= 5 for tops in logprobs.top_logprobs)
    _check_tops([(sampled, list(tops)) for sampled, tops
                 in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)])
