"""``kill -9`` of a standalone engine process under ``anyio-genout generate`` and ``run``.

The engine is ``anyio-genout mock-engine`` in a process of its own, killed with SIGKILL in
the middle of a stream: it says nothing, its sockets just go. The command must end with a
one-line error naming the engine and a non-zero exit within 5 s, and ``run`` must keep every
result that finished before the kill.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from tests.support import wait_until

from .support import (
    BACKEND_PAIRS,
    assert_finished_result,
    cli_process,
    complete_lines,
    free_port,
    read_results,
    request_line,
    running,
    write_lines,
)

pytestmark = pytest.mark.anyio

#: The promise: the command has ended this long after the engine was killed.
DETECTION = 5.0


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line.lower()]


def assert_one_line_engine_error(err: str) -> None:
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("anyio-genout: error: EngineDeadError: "), err
    assert "engine 0" in last or "rank 0" in last, last  # names the engine
    assert error_lines(err) == [last], err  # one line


@BACKEND_PAIRS
async def test_kill_9_of_the_engine_under_generate(cli_backend: str) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--step-time", "0.01") as (engine, engine_output), \
            cli_process("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "4000",
                        "--ignore-eos", "--handshake-address", address,
                        "--backend", cli_backend) as (process, output):
        await wait_until(lambda: running(process, output) and running(engine, engine_output)
                         and len(output.stdout.split()) >= 5, seconds=20)
        engine.kill()
        killed = time.monotonic()
        with anyio.fail_after(DETECTION + 5):  # a hang fails here, not in pytest's timeout
            code = await process.wait()
        took = time.monotonic() - killed
    assert code not in (0, None), output.err
    assert took < DETECTION, f"ended {took:.1f} s after the kill"
    assert_one_line_engine_error(output.err)
    assert output.stdout.endswith(b"\n")  # the tokens streamed so far, as a whole line


@BACKEND_PAIRS
async def test_kill_9_of_the_engine_under_run_keeps_the_finished_results(
        tmp_path: Path, cli_backend: str) -> None:
    # 300 requests of 20 tokens at 10 ms a step, 16 at a time: ~4 s if left alone.
    ids = [f"r{i:03d}" for i in range(300)]
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(rid, [1, 2, i], max_tokens=20, ignore_eos=True)
                            for i, rid in enumerate(ids)])
    results = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--step-time", "0.01") as (engine, engine_output), \
            cli_process("run", str(requests), "-o", str(results), "--concurrency", "16",
                        "--handshake-address", address, "--backend", cli_backend
                        ) as (process, output):
        await wait_until(lambda: running(process, output) and running(engine, engine_output)
                         and complete_lines(results) >= 20, seconds=20)
        engine.kill()
        killed = time.monotonic()
        before = complete_lines(results)
        with anyio.fail_after(DETECTION + 5):
            code = await process.wait()
        took = time.monotonic() - killed
    assert code == 1, output.err
    assert took < DETECTION, f"ended {took:.1f} s after the kill"
    assert_one_line_engine_error(output.err)

    lines = read_results(results)  # valid JSONL, no partial line
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines)
    finished = [line for line in lines if "error" not in line]
    assert len(finished) >= before  # every result finished before the kill is kept
    for line in finished:
        assert_finished_result(line)
        assert len(line["token_ids"]) == 20
    failed = [line for line in lines if "error" in line]
    assert all(line["error"].startswith("EngineDeadError: ") for line in failed)
    # The rest is accounted for: in flight failed, and how many were never run.
    not_run = len(ids) - len(lines)
    assert (f"({len(failed)} in flight failed, {not_run} request(s) not run; run again with "
            "--resume to finish)") in output.err.strip().splitlines()[-1]
    assert f"{len(finished)}/300 done, {len(failed)} failed, 0 skipped" in output.err


@BACKEND_PAIRS
async def test_kill_9_of_one_of_two_engines_under_run_fails_only_its_requests(
        tmp_path: Path, cli_backend: str) -> None:
    """With several engines the job goes on: the dead engine's requests in flight get an
    error line naming it, everything else (also what was still to run) finishes on the
    survivor."""
    ids = [f"r{i:03d}" for i in range(200)]
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(rid, [1, 2, i], max_tokens=20, ignore_eos=True)
                            for i, rid in enumerate(ids)])
    results = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address, "--rank", "0",
                           "--step-time", "0.01") as (first, first_output), \
            cli_process("mock-engine", "--handshake-address", address, "--rank", "1",
                        "--step-time", "0.01") as (second, second_output), \
            cli_process("run", str(requests), "-o", str(results), "--concurrency", "16",
                        "--handshake-address", address, "--engine-count", "2",
                        "--backend", cli_backend) as (process, output):
        await wait_until(lambda: running(process, output) and running(first, first_output)
                         and running(second, second_output)
                         and complete_lines(results) >= 20, seconds=20)
        second.kill()
        with anyio.fail_after(60):
            code = await process.wait()
    lines = read_results(results)
    assert sorted(line["request_id"] for line in lines) == ids, output.err  # none lost
    failed = [line for line in lines if "error" in line]
    assert failed, "engine 1 had requests in flight when it was killed"
    assert all(line["error"].startswith("EngineDeadError: ") and "engine 1" in line["error"]
               for line in failed), failed[:3]
    for line in lines:
        if "error" not in line:
            assert_finished_result(line)
            assert len(line["token_ids"]) == 20
    assert code == 1, output.err  # some requests failed
    assert "Traceback" not in output.err
