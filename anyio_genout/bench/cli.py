"""``anyio-genout bench``: plan the cells, run each in a fresh process, report.

Three entry points share this module::

    anyio-genout bench [--quick] [--workloads ...] [--backends ...] [--concurrency ...]
    anyio-genout bench vllm --model DIR [...]    # the AsyncLLM reference (interop venv)
    anyio-genout bench report [...]              # re-print a saved run (with vLLM figures)

A run writes ``bench-results/bench.json`` and ``bench-results/bench.png`` and prints the
table, the ratios to the floor and to vLLM (when ``bench-results/vllm.json`` exists) and
PASS/MISS for every target.

Measuring needs the ``bench`` extra (psutil; matplotlib for the plot, pyinstrument for
``--profile``): without it a run says so in one line and exits with status 2, and so does a
backend named in ``--backends`` whose library (uvloop, trio) is missing. ``--help`` and
``bench report`` need no extra (``report`` skips the plot without matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ..cli.backends import extra_message, importable, missing_backend
from ..cli.helpformat import HelpFormatter
from .spec import (
    BACKENDS,
    DEFAULT_CONCURRENCY,
    WORKLOADS,
    CellSpec,
    Result,
    tokens_for,
)

__all__ = ["DEFAULT_PROG", "build_parser", "build_report_parser", "build_vllm_parser", "main",
           "plan", "plan_vllm"]

#: The program name ``--help`` shows when run as ``anyio-genout bench``.
DEFAULT_PROG: Final = "anyio-genout bench"
DEFAULT_DIR: Final = "bench-results"
GC_NOTE: Final = ("gc.freeze() after start-up and warm-up in every client process (ours, "
                  "floor, vLLM); the collector stays enabled for objects made later")
ENGINE_NOTE: Final = ("mock engine core in its own process (python -m anyio_genout.mock, "
                      "--step-time 0, --no-log-stats, max_num_seqs 1024, one "
                      "EngineCoreOutputs per step for all running requests), TCP loopback")
LATENCY_STEP: Final = 0.001
MEMORY_STEP: Final = 0.05
MEMORY_SEQS: Final = 16


def _csv(kind: type, choices: Sequence[str] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {', '.join(map(str, bad))} (choose from {', '.join(choices)})")
        return items

    return parse


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Benchmark the client against a mock engine core in its own process: "
                    "delivered tokens/s, client CPU per token, latency, churn, memory; with "
                    "a bare floor client and (from `nox -s bench-vllm`) vLLM's AsyncLLM as "
                    f"reference points. `{prog} vllm --help` and `{prog} report --help` "
                    "describe the other two modes. Needs the 'bench' extra: pip install "
                    "'anyio-genout[bench]'.")
    _add_common(parser, "bench.json", 2)
    parser.add_argument("--backends", type=_csv(str, BACKENDS), default=None,
                        metavar="LIST",
                        help=f"comma-separated backends of ours, of {', '.join(BACKENDS)} "
                             "(default: those installed; uvloop and trio come with their "
                             "extras)")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the bare floor client (default: run it)")
    parser.add_argument("--vllm-results", default=None, metavar="PATH",
                        help="vLLM reference figures (default: vllm.json next to --output, "
                             "if present)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="PNG path (default: --output with .png)")
    parser.add_argument("--no-plot", action="store_true",
                        help="write no PNG (default: write one if matplotlib is installed)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="run ours under pyinstrument and write a profile per cell into "
                             "DIR (slower: the figures are marked profiled and count for "
                             "no target; the default --output becomes profile.json) "
                             "(default: no profiling)")
    return parser


def _add_common(parser: argparse.ArgumentParser, output: str, retries: int) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small shapes, one round each (seconds, not minutes)")
    parser.add_argument("--workloads", type=_csv(str, WORKLOADS), default=None,
                        metavar="LIST",
                        help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: "
                             f"all)")
    parser.add_argument("--concurrency", type=_csv(int), default=None, metavar="LIST",
                        help="throughput concurrency levels (default: "
                             f"{','.join(map(str, DEFAULT_CONCURRENCY))}; quick: 1,64)")
    parser.add_argument("--min-time", type=float, default=None, metavar="SECONDS",
                        help="seconds of measured rounds per cell at least (default: 1.0; "
                             "quick: 0)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help=f"JSON results path (default: {DEFAULT_DIR}/{output})")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="seconds before a cell is given up")
    parser.add_argument("--settle", type=float, default=None, metavar="SECONDS",
                        help="before each cell, wait up to this many seconds until other "
                             "processes use under --quiet cores (default: 20; quick: 0)")
    parser.add_argument("--quiet", type=float, default=0.2, metavar="CORES",
                        help="other processes' CPU, in cores, that counts as quiet")
    parser.add_argument("--retries", type=int, default=None, metavar="N",
                        help="run a cell again (after settling) while other processes used "
                             "more than twice --quiet cores during it; the quietest attempt "
                             f"is kept (default: {retries}; quick: 0)")


def plan(*, workloads: Sequence[str], backends: Sequence[str], concurrency: Sequence[int],
         quick: bool, floor: bool, min_time: float | None, profile: str | None = None
         ) -> list[CellSpec]:
    """The cells of a run, interleaved so that drifting machine load hits all alike."""
    rounds: dict[str, Any] = (
        {"min_rounds": 1, "min_time": 0.0} if quick
        else {"min_rounds": 2, "min_time": 1.0 if min_time is None else min_time})
    if quick and min_time is not None:
        rounds["min_time"] = min_time
    impls: list[tuple[str, str]] = [("floor", "sync")] if floor else []
    impls += [("ours", b) for b in backends]
    cells: list[CellSpec] = []

    def add(impl: str, backend: str, workload: str, **fields: Any) -> None:
        path = None
        if profile is not None and impl == "ours":
            path = str(Path(profile) / f"profile-{backend}-{workload}-"
                                       f"{fields.get('concurrency', 1)}.txt")
        elif profile is not None:
            return
        cells.append(CellSpec(impl=impl, backend=backend, workload=workload, profile=path,
                              **fields))

    for workload in workloads:
        if workload == "throughput":
            for c in concurrency:
                for impl, backend in impls:
                    add(impl, backend, workload, concurrency=c,
                        tokens=32 if quick else tokens_for(c), **rounds)
        elif workload == "latency":
            for impl, backend in impls:
                add(impl, backend, workload, concurrency=1, tokens=16,
                    requests=10 if quick else 100, engine_step_time=LATENCY_STEP)
        elif workload == "churn":
            for impl, backend in impls:
                add(impl, backend, workload, concurrency=64, tokens=4,
                    requests=200 if quick else 2000, **rounds)
        elif workload == "memory":
            for backend in backends:
                add("ours", backend, workload, concurrency=1000 if quick else 10_000,
                    tokens=1000, requests=1000 if quick else 10_000,
                    engine_step_time=MEMORY_STEP, engine_max_num_seqs=MEMORY_SEQS,
                    min_rounds=1)
    return cells


def _run_cell(spec: CellSpec, timeout: float) -> Result:
    """Run one cell in a fresh interpreter; its stderr is shown only if it fails."""
    with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "anyio_genout.bench.cell", json.dumps(spec.to_json()),
               str(out)]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            return {**spec.to_json(), "error": f"timed out after {timeout:g} s"}
        if out.exists():
            result: Result = json.loads(out.read_text())
        else:
            result = {**spec.to_json(), "error": f"cell exited with status {proc.returncode}"}
        if "error" in result:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        return result


def _noise(result: Result) -> float:
    others = result.get("others_cores")
    return float(others) if isinstance(others, int | float) else 0.0


def _settle(args: argparse.Namespace) -> float:
    if args.settle is not None:
        return float(args.settle)
    return 0.0 if args.quick else 20.0


def _progress(i: int, n: int, spec: CellSpec, result: Result, seconds: float) -> str:
    what = f"[{i}/{n}] {spec.key}"
    if "error" in result:
        return f"{what}: ERROR {result['error']}"
    bits = []
    if spec.workload in ("throughput",):
        bits.append(f"{result.get('tokens_per_s', 0):,.0f} tok/s, "
                    f"{result.get('cpu_us_per_token') or 0:.2f} us/tok")
    elif spec.workload == "churn":
        bits.append(f"{result.get('requests_per_s', 0):,.0f} req/s, "
                    f"{result.get('cpu_us_per_request') or 0:.1f} us/req")
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


def _load_vllm(path: str | None) -> tuple[list[Result] | None, dict[str, Any] | None]:
    if path is None or not Path(path).exists():
        return None, None
    data = json.loads(Path(path).read_text())
    return list(data.get("results", [])), data.get("meta")


def _meta(mode: str, argv: Sequence[str]) -> dict[str, Any]:
    from .measure import environment

    return {
        "mode": mode,
        "argv": list(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "env": environment(),
        "gc": GC_NOTE,
        "engine": ENGINE_NOTE,
        "workloads": {
            "throughput": "C concurrent streams of T tokens (T=256 for C<=64, 128 for 256, "
                          "64 for 1024), `async with client.generate(...) as s: async for "
                          "out in s`; rounds repeat for >= min_time; totals over rounds",
            "latency": "one request (16 tokens) at a time, engine paced at 1 ms per step; "
                       "first output = wall time from generate() entry; per output = "
                       "main-thread CPU between consecutive outputs",
            "churn": "2000 requests of 1..4 tokens per round, 64 in flight",
            "memory": "10,000 requests in flight (engine runs 16 at 50 ms per step); RSS "
                      "delta from after warm-up to all in flight, / 10,000",
        },
        "prompt_len": 16,
    }


def _report(results: list[Result], vllm: list[Result] | None, meta: dict[str, Any]
            ) -> tuple[str, list[Result], list[Result]]:
    from .report import build_report, format_table

    ratios, targets = build_report(results, vllm)
    return format_table(results, vllm, targets, meta), ratios, targets


def _write_plot(results: list[Result], vllm: list[Result] | None, path: str,
                meta: dict[str, Any]) -> str | None:
    try:
        from .plot import plot
    except ImportError:  # pragma: no cover - matplotlib missing
        return None
    try:
        title = (f"anyio-genout bench ({meta.get('mode')}), {meta['env'].get('cpus')} CPUs, "
                 f"mock engine over TCP loopback; GC frozen after start-up")
        return plot(results, vllm, path, title)
    except ImportError:
        print(f"{extra_message('the plot', 'bench')} (no PNG written)", file=sys.stderr)
        return None


def _missing_extras(prog: str, args: argparse.Namespace) -> str | None:
    """The one line to exit with if this run needs a library that is not installed."""
    if not importable("psutil"):  # every meter reads the processes' CPU through it
        return extra_message(prog, "bench")
    if getattr(args, "profile", None) and not importable("pyinstrument"):
        return extra_message(f"{prog} --profile", "bench")
    for backend in getattr(args, "backends", None) or ():
        message = missing_backend(prog, backend, "--backends")
        if message is not None:
            return message
    for loop in getattr(args, "loops", None) or ():
        message = missing_backend(prog, loop, "--loops")
        if message is not None:
            return message
    return None


def run_main(argv: Sequence[str], prog: str = DEFAULT_PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    missing = _missing_extras(prog, args)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    from .measure import wait_until_quiet

    workloads = args.workloads or list(WORKLOADS)
    concurrency = args.concurrency or ([1, 64] if args.quick else list(DEFAULT_CONCURRENCY))
    backends = args.backends or _available(prog, BACKENDS)
    cells = plan(workloads=workloads, backends=backends, concurrency=concurrency,
                 quick=args.quick, floor=args.floor, min_time=args.min_time,
                 profile=args.profile)
    default_name = "profile.json" if args.profile else "bench.json"
    output = args.output or str(Path(DEFAULT_DIR) / default_name)
    vllm_path = args.vllm_results or str(Path(output).parent / "vllm.json")
    meta = _meta("quick" if args.quick else ("profile" if args.profile else "full"), argv)
    meta["backends"] = backends
    print(f"bench: {len(cells)} cells, each in a fresh process with its own engine; "
          f"GC: {GC_NOTE}", file=sys.stderr)
    results: list[Result] = []
    started = time.monotonic()
    settle = _settle(args)
    retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    for i, spec in enumerate(cells, 1):
        t0 = time.monotonic()
        result: Result = {}
        for attempt in range(1 + retries):
            before = wait_until_quiet(args.quiet, settle) if settle else None
            found = _run_cell(spec, args.timeout)
            found["attempt"] = attempt + 1
            if before is not None:
                found["others_cores_before"] = round(before, 3)
            if not result or _noise(found) < _noise(result):
                result = found
            if "error" in result or _noise(result) <= 2 * args.quiet:
                break
        results.append(result)
        print(_progress(i, len(cells), spec, result, time.monotonic() - t0), file=sys.stderr)
    meta["seconds"] = round(time.monotonic() - started, 1)
    vllm, vllm_meta = _load_vllm(vllm_path)
    if vllm_meta is not None:
        meta["vllm"] = {"file": vllm_path, "date": vllm_meta.get("date"),
                        "loops": vllm_meta.get("loops")}
    table, ratios, targets = _report(results, vllm, meta)
    print(table)
    for r in results:
        summary = r.get("profile")
        if isinstance(summary, dict):
            print(_profile_text(r, summary))
    document = {"meta": meta, "results": results, "vllm": vllm, "ratios": ratios,
                "targets": targets}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(document, indent=1, default=str))
    print(f"results: {output}")
    if not args.no_plot:
        png = _write_plot(results, vllm, args.plot or str(Path(output).with_suffix(".png")),
                          meta)
        if png:
            print(f"plot: {png}")
    return 1 if any("error" in r for r in results) else 0


def _profile_text(result: Result, summary: dict[str, Any]) -> str:
    lines = [f"profile of {result['impl']}/{result['backend']}/{result['workload']}/"
             f"{result['concurrency']} ({summary.get('sampled_s')} s sampled, "
             f"{summary.get('file')}):", "  self time by area:"]
    lines += [f"    {pct:5.1f}%  {name}" for name, _s, pct in summary.get("by_area", [])]
    lines += ["  top functions by self time:"]
    lines += [f"    {pct:5.1f}%  {name}" for name, _s, pct in summary.get("top_self", [])]
    return "\n".join(lines) + "\n"


def _available(prog: str, backends: Sequence[str]) -> list[str]:
    """The default backends that are installed; one line for each one skipped."""
    found = []
    for backend in backends:
        message = missing_backend(prog, backend, "--backends")
        if message is not None:
            print(f"{prog}: skipping the {backend} backend ({message})", file=sys.stderr)
            continue
        found.append(backend)
    return found


# ---------------------------------------------------------------------------- vLLM


def build_vllm_parser(prog: str = f"{DEFAULT_PROG} vllm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Measure vLLM's AsyncLLM (external engine: the same mock engine) on the "
                    "throughput, churn and latency workloads; needs vLLM (`nox -s "
                    "bench-vllm` runs this in the interop environment).")
    _add_common(parser, "vllm.json", 1)
    parser.add_argument("--model", default=os.environ.get("ANYIO_GENOUT_VLLM_MODEL"),
                        metavar="DIR",
                        help="model folder (default: $ANYIO_GENOUT_VLLM_MODEL)")
    parser.add_argument("--loops", type=_csv(str, ("asyncio", "uvloop")),
                        default=["asyncio", "uvloop"], metavar="LIST",
                        help="event loops to run AsyncLLM on (default: asyncio,uvloop)")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="our results to print the combined table with (default: "
                             "bench.json next to --output, if present)")
    return parser


def plan_vllm(*, workloads: Sequence[str], concurrency: Sequence[int], quick: bool,
              min_time: float | None, loop: str) -> list[CellSpec]:
    cells = plan(workloads=[w for w in workloads if w != "memory"], backends=[loop],
                 concurrency=concurrency, quick=quick, floor=False, min_time=min_time)
    return [CellSpec.from_json({**c.to_json(), "impl": "vllm"}) for c in cells]


def vllm_main(argv: Sequence[str], prog: str = f"{DEFAULT_PROG} vllm") -> int:
    args = build_vllm_parser(prog).parse_args(argv)
    if not args.model:
        print(f"{prog}: give --model (or set ANYIO_GENOUT_VLLM_MODEL)", file=sys.stderr)
        return 2
    missing = _missing_extras(prog, args)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    from .measure import wait_until_quiet

    workloads = args.workloads or ["throughput", "latency", "churn"]
    concurrency = args.concurrency or ([1, 64] if args.quick else list(DEFAULT_CONCURRENCY))
    output = args.output or str(Path(DEFAULT_DIR) / "vllm.json")
    meta = _meta("quick" if args.quick else "full", argv)
    meta["loops"] = args.loops
    results: list[Result] = []
    for loop in args.loops:
        cells = plan_vllm(workloads=workloads, concurrency=concurrency, quick=args.quick,
                          min_time=args.min_time, loop=loop)
        # AsyncLLM's handshake is one-shot: one process (and engine) per engine shape.
        groups: dict[tuple[float, int], list[CellSpec]] = {}
        for cell in cells:
            groups.setdefault((cell.engine_step_time, cell.engine_max_num_seqs), []).append(cell)
        for group in groups.values():
            settle = _settle(args)
            retries = args.retries if args.retries is not None else (0 if args.quick else 1)
            t0 = time.monotonic()
            found: list[Result] = []
            for attempt in range(1 + retries):
                if settle:
                    wait_until_quiet(args.quiet, settle)
                again = _run_vllm_group(group, args.model, loop, args.timeout * len(group))
                for r in again:
                    r["attempt"] = attempt + 1
                # Keep the quieter attempt, cell by cell.
                found = again if not found else [
                    new if _noise(new) < _noise(old) or "error" in old else old
                    for old, new in zip(found, again, strict=True)]
                if all(_noise(r) <= 2 * args.quiet for r in found):
                    break
            for i, (spec, result) in enumerate(zip(group, found, strict=True), 1):
                print(_progress(i, len(group), spec, result, time.monotonic() - t0),
                      file=sys.stderr)
            results.extend(found)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                       default=str))
    print(f"vLLM results: {output}")
    ours_path = args.results or str(Path(output).parent / "bench.json")
    if Path(ours_path).exists():
        data = json.loads(Path(ours_path).read_text())
        table, _ratios, _targets = _report(data.get("results", []), results,
                                           data.get("meta") or meta)
        print(f"combined with {ours_path} ({(data.get('meta') or {}).get('date')}):")
        print(table)
    else:
        table, _ratios, _targets = _report([], results, meta)
        print(table)
    return 1 if any("error" in r for r in results) else 0


def _run_vllm_group(specs: list[CellSpec], model: str, loop: str, timeout: float
                    ) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-vllm-") as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "anyio_genout.bench.vllm_ref",
               json.dumps([s.to_json() for s in specs]), str(out), "--model", model,
               "--loop", loop]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout + 120, text=True)
        except subprocess.TimeoutExpired:
            return [{**s.to_json(), "loop": loop, "error": "timed out"} for s in specs]
        if not out.exists():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
            return [{**s.to_json(), "loop": loop,
                     "error": f"AsyncLLM process exited with status {proc.returncode}"}
                    for s in specs]
        results: list[Result] = json.loads(out.read_text())
        if any("error" in r for r in results):
            sys.stderr.write(proc.stderr[-6000:])
        return results


# ---------------------------------------------------------------------------- report


def build_report_parser(prog: str = f"{DEFAULT_PROG} report") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Print the table of a saved run, with vLLM's figures when present, and "
                    "redraw its plot.")
    parser.add_argument("--results", default=str(Path(DEFAULT_DIR) / "bench.json"),
                        metavar="PATH", help="the saved run (rewritten with the ratios)")
    parser.add_argument("--vllm-results", default=None, metavar="PATH",
                        help="vLLM reference figures (default: vllm.json next to "
                             "--results, if present, else the run's own)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="PNG path (default: --results with .png)")
    parser.add_argument("--no-plot", action="store_true",
                        help="write no PNG (default: write one if matplotlib is installed)")
    return parser


def report_main(argv: Sequence[str], prog: str = f"{DEFAULT_PROG} report") -> int:
    args = build_report_parser(prog).parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    results: list[Result] = data.get("results", [])
    vllm, _ = _load_vllm(args.vllm_results or str(Path(args.results).parent / "vllm.json"))
    if vllm is None:
        vllm = data.get("vllm")
    meta = data.get("meta") or {}
    table, ratios, targets = _report(results, vllm, meta)
    print(table)
    data.update(vllm=vllm, ratios=ratios, targets=targets)
    Path(args.results).write_text(json.dumps(data, indent=1, default=str))
    if not args.no_plot:
        png = _write_plot(results, vllm, args.plot or str(Path(args.results).with_suffix(".png")),
                          meta)
        if png:
            print(f"plot: {png}")
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """``anyio-genout bench [vllm|report] ...``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "vllm":
        return vllm_main(args[1:], f"{prog} vllm")
    if args and args[0] == "report":
        return report_main(args[1:], f"{prog} report")
    return run_main(args, prog)
