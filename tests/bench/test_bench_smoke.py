"""Smoke tests of ``anyio-genout bench``: the quick mode runs, and the report logic.

Only the shape of the results is checked, never timings (they depend on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from anyio_genout.bench.report import build_report, format_table
from anyio_genout.cli.bench.main import plan

CELL_KEYS = {
    "impl", "backend", "workload", "concurrency", "rounds", "wall_s", "delivered_tokens",
    "client_cpu_s", "client_main_cpu_s", "engine_cpu_s", "tokens_per_s", "busy", "main_busy",
    "engine_busy", "saturated", "gc_frozen_objects",
}


@pytest.mark.timeout(240)
def test_quick_run_writes_the_expected_json(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "anyio_genout", "bench", "--quick", "--backends", "asyncio",
         "--output", str(output), "--no-plot"],
        capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets:" in proc.stdout
    document = json.loads(output.read_text())
    assert set(document) >= {"meta", "results", "vllm", "ratios", "targets"}
    assert "gc.freeze()" in document["meta"]["gc"]
    results = document["results"]
    seen = {(r["impl"], r["backend"], r["workload"]) for r in results}
    assert seen == {
        ("floor", "sync", "throughput"), ("floor", "sync", "latency"),
        ("floor", "sync", "churn"), ("ours", "asyncio", "throughput"),
        ("ours", "asyncio", "latency"), ("ours", "asyncio", "churn"),
        ("ours", "asyncio", "memory"), ("ours", "asyncio", "lateness"),
    }
    for r in results:
        assert "error" not in r, r
        assert set(r) >= CELL_KEYS, CELL_KEYS - set(r)
        assert r.get("complete", True) is True
        if r["workload"] == "throughput":
            assert r["cpu_us_per_token"] > 0
        if r["workload"] == "latency":
            assert {"first_output_p50_us", "first_output_p99_us", "per_output_cpu_p50_us",
                    "per_output_cpu_p99_us"} <= set(r)
        if r["workload"] == "churn":
            assert r["cpu_us_per_request"] > 0
        if r["workload"] == "lateness":
            assert 0 <= r["lateness_p50_ms"] <= r["lateness_p99_ms"]
        if r["workload"] == "memory":
            assert r["held"] is True
            assert r["inflight"] == r["requests"]
            assert "bytes_per_request" in r
    ours_throughput = [r for r in results
                       if r["impl"] == "ours" and r["workload"] == "throughput"]
    assert all("cpu_x_floor" in r["ratios"] for r in ours_throughput)
    statuses = {t["status"] for t in document["targets"]}
    assert statuses <= {"PASS", "MISS", "N/A"}


def _cell(impl: str, backend: str, workload: str, concurrency: int, **figures: Any
          ) -> dict[str, Any]:
    return {"impl": impl, "backend": backend, "workload": workload,
            "concurrency": concurrency, "tokens": 128, "requests": 10_000, **figures}


def test_targets_are_ratios_to_the_floor_and_to_the_best_vllm_figure() -> None:
    results = [
        _cell("floor", "sync", "throughput", 256, cpu_us_per_token=0.5, tokens_per_s=1e6),
        _cell("ours", "asyncio", "throughput", 256, cpu_us_per_token=2.0, tokens_per_s=3e5),
        _cell("ours", "trio", "throughput", 256, cpu_us_per_token=6.0, tokens_per_s=1e5),
        _cell("ours", "asyncio", "lateness", 256, lateness_p99_ms=30.0,
              lateness_worst_round_max_ms=40.0, lateness_target_met=True),
        _cell("ours", "trio", "lateness", 256, lateness_p99_ms=60.0,
              lateness_worst_round_max_ms=90.0, lateness_target_met=False),
        _cell("ours", "asyncio", "churn", 64, cpu_us_per_request=50.0, requests_per_s=1e4),
        _cell("ours", "asyncio", "memory", 10_000, held=True, inflight=10_000,
              bytes_per_request=9000.0),
    ]
    vllm = [
        _cell("vllm", "asyncio", "throughput", 256, cpu_us_per_token=9.0, tokens_per_s=1e5),
        _cell("vllm", "uvloop", "throughput", 256, cpu_us_per_token=8.0, tokens_per_s=1.2e5),
        _cell("vllm", "uvloop", "churn", 64, cpu_us_per_request=160.0, requests_per_s=5e3),
    ]
    ratios, targets = build_report(results, vllm)
    by = {(t["target"].split(" ")[0], t["backend"], t["target"]): t for t in targets}
    status = {(b, name): t["status"] for (_k, b, name), t in by.items()}
    assert status[("asyncio", "CPU/token @256 streams <= 5x floor")] == "PASS"  # 4x
    assert status[("trio", "CPU/token @256 streams <= 5x floor")] == "MISS"  # 12x
    assert status[("asyncio", "lateness p99 <= 50 ms, max <= 100 ms")] == "PASS"
    assert status[("trio", "lateness p99 <= 50 ms, max <= 100 ms")] == "MISS"
    assert status[("asyncio", "tokens/s @256 >= 2x vLLM")] == "PASS"  # 3e5 / 1.2e5
    assert status[("trio", "tokens/s @256 >= 2x vLLM")] == "MISS"
    assert status[("asyncio", "churn CPU/request <= 40% of vLLM")] == "PASS"  # 31%
    assert status[("asyncio", "10,000 in flight, < 10 KiB each")] == "PASS"
    row = next(r for r in ratios if r["backend"] == "asyncio" and r["workload"] == "throughput")
    assert row["cpu_x_floor"] == pytest.approx(4.0)
    assert row["cpu_x_vllm"] == pytest.approx(2.0 / 8.0)  # the best vLLM figure
    assert row["tps_x_vllm"] == pytest.approx(2.5)
    table = format_table(results, vllm, targets)
    assert "PASS" in table and "MISS" in table and "vLLM/uvloop" in table


def test_without_vllm_figures_the_vllm_targets_are_not_applicable() -> None:
    results = [_cell("ours", "asyncio", "throughput", 64, cpu_us_per_token=3.0,
                     tokens_per_s=3e5)]
    _ratios, targets = build_report(results, None)
    assert {t["status"] for t in targets if "vLLM" in t["target"]} == {"N/A"}


def test_the_plan_covers_every_backend_and_workload() -> None:
    cells = plan(workloads=["throughput", "latency", "churn", "memory"],
                 backends=["asyncio", "uvloop", "trio"], concurrency=[1, 64, 256, 1024],
                 quick=False, floor=True, min_time=None)
    keys = {(c.impl, c.backend, c.workload) for c in cells}
    for backend in ("asyncio", "uvloop", "trio"):
        for workload in ("throughput", "latency", "churn", "memory"):
            assert ("ours", backend, workload) in keys
    assert {c.concurrency for c in cells if c.workload == "throughput"} == {1, 64, 256, 1024}
    memory = [c for c in cells if c.workload == "memory"]
    assert all(c.requests == 10_000 and c.engine_max_num_seqs < 10_000 for c in memory)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the bench extra)")
def test_plot_writes_a_png(tmp_path: Path) -> None:
    from anyio_genout.bench.plot import plot

    results = [
        _cell("floor", "sync", "throughput", c, cpu_us_per_token=0.5, tokens_per_s=1e6)
        for c in (1, 64)
    ] + [
        _cell("ours", "asyncio", "throughput", c, cpu_us_per_token=3.0, tokens_per_s=3e5)
        for c in (1, 64)
    ]
    path = plot(results, None, str(tmp_path / "bench.png"))
    assert path is not None
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
