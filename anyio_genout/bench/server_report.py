"""The server benchmark's pure parts: the load generator's result file read into figures,
the ratios between servers of one run, issue #26's targets marked met or missed, the table.

No process, no clock, no network: :mod:`~anyio_genout.cli.bench.server_cmd` measures and
calls these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from .profile import classify_path

__all__ = ["TARGET_LEVELS", "build_server_report", "format_server_table", "parse_bench_result",
           "server_area", "summarise_server_stacks"]

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


def _endpoint(cell: Mapping[str, Any]) -> str:
    return str(cell.get("endpoint", "completions"))


def _tokenizer(cell: Mapping[str, Any]) -> str:
    """The cell's tokenizer (``model``, the ``--model`` folder's, in results from before
    ``--tokenizers``)."""
    return str(cell.get("tokenizer", "model"))


def _find(cells: Sequence[Mapping[str, Any]], kind: str, concurrency: int,
          endpoint: str = "completions", tokenizer: str = "model"
          ) -> Mapping[str, Any] | None:
    for cell in cells:
        if (cell.get("kind") == kind and cell.get("concurrency") == concurrency
                and _endpoint(cell) == endpoint and _tokenizer(cell) == tokenizer
                and _ok(cell)):
            return cell
    return None


def _name(cell: Mapping[str, Any]) -> str:
    """A cell's server, ``chat`` when it streamed chat completions, and its tokenizer in
    brackets unless it is the ``--model`` folder's."""
    name = f"{cell['server']} chat" if _endpoint(cell) == "chat" else str(cell["server"])
    tokenizer = _tokenizer(cell)
    return name if tokenizer == "model" else f"{name} [{tokenizer}]"


