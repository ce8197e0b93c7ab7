"""``anyio-genout bench vllm --model DIR [...]``: vLLM's AsyncLLM as the reference point.

Runs AsyncLLM (external engine: the same mock engine core) on the throughput, churn and
latency workloads, on each of ``--loops``, and writes ``bench-results/vllm.json``; needs vLLM,
so ``nox -s bench-vllm`` runs it in the interop environment. AsyncLLM's handshake is one-shot,
so the cells sharing an engine shape run in one process, and are retried together.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ...bench.attempts import keep_quietest, run_vllm_group
from ...bench.spec import CellSpec, Result
from ..helpformat import HelpFormatter
from .options import (
    DEFAULT_DIR,
    add_measuring_options,
    concurrency_levels,
    csv_list,
    missing_extras,
    retries,
    settle_seconds,
)
from .output import meta, progress, report
from .run_cmd import plan

__all__ = ["add_parser", "plan_vllm", "run"]

#: ``--retries`` outside ``--quick`` (a group of cells is retried together).
RETRIES: Final = 1
LOOPS: Final = ("asyncio", "uvloop")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "vllm", formatter_class=HelpFormatter,
        help="measure vLLM's AsyncLLM on the same workloads, as the reference (needs vLLM)",
        description="Measure vLLM's AsyncLLM (external engine: the same mock engine) on the "
                    "throughput, churn and latency workloads; needs vLLM (`nox -s "
                    "bench-vllm` runs this in the interop environment).")
    add_measuring_options(parser, "vllm.json", RETRIES)
    parser.add_argument("--model", default=os.environ.get("ANYIO_GENOUT_VLLM_MODEL"),
                        metavar="DIR",
                        help="model folder (default: $ANYIO_GENOUT_VLLM_MODEL)")
    parser.add_argument("--loops", type=csv_list(str, LOOPS), default=list(LOOPS),
                        metavar="LIST",
                        help=f"event loops to run AsyncLLM on (default: {','.join(LOOPS)})")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="our results to print the combined table with (default: "
                             "bench.json next to --output, if present)")
    parser.set_defaults(command=run, prog=parser.prog)
    return parser


def plan_vllm(*, workloads: Sequence[str], concurrency: Sequence[int], quick: bool,
              min_time: float | None, loop: str) -> list[CellSpec]:
    """The cells of :func:`.run_cmd.plan` that AsyncLLM runs (no memory workload)."""
    cells = plan(workloads=[w for w in workloads if w != "memory"], backends=[loop],
                 concurrency=concurrency, quick=quick, floor=False, min_time=min_time)
    return [CellSpec.from_json({**c.to_json(), "impl": "vllm"}) for c in cells]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Measure, write the results, print the table (combined with ours when found); exit
    status 1 if a cell failed, 2 without ``--model`` or a needed extra (one line, nothing
    run)."""
    prog: str = args.prog
    if not args.model:
        print(f"{prog}: give --model (or set ANYIO_GENOUT_VLLM_MODEL)", file=sys.stderr)
        return 2
    missing = missing_extras(prog, args)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    workloads = args.workloads or ["throughput", "latency", "churn"]
    output = args.output or str(Path(DEFAULT_DIR) / "vllm.json")
    info = meta("quick" if args.quick else "full", argv)
    info["loops"] = args.loops
    results: list[Result] = []
    for loop in args.loops:
        cells = plan_vllm(workloads=workloads, concurrency=concurrency_levels(args),
                          quick=args.quick, min_time=args.min_time, loop=loop)
        # AsyncLLM's handshake is one-shot: one process (and engine) per engine shape.
        groups: dict[tuple[float, int], list[CellSpec]] = {}
        for cell in cells:
            groups.setdefault((cell.engine_step_time, cell.engine_max_num_seqs), []).append(cell)
        for group in groups.values():
            t0 = time.monotonic()
            found = keep_quietest(
                functools.partial(run_vllm_group, group, args.model, loop,
                                  args.timeout * len(group)),
                retries=retries(args, RETRIES), quiet=args.quiet, settle=settle_seconds(args))
            for i, (spec, result) in enumerate(zip(group, found, strict=True), 1):
                print(progress(i, len(group), spec, result, time.monotonic() - t0),
                      file=sys.stderr)
            results.extend(found)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps({"meta": info, "results": results}, indent=1,
                                       default=str))
    print(f"vLLM results: {output}")
    ours_path = args.results or str(Path(output).parent / "bench.json")
    if Path(ours_path).exists():
        data = json.loads(Path(ours_path).read_text())
        table, _ratios, _targets = report(data.get("results", []), results,
                                          data.get("meta") or info)
        print(f"combined with {ours_path} ({(data.get('meta') or {}).get('date')}):")
    else:
        table, _ratios, _targets = report([], results, info)
    print(table)
    return 1 if any("error" in r for r in results) else 0
