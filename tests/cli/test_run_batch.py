"""``anyio-genout run`` on an OpenAI batch file (``vllm run-batch``'s format), as a user runs it:
the lines run unchanged and each output line has the shape vLLM's run_batch writes
(``BatchRequestOutput``: ``id``, ``custom_id``, ``response`` {``status_code``,
``request_id``, ``body``}, ``error``), field by field; ``--resume`` goes by ``custom_id``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from anyio_genout.protocol import AddRequest
from anyio_genout.text.bundled import bundled_model_dir, bundled_tokenizer

from .support import (
    CLI,
    COMMAND_TIMEOUT,
    cli,
    cli_process,
    engine_for,
    free_port,
    read_results,
    write_lines,
)
from .test_text_cli import PROMPT, predicted_text

ID = re.compile(r"^vllm-[0-9a-f]{16}$")
REQUEST_ID = re.compile(r"^vllm-batch-[0-9a-f]{16}$")
USAGE_KEYS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    batch_line("cmpl-1", "/v1/completions",
               {"model": "my-model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}),
    batch_line("chat-1", "/v1/chat/completions",
               {"model": "my-model", "max_tokens": 6, "temperature": 0.0,
                "messages": [{"role": "user", "content": "Where is the lighthouse?"}]}),
    batch_line("embed-1", "/v1/embeddings", {"model": "my-model", "input": "hello"}),
    batch_line("bad-1", "/v1/chat/completions",
               {"model": "my-model", "temperature": -1.0,
                "messages": [{"role": "user", "content": "hi"}]}),
]


def by_custom_id(path: Path) -> dict[str, dict[str, Any]]:
    results = read_results(path)
    found = {result["custom_id"]: result for result in results}
    assert len(found) == len(results), results
    return found


def assert_envelope(line: dict[str, Any], status: int) -> dict[str, Any]:
    """vLLM's BatchRequestOutput: exactly its four keys, its id forms; returns response."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    assert ID.match(line["id"]), line["id"]
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"}, response
    assert response["status_code"] == status
    assert REQUEST_ID.match(response["request_id"]), response["request_id"]
    return response  # type: ignore[no-any-return]


def assert_success(line: dict[str, Any], obj: str) -> dict[str, Any]:
    body = assert_envelope(line, 200)["body"]
    assert line["error"] is None
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body), body
    assert body["object"] == obj and body["model"] == "my-model"
    assert isinstance(body["created"], int)
    assert set(body["usage"]) == USAGE_KEYS
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
    return body  # type: ignore[no-any-return]


