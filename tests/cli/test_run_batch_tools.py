"""``anyio-genout run`` serves OpenAI batch lines with tools as ``vllm run-batch`` does,
with the same ``--enable-auto-tool-choice``, ``--tool-call-parser`` and
``--reasoning-parser`` as ``serve``."""

from __future__ import annotations

from pathlib import Path

from .support import cli, write_lines
from .test_run_batch import assert_success, batch_line, by_custom_id

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
LINE = batch_line("tools-1", "/v1/chat/completions", {
    "model": "my-model", "max_tokens": 6, "temperature": 0.0, "tools": [TOOL],
    "messages": [{"role": "user", "content": "Where is the lighthouse?"}]})


def test_tools_lines_run_with_the_tool_flags_and_are_refused_without(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "batch.jsonl", [LINE])
    served = cli("run", "-i", str(requests), "-o", str(tmp_path / "with.jsonl"),
                 "--no-progress", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "deepseek_r1")
    refused = cli("run", "-i", str(requests), "-o", str(tmp_path / "without.jsonl"),
                  "--no-progress")
    unknown = cli("run", "-i", str(requests), "-o", str(tmp_path / "x.jsonl"),
                  "--tool-call-parser", "nope")
    assert served.returncode == 0, served.stderr
    body = assert_success(by_custom_id(tmp_path / "with.jsonl")["tools-1"], "chat.completion")
    assert "reasoning" in body["choices"][0]["message"]  # the reasoning parser read it
    assert refused.returncode == 1, refused.stderr
    error = by_custom_id(tmp_path / "without.jsonl")["tools-1"]["error"]["error"]
    assert error["message"].startswith('"auto" tool choice requires --enable-auto-tool-choice')
    assert error["param"] == "tool_choice"
    assert unknown.returncode == 2 and "unknown tool parser 'nope'" in unknown.stderr
