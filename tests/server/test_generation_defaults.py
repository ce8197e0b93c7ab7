"""The model's sampling defaults (vLLM's ``--generation-config``): a request's unset
sampling fields take the model folder's ``generation_config.json`` values, ``max_tokens``
its ``max_new_tokens``. The rule, the requests the engine then gets (real HTTP, every
backend), and the flags through the CLI as a subprocess."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from anyio_genout.errors import UsageError
from anyio_genout.server.generation_defaults import generation_defaults
from anyio_genout.text.bundled import bundled_model_dir
from tests.cli.support import cli
from tests.server.support import MODEL, serve_process, served
from tests.text.client_support import PROMPT, added

CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 4], "do_sample": True, "temperature": 0.6,
          "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.0,
          "max_new_tokens": 9, "num_beams": 1}


def _folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    """The bundled model folder with ``config`` as its generation_config.json."""
    folder = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_rule(tmp_path: Path) -> None:
    folder = _folder(tmp_path, CONFIG)
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
                "repetition_penalty": 1.0, "max_tokens": 9}
    assert generation_defaults("auto", folder) == expected
    # a folder named, or max_new_tokens in the override, caps every request too (vLLM's
    # override_max_tokens)
    assert generation_defaults(str(folder), None) == {**expected, "max_tokens_cap": 9}
    assert generation_defaults("vllm", folder) == {}
    assert generation_defaults("vllm", folder, {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults("auto", folder, {"top_k": 5, "max_new_tokens": 3}) == {
        **expected, "top_k": 5, "max_tokens": 3, "max_tokens_cap": 3}
    # a named folder and an override: the cap is the value after the override (vLLM's
    # default_sampling_params["max_tokens"])
    assert generation_defaults(str(folder), None, {"max_new_tokens": 4}) == {
        **expected, "max_tokens": 4, "max_tokens_cap": 4}
    assert generation_defaults("auto", tmp_path) == {}  # no file: none
    for bad in ({"temperature": "hot"}, {"max_new_tokens": 0}, {"top_p": True},
                {"min_p": float("nan")}):
        with pytest.raises(UsageError, match=next(iter(bad))):
            generation_defaults("vllm", None, bad)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(UsageError, match="must be a JSON object"):
        generation_defaults("auto", tmp_path)
    with pytest.raises(UsageError, match="not 'auto', 'vllm' or a folder"):
        generation_defaults(str(tmp_path / "nowhere"), None)
    # read as the model folder's own files are: named, never a traceback
    for content, message in ((b"\xff\xfe{}", "not UTF-8 text"), (b"{", "not valid JSON")):
        (tmp_path / "generation_config.json").write_bytes(content)
        with pytest.raises(UsageError, match=f"generation_config.json: {message}"):
            generation_defaults(str(tmp_path), None)


@pytest.mark.anyio
async def test_unset_fields_take_the_models_defaults(tmp_path: Path) -> None:
    defaults = generation_defaults("auto", _folder(tmp_path, CONFIG))
    async with served(app_options={"sampling_defaults": defaults}) as s, \
            httpx.AsyncClient(base_url=s.v1, timeout=30) as http:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
        plain = await http.post("/chat/completions", json=chat)
        own = await http.post("/chat/completions",
                              json={**chat, "temperature": 1.0, "top_k": -1, "max_tokens": 3})
        completion = await http.post("/completions", json={"model": MODEL, "prompt": PROMPT})
        null = await http.post("/completions", json={"model": MODEL, "prompt": PROMPT,
                                                     "max_tokens": None})
        sent = [a.request.sampling_params for a in added(s.setup.engine)]
    assert plain.status_code == own.status_code == completion.status_code == 200
    assert null.status_code == 200
    first, second, third, fourth = sent
    assert fourth.max_tokens == 16  # a completion's null is 16, as vLLM normalizes it
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.6, 0.9, 50, 0.05)
    assert first.max_tokens == 9 and plain.json()["usage"]["completion_tokens"] <= 9
    assert (second.temperature, second.top_k, second.top_p, second.max_tokens) == (
        1.0, -1, 0.9, 3)  # what a request sets wins, field by field
    assert third.max_tokens == 16 and third.temperature == 0.6  # completions' own default


@pytest.mark.anyio
async def test_a_cap_bounds_what_requests_ask(tmp_path: Path) -> None:
    defaults = generation_defaults("vllm", None, {"max_new_tokens": 4})
    async with served(app_options={"sampling_defaults": defaults}) as s, \
            httpx.AsyncClient(base_url=s.v1, timeout=30) as http:
        asked = await http.post("/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "max_tokens": 12})
        chat = await http.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_completion_tokens": 2})
        too_many = await http.post("/completions", json={"model": MODEL, "prompt": PROMPT,
                                                         "max_tokens": 10**6})
        sent = [a.request.sampling_params.max_tokens for a in added(s.setup.engine)]
    assert asked.status_code == chat.status_code == 200
    assert sent == [4, 2]
    assert too_many.status_code == 400  # above the context: refused, cap or not (as vLLM)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_flags(tmp_path: Path, backend: str) -> None:
    folder = _folder(tmp_path, {**CONFIG, "temperature": 0.0, "max_new_tokens": 5})
    body = {"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True}
    with serve_process("--backend", backend, "--model", str(folder), exit_code=130) as auto:
        answer = httpx.post(f"{auto.base}/v1/chat/completions", json=body, timeout=30).json()
        again = httpx.post(f"{auto.base}/v1/chat/completions", json=body, timeout=30).json()
    assert answer["usage"]["completion_tokens"] == 5  # max_new_tokens
    # temperature 0 from the file: greedy, so the same answer twice
    assert answer["choices"][0]["message"] == again["choices"][0]["message"]
    with serve_process("--backend", backend, "--model", str(folder), "--generation-config",
                       "vllm", "--override-generation-config", '{"max_new_tokens": 7}',
                       exit_code=130) as neutral:
        answer = httpx.post(f"{neutral.base}/v1/chat/completions", json=body,
                            timeout=30).json()
    assert answer["usage"]["completion_tokens"] == 7


def test_a_bad_override_is_exit_2() -> None:
    done = cli("serve", "--override-generation-config", "[1]")
    assert done.returncode == 2
    assert "--override-generation-config must be a JSON object" in done.stderr
