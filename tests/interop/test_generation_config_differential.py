"""The model's sampling defaults against ``vllm serve`` 0.32 (``--generation-config``): the
same tiny model, its ``generation_config.json`` giving ``temperature`` 0 (so both answers
are greedy and comparable), a ``repetition_penalty`` and ``max_new_tokens``; completions
that set some of them or none get the same text and usage from both servers (the tiny
model has no chat template, so chat's ``max_new_tokens`` default is checked in
``tests/server/test_generation_defaults.py`` only). Needs a real engine (``nox -s interop``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import RealVllm
from .test_metrics_differential import MODEL, ours, vllm_serve

pytestmark = pytest.mark.anyio

CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0,
          "repetition_penalty": 1.6, "max_new_tokens": 7}
BODIES: list[tuple[str, dict[str, Any]]] = [  # completions: the tiny model has no template
    ("/v1/completions", {"prompt": "t5 t9 t44 t5 t9", "max_tokens": None}),
    ("/v1/completions", {"prompt": "t5 t9 t44 t5 t9", "max_tokens": None,
                         "repetition_penalty": 1.0}),
    ("/v1/completions", {"prompt": "t5 t9 t44 t5 t9"}),
    ("/v1/completions", {"prompt": "t5 t9 t44 t5 t9", "max_tokens": 5, "top_k": 3}),
]


@pytest.fixture
def model(real_vllm: RealVllm, tmp_path: Path) -> Path:
    """The tiny model with sampling defaults in its generation config."""
    folder = tmp_path / "tiny-defaults"
    folder.mkdir()
    for item in Path(real_vllm.model).iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").write_text(json.dumps(CONFIG))
    return folder


async def _answers(base: str) -> list[Any]:
    found = []
    async with httpx.AsyncClient(timeout=120) as http:
        for path, body in BODIES:
            reply = await http.post(f"{base}{path}", json={"model": MODEL, "ignore_eos": True,
                                                           **body})
            assert reply.status_code == 200, reply.text
            data = reply.json()
            choice = data["choices"][0]
            found.append((choice["text"], data["usage"]["completion_tokens"]))
    return found


async def test_the_models_defaults_as_vllm_serve_applies_them(
        real_vllm: RealVllm, model: Path, anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("one run: the servers are subprocesses, the backend does not matter")
    async with vllm_serve(real_vllm, model) as base:
        theirs = await _answers(base)
    async with ours(real_vllm, model) as base:
        mine = await _answers(base)
    assert mine == theirs
    # a completion's max_tokens is 16 even when null (max_new_tokens never reaches it), or
    # the request's
    assert [tokens for _, tokens in mine] == [16, 16, 16, 5]
    print(f"\ngeneration-config differential: {len(mine)} answers equal; with the file's "
          f"repetition_penalty {mine[0][0]!r}, without {mine[1][0]!r}")
