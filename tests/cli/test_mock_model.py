"""``anyio-genout mock-engine --model DIR``: a standalone mock that passes for a folder's
model, as the embedded one passes for the shipped tokenizer's. A front end with the same
``--model DIR`` then shows readable text (before, the mock drew ids from 32,000 for a
1,024-token tokenizer: empty text, or U+FFFD), its top logprobs real tokens."""

from __future__ import annotations

import json

import anyio
import pytest

from anyio_genout.text.bundled import bundled_corpus, bundled_model_dir

from .support import COMMAND_TIMEOUT, cli_process, free_port

pytestmark = pytest.mark.anyio


async def _generate_against_mock(*options: str) -> tuple[int, str, str]:
    """``generate --model DIR ... --handshake-address A`` against ``mock-engine --model DIR
    --handshake-address A --once``: the front end's exit status, stdout and stderr."""
    address = f"tcp://127.0.0.1:{free_port()}"
    folder = str(bundled_model_dir())
    async with cli_process("mock-engine", "--model", folder, "--handshake-address", address,
                           "--once") as (engine, engine_output), \
            cli_process("generate", "--model", folder, "--handshake-address", address,
                        "--ready-timeout", "20", *options) as (front, output):
        with anyio.fail_after(COMMAND_TIMEOUT):
            code = await front.wait()
            stopped = await engine.wait()
    assert stopped == 0, engine_output.err  # --once: its client left
    return code, output.stdout.decode(), output.err


async def test_a_standalone_mock_with_a_model_folder_writes_its_text() -> None:
    code, out, err = await _generate_against_mock("--prompt", "Once upon a time",
                                                  "--max-tokens", "40", "--ignore-eos")
    assert code == 0, err
    text = out.strip()
    assert "\ufffd" not in text and len(text.split()) >= 8, text
    assert text in bundled_corpus()  # a stretch of the corpus, from a sentence's start
    assert text[0].isupper(), text


async def test_its_logprobs_show_the_tokens_it_sent() -> None:
    code, out, err = await _generate_against_mock("--prompt", "Once upon a time",
                                                  "--max-tokens", "12", "--ignore-eos",
                                                  "--logprobs", "3")
    assert code == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert len(rows) == 12
    texts = [json.loads(row[4]) for row in rows]
    assert all(texts) and "".join(texts) in bundled_corpus(), texts
    for row in rows:
        alternatives = [int(pair.split(":")[0]) for pair in row[3].split()]
        assert len(set(alternatives)) == 3 and all(t < 1024 for t in alternatives), row
