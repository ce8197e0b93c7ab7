"""``anyio-genout run`` when its engine dies mid-run: results kept, the rest accounted, exit 1."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.support import wait_until

from .support import (
    BACKEND_PAIRS,
    assert_finished_result,
    cli,
    cli_process,
    engine_for,
    external_ids,
    free_port,
    read_results,
    request_line,
    write_lines,
)

pytestmark = pytest.mark.anyio


@BACKEND_PAIRS
async def test_engine_death_keeps_results_accounts_for_the_rest_and_resumes(
        tmp_path: Path, cli_backend: str) -> None:
    # 16 at a time, 30 tokens each: the first wave finishes 30 steps after its last request
    # arrived, and the engine sends ENGINE_CORE_DEAD 45 steps after that arrival, in the
    # middle of the second wave. Counted from the arrival, not from the engine's first step
    # (as dead_after_steps would): the child process's 16 ADDs may trickle in over more
    # than 15 steps on a loaded machine.
    ids = [f"r{i:02d}" for i in range(80)]
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(rid, [5, 6, i], max_tokens=30, ignore_eos=True)
                            for i, rid in enumerate(ids)])
    results = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, step_time=0.002) as engine:
        async with cli_process("run", str(requests), "-o", str(results), "--concurrency", "16",
                               "--handshake-address", address, "--backend", cli_backend
                               ) as (process, output):
            with anyio.fail_after(20):  # no hang
                await wait_until(lambda: len(engine.added_ids) >= 16
                                 or process.returncode is not None, 20)
                death = engine.steps + 45
                await wait_until(lambda: engine.steps >= death
                                 or process.returncode is not None, 20)
                engine.die("fault injection: dead 45 steps after the first wave arrived")
                code = await process.wait()
        assert engine.dead
        started = set(external_ids(engine).values())
    assert code == 1, output.err
    assert "Traceback" not in output.err

    lines = read_results(results)
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines)  # at most one line per request
    finished = {rid for rid, line in by_id.items() if "error" not in line}
    failed = set(by_id) - finished
    for rid in finished:
        assert_finished_result(by_id[rid])
        assert len(by_id[rid]["token_ids"]) == 30
    for rid in failed:  # in flight when the engine died
        assert by_id[rid]["error"].startswith("EngineDeadError: "), by_id[rid]
        assert set(by_id[rid]) == {"request_id", "error"}
    assert len(finished) >= 16  # the first wave
    assert failed and failed <= started - finished
    not_run = set(ids) - set(by_id)  # not started once the engine was dead: no line
    assert not_run

    # The closing lines account for every request; the last is the one error line.
    err = output.err.strip().splitlines()
    assert f"{len(finished)}/80 done, {len(failed)} failed, 0 skipped" in err[-2]
    assert err[-1].startswith("anyio-genout: error: EngineDeadError: "), err[-1]
    assert (f"({len(failed)} in flight failed, {len(not_run)} request(s) not run; run again "
            "with --resume to finish)") in err[-1]
    assert not any(line.startswith("anyio-genout: failed: ") for line in err)

    # --resume keeps the finished results and runs the failed and the not-run requests.
    again = cli("run", str(requests), "-o", str(results), "--resume", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert (f"resuming: {len(finished)} finished result(s) in {results} kept, {len(failed)} "
            "error or truncated line(s) dropped to run again") in again.stderr
    lines = read_results(results)
    assert sorted(line["request_id"] for line in lines) == ids
    for line in lines:
        assert_finished_result(line)
        assert len(line["token_ids"]) == 30
    assert {rid: line for rid, line in by_id.items() if rid in finished} == {
        line["request_id"]: line for line in lines[:len(finished)]}  # kept as they were
    assert "80/80 done, 0 failed, 0 skipped" in again.stderr
