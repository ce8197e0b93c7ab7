"""``anyio-genout serve`` passes the tool and reasoning flags to every server process
(``--api-server-count 2``: each worker builds its app from the supervisor's options)."""

from __future__ import annotations

import httpx

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
