"""Ratios to the reference points, the targets (PASS/MISS), and the table on stdout.

The floor is matched by workload and concurrency within the same run. vLLM's figures come
from ``nox -s bench-vllm`` (``bench-results/vllm.json``); where it ran on several event loops
the *best* vLLM figure is the reference (its highest tokens/s, its lowest CPU cost), so every
ratio to vLLM is the conservative one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

from .lateness import LATENESS_MAX_MS, LATENESS_P99_MS
from .spec import Result

__all__ = ["TARGETS", "build_report", "format_table", "reference_index"]

#: Client CPU per delivered token at 64 and 256 streams, at most this many times the
#: floor's, on every backend (issue 23).
CPU_X_FLOOR_LIMIT: Final = 5.0
CPU_X_FLOOR_CONCURRENCY: Final = (64, 256)
#: Delivered tokens/s at least this many times vLLM's, by concurrency.
TPS_X_VLLM_LIMITS: Final = {1: 3.0, 64: 2.0, 256: 2.0}
#: Churn: client CPU per request at most this fraction of vLLM's.
CHURN_CPU_FRACTION: Final = 0.40
#: Memory: bytes of client memory per in-flight request, below this.
MEMORY_LIMIT: Final = 10 * 1024
MEMORY_REQUESTS: Final = 10_000

TARGETS: Final = (
    "client CPU/token at 64 and 256 streams <= 5x floor, every backend",
    "delivered tokens/s >= 3x vLLM at 1 stream, >= 2x at 64 and 256 streams",
    "churn: client CPU per request <= 40% of vLLM's",
    "10,000 concurrent requests hold, < 10 KiB of client memory each",
    "a timeout around each of 256 busy streams: p99 <= 50 ms and every round's max <= 100 ms"
    " late",
)


def _ok(result: Result) -> bool:
    return "error" not in result and not result.get("profile")


def _best(results: Iterable[Result], key: str, *, high: bool) -> float | None:
    values = [float(r[key]) for r in results
              if _ok(r) and isinstance(r.get(key), int | float)]
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return None
    return max(values) if high else min(values)


def reference_index(results: Sequence[Result], impl: str) -> dict[tuple[str, int], Result]:
    """The reference figures of ``impl`` per (workload, concurrency), best of its runs."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        if r.get("impl") == impl and _ok(r):
            groups.setdefault((r["workload"], r["concurrency"]), []).append(r)
    index: dict[tuple[str, int], Result] = {}
    for key, group in groups.items():
        best: Result = {
            "impl": impl, "workload": key[0], "concurrency": key[1],
            "backend": "+".join(sorted({str(r.get("loop") or r["backend"]) for r in group})),
        }
        for name, high in (("tokens_per_s", True), ("requests_per_s", True),
                           ("cpu_us_per_token", False), ("cpu_us_per_request", False),
                           ("first_output_p50_us", False), ("first_output_p99_us", False),
                           ("per_output_cpu_p50_us", False), ("per_output_cpu_p99_us", False)):
            value = _best(group, name, high=high)
            if value is not None:
                best[name] = value
        index[key] = best
    return index


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return float(a) / float(b)
    return None


def build_report(results: Sequence[Result], vllm: Sequence[Result] | None
                 ) -> tuple[list[Result], list[Result]]:
    """(ratios per cell of ours, targets). Adds ``x_floor``/``x_vllm`` ratios to the cells."""
    floor = reference_index(results, "floor")
    ref = reference_index(vllm or [], "vllm")
    ratios: list[Result] = []
    for r in results:
        if r.get("impl") != "ours" or not _ok(r):
            continue
        key = (r["workload"], r["concurrency"])
        f, v = floor.get(key, {}), ref.get(key, {})
        row: Result = {"backend": r["backend"], "workload": r["workload"],
                       "concurrency": r["concurrency"]}
        if r["workload"] == "throughput":
            row.update(
                cpu_x_floor=_ratio(r.get("cpu_us_per_token"), f.get("cpu_us_per_token")),
                cpu_x_vllm=_ratio(r.get("cpu_us_per_token"), v.get("cpu_us_per_token")),
                tps_x_floor=_ratio(r.get("tokens_per_s"), f.get("tokens_per_s")),
                tps_x_vllm=_ratio(r.get("tokens_per_s"), v.get("tokens_per_s")),
            )
        elif r["workload"] == "churn":
            row.update(
                cpu_x_floor=_ratio(r.get("cpu_us_per_request"), f.get("cpu_us_per_request")),
                cpu_x_vllm=_ratio(r.get("cpu_us_per_request"), v.get("cpu_us_per_request")),
                rps_x_vllm=_ratio(r.get("requests_per_s"), v.get("requests_per_s")),
            )
        elif r["workload"] == "latency":
            row.update(
                first_x_floor=_ratio(r.get("first_output_p50_us"),
                                     f.get("first_output_p50_us")),
                first_x_vllm=_ratio(r.get("first_output_p50_us"),
                                    v.get("first_output_p50_us")),
                per_output_x_floor=_ratio(r.get("per_output_cpu_p50_us"),
                                          f.get("per_output_cpu_p50_us")),
                per_output_x_vllm=_ratio(r.get("per_output_cpu_p50_us"),
                                         v.get("per_output_cpu_p50_us")),
            )
        r["ratios"] = {k: val for k, val in row.items()
                       if k not in ("backend", "workload", "concurrency")}
        ratios.append(row)
    return ratios, _targets(results, floor, ref, vllm is not None)


