"""vLLM's ``--tokenizer``: ``vllm serve`` tokenizes with it, so ``serve`` does too (it is
this server's tokenizer folder, ``--model``); with engines it starts it goes on to them as
well. The CLI as a subprocess, over real HTTP."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from anyio_genout.text.bundled import bundled_model_dir
from tests.cli.support import cli
from tests.server.support import serve_process


def _tokenizer_with_a_template(tmp_path: Path) -> Path:
    """The bundled folder with a chat template that shows it is the one in use."""
    folder = tmp_path / "tok"
    shutil.copytree(bundled_model_dir(), folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "FROM-THE-TOKENIZER-FLAG {{ messages[0]['content'] }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_tokenizer_flag_names_the_servers_tokenizer(tmp_path: Path) -> None:
    folder = _tokenizer_with_a_template(tmp_path)
    with serve_process("--tokenizer", str(folder), exit_code=130) as server:
        rendered = httpx.post(f"{server.base}/tokenize", json={
            "messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
        text = httpx.post(f"{server.base}/detokenize", json={"tokens": rendered["tokens"]},
                          timeout=30).json()["prompt"]
    assert text.startswith("FROM-THE-TOKENIZER-FLAG hi")


def test_the_tokenizer_flag_and_another_model_folder_are_refused(tmp_path: Path) -> None:
    done = cli("serve", "--tokenizer", str(tmp_path), "--model", str(bundled_model_dir()))
    assert done.returncode == 2
    assert "both name the tokenizer folder" in done.stderr
