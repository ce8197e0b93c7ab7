"""``anyio-genout run`` on OpenAI batch lines with ``n > 1``, ``echo`` (with ``logprobs``),
several prompts and chat choices writes the response bodies the server answers for the same
bodies (asked with the ``openai`` package), on every backend; the server's limits hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from anyio_genout.text.bundled import bundled_model_dir
from tests.server.support import MODEL, served
from tests.text.client_support import PROMPT, corpus

from .support import COMMAND_TIMEOUT, cli_process, engine_for, free_port, read_results, write_lines

pytestmark = pytest.mark.anyio

OTHER = "The lighthouse keeper"

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "n": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "seed": 3, "n": 2}),
    "seeded": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 3, "seed": 11}),
    "echo": ("/v1/completions", {"prompt": [5, 17, 300, 42], "max_tokens": 4,
                                 "temperature": 0.0, "echo": True}),
    "echo-logprobs": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                          "temperature": 0.0, "echo": True, "logprobs": 2}),
    "prompts": ("/v1/completions", {"prompt": [PROMPT, OTHER], "n": 2, "max_tokens": 4,
                                    "seed": 3, "echo": True, "logprobs": 1}),
    "id-prompts": ("/v1/completions", {"prompt": [[5, 17, 300], [42, 7]], "max_tokens": 3,
                                       "temperature": 0.0}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}],
                                      "max_tokens": 4, "seed": 3, "n": 2,
                                      "logprobs": True, "top_logprobs": 1}),
    "too-many": ("/v1/completions", {"prompt": [PROMPT] * 9, "n": 2, "max_tokens": 2}),
}


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response body without what differs between two runs of it (its id and time) and
    between the two setups (the fingerprint: the server's and run's names and folders)."""
    return {key: value for key, value in body.items()
            if key not in ("id", "created", "system_fingerprint")}


async def _server_answers(bodies: dict[str, tuple[str, dict[str, Any]]]
                          ) -> dict[str, tuple[int, dict[str, Any]]]:
    answers = {}
    async with served() as s, openai.AsyncOpenAI(base_url=s.v1, api_key="none",
                                                 max_retries=0) as client:
        for name, (url, body) in bodies.items():
            create: Any = (client.completions if url == "/v1/completions"
                           else client.chat.completions).with_raw_response.create
            try:
                raw = await create(model=MODEL, **body)
            except openai.APIStatusError as exc:
                answers[name] = (exc.status_code, exc.response.json())
            else:
                answers[name] = (raw.http_response.status_code, raw.http_response.json())
    return answers


async def test_batch_bodies_are_the_servers_for_n_echo_and_several_prompts(
        tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": name, "method": "POST", "url": url,
                         "body": {"model": MODEL, **body}})
             for name, (url, body) in BODIES.items()]
    requests = write_lines(tmp_path / "batch.jsonl", lines)
    output = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    # The engine the server's tests use (the shipped corpus, the shipped tokenizer's vocab).
    async with engine_for(address, corpus_token_ids=corpus(), vocab_size=32000), cli_process(
            "run", str(requests), "-o", str(output), "--no-progress", "--handshake-address",
            address, "--vocab-size", "32000", "--model", str(bundled_model_dir())
    ) as (process, out):
        with anyio.fail_after(COMMAND_TIMEOUT):
            code = await process.wait()
    assert code == 1, out.err  # one line is refused
    found = {line["custom_id"]: line for line in read_results(output)}
    assert set(found) == set(BODIES)
    server = await _server_answers(BODIES)
    for name, (status, body) in server.items():
        line = found[name]
        assert line["response"]["status_code"] == status, (name, line)
        if status == 200:
            assert line["error"] is None
            assert _comparable(line["response"]["body"]) == _comparable(body), name
        else:
            assert line["response"]["body"] is None
            assert line["error"] == body, name
    prompts = found["prompts"]["response"]["body"]
    assert [c["index"] for c in prompts["choices"]] == [0, 1, 2, 3]
    assert [c["text"].startswith(p) for c, p in zip(
        prompts["choices"], [PROMPT, PROMPT, OTHER, OTHER], strict=True)] == [True] * 4
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in prompts["choices"])
    assert len(found["n"]["response"]["body"]["choices"]) == 2
    assert found["too-many"]["error"]["error"]["param"] == "prompt"