def _status(ok: bool | None) -> str:
    return "N/A" if ok is None else ("PASS" if ok else "MISS")


def _target(name: str, backend: str, value: float | None, limit: float, ok: bool | None,
            detail: str) -> Result:
    """One target's row: PASS, MISS, or N/A when ``ok`` is None (nothing to compare)."""
    return {"target": name, "backend": backend, "value": value, "limit": limit,
            "status": _status(ok), "detail": detail}


def _targets(results: Sequence[Result], floor: dict[tuple[str, int], Result],
             ref: dict[tuple[str, int], Result], have_vllm: bool) -> list[Result]:
    ours = {(r["backend"], r["workload"], r["concurrency"]): r
            for r in results if r.get("impl") == "ours" and _ok(r)}
    backends = sorted({b for b, _w, _c in ours}, key=_backend_order)
    found: list[Result] = []
    no_vllm = "no vLLM figures (run `nox -s bench-vllm`)" if not have_vllm else ""

    limit = CPU_X_FLOOR_LIMIT
    for concurrency in CPU_X_FLOOR_CONCURRENCY:
        f = floor.get(("throughput", concurrency))
        for backend in backends:
            r = ours.get((backend, "throughput", concurrency))
            if r is None:
                continue
            value = _ratio(r.get("cpu_us_per_token"), f and f.get("cpu_us_per_token"))
            found.append(_target(
                f"CPU/token @{concurrency} streams <= {limit:g}x floor", backend, value, limit,
                None if value is None else value <= limit,
                _detail(value, "x floor", r.get("cpu_us_per_token"),
                        f and f.get("cpu_us_per_token"), "us/token")))
    for backend in backends:
        r = next((x for (b, w, _c), x in ours.items() if b == backend and w == "lateness"),
                 None)
        if r is None or r.get("lateness_p99_ms") is None:
            continue
        p99, worst = r["lateness_p99_ms"], r.get("lateness_worst_round_max_ms")
        found.append(_target(
            f"lateness p99 <= {LATENESS_P99_MS:g} ms, max <= {LATENESS_MAX_MS:g} ms", backend,
            p99, LATENESS_P99_MS, bool(r.get("lateness_target_met")),
            f"p99 {p99:.1f} ms, worst round's max {worst or 0:.1f} ms"))
    for concurrency, limit in TPS_X_VLLM_LIMITS.items():
        v = ref.get(("throughput", concurrency))
        for backend in backends:
            r = ours.get((backend, "throughput", concurrency))
            if r is None:
                continue
            value = _ratio(r.get("tokens_per_s"), v and v.get("tokens_per_s"))
            found.append(_target(
                f"tokens/s @{concurrency} >= {limit:g}x vLLM", backend, value, limit,
                None if value is None else value >= limit,
                _detail(value, "x vLLM", r.get("tokens_per_s"),
                        v and v.get("tokens_per_s"), "tok/s") or no_vllm))
    v = ref.get(("churn", _first_concurrency(ref, "churn")))
    for backend in backends:
        r = next((x for (b, w, _c), x in ours.items() if b == backend and w == "churn"), None)
        if r is None:
            continue
        value = _ratio(r.get("cpu_us_per_request"), v and v.get("cpu_us_per_request"))
        found.append(_target(
            f"churn CPU/request <= {CHURN_CPU_FRACTION:.0%} of vLLM", backend, value,
            CHURN_CPU_FRACTION, None if value is None else value <= CHURN_CPU_FRACTION,
            _detail(value, "of vLLM", r.get("cpu_us_per_request"),
                    v and v.get("cpu_us_per_request"), "us/request") or no_vllm))
    for backend in backends:
        r = next((x for (b, w, _c), x in ours.items() if b == backend and w == "memory"), None)
        if r is None:
            continue
        per = r.get("bytes_per_request")
        count = r.get("requests")
        full = count is not None and count >= MEMORY_REQUESTS
        ok = bool(r.get("held")) and per is not None and per < MEMORY_LIMIT
        found.append(_target(
            "10,000 in flight, < 10 KiB each", backend, per, MEMORY_LIMIT, ok if full else None,
            f"{r.get('inflight')} of {count} in flight, {(per or 0) / 1024:.2f} KiB/request"
            + ("" if full else f" (only {count} requests: quick run)")))
    return found


