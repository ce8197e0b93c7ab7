"""An OpenAI batch line that ``anyio-genout run`` refuses fails with exactly the error the
server answers for the same body: the same status, message, type and ``param`` (a field with
a union type named without pydantic's member tags, ``prompt`` not ``prompt.str``; vLLM's
names, ``logprobs`` for chat's ``top_logprobs`` and ``input_tokens``), whether the line
fails as it is read (the body's model) or as it runs (the engines' limits)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from anyio_genout.cli.run_batch import CHAT_URL, COMPLETIONS_URL, BatchParser, BatchRunner
from tests.server.support import MODEL, served

MESSAGES = [{"role": "user", "content": "hi"}]

#: (url, body, the param the server names): bodies each refused with a 400.
BAD: list[tuple[str, dict[str, Any], str]] = [
    # pydantic's unions: the server strips the member tags from the error's location
    (COMPLETIONS_URL, {"prompt": 5, "max_tokens": 2}, "prompt"),
    (COMPLETIONS_URL, {"prompt": ["a", 5], "max_tokens": 2}, "prompt"),
    (COMPLETIONS_URL, {"prompt": "hi", "stop": 5, "max_tokens": 2}, "stop"),
    (COMPLETIONS_URL, {"prompt": "hi", "stop": ["a", 7], "max_tokens": 2}, "stop"),
    (CHAT_URL, {"messages": MESSAGES, "stop": 5, "max_tokens": 2}, "stop"),
    (CHAT_URL, {"messages": [{"role": "user", "content": 5}], "max_tokens": 2},
     "messages[0].content"),
    # out of range: by the model, and by the engine's max_logprobs when the request runs
    (COMPLETIONS_URL, {"prompt": "hi", "logprobs": -1, "max_tokens": 2}, "logprobs"),
    (COMPLETIONS_URL, {"prompt": "hi", "logprobs": 50, "max_tokens": 2}, "logprobs"),
    (CHAT_URL, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50, "max_tokens": 2},
     "logprobs"),
    # what needs the engines and the tokenizer: checked as the line runs
    (COMPLETIONS_URL, {"prompt": [1, 2, 10**6], "max_tokens": 2}, "prompt[2]"),
    (COMPLETIONS_URL, {"prompt": "hi", "max_tokens": 10**7}, "max_tokens"),
    (COMPLETIONS_URL, {"prompt": [1] * 5000, "max_tokens": 2}, "input_tokens"),
]


@pytest.mark.anyio
async def test_a_batch_lines_error_is_the_servers_for_the_same_body() -> None:
    parser = BatchParser(MODEL)
    async with served() as server, httpx.AsyncClient(timeout=30) as http:
        runner = BatchRunner(server.setup.text)
        for number, (url, body, param) in enumerate(BAD, 1):
            answer = await http.post(f"{server.base_url}{url}", json=body)
            assert answer.status_code == 400, (body, answer.text)
            expected = answer.json()
            assert expected["error"]["param"] == param, (body, expected)
            line = json.dumps({"custom_id": f"bad-{number}", "method": "POST", "url": url,
                               "body": body}).encode()
            output, failure, tokens = await runner.run(parser.parse(number, line))
            assert output["response"]["status_code"] == 400, (body, output)
            assert output["response"]["body"] is None and tokens == 0
            assert output["error"] == expected, body
            assert failure == expected["error"]["message"]
