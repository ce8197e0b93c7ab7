"""``anyio-genout bench profile STACKS.txt``: summarise py-spy's collapsed stacks.

The stacks come from ``py-spy record --nonblocking -f raw`` over a cell (docs/performance.md
has the command line); the summary is :func:`~anyio_genout.bench.profile.summarise_collapsed`'s:
time by area of the code, and the top functions by self and by total time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ...bench.profile import summarise_collapsed
from ..helpformat import HelpFormatter

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "profile", formatter_class=HelpFormatter,
        help="summarise py-spy's collapsed stacks of a cell",
        description="Print where a py-spy recording (`py-spy record --nonblocking -f raw`) "
                    "spent its samples: by area of the code, and the top functions by self "
                    "and by total time.")
    parser.add_argument("stacks", metavar="STACKS.txt", help="py-spy record -f raw output")
    parser.add_argument("--within", default="run_forever",
                        help="count only stacks through a frame containing this "
                             "(default: run_forever, the asyncio loop; trio: 'run')")
    parser.add_argument("--top", type=int, default=20, metavar="N",
                        help="functions listed per table")
    parser.set_defaults(command=run, prog=parser.prog)
    return parser


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the summary; status 0. Raises :class:`OSError` if the file cannot be read."""
    lines = Path(args.stacks).read_text().splitlines()
    summary = summarise_collapsed(lines, within=args.within or None, top=args.top)
    print(f"{summary['samples']} samples")
    for title, key in (("self time by area", "by_area"),
                       ("top functions by self time", "top_self"),
                       ("top functions by total time", "top_total")):
        print(f"{title}:")
        for name, _n, pct in summary[key]:
            print(f"  {pct:5.1f}%  {name}")
    return 0