def _first_concurrency(index: dict[tuple[str, int], Result], workload: str) -> int:
    return next((c for (w, c) in index if w == workload), 0)


def _detail(ratio: float | None, unit: str, ours: Any, ref: Any, what: str) -> str:
    if ratio is None:
        return ""
    shown = f"{ratio:.0%}" if unit.startswith("of") else f"{ratio:.2f}x"
    unit = unit.removeprefix("x ")
    return f"{shown} {unit} ({ours:,.1f} vs {ref:,.1f} {what})"


def _backend_order(backend: str) -> int:
    order = ("asyncio", "uvloop", "trio", "sync")
    return order.index(backend) if backend in order else len(order)


# ---------------------------------------------------------------------------- table


def _fmt(value: Any, spec: str = ",.1f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def _label(r: Result) -> str:
    if r.get("impl") == "ours":
        return f"ours/{r['backend']}"
    if r.get("impl") == "vllm":
        return f"vLLM/{r.get('loop') or r['backend']}"
    return "floor"


def _rows_for(results: Sequence[Result], workload: str) -> list[Result]:
    rows = [r for r in results if r.get("workload") == workload]
    order = {"floor": 0, "ours": 1, "vllm": 2}
    return sorted(rows, key=lambda r: (r.get("concurrency", 0), order.get(r.get("impl", ""), 3),
                                       _backend_order(str(r.get("loop") or r.get("backend")))))


def format_table(results: Sequence[Result], vllm: Sequence[Result] | None,
                 targets: Sequence[Result], meta: dict[str, Any] | None = None) -> str:
    """The human-readable report: one block per workload, then the targets."""
    everything = [*results, *(vllm or [])]
    floor = reference_index(results, "floor")
    ref = reference_index(vllm or [], "vllm")
    out: list[str] = []
    if meta:
        out.append(f"anyio-genout bench ({meta.get('mode', 'full')} run, "
                   f"{meta.get('env', {}).get('cpus', '?')} CPUs, Python "
                   f"{meta.get('env', {}).get('python', '?')}); engine: {meta.get('engine', '')}")
        out.append(f"GC: {meta.get('gc', '')}")
        out.append("Columns: client busy = client main-thread CPU / wall; engine busy = engine "
                   "process CPU / wall; saturated = the side whose main thread was >= 80% "
                   "busy; others = cores other processes on the machine used meanwhile (noise)")
        out.append("")

    def block(title: str, header: Sequence[str], rows: list[list[str]]) -> None:
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
                  for i, h in enumerate(header)]
        out.append(title)
        out.append("  ".join(h.rjust(w) if i else h.ljust(w)
                             for i, (h, w) in enumerate(zip(header, widths, strict=True))))
        for row in rows:
            out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        out.append("")

    def errors(r: Result) -> list[str] | None:
        if "error" in r:
            return [_label(r), str(r.get("concurrency", "")), "ERROR: " + str(r["error"])[:60]]
        return None

    rows: list[list[str]] = []
    for r in _rows_for(everything, "throughput"):
        bad = errors(r)
        if bad:
            rows.append(bad + [""] * 8)
            continue
        key = ("throughput", r["concurrency"])
        f, v = floor.get(key, {}), ref.get(key, {})
        rows.append([
            _label(r), f"{r['concurrency']}x{r['tokens']}", _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r.get("cpu_us_per_token"), ".2f"),
            _fmt(_ratio(r.get("cpu_us_per_token"), f.get("cpu_us_per_token")), ".1f", "x"),
            _fmt(_ratio(r.get("cpu_us_per_token"), v.get("cpu_us_per_token")), ".2f", "x"),
            _fmt(_ratio(r.get("tokens_per_s"), v.get("tokens_per_s")), ".2f", "x"),
            _fmt(r.get("main_busy"), ".0%"), _fmt(r.get("engine_busy"), ".0%"),
            str(r.get("saturated", "-")), _fmt(r.get("others_cores"), ".2f"),
        ])
    if rows:
        block("(a) throughput: C concurrent streams x T tokens, fully consumed",
              ["client", "CxT", "tok/s", "CPU us/tok", "CPU/floor", "CPU/vLLM",
               "tok/s/vLLM", "client busy", "engine busy", "saturated", "others"], rows)

    rows = []
    for r in _rows_for(everything, "latency"):
        bad = errors(r)
        if bad:
            rows.append(bad + [""] * 4)
            continue
        f = floor.get(("latency", r["concurrency"]), {})
        rows.append([
            _label(r), _fmt(r.get("first_output_p50_us"), ",.0f"),
            _fmt(r.get("first_output_p99_us"), ",.0f"),
            _fmt(r.get("per_output_cpu_p50_us"), ",.1f"),
            _fmt(r.get("per_output_cpu_p99_us"), ",.1f"),
            _fmt(_ratio(r.get("first_output_p50_us"), f.get("first_output_p50_us")), ".1f", "x"),
            _fmt(_ratio(r.get("per_output_cpu_p50_us"), f.get("per_output_cpu_p50_us")),
                 ".1f", "x"),
        ])
    if rows:
        block("(b) latency: one request at a time (engine paced at 1 ms/step); first output "
              "= generate() entry to first output (wall); per output = main-thread CPU "
              "between outputs",
              ["client", "first p50 us", "first p99 us", "per-output p50 us",
               "per-output p99 us", "first/floor", "per-output/floor"], rows)

    rows = []
    for r in _rows_for(everything, "churn"):
        bad = errors(r)
        if bad:
            rows.append(bad + [""] * 6)
            continue
        key = ("churn", r["concurrency"])
        f, v = floor.get(key, {}), ref.get(key, {})
        rows.append([
            _label(r), _fmt(r.get("requests_per_s"), ",.0f"),
            _fmt(r.get("cpu_us_per_request"), ",.1f"),
            _fmt(_ratio(r.get("cpu_us_per_request"), f.get("cpu_us_per_request")), ".1f", "x"),
            _fmt(_ratio(r.get("cpu_us_per_request"), v.get("cpu_us_per_request")), ".0%"),
            _fmt(r.get("main_busy"), ".0%"), _fmt(r.get("engine_busy"), ".0%"),
            str(r.get("saturated", "-")), _fmt(r.get("others_cores"), ".2f"),
        ])
    if rows:
        block("(c) churn: short requests (1..4 tokens), 64 at a time",
              ["client", "req/s", "CPU us/req", "CPU/floor", "CPU/vLLM", "client busy",
               "engine busy", "saturated", "others"], rows)

    rows = []
    for r in _rows_for(everything, "memory"):
        bad = errors(r)
        if bad:
            rows.append(bad + [""] * 2)
            continue
        rows.append([
            _label(r), f"{r.get('inflight', 0):,} / {r.get('requests', 0):,}",
            _fmt((r.get("rss_delta_bytes") or 0) / 2**20, ".1f", " MiB"),
            _fmt((r.get("bytes_per_request") or 0) / 1024, ".2f", " KiB"),
            _fmt(r.get("cancel_all_s"), ".2f", " s"),
        ])
    if rows:
        block("(d) memory: requests in flight at once (engine: 16 running, 50 ms steps)",
              ["client", "in flight", "RSS delta", "per request", "cancel all"], rows)

    rows = []
    for r in _rows_for(everything, "lateness"):
        bad = errors(r)
        rows.append(bad + [""] * 3 if bad else [
            _label(r), str(r.get("concurrency", "")),
            *(_fmt(r.get(f"lateness_{k}_ms"), ".1f", " ms") for k in ("p50", "p99", "max")),
            _fmt(r.get("lateness_worst_round_max_ms"), ".1f", " ms")])
    if rows:
        block("(e) lateness: move_on_after(0.1) around each of C busy streams (0.2 ms of "
              "blocking work per output), deadline to scope exit",
              ["client", "C", "p50", "p99", "max", "worst round max"], rows)

    if targets:
        out.append("targets:")
        for t in targets:
            out.append(f"  {t['status']:4}  {t['backend']:8} {t['target']}: {t['detail']}")
        out.append("")
    return "\n".join(out)
