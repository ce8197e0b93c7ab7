"""Helpers for driving ``anyio-genout`` as a user would: a child process, files, signals."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.protocol import AddRequest
from anyio_genout.transport import free_tcp_port

#: ``python -m anyio_genout``: the command line, without depending on where scripts install.
CLI = [sys.executable, "-m", "anyio_genout"]

#: Bound on any one command that is expected to finish by itself.
COMMAND_TIMEOUT = 30.0


free_port = free_tcp_port


def cli(*args: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``anyio-genout ARGS`` to completion; stdout and stderr captured as text."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


def request_line(request_id: str, prompt: Sequence[int], **sampling: Any) -> str:
    return json.dumps({"request_id": request_id, "prompt_token_ids": list(prompt),
                       "sampling_params": sampling})


def write_lines(path: Path, lines: Iterable[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    """Every line of a results file, parsed (a partial or malformed line fails the test)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"results file ends mid-line: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def complete_lines(path: Path) -> int:
    """Lines fully written so far (safe to call while the writer runs)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def assert_finished_result(result: dict[str, Any]) -> None:
    """One finished request's result line, with every documented field."""
    assert "error" not in result, result
    assert isinstance(result["request_id"], str)
    tokens = result["token_ids"]
    assert isinstance(tokens, list) and all(type(t) is int for t in tokens)
    assert result["finish_reason"] in ("length", "stop"), result
    usage = result["usage"]
    assert usage["output_tokens"] == len(tokens)
    assert usage["prompt_tokens"] > 0
    assert "cached_tokens" in usage
    assert isinstance(result["ttft"], float) and result["ttft"] >= 0
    assert isinstance(result["e2e_latency"], float)
    assert result["e2e_latency"] >= result["ttft"]


# (backend of the test and its mock engine, backend of the CLI process)
BACKEND_PAIRS = pytest.mark.parametrize(("anyio_backend", "cli_backend"),
                                        [("asyncio", "trio"), ("trio", "asyncio")])


def external_ids(engine: MockEngine) -> dict[str, str]:
    """Internal (engine-side) request id -> the request id of the input line."""
    return {r.request.request_id: r.request.external_req_id or r.request.request_id
            for r in engine.received if isinstance(r, AddRequest)}


@asynccontextmanager
async def engine_for(address: str, **config: Any) -> AsyncIterator[MockEngine]:
    """A mock engine in this process that dials ``address`` once the CLI binds it."""
    engine = MockEngine(MockEngineConfig(handshake_address=address, handshake_timeout=20.0,
                                         linger=0.0, **config))
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.serve)
        try:
            yield engine
        finally:
            tg.cancel_scope.cancel()


async def drain(stream: anyio.abc.ByteReceiveStream | None, into: bytearray) -> None:
    assert stream is not None
    async for chunk in stream:
        into.extend(chunk)


class Output:
    """What a child process wrote so far (complete once :func:`cli_process` has exited)."""

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")


@asynccontextmanager
async def cli_process(*args: str) -> AsyncIterator[tuple[anyio.abc.Process, Output]]:
    """``anyio-genout ARGS`` as a child process whose output is collected as it comes.

    On exit the process is killed if it still runs (a failing test never waits for it), and
    its output is read to the end, so assertions after the block see all of it.
    """
    output = Output()
    async with await anyio.open_process([*CLI, *args]) as process, \
            anyio.create_task_group() as tg:
        tg.start_soon(drain, process.stdout, output.stdout)
        tg.start_soon(drain, process.stderr, output.stderr)
        try:
            yield process, output
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                with anyio.move_on_after(5):
                    await process.wait()
            tg.cancel_scope.deadline = anyio.current_time() + 5


def running(process: anyio.abc.Process, output: Output) -> bool:
    """True while ``process`` runs; fails the test at once (with its stderr) if it ended."""
    assert process.returncode is None, f"exited {process.returncode}: {output.err}"
    return True
