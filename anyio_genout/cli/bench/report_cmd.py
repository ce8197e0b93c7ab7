"""``anyio-genout bench report [...]``: re-print a saved run, with vLLM's figures.

Reads a saved ``bench.json``, prints its table with the ratios and targets against
``vllm.json`` (next to it, if present, else the figures the run saved), rewrites the file with
them and redraws its plot. Needs no extra: without matplotlib it skips the plot.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from ...bench.spec import Result
from ..helpformat import HelpFormatter
from .options import DEFAULT_DIR
from .output import load_vllm, report, write_plot

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", formatter_class=HelpFormatter,
        help="re-print a saved run with vLLM's figures, and redraw its plot",
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
    parser.set_defaults(command=run, prog=parser.prog)
    return parser


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the table and rewrite the saved run with its ratios and targets; status 0.

    Raises :class:`OSError` if the saved run cannot be read or written, and
    :class:`ValueError` (:class:`json.JSONDecodeError`) if it is not JSON.
    """
    data = json.loads(Path(args.results).read_text())
    results: list[Result] = data.get("results", [])
    vllm, _ = load_vllm(args.vllm_results or str(Path(args.results).parent / "vllm.json"))
    if vllm is None:
        vllm = data.get("vllm")
    info = data.get("meta") or {}
    table, ratios, targets = report(results, vllm, info)
    print(table)
    data.update(vllm=vllm, ratios=ratios, targets=targets)
    Path(args.results).write_text(json.dumps(data, indent=1, default=str))
    if not args.no_plot:
        png = write_plot(results, vllm, args.plot or str(Path(args.results).with_suffix(".png")),
                         info)
        if png:
            print(f"plot: {png}")
    return 0
