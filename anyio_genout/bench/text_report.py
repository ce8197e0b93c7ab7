"""The report of ``anyio-genout bench text``: medians over repeats, ratios, targets, table.

Every figure of a cell is already the median of its rounds (``*_median_round``); over the
run's repeats (each a fresh process and engine) the median of those is taken. Ratios:

* ``added_x_step``: ``(CPU/token text - CPU/token tokens) / DecodeStream.step per token``,
  paired within each round of our cells (:func:`.text.added_cost`), median over rounds, then
  over repeats. Target: at most :data:`ADDED_X_STEP_LIMIT`.
* ``tps_x_vllm``: our delivered tokens/s over ``AsyncLLM``'s for the same variant at the same
  concurrency (its best event loop, as in :mod:`.report`). Target at 64 and 256 streams:
  at least :data:`TPS_X_VLLM_LIMIT`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Final

from .spec import Result
from .tokenizers import TOKENIZERS

__all__ = ["ADDED_X_STEP_LIMIT", "TARGETS", "TPS_X_VLLM_LIMIT", "build_text_report",
           "format_text_table"]

ADDED_X_STEP_LIMIT: Final = 1.5
TPS_X_VLLM_LIMIT: Final = 2.0
TPS_X_VLLM_AT: Final = (64, 256)
TEXT_VARIANTS: Final = ("text", "text-stop2")
#: Variants whose added cost is shown (the targets take TEXT_VARIANTS).
ADDED_VARIANTS: Final = ("text-nodetok", *TEXT_VARIANTS)

TARGETS: Final = (
    f"the text layer adds <= {ADDED_X_STEP_LIMIT}x DecodeStream.step's CPU per token",
    f"the text path's tokens/s >= {TPS_X_VLLM_LIMIT}x AsyncLLM's with detokenization, at "
    f"{' and '.join(map(str, TPS_X_VLLM_AT))} streams",
)


def _median(values: Iterable[Any]) -> float | None:
    found = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(v)]
    return statistics.median(found) if found else None


def _figure(figures: Result, name: str) -> Any:
    """A variant's per-round median of ``name`` (the total if it ran one round)."""
    return figures.get(f"{name}_median_round", figures.get(name))


def _tokenizer(result: Result) -> str:
    """The cell's tokenizer (``model`` in results from before ``--tokenizers``)."""
    return str(result.get("tokenizer", "model"))


def _order(tokenizer: str) -> tuple[int, str]:
    """Tokenizers in ``--tokenizers``' default order, then any other by name."""
    return (TOKENIZERS.index(tokenizer), "") if tokenizer in TOKENIZERS else (len(TOKENIZERS),
                                                                              tokenizer)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_text_report(results: Sequence[Result]) -> tuple[list[Result], list[Result]]:
    """The rows (one per tokenizer, implementation, backend, concurrency and variant, with its
    medians and ratios; ours compared with vLLM on the same tokenizer) and the targets
    (``status`` PASS, MISS or N/A)."""
    groups: dict[tuple[str, str, str, int], list[Result]] = {}
    for r in results:
        if "error" not in r:
            groups.setdefault((_tokenizer(r), r["impl"], r["backend"], r["concurrency"]),
                              []).append(r)
    rows: list[Result] = []
    for (tokenizer, impl, backend, concurrency), cells in sorted(
            groups.items(), key=lambda item: (_order(item[0][0]), item[0])):
        floor = _median(c.get("decode_step_us") for c in cells)
        for variant in cells[0]["variants"]:
            figures = [c["variants"][variant] for c in cells if variant in c["variants"]]
            row: Result = {
                "tokenizer": tokenizer, "impl": impl, "backend": backend,
                "concurrency": concurrency,
                "tokens": cells[0]["tokens"], "variant": variant, "repeats": len(figures),
                "tokens_per_s": _median(_figure(f, "tokens_per_s") for f in figures),
                "cpu_us_per_token": _median(_figure(f, "cpu_us_per_token") for f in figures),
                "main_busy": _median(f.get("main_busy") for f in figures),
                "others_cores": _median(f.get("others_cores") for f in figures),
                "complete": all(c.get("complete", False) for c in cells),
            }
            if floor is not None:
                row["decode_step_us"] = floor
            if variant in ADDED_VARIANTS and impl == "ours":
                row["added_x_step"] = _median(
                    (c.get("added_x_step") or {}).get(variant) for c in cells)
            rows.append(row)
    vllm: dict[tuple[str, int, str], Result] = {}
    for row in rows:
        if row["impl"] == "vllm":
            where = (row["tokenizer"], row["concurrency"], row["variant"])
            best = vllm.get(where)
            if best is None or (row["tokens_per_s"] or 0) > (best["tokens_per_s"] or 0):
                vllm[where] = row
    for row in rows:
        base = vllm.get((row["tokenizer"], row["concurrency"], row["variant"]))
        tokens_row = next((r for r in rows if r["impl"] == row["impl"]
                           and r["tokenizer"] == row["tokenizer"]
                           and r["backend"] == row["backend"]
                           and r["concurrency"] == row["concurrency"]
                           and r["variant"] == "tokens"), None)
        if tokens_row is not None and row["variant"] != "tokens":
            row["added_us_per_token"] = (
                None if row["cpu_us_per_token"] is None
                or tokens_row["cpu_us_per_token"] is None
                else row["cpu_us_per_token"] - tokens_row["cpu_us_per_token"])
        if row["impl"] != "vllm" and base is not None:
            row["tps_x_vllm"] = _ratio(row["tokens_per_s"], base["tokens_per_s"])
            row["cpu_x_vllm"] = _ratio(row["cpu_us_per_token"], base["cpu_us_per_token"])
    return rows, _targets(rows, bool(vllm))


