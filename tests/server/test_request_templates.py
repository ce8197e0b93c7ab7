"""A request's own chat template (CVE-2025-61620), through real HTTP on every backend:
refused (400 naming ``chat_template`` or ``chat_template_kwargs.chat_template``) unless the
server trusts request templates (``create_app(trust_request_chat_template=True)``,
``anyio-genout serve --trust-request-chat-template``); a trusted one that runs away is
stopped within its budget (400) while ``/health`` and the other streams go on."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest

from anyio_genout.text import chat_template
from tests.server.support import MODEL, serve_process, served
from tests.text.client_support import added, tokenizer

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hi"}]
#: A template of the request's own: the messages' contents after a marker.
OWN = "OWN:{% for m in messages %}{{ m.content }}{% endfor %}"
#: Two nested loops: about 10 s on asyncio, 4 s on trio when rendered on the event loop.
RUNAWAY = "{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}x"
REFUSED = "--trust-request-chat-template is not set"
#: How long one rendering may take (the code before it had no budget).
BUDGET: float = getattr(chat_template, "RENDER_BUDGET", 1.0)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}


@pytest.mark.parametrize(("extra", "param"), [
    ({"chat_template": OWN}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": OWN}}, "chat_template_kwargs.chat_template"),
])
async def test_a_request_template_is_refused_by_default(extra: dict[str, Any],
                                                        param: str) -> None:
    async with served() as s, httpx.AsyncClient(base_url=s.base_url) as http:
        for path, body in (("/v1/chat/completions", _chat(**extra)),
                           ("/tokenize", {"messages": MESSAGES, **extra})):
            answer = await http.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param
            assert REFUSED in error["message"] and param in error["message"]
        assert added(s.setup.engine) == []  # nothing reached the engine
        # The model's own template, and other template variables, are still fine.
        answer = await http.post("/v1/chat/completions",
                                 json=_chat(chat_template_kwargs={"enable_thinking": False}))
        assert answer.status_code == 200, answer.text


async def test_a_trusted_request_template_is_rendered() -> None:
    expected = tokenizer().encode("OWN:hi", add_special_tokens=False)
    async with served(app_options={"trust_request_chat_template": True}) as s, \
            httpx.AsyncClient(base_url=s.base_url) as http:
        for extra in ({"chat_template": OWN}, {"chat_template_kwargs": {"chat_template": OWN}},
                      # the top-level one wins, as in vLLM
                      {"chat_template": OWN, "chat_template_kwargs": {"chat_template": "no"}}):
            tokens = await http.post("/tokenize", json={"messages": MESSAGES, **extra})
            assert tokens.status_code == 200, tokens.text
            assert tokens.json()["tokens"] == expected
            answer = await http.post("/v1/chat/completions", json=_chat(**extra))
            assert answer.status_code == 200, answer.text
            assert list(added(s.setup.engine)[-1].request.prompt_token_ids) == expected


async def test_a_runaway_template_is_stopped_while_health_answers() -> None:
    worst = 0.0

    async def poll_health(http: httpx.AsyncClient, done: anyio.Event) -> None:
        nonlocal worst
        while not done.is_set():
            start = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - start)
            await anyio.sleep(0.02)

    async with served(app_options={"trust_request_chat_template": True}) as s, \
            httpx.AsyncClient(base_url=s.base_url, timeout=30) as http:
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll_health, http, done)
            start = time.perf_counter()
            answer = await http.post("/v1/chat/completions", json=_chat(chat_template=RUNAWAY))
            took = time.perf_counter() - start
            done.set()
        assert answer.status_code == 400, answer.text
        assert f"budget of {BUDGET:g} s" in answer.json()["error"]["message"]
        assert took < BUDGET + 2.0  # stopped at its budget, not rendered to the end
        assert worst < 1.0, f"/health took {worst:.2f} s while the template rendered"
        # The worker thread stopped: a normal request is served at once afterwards.
        answer = await http.post("/v1/chat/completions", json=_chat())
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_serve_trusts_request_templates_only_with_the_flag(backend: str) -> None:
    for options, status in (((), 400), (("--trust-request-chat-template",), 200)):
        with serve_process("--backend", backend, "--served-model-name", MODEL,
                           *options) as server:
            answer = httpx.post(f"{server.base}/v1/chat/completions",
                                json=_chat(chat_template=OWN), timeout=10)
            assert answer.status_code == status, answer.text
