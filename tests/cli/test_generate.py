"""``anyio-genout generate`` as a user runs it: embedded mock, backends, usage and engine errors."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.to_thread
import httpx
import pytest

from anyio_genout.mock import greedy_tokens

from .support import COMMAND_TIMEOUT, cli, free_port

SUMMARY = re.compile(r"^finish_reason=length prompt_tokens=3 output_tokens=(\d+) "
                     r"ttft=(\d+\.\d)ms tokens/s=(\d+\.\d) total=(\d+\.\d)ms$")


def summary(stderr: str) -> re.Match[str]:
    match = SUMMARY.match(stderr.strip().splitlines()[-1])
    assert match, stderr
    return match


@pytest.mark.parametrize("backend", [
    "asyncio",
    pytest.param("uvloop", marks=pytest.mark.skipif(
        importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")),
    "trio",
])
def test_generate_streams_tokens_then_a_summary(backend: str) -> None:
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "24", "--ignore-eos",
               "--backend", backend)
    assert done.returncode == 0, done.stderr
    tokens = [int(t) for t in done.stdout.split()]
    assert len(tokens) == 24
    assert tokens == greedy_tokens([1, 2, 3], 24)  # the CLI is greedy by default
    assert done.stdout.endswith("\n")
    match = summary(done.stderr)
    assert int(match[1]) == 24
    assert float(match[2]) >= 0 and float(match[3]) > 0
    assert "Traceback" not in done.stderr


def test_the_token_ids_command_through_the_console_script() -> None:
    """``anyio-genout generate --prompt-token-ids 1,2,3 --max-tokens 32`` verbatim (quickstart)."""
    script = Path(sys.executable).with_name("anyio-genout")
    found = str(script) if script.exists() else shutil.which("anyio-genout")
    if found is None:
        pytest.skip("the anyio-genout console script is not installed")
    done = subprocess.run([found, "generate", "--prompt-token-ids", "1,2,3",
                           "--max-tokens", "32"], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 32
    assert int(summary(done.stderr)[1]) == 32


def test_bad_prompt_token_ids_is_a_one_line_usage_error() -> None:
    done = cli("generate", "--prompt-token-ids", "x,y")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("anyio-genout generate: error: argument --prompt-token-ids")
    assert "'x,y'" in lines[0]


@pytest.mark.parametrize("argv", [[], ["frob"], ["run"],
                                  ["generate", "--prompt-token-ids", "1", "--max-tokens", "x"]])
def test_every_usage_error_is_one_line_and_exit_2(argv: list[str]) -> None:
    done = cli(*argv)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "error:" in done.stderr and "--help" in done.stderr


def waiting_for_no_engine(*extra: str) -> subprocess.CompletedProcess[str]:
    port = free_port()
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--handshake-address",
               f"tcp://127.0.0.1:{port}", "--ready-timeout", "0.5", *extra)
    assert done.returncode == 1
    assert done.stdout == ""
    # While it waits it tells how to start the engines it serves.
    assert (f"vllm serve <model> --headless --data-parallel-address 127.0.0.1 "
            f"--data-parallel-rpc-port {port}") in done.stderr
    return done


def test_engine_error_is_one_line_without_debug() -> None:
    done = waiting_for_no_engine()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("anyio-genout: error: HandshakeTimeoutError: ")
    assert "HELLO" in last and "0.5 s" in last
    assert "Traceback" not in done.stderr


def test_debug_shows_the_traceback() -> None:
    done = waiting_for_no_engine("--debug")
    assert "Traceback (most recent call last)" in done.stderr
    assert "anyio_genout.errors.HandshakeTimeoutError" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "anyio-genout: error: HandshakeTimeoutError: ")


def test_an_out_of_vocabulary_id_is_refused_locally_by_the_embedded_mock() -> None:
    done = cli("generate", "--prompt-token-ids", "1,2,32000")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("anyio-genout: error: InvalidRequestError: "), line
    assert "prompt_token_ids[2]: 32000 is not in the vocabulary (0..31999)" in line
    assert "EngineDeadError" not in line


def test_max_tokens_beyond_the_context_is_refused_with_the_numbers() -> None:
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "5000")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line == ("anyio-genout: error: InvalidRequestError: invalid request: max_tokens: "
                    "max_tokens=5000 cannot be greater than max_model_len=4096. Please request "
                    "fewer output tokens.")


@pytest.mark.anyio
async def test_the_cli_and_the_server_apply_one_max_tokens_rule() -> None:
    """vLLM's rule, for both: ``max_tokens`` above the context is refused, in the same
    words; a prompt plus ``max_tokens`` beyond the context is not refused: it generates up
    to the context (finish ``length``)."""
    from tests.server.support import MODEL, served

    refused = await anyio.to_thread.run_sync(functools.partial(
        cli, "generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "4097"))
    cut = await anyio.to_thread.run_sync(functools.partial(
        cli, "generate", "--mock-step-time", "0", "--prompt-token-ids", "1,2,3",
        "--max-tokens", "4095", "--ignore-eos"))
    async with served(max_model_len=4096, step_time=0.0) as s, httpx.AsyncClient(
            timeout=COMMAND_TIMEOUT) as http:
        too_long = await http.post(f"{s.v1}/completions", json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4097})
        fits = await http.post(f"{s.v1}/completions", json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4095, "ignore_eos": True})
    message = too_long.json()["error"]["message"]
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(f"invalid request: max_tokens: {message}")
    assert cut.returncode == 0, cut.stderr
    assert "finish_reason=length prompt_tokens=3 output_tokens=4093" in cut.stderr
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["completion_tokens"] == 4093
    assert fits.json()["choices"][0]["finish_reason"] == "length"


def test_a_text_prompt_too_long_for_the_context_is_refused_before_it_is_encoded() -> None:
    """The CLI encodes as a stream does: the context's character bound refuses the text
    first (vLLM's message), with nothing sent to the engine and nothing on stdout."""
    done = cli("generate", "--prompt", "hello world " * 5000)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("anyio-genout: error: InvalidRequestError: "), line
    assert "your prompt contains 60000 characters (more than 49152 characters" in line
    assert "maximum context length is 4096 tokens" in line


def test_logprobs_prints_one_line_per_token_with_the_top_n() -> None:
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos",
               "--logprobs", "2")
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == greedy_tokens([1, 2, 3], 6)
    for token, logprob, rank, top in rows:
        assert float(logprob) <= 0 and int(rank) >= 1
        alternatives = [entry.split(":") for entry in top.split(" ")]
        assert len(alternatives) == 2
        assert all(float(lp) <= 0 for _, lp in alternatives)
        assert alternatives[0] == [token, logprob]  # greedy: the sampled token is the top one
    assert int(summary(done.stderr)[1]) == 6
