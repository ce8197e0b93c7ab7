"""``anyio-genout generate --model DIR --handshake-address ...``: text from an engine in another
process (the README's command-line line for real engines, with the mock-engine command as the
engine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anyio
import pytest

from anyio_genout.text import bundled_corpus, bundled_model_dir, bundled_tokenizer

from .support import CLI, COMMAND_TIMEOUT, cli_process, free_port

pytestmark = pytest.mark.anyio


async def test_text_from_an_engine_process_with_the_folders_tokenizer(tmp_path: Path) -> None:
    tokenizer = bundled_tokenizer()
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(tokenizer.encode(bundled_corpus(), add_special_tokens=False)))
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address, "--vocab-size",
                           "1024", "--corpus-token-ids", str(corpus)) as (process, output):
        with anyio.fail_after(COMMAND_TIMEOUT):
            done = await anyio.run_process(
                [*CLI, "generate", "--model", str(bundled_model_dir()), "--prompt",
                 "Once upon a time", "--max-tokens", "24", "--stop", "\u3002",
                 "--handshake-address", address, "--vocab-size", "1024"],
                check=False, stdin=subprocess.DEVNULL)
        assert process.returncode is None, output.err  # the engine outlives its client
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    text = stdout.removesuffix("\n")
    assert len(text) > 10 and text.strip() in bundled_corpus()  # words from the engine
    assert "finish_reason=" in stderr and "prompt_tokens=" in stderr