def test_batch_file_runs_unchanged_and_writes_vllm_output_lines(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "batch.jsonl", LINES)
    done = cli("run", str(requests), "-o", str(tmp_path / "out.jsonl"), "--no-progress")
    assert done.returncode == 1, done.stderr  # two lines failed, reported
    assert "2/4 done, 2 failed, 0 skipped" in done.stderr, done.stderr
    out = by_custom_id(tmp_path / "out.jsonl")
    assert set(out) == {"cmpl-1", "chat-1", "embed-1", "bad-1"}

    completion = assert_success(out["cmpl-1"], "text_completion")
    assert completion["id"].startswith("cmpl-")
    choice = completion["choices"][0]
    assert choice["text"] == predicted_text(bundled_tokenizer().encode(PROMPT), 8)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["usage"]["prompt_tokens"] == len(bundled_tokenizer().encode(PROMPT))

    chat = assert_success(out["chat-1"], "chat.completion")
    assert chat["id"].startswith("chatcmpl-")
    choice = chat["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop")
    assert chat["usage"]["completion_tokens"] <= 6

    # An unsupported url: vLLM's make_error_request_output (400, no body, a message).
    unsupported = out["embed-1"]
    assert assert_envelope(unsupported, 400)["body"] is None
    assert isinstance(unsupported["error"], str) and "/v1/embeddings" in unsupported["error"]

    # An invalid body: vLLM's ErrorResponse, the status code its code, naming the field.
    bad = out["bad-1"]
    assert assert_envelope(bad, 400)["body"] is None
    error = bad["error"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "temperature" and error["code"] == 400
    assert error["type"] == "BadRequestError" and "temperature" in error["message"]


def test_resume_keeps_finished_custom_ids_and_reruns_the_failed(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "batch.jsonl", LINES)
    output = tmp_path / "out.jsonl"
    first = cli("run", str(requests), "-o", str(output), "--no-progress")
    assert first.returncode == 1, first.stderr
    before = by_custom_id(output)
    again = cli("run", str(requests), "-o", str(output), "--no-progress", "--resume")
    assert again.returncode == 1, again.stderr
    assert "2 finished result(s)" in again.stderr and "2 error" in again.stderr, again.stderr
    after = by_custom_id(output)
    assert set(after) == set(before)
    for kept in ("cmpl-1", "chat-1"):
        assert after[kept] == before[kept]  # not run again: the same ids
    for rerun in ("embed-1", "bad-1"):
        assert after[rerun]["id"] != before[rerun]["id"]


def test_batch_lines_from_stdin(tmp_path: Path) -> None:
    """From a pipe the first line decides the format too (it is read, then run)."""
    done = subprocess.run([*CLI, "run", "-", "-o", "-", "--no-progress"],
                          input="\n" + "\n".join(LINES[:2]) + "\n", capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(line["custom_id"] for line in out) == ["chat-1", "cmpl-1"]
    for line in out:
        assert_success(line, "text_completion" if line["custom_id"] == "cmpl-1"
                       else "chat.completion")


@pytest.mark.anyio
async def test_structured_outputs_in_batch_lines_reach_the_engine(tmp_path: Path) -> None:
    """``response_format`` and ``structured_outputs`` mean what they mean to the server: the
    engine gets the constraint (the mock refuses it: that line's 500); a bad one is that
    line's 400."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    lines = [
        batch_line("json-1", "/v1/chat/completions",
                   {"max_tokens": 3, "response_format": {"type": "json_object"},
                    "messages": [{"role": "user", "content": "hi"}]}),
        batch_line("schema-1", "/v1/chat/completions",
                   {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema}}}),
        batch_line("regex-1", "/v1/completions",
                   {"max_tokens": 3, "prompt": PROMPT, "structured_outputs": {"regex": "a+"}}),
        batch_line("bad-1", "/v1/completions",
                   {"max_tokens": 3, "prompt": PROMPT, "structured_outputs": {"bogus": 1}}),
    ]
    requests = write_lines(tmp_path / "batch.jsonl", lines)
    output = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, vocab_size=1024) as engine:
        async with cli_process("run", str(requests), "-o", str(output), "--no-progress",
                               "--handshake-address", address, "--vocab-size", "1024",
                               "--model", str(bundled_model_dir())) as (process, out):
            with anyio.fail_after(COMMAND_TIMEOUT):
                code = await process.wait()
        wires = {r.request.external_req_id or r.request.request_id:
                 r.sampling_wire.get("structured_outputs")
                 for r in engine.received if isinstance(r, AddRequest)}
    assert code == 1, out.err  # the bad line failed
    found = by_custom_id(output)
    for refused, field in (("json-1", "response_format"), ("schema-1", "response_format"),
                           ("regex-1", "structured_outputs")):
        # The mock has no grammar backend: it refuses each (a 500 naming the field).
        assert assert_envelope(found[refused], 500)["body"] is None
        message = found[refused]["error"]["error"]["message"]
        assert "structured outputs" in message and field in message, message
    by_kind = {next(k for k in ("json_object", "json", "regex") if wire.get(k) is not None):
               wire for wire in wires.values() if wire is not None}
    assert len(wires) == 3 and len(by_kind) == 3, wires
    assert by_kind["json_object"]["json_object"] is True
    assert by_kind["json"]["json"] == schema
    assert by_kind["regex"]["regex"] == "a+"
    bad = found["bad-1"]
    assert assert_envelope(bad, 400)["body"] is None
    assert bad["error"]["error"]["param"] == "structured_outputs.bogus"
