"""A cell that fails (times out, crashes) is reported as such; the run's other figures stay.

The cells are not run: ``run_cell`` is replaced by a script, so only the command's handling
of their results is exercised (the quick smoke run in test_bench_smoke.py runs real ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from anyio_genout.bench.report import build_report, format_table
from anyio_genout.bench.spec import WORKLOADS, CellSpec
from anyio_genout.cli.bench import main as bench_cli
from anyio_genout.cli.bench import run_cmd


def failed(workload: str, concurrency: int) -> dict[str, Any]:
    return {"impl": "ours", "backend": "asyncio", "workload": workload,
            "concurrency": concurrency, "tokens": 16, "error": "timed out after 300 s"}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_table_shows_a_failed_cell_of_any_workload(workload: str) -> None:
    results = [failed(workload, 64)]
    _ratios, targets = build_report(results, None)
    table = format_table(results, None, targets)
    assert "ERROR: timed out after 300 s" in table


def test_a_failed_cell_keeps_the_results_file_and_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def fake_run_cell(spec: CellSpec, timeout: float) -> list[dict[str, Any]]:
        if spec.workload == "latency":
            return [{**spec.to_json(), "error": "cell exited with status 1"}]
        return [{**spec.to_json(), "tokens_per_s": 1000.0, "cpu_us_per_token": 2.0,
                 "requests_per_s": 10.0, "cpu_us_per_request": 5.0}]

    monkeypatch.setattr(run_cmd, "run_cell", fake_run_cell)
    output = tmp_path / "bench.json"
    code = bench_cli.main(["--quick", "--no-floor", "--backends", "asyncio", "--workloads",
                           "throughput,latency,churn", "--concurrency", "1", "--no-plot",
                           "--output", str(output)])
    assert code == 1
    captured = capsys.readouterr()
    assert "ours/asyncio/latency/1: ERROR cell exited with status 1" in captured.err
    assert "ERROR: cell exited with status 1" in captured.out
    results = json.loads(output.read_text())["results"]
    assert [("error" in r, r["workload"]) for r in results] == [
        (False, "throughput"), (True, "latency"), (False, "churn")]
