"""The server benchmark's pure parts: the load generator's result file read into figures,
the ratios between servers of one run, issue #15's targets marked met or missed, the table.

No process, no clock, no network: :mod:`.server_bench` measures and calls these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["TARGET_LEVELS", "build_server_report", "format_server_table", "parse_bench_result"]

Result = dict[str, Any]

#: The concurrency levels the targets are judged at.
TARGET_LEVELS: Final = (64, 256)

#: What is read from ``vllm-rs bench serve --save-result``'s JSON, by our name.
_FIELDS: Final = {
    "completed": "completed", "failed": "failed", "duration_s": "duration",
    "output_tokens": "total_output_tokens", "tokens_per_s": "output_throughput",
    "requests_per_s": "request_throughput", "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms", "itl_p50_ms": "p50_itl_ms", "itl_p99_ms": "p99_itl_ms",
    "tpot_p50_ms": "p50_tpot_ms", "e2el_p50_ms": "p50_e2el_ms",
}


def parse_bench_result(document: Mapping[str, Any]) -> Result:
    """The figures of one ``vllm-rs bench serve`` result file.

    Percentiles must have been asked for (``--percentile-metrics ttft,itl,tpot,e2el
    --metric-percentiles 50,99``). Raises :class:`ValueError` naming the first missing
    field, or if a request failed or none completed.
    """
    figures: Result = {}
    for ours, theirs in _FIELDS.items():
        value = document.get(theirs)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"the load generator's result has no number {theirs!r}")
        figures[ours] = value
    if figures["failed"]:
        raise ValueError(f"{figures['failed']} of {figures['failed'] + figures['completed']} "
                         f"requests failed")
    if not figures["completed"]:
        raise ValueError("no request completed")
    return figures


def _ok(cell: Mapping[str, Any]) -> bool:
    return "error" not in cell and bool(cell.get("tokens_per_s"))


def _find(cells: Sequence[Mapping[str, Any]], kind: str, concurrency: int
          ) -> Mapping[str, Any] | None:
    for cell in cells:
        if cell.get("kind") == kind and cell.get("concurrency") == concurrency and _ok(cell):
            return cell
    return None


def build_server_report(cells: Sequence[Mapping[str, Any]]) -> tuple[list[Result], list[Result]]:
    """(ratios, targets) of one run's cells.

    A cell has ``server`` (its label), ``kind`` (ours, vllm, vllm-rs), ``workers``,
    ``concurrency`` and the figures of :func:`parse_bench_result`, or ``error``. ``ratios``:
    one row per cell of ours, its tokens/s and TTFT p50 over ``vllm serve``'s and
    ``vllm-rs``'s at the same concurrency (``None`` where that reference has no figure).
    ``targets``: for ours with one worker at 64 and 256 streams, tokens/s at least 3x vllm
    serve's, TTFT p50 at most a third of its, tokens/s at least half of vllm-rs's; ``met``
    is ``None`` where a figure is missing.
    """
    ratios: list[Result] = []
    targets: list[Result] = []
    for cell in cells:
        if cell.get("kind") != "ours":
            continue
        c = cell["concurrency"]
        vllm, rust = _find(cells, "vllm", c), _find(cells, "vllm-rs", c)
        ok = _ok(cell)

        def over(ref: Mapping[str, Any] | None, key: str, *, cell: Mapping[str, Any] = cell,
                 ok: bool = ok) -> float | None:
            if ref is None or not ok or not ref.get(key):
                return None
            return float(cell[key]) / float(ref[key])

        row = {"server": cell["server"], "concurrency": c,
               "tokens_per_s_vs_vllm": over(vllm, "tokens_per_s"),
               "tokens_per_s_vs_vllm_rs": over(rust, "tokens_per_s"),
               "ttft_p50_vs_vllm": over(vllm, "ttft_p50_ms"),
               "ttft_p50_vs_vllm_rs": over(rust, "ttft_p50_ms")}
        ratios.append(row)
        if cell.get("workers") != 1 or c not in TARGET_LEVELS:
            continue
        for name, value, needed, at_least in (
                ("tokens/s >= 3x vllm serve", row["tokens_per_s_vs_vllm"], 3.0, True),
                ("TTFT p50 <= 1/3 of vllm serve's", row["ttft_p50_vs_vllm"], 1 / 3, False),
                ("tokens/s >= 0.5x vllm-rs", row["tokens_per_s_vs_vllm_rs"], 0.5, True)):
            met = None if value is None else (value >= needed if at_least else value <= needed)
            targets.append({"server": cell["server"], "concurrency": c, "target": name,
                            "ratio": value, "needed": needed, "met": met})
    return ratios, targets


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_server_table(cells: Sequence[Mapping[str, Any]], ratios: Sequence[Mapping[str, Any]],
                        targets: Sequence[Mapping[str, Any]]) -> str:
    """The figures, the ratios and the targets as plain-text tables (Markdown-friendly)."""
    lines = ["| server | C | N | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "server CPU s/1k tok | engine CPU s/1k tok |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for cell in cells:
        head = f"| {cell['server']} | {cell['concurrency']} | {cell.get('num_prompts', '-')} |"
        if not _ok(cell):
            lines.append(f"{head} ERROR: {cell.get('error', 'no figures')} | | | | |")
            continue
        lines.append(
            f"{head} {cell['tokens_per_s']:,.0f} | {cell['ttft_p50_ms']:.1f} / "
            f"{cell['ttft_p99_ms']:.1f} | {cell['itl_p50_ms']:.2f} / {cell['itl_p99_ms']:.2f} | "
            f"{_num(cell.get('server_cpu_s_per_1k'), '.3f')} | "
            f"{_num(cell.get('engine_cpu_s_per_1k'), '.3f')} |")
    if ratios:
        lines += ["", "| ours | C | tok/s vs vllm serve | tok/s vs vllm-rs | "
                      "TTFT p50 vs vllm serve | TTFT p50 vs vllm-rs |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in ratios:
            lines.append(
                f"| {row['server']} | {row['concurrency']} | "
                f"{_ratio(row['tokens_per_s_vs_vllm'])} | "
                f"{_ratio(row['tokens_per_s_vs_vllm_rs'])} | "
                f"{_ratio(row['ttft_p50_vs_vllm'])} | {_ratio(row['ttft_p50_vs_vllm_rs'])} |")
    if targets:
        lines += ["", "targets (issue #15, one worker, from this run):"]
        for t in targets:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  {t['server']} @ {t['concurrency']}: {t['target']}: "
                         f"{_ratio(t['ratio'])} (needs {t['needed']:.2f}x) {verdict}")
    return "\n".join(lines)
