"""One ``max_tokens`` rule (vLLM's) for the server and the client underneath it: the same
default, the same cut at the context, the same refusal above it."""

from __future__ import annotations

import httpx
import pytest

from anyio_genout import GenerateRequest, InvalidRequestError, SamplingParams
from tests.server.support import MODEL, served

pytestmark = pytest.mark.anyio

PROMPT_IDS = [5, 6, 7, 8]


async def test_the_clients_default_max_tokens_is_the_servers() -> None:
    """No ``max_tokens``: the chat server and the client both generate the rest of the
    context (``max_model_len`` minus the prompt)."""
    async with served(max_model_len=64, step_time=0.0) as s, httpx.AsyncClient() as http:
        chat = await http.post(f"{s.v1}/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True})
        client = s.setup.text.client
        async with client.generate(GenerateRequest(
                request_id="direct", prompt_token_ids=PROMPT_IDS,
                sampling_params=SamplingParams(ignore_eos=True))) as stream:
            direct = await stream.collect_output()
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert len(direct.token_ids) == 64 - len(PROMPT_IDS)
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert direct.finish_reason is not None and direct.finish_reason.as_str() == "length"


async def test_the_client_cuts_and_refuses_as_the_server_does() -> None:
    async with served(max_model_len=64, step_time=0.0) as s, httpx.AsyncClient() as http:
        refused = await http.post(f"{s.v1}/completions", json={
            "model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 65})
        cut = await http.post(f"{s.v1}/completions", json={
            "model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 64, "ignore_eos": True})
        client = s.setup.text.client
        with pytest.raises(InvalidRequestError) as direct_refused:
            async with client.generate(GenerateRequest(
                    request_id="long", prompt_token_ids=PROMPT_IDS,
                    sampling_params=SamplingParams(max_tokens=65))):
                pass
        async with client.generate(GenerateRequest(
                request_id="cut", prompt_token_ids=PROMPT_IDS,
                sampling_params=SamplingParams(max_tokens=64, ignore_eos=True))) as stream:
            direct_cut = await stream.collect_output()
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["message"]) == (
        direct_refused.value.field, direct_refused.value.message)
    assert error["message"] == ("max_tokens=65 cannot be greater than max_model_len=64. "
                                "Please request fewer output tokens.")
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["completion_tokens"] == len(direct_cut.token_ids) == 60
