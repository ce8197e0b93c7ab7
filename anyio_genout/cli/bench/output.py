"""What the bench commands print and write besides the figures: a run's ``meta`` block,
one progress line per cell, the table (:mod:`~anyio_genout.bench.report`), profile summaries
and the plot."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ...bench.spec import CellSpec, Result
from ..backends import extra_message

__all__ = ["ENGINE_NOTE", "GC_NOTE", "load_vllm", "meta", "profile_text", "progress",
           "report", "write_plot"]

GC_NOTE: Final = ("gc.freeze() after start-up and warm-up in every client process (ours, "
                  "floor, vLLM); the collector stays enabled for objects made later")
ENGINE_NOTE: Final = ("mock engine core in its own process (python -m anyio_genout mock-engine, "
                      "--step-time 0, --no-log-stats, max_num_seqs 1024, one "
                      "EngineCoreOutputs per step for all running requests), TCP loopback")
_WORKLOADS: Final = {
    "throughput": "C concurrent streams of T tokens (T=256 for C<=64, 128 for 256, "
                  "64 for 1024), `async with client.generate(...) as s: async for "
                  "out in s`; rounds repeat for >= min_time; totals over rounds",
    "latency": "one request (16 tokens) at a time, engine paced at 1 ms per step; "
               "first output = wall time from generate() entry; per output = "
               "main-thread CPU between consecutive outputs",
    "churn": "2000 requests of 1..4 tokens per round, 64 in flight",
    "memory": "10,000 requests in flight (engine runs 16 at 50 ms per step); RSS "
              "delta from after warm-up to all in flight, / 10,000",
}


def meta(mode: str, argv: Sequence[str]) -> dict[str, Any]:
    """The ``meta`` block of a results file: the mode, the command, the machine, the notes."""
    from ...bench.measure import environment  # psutil: checked before a command starts

    return {
        "mode": mode,
        "argv": list(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "env": environment(),
        "gc": GC_NOTE,
        "engine": ENGINE_NOTE,
        "workloads": dict(_WORKLOADS),
        "prompt_len": 16,
    }


def progress(i: int, n: int, spec: CellSpec, result: Result, seconds: float) -> str:
    """``[i/n] <cell>: <its headline figures> (<seconds> s)``, or its error."""
    what = f"[{i}/{n}] {spec.key}"
    if "error" in result:
        return f"{what}: ERROR {result['error']}"
    bits = []
    if spec.workload == "throughput":
        bits.append(f"{result.get('tokens_per_s', 0):,.0f} tok/s, "
                    f"{result.get('cpu_us_per_token') or 0:.2f} us/tok")
    elif spec.workload == "churn":
        bits.append(f"{result.get('requests_per_s', 0):,.0f} req/s, "
                    f"{result.get('cpu_us_per_request') or 0:.1f} us/req")
    elif spec.workload == "lateness":
        bits.append(f"lateness p50 {result.get('lateness_p50_ms', 0):.1f} ms, p99 "
                    f"{result.get('lateness_p99_ms', 0):.1f} ms, max "
                    f"{result.get('lateness_max_ms', 0):.1f} ms")
    elif spec.workload == "latency":
        bits.append(f"first p50 {result.get('first_output_p50_us', 0):,.0f} us, per-output "
                    f"CPU p50 {result.get('per_output_cpu_p50_us', 0):.1f} us")
    elif spec.workload == "memory":
        bits.append(f"{result.get('inflight', 0):,} in flight, "
                    f"{(result.get('bytes_per_request') or 0) / 1024:.2f} KiB/request")
    others = result.get("others_cores")
    if isinstance(others, float) and others >= 0.1:
        bits.append(f"other processes used {others:.2f} cores meanwhile")
    return f"{what}: {', '.join(bits)} ({seconds:.1f} s)"


def load_vllm(path: str | None) -> tuple[list[Result] | None, dict[str, Any] | None]:
    """The results and meta of a saved ``bench vllm`` run, or ``(None, None)`` if there is
    no file at ``path``."""
    if path is None or not Path(path).exists():
        return None, None
    data = json.loads(Path(path).read_text())
    return list(data.get("results", [])), data.get("meta")


def report(results: list[Result], vllm: list[Result] | None, meta: dict[str, Any]
           ) -> tuple[str, list[Result], list[Result]]:
    """The table to print, the ratios and the targets
    (:func:`~anyio_genout.bench.report.build_report`)."""
    from ...bench.report import build_report, format_table

    ratios, targets = build_report(results, vllm)
    return format_table(results, vllm, targets, meta), ratios, targets


def profile_text(result: Result, summary: dict[str, Any]) -> str:
    """A profiled cell's summary: self time by area, then the top functions."""
    lines = [f"profile of {result['impl']}/{result['backend']}/{result['workload']}/"
             f"{result['concurrency']} ({summary.get('sampled_s')} s sampled, "
             f"{summary.get('file')}):", "  self time by area:"]
    lines += [f"    {pct:5.1f}%  {name}" for name, _s, pct in summary.get("by_area", [])]
    lines += ["  top functions by self time:"]
    lines += [f"    {pct:5.1f}%  {name}" for name, _s, pct in summary.get("top_self", [])]
    return "\n".join(lines) + "\n"


def write_plot(results: list[Result], vllm: list[Result] | None, path: str,
               meta: dict[str, Any]) -> str | None:
    """Draw the PNG; its path, or None if there was nothing to draw or no matplotlib (one
    line on stderr names the extra)."""
    try:
        from ...bench.plot import plot
    except ImportError:  # pragma: no cover - matplotlib missing
        return None
    try:
        cpus = (meta.get("env") or {}).get("cpus")
        title = (f"anyio-genout bench ({meta.get('mode')}), {cpus} CPUs, "
                 f"mock engine over TCP loopback; GC frozen after start-up")
        return plot(results, vllm, path, title)
    except ImportError:
        print(f"{extra_message('the plot', 'bench')} (no PNG written)", file=sys.stderr)
        return None
