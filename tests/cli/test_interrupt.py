"""Ctrl-C in the middle of ``anyio-genout run``/``generate``, against an in-test mock engine.

The mock engine runs in the pytest process (so the test can read what it received); the CLI
runs as a child process that serves it (``--handshake-address``), as a user would run it
against real ``vllm serve --headless`` engines.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import anyio
import pytest

from tests.support import wait_until

from .support import (
    BACKEND_PAIRS,
    assert_finished_result,
    cli_process,
    complete_lines,
    engine_for,
    external_ids,
    free_port,
    read_results,
    request_line,
    running,
    write_lines,
)

pytestmark = pytest.mark.anyio


@BACKEND_PAIRS
async def test_ctrl_c_aborts_every_in_flight_request_and_keeps_every_result(
        tmp_path: Path, cli_backend: str) -> None:
    # 200 requests of 40-199 tokens at 10 ms a step, 32 at a time: ~15 s if left alone.
    max_tokens = {f"r{i:03d}": 40 + (i * 37) % 160 for i in range(200)}
    requests = write_lines(tmp_path / "big.jsonl",
                           [request_line(rid, [1, 2, i], max_tokens=n, ignore_eos=True)
                            for i, (rid, n) in enumerate(max_tokens.items())])
    results = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, step_time=0.01) as engine:
        async with cli_process("run", str(requests), "-o", str(results), "--concurrency", "32",
                               "--handshake-address", address, "--backend", cli_backend
                               ) as (process, output):
            await wait_until(lambda: running(process, output) and complete_lines(results) >= 5,
                             seconds=20)
            assert len(engine.running_ids) > 0  # requests are in flight right now
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                code = await process.wait()
        assert code == 130, output.err

        lines = read_results(results)
        finished = set()
        for line in lines:
            assert_finished_result(line)
            assert len(line["token_ids"]) == max_tokens[line["request_id"]]
            finished.add(line["request_id"])
        assert len(finished) == len(lines) >= 5

        # The engine got an ABORT for each request it was given that has no result line.
        def aborted_in_flight() -> bool:
            names = external_ids(engine)
            return {names[rid] for rid in engine.aborted_ids} == set(names.values()) - finished

        await wait_until(aborted_in_flight, seconds=2)
        assert set(external_ids(engine).values()) - finished, "nothing was in flight"
        counts = Counter(engine.aborted_ids)
        assert set(counts.values()) == {1}, counts.most_common(3)  # each exactly once
        assert engine.running_ids == [] and engine.waiting_ids == []
        assert engine.errors == [] and not engine.dead

    assert "Traceback" not in output.err
    assert f"interrupted; {len(lines)} finished result(s) kept in {results}" in output.err


@BACKEND_PAIRS
async def test_ctrl_c_in_generate_aborts_the_request(cli_backend: str) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, step_time=0.01) as engine:
        async with cli_process("generate", "--prompt-token-ids", "1,2,3", "--max-tokens",
                               "4000", "--ignore-eos", "--handshake-address", address,
                               "--backend", cli_backend) as (process, output):
            await wait_until(lambda: running(process, output) and len(output.stdout.split()) >= 5,
                             seconds=20)
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                code = await process.wait()
        assert code == 130, output.err
        await wait_until(lambda: bool(engine.aborted_ids), seconds=2)
        assert engine.aborted_ids == engine.added_ids  # one request, aborted once
        assert engine.running_ids == []
    assert "Traceback" not in output.err
    assert output.err.strip().splitlines()[-1].startswith("anyio-genout: interrupted after ")


@BACKEND_PAIRS
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_while_waiting_for_engines_exits_130(
        tmp_path: Path, cli_backend: str, signum: signal.Signals) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", [request_line("a", [1], max_tokens=2)])
    async with cli_process("run", str(requests), "-o", str(tmp_path / "out.jsonl"),
                           "--handshake-address", f"tcp://127.0.0.1:{free_port()}",
                           "--backend", cli_backend) as (process, output):
        await wait_until(lambda: running(process, output) and b"vllm serve" in output.stderr,
                         seconds=20)
        process.send_signal(signum)
        with anyio.fail_after(10):
            code = await process.wait()
    assert code == 130, output.err
    assert "Traceback" not in output.err
    assert "interrupted" in output.err
