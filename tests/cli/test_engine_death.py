"""``anyio-genout run`` when its engine dies mid-run: results kept, failures recorded, exit 1."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from anyio_genout.mock import MockFaults

from .support import (
    BACKEND_PAIRS,
    assert_finished_result,
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
async def test_engine_death_keeps_results_and_records_each_failure(
        tmp_path: Path, cli_backend: str) -> None:
    # 16 at a time, 30 tokens each: the first wave finishes at step 30, the engine sends
    # ENGINE_CORE_DEAD at step 45, in the middle of the second wave.
    ids = [f"r{i:02d}" for i in range(80)]
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(rid, [5, 6, i], max_tokens=30, ignore_eos=True)
                            for i, rid in enumerate(ids)])
    results = tmp_path / "out.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, step_time=0.002,
                          faults=MockFaults(dead_after_steps=45)) as engine:
        async with cli_process("run", str(requests), "-o", str(results), "--concurrency", "16",
                               "--handshake-address", address, "--backend", cli_backend
                               ) as (process, output):
            with anyio.fail_after(20):  # no hang
                code = await process.wait()
        assert engine.dead
        started = set(external_ids(engine).values())
    assert code == 1, output.err
    assert "Traceback" not in output.err

    lines = read_results(results)
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines)
    assert by_id.keys() == set(ids)  # every request has exactly one line: result or error
    finished = {rid for rid, line in by_id.items() if "error" not in line}
    failed = set(ids) - finished
    for rid in finished:
        assert_finished_result(by_id[rid])
        assert len(by_id[rid]["token_ids"]) == 30
    for rid in failed:
        assert by_id[rid]["error"].startswith("EngineDeadError: "), by_id[rid]
        assert set(by_id[rid]) == {"request_id", "error"}
    assert len(finished) >= 16  # the first wave
    assert started - finished  # some requests were running when the engine died
    assert failed

    assert f"{len(finished)}/80 done, {len(failed)} failed" in output.err
    failure_lines = [line for line in output.err.splitlines()
                     if line.startswith("anyio-genout: failed: ")]
    assert len(failure_lines) == min(20, len(failed))
    assert all("EngineDeadError" in line for line in failure_lines)
    if len(failed) > 20:
        assert f"... and {len(failed) - 20} more failed request(s)" in output.err