def build_server_report(cells: Sequence[Mapping[str, Any]]) -> tuple[list[Result], list[Result]]:
    """(ratios, targets) of one run's cells.

    A cell has ``server`` (its label), ``kind`` (ours, vllm, vllm-rs), ``workers``,
    ``concurrency``, ``tokenizer`` (absent: ``model``) and the figures of
    :func:`parse_bench_result`, or ``error``. ``ratios``: one row per cell of ours, its
    tokens/s and TTFT p50 over ``vllm serve``'s and ``vllm-rs``'s at the same concurrency and
    tokenizer (``None`` where that reference has no figure).
    ``targets`` (issue #26): for ours with one worker at 64 and 256 streams, server CPU
    per output token at most 2x vllm-rs's (2.5x on trio), tokens/s at least 2x vllm
    serve's, TTFT p50 at most half of its; ``met`` is ``None`` where a figure is missing.
    """
    ratios: list[Result] = []
    targets: list[Result] = []
    for cell in cells:
        if cell.get("kind") != "ours":
            continue
        c = cell["concurrency"]
        vllm = _find(cells, "vllm", c, _endpoint(cell), _tokenizer(cell))
        rust = _find(cells, "vllm-rs", c, _endpoint(cell), _tokenizer(cell))
        ok = _ok(cell)

        def over(ref: Mapping[str, Any] | None, key: str, *, cell: Mapping[str, Any] = cell,
                 ok: bool = ok) -> float | None:
            if ref is None or not ok or not ref.get(key):
                return None
            return float(cell[key]) / float(ref[key])

        row = {"server": _name(cell), "tokenizer": _tokenizer(cell), "concurrency": c,
               "tokens_per_s_vs_vllm": over(vllm, "tokens_per_s"),
               "tokens_per_s_vs_vllm_rs": over(rust, "tokens_per_s"),
               "ttft_p50_vs_vllm": over(vllm, "ttft_p50_ms"),
               "ttft_p50_vs_vllm_rs": over(rust, "ttft_p50_ms"),
               "cpu_per_token_vs_vllm_rs": over(rust, "server_cpu_s_per_1k")}
        ratios.append(row)
        if cell.get("workers") != 1 or c not in TARGET_LEVELS or _endpoint(cell) != "completions":
            continue
        cpu_bound = 2.5 if cell.get("backend") == "trio" else 2.0
        for name, value, needed, at_least in (
                (f"server CPU/token <= {cpu_bound:g}x vllm-rs's",
                 row["cpu_per_token_vs_vllm_rs"], cpu_bound, False),
                ("tokens/s >= 2x vllm serve", row["tokens_per_s_vs_vllm"], 2.0, True),
                ("TTFT p50 <= 0.5x vllm serve's", row["ttft_p50_vs_vllm"], 0.5, False)):
            met = None if value is None else (value >= needed if at_least else value <= needed)
            targets.append({"server": _name(cell), "concurrency": c, "target": name,
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
        head = f"| {_name(cell)} | {cell['concurrency']} | {cell.get('num_prompts', '-')} |"
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
                      "TTFT p50 vs vllm serve | TTFT p50 vs vllm-rs | CPU/tok vs vllm-rs |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in ratios:
            lines.append(
                f"| {row['server']} | {row['concurrency']} | "
                f"{_ratio(row['tokens_per_s_vs_vllm'])} | "
                f"{_ratio(row['tokens_per_s_vs_vllm_rs'])} | "
                f"{_ratio(row['ttft_p50_vs_vllm'])} | {_ratio(row['ttft_p50_vs_vllm_rs'])} | "
                f"{_ratio(row.get('cpu_per_token_vs_vllm_rs'))} |")
    if targets:
        lines += ["", "targets (issue #26, one worker, from this run):"]
        for t in targets:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            lines.append(f"  {t['server']} @ {t['concurrency']}: {t['target']}: "
                         f"{_ratio(t['ratio'])} (needs {t['needed']:.2f}x) {verdict}")
    return "\n".join(lines)


#: Path fragments naming an area of the server's code, checked in order.
_SERVER_AREAS: Final = (
    ("anyio_genout/server", "anyio_genout.server (routes, SSE chunks)"),
    ("anyio_genout/text", "anyio_genout.text (tokenize, detokenize, stop strings)"),
    ("anyio_genout/protocol", "anyio_genout.protocol (decode)"),
    ("anyio_genout/engine", "anyio_genout.engine (reader, registry)"),
    ("anyio_genout/generate", "anyio_genout.generate (streams)"),
    ("anyio_genout/metrics", "anyio_genout.metrics"),
    ("anyio_genout/transport", "anyio_genout.transport (zmq)"),
    ("anyio_genout", "anyio_genout (other)"),
    ("hypercorn/", "hypercorn (HTTP/1.1, ASGI server)"),
    ("uvicorn/", "uvicorn (HTTP/1.1, ASGI server)"),
    ("h11/", "h11 (HTTP parsing)"),
    ("fastapi/", "fastapi"),
    ("starlette/", "starlette"),
    ("pydantic", "pydantic (request validation)"),
    ("tokenizers", "tokenizers"),
    ("anyio/", "anyio"),
    ("trio/", "trio"),
    ("uvloop", "uvloop"),
    ("asyncio/", "asyncio"),
    ("zmq/", "pyzmq"),
    ("msgpack", "msgpack"),
    ("prometheus_client", "prometheus_client"),
    ("json/", "json"),
)


def server_area(path: str | None) -> str:
    """The area of the server's code a source file belongs to."""
    return classify_path(path, _SERVER_AREAS, "builtins and generated code")


def _frame(text: str) -> tuple[str, str]:
    """(``function (file)``, file) of one py-spy frame ``function (file:line)``."""
    text = text.strip()
    head, sep, tail = text.rpartition(" (")
    if not sep or not tail.endswith(")"):
        return text, ""
    path = tail[:-1].rsplit(":", 1)[0] if ":" in tail else tail[:-1]
    return f"{head} ({path})", path


def summarise_server_stacks(lines: Sequence[str], top: int = 20) -> Result:
    """py-spy ``raw`` stacks (``frame;frame;... count``, frames ``function (file:line)``,
    a ``process ...`` root frame with ``--subprocesses``) summarised: samples, the top
    functions by self and by total samples, self samples by area; percents of all samples.
    Idle samples are in (``--nonblocking`` samples every thread whether it runs or not).
    """
    total = 0
    self_n: dict[str, int] = {}
    total_n: dict[str, int] = {}
    areas: dict[str, int] = {}
    for line in lines:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame(f) for f in stack.split(";") if not f.startswith(("process ",
                                                                             "thread "))]
        if not frames:
            continue
        name, path = frames[-1]
        self_n[name] = self_n.get(name, 0) + count
        area = server_area(path)
        areas[area] = areas.get(area, 0) + count
        for seen in {n for n, _p in frames}:
            total_n[seen] = total_n.get(seen, 0) + count

    def ranked(table: dict[str, int]) -> list[list[Any]]:
        rows = sorted(table.items(), key=lambda item: item[1], reverse=True)[:top]
        return [[name, n, round(100.0 * n / (total or 1), 1)] for name, n in rows]

    return {"samples": total, "by_area": ranked(areas), "top_self": ranked(self_n),
            "top_total": ranked(total_n)}