def _targets(rows: Sequence[Result], have_vllm: bool) -> list[Result]:
    targets: list[Result] = []
    ours = [r for r in rows if r["impl"] == "ours" and r["variant"] in TEXT_VARIANTS]
    for row in ours:
        value = row.get("added_x_step")
        targets.append({
            "target": TARGETS[0], "tokenizer": row["tokenizer"], "backend": row["backend"],
            "concurrency": row["concurrency"], "variant": row["variant"], "value": value,
            "limit": ADDED_X_STEP_LIMIT,
            "status": "N/A" if value is None else
            ("PASS" if value <= ADDED_X_STEP_LIMIT else "MISS")})
    for row in ours:
        if row["concurrency"] not in TPS_X_VLLM_AT:
            continue
        value = row.get("tps_x_vllm")
        targets.append({
            "target": TARGETS[1], "tokenizer": row["tokenizer"], "backend": row["backend"],
            "concurrency": row["concurrency"], "variant": row["variant"], "value": value,
            "limit": TPS_X_VLLM_LIMIT,
            "status": "N/A" if value is None or not have_vllm else
            ("PASS" if value >= TPS_X_VLLM_LIMIT else "MISS")})
    return targets


def _num(value: Any, spec: str, suffix: str = "") -> str:
    if not isinstance(value, int | float) or math.isnan(value):
        return "-"
    return f"{value:{spec}}{suffix}"


def format_text_table(rows: Sequence[Result], targets: Sequence[Result]) -> str:
    """The Markdown table and one line per target."""
    lines = [
        "| tokenizer | client | variant | CxT | tok/s | CPU us/tok | + us/tok over tokens | "
        "/ DecodeStream.step | tok/s / vLLM | CPU / vLLM | others | repeats |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        client = f"{'vLLM' if r['impl'] == 'vllm' else 'ours'}/{r['backend']}"
        lines.append(
            f"| {r.get('tokenizer', 'model')} | {client} | {r['variant']} | "
            f"{r['concurrency']}x{r['tokens']} | "
            f"{_num(r['tokens_per_s'], ',.0f')} | {_num(r['cpu_us_per_token'], '.2f')} | "
            f"{_num(r.get('added_us_per_token'), '.2f')} | "
            f"{_num(r.get('added_x_step'), '.2f', 'x')} | "
            f"{_num(r.get('tps_x_vllm'), '.2f', 'x')} | "
            f"{_num(r.get('cpu_x_vllm'), '.2f', 'x')} | "
            f"{_num(r.get('others_cores'), '.2f')} | {r['repeats']} |")
    steps = sorted({(_order(r.get("tokenizer", "model")), r.get("tokenizer", "model"),
                     r["concurrency"], r["decode_step_us"]) for r in rows
                    if "decode_step_us" in r and r["impl"] == "ours"})
    if steps:
        lines.append("")
        lines.append("DecodeStream.step alone: " + ", ".join(
            f"{step:.2f} us/token at {c} streams ({name})" for _, name, c, step in steps))
    lines.append("(others: cores other processes used meanwhile, median; medians over "
                 "repeats of each cell's median round)")
    lines.append("")
    lines.append("targets:")
    for t in targets:
        lines.append(f"  {t['status']:4}  {t['target']}: {t.get('tokenizer', 'model')} "
                     f"{t['backend']} {t['variant']} at "
                     f"{t['concurrency']} streams = {_num(t['value'], '.2f', 'x')} "
                     f"(limit {t['limit']}x)")
    incomplete = [r for r in rows if not r["complete"]]
    if incomplete:
        lines.append("")
        lines.append("INCOMPLETE (a stream stopped early): " + ", ".join(
            f"{r['impl']}/{r.get('tokenizer', 'model')}/{r['variant']}/{r['concurrency']}"
            for r in incomplete))
    return "\n".join(lines)
