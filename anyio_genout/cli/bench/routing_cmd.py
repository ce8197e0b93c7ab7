"""``anyio-genout bench routing [...]``: prefix-aware vs load-only routing (issue #17).

Runs :func:`~anyio_genout.bench.routing.run_benchmark` (every workload under both routers,
fresh mock engines per cell, all in this process) ``--repeats`` times, prints the Markdown
table of the median repeat per cell and the prefix/load ratios, and writes every repeat to
``--output`` (JSON). ``nox -s bench-routing`` runs it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from ...bench.routing import (
    ROUTINGS,
    WORKLOADS,
    BenchSettings,
    CellResult,
    markdown_table,
    median_results,
    run_benchmark,
    summary,
)
from ..backends import BACKENDS, anyio_run_arguments, require_backend
from ..helpformat import HelpFormatter
from .options import DEFAULT_DIR, csv_list

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    d = BenchSettings()
    parser = subparsers.add_parser(
        "routing", formatter_class=HelpFormatter,
        help="prefix-aware vs load-only routing over mock engines with a prefix cache",
        description="Compare RoutingConfig('prefix') with RoutingConfig('load') "
                    "on mock engines that cache prompt prefixes and pay for prefill: a "
                    "workload of shared system prompts and one without sharing, both "
                    "routers in one run (fresh engines per cell): cached-token fraction, "
                    "output tokens/s, time to first token.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 256 requests, one repeat")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help=f"requests per cell (default: {d.requests}; quick: 256)")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help="repeats of the whole run; the median per cell is reported "
                             "(default: 3; quick: 1)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, metavar="N",
                        help="requests in flight (closed loop)")
    parser.add_argument("--engines", type=int, default=d.engines, metavar="N",
                        help="mock engines")
    parser.add_argument("--cache-blocks", type=int, default=d.cache_blocks, metavar="N",
                        help="each engine's prefix cache, in blocks of 16 tokens")
    parser.add_argument("--imbalance-threshold", type=float, default=None, metavar="X",
                        help="the prefix router's prefix_imbalance_threshold (default: its "
                             "default)")
    parser.add_argument("--workloads", type=csv_list(str, WORKLOADS), default=list(WORKLOADS),
                        metavar="LIST", help="workloads: shared, unshared")
    parser.add_argument("--backend", choices=BACKENDS, default="asyncio",
                        help="event loop to run on")
    parser.add_argument("--output", type=Path, default=Path(DEFAULT_DIR) / "routing.json",
                        metavar="FILE", help="where every repeat's results go (JSON)")
    parser.set_defaults(command=run)
    return parser


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the benchmark as ``args`` say; print the table; returns the exit status."""
    require_backend("anyio-genout bench routing", args.backend)
    requests = args.requests if args.requests is not None else 256 if args.quick else 1024
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    settings = BenchSettings(requests=requests, concurrency=args.concurrency,
                             engines=args.engines, cache_blocks=args.cache_blocks,
                             imbalance_threshold=args.imbalance_threshold)
    backend, options = anyio_run_arguments(args.backend)
    runs: list[list[CellResult]] = []
    for repeat in range(repeats):
        # Alternate the routers' order between repeats (a drifting machine favours neither).
        order = ROUTINGS if repeat % 2 == 0 else tuple(reversed(ROUTINGS))
        cells = anyio.run(run_benchmark, settings, args.workloads, order, backend=backend,
                          backend_options=options)
        runs.append(sorted(cells, key=lambda c: (c.workload, ROUTINGS.index(c.routing))))
        print(f"repeat {repeat + 1}/{repeats} done", flush=True)
    table = markdown_table(median_results(runs))
    print(summary(settings))
    print(table)
    data: dict[str, Any] = {"settings": attrs.asdict(settings), "backend": args.backend,
                            "argv": list(argv), "runs": [[c.to_json() for c in r] for r in runs]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=1))
    print(f"results: {args.output}")
    return 0
