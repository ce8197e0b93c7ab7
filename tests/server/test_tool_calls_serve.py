"""``anyio-genout serve`` passes the tool and reasoning flags to every server process
(``--api-server-count 2``: each worker builds its app from the supervisor's options)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from anyio_genout.text.bundled import bundled_model_dir
from tests.cli.support import cli
from tests.server.test_serve_workers import serving

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_every_worker_serves_tool_choice_auto_and_reasoning() -> None:
    with serving("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "qwen3") as server:
        answers = []
        for _ in range(12):  # a new connection each: either worker may take it
            with httpx.Client(base_url=server.base, timeout=20) as http:
                answers.append(http.post("/v1/chat/completions", json={
                    "model": "anyio-genout", "max_tokens": 4, "tools": [TOOL],
                    "messages": [{"role": "user", "content": "Once upon a time"}]}))
    for answer in answers:
        assert answer.status_code == 200, answer.text  # auto served, not refused
        # a reasoning parser is configured: the message has vLLM's reasoning field
        assert "reasoning" in answer.json()["choices"][0]["message"]


def test_a_built_in_reasoning_parser_goes_to_the_engines_serve_starts(tmp_path: Path) -> None:
    seen = tmp_path / "argv.json"
    fake = tmp_path / "fake_vllm.py"  # records its command line and exits: no engine
    fake.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(seen)!r}, 'w'))\n")
    done = cli("serve", str(bundled_model_dir()), "--reasoning-parser", "qwen3",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--vllm-command", f"{sys.executable} {fake}", "--ready-timeout", "10")
    assert done.returncode == 1, done.stderr  # the "engine" exited at once
    argv = json.loads(seen.read_text())
    assert "--reasoning-parser=qwen3" in argv  # vLLM's engine flag as well
    assert not any("tool" in arg for arg in argv)  # the tool flags are the front end's
