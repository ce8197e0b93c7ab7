"""``anyio-genout bench [--quick] [--workloads ...] [--backends ...] [--concurrency ...]``.

Measures our client (on each backend) and the bare floor client against the mock engine
core: plans the cells, runs each in a fresh process (again while the machine was busy,
keeping the quietest attempt), then writes ``bench-results/bench.json`` and ``bench.png`` and
prints the table, the ratios to the floor and to vLLM (when ``bench-results/vllm.json``
exists) and PASS/MISS for every target.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ...bench.attempts import keep_quietest, run_cell
from ...bench.spec import BACKENDS, WORKLOADS, CellSpec, Result, tokens_for
from ..backends import missing_backend
from .options import (
    DEFAULT_DIR,
    add_measuring_options,
    concurrency_levels,
    csv_list,
    missing_extras,
    retries,
    settle_seconds,
)
from .output import GC_NOTE, load_vllm, meta, profile_text, progress, report, write_plot

__all__ = ["add_arguments", "available", "plan", "run"]

LATENCY_STEP: Final = 0.001
MEMORY_STEP: Final = 0.05
MEMORY_SEQS: Final = 16
#: ``--retries`` outside ``--quick``.
RETRIES: Final = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options, on ``anyio-genout bench`` itself (it is the default)."""
    add_measuring_options(parser, "bench.json", RETRIES)
    parser.add_argument("--backends", type=csv_list(str, BACKENDS), default=None,
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
    parser.set_defaults(command=run, prog=parser.prog)


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
        elif workload == "lateness":  # ours only: the floor has no cancel scopes
            for backend in backends:
                add("ours", backend, workload, concurrency=64 if quick else 256,
                    tokens=2000, min_rounds=1 if quick else 3, min_time=0.0)
    return cells


def available(prog: str, backends: Sequence[str]) -> list[str]:
    """The default backends that are installed; one line for each one skipped."""
    found = []
    for backend in backends:
        message = missing_backend(prog, backend, "--backends")
        if message is not None:
            print(f"{prog}: skipping the {backend} backend ({message})", file=sys.stderr)
            continue
        found.append(backend)
    return found


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the planned cells and report; exit status 1 if a cell failed, 2 if an extra is
    missing (one line on stderr, nothing run)."""
    prog: str = args.prog
    missing = missing_extras(prog, args)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    backends = args.backends or available(prog, BACKENDS)
    cells = plan(workloads=args.workloads or list(WORKLOADS), backends=backends,
                 concurrency=concurrency_levels(args), quick=args.quick, floor=args.floor,
                 min_time=args.min_time, profile=args.profile)
    output = args.output or str(Path(DEFAULT_DIR) / ("profile.json" if args.profile
                                                     else "bench.json"))
    vllm_path = args.vllm_results or str(Path(output).parent / "vllm.json")
    info = meta("quick" if args.quick else ("profile" if args.profile else "full"), argv)
    info["backends"] = backends
    print(f"bench: {len(cells)} cells, each in a fresh process with its own engine; "
          f"GC: {GC_NOTE}", file=sys.stderr)
    results: list[Result] = []
    started = time.monotonic()
    for i, spec in enumerate(cells, 1):
        t0 = time.monotonic()
        [result] = keep_quietest(functools.partial(run_cell, spec, args.timeout),
                                 retries=retries(args, RETRIES), quiet=args.quiet,
                                 settle=settle_seconds(args))
        results.append(result)
        print(progress(i, len(cells), spec, result, time.monotonic() - t0), file=sys.stderr)
    info["seconds"] = round(time.monotonic() - started, 1)
    vllm, vllm_meta = load_vllm(vllm_path)
    if vllm_meta is not None:
        info["vllm"] = {"file": vllm_path, "date": vllm_meta.get("date"),
                        "loops": vllm_meta.get("loops")}
    table, ratios, targets = report(results, vllm, info)
    print(table)
    for r in results:
        summary = r.get("profile")
        if isinstance(summary, dict):
            print(profile_text(r, summary))
    document = {"meta": info, "results": results, "vllm": vllm, "ratios": ratios,
                "targets": targets}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(document, indent=1, default=str))
    print(f"results: {output}")
    if not args.no_plot:
        png = write_plot(results, vllm, args.plot or str(Path(output).with_suffix(".png")),
                         info)
        if png:
            print(f"plot: {png}")
    return 1 if any("error" in r for r in results) else 0
