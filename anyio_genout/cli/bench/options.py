"""The options both measuring commands (``bench`` and ``bench vllm``) take, and the extras
they need.

Measuring needs the ``bench`` extra (psutil reads every process's CPU; pyinstrument is for
``--profile``), and a backend or loop named on the command line needs its library:
:func:`missing_extras` words the one line a command exits with (status 2) when one is not
installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, Final

from ...bench.spec import DEFAULT_CONCURRENCY, WORKLOADS
from ..backends import extra_message, importable, missing_backend

__all__ = ["DEFAULT_DIR", "add_measuring_options", "concurrency_levels", "csv_list",
           "missing_extras", "retries", "settle_seconds"]

#: Where results go unless ``--output`` says otherwise.
DEFAULT_DIR: Final = "bench-results"

#: The throughput concurrency levels of ``--quick``.
QUICK_CONCURRENCY: Final = (1, 64)


def csv_list(kind: Callable[[str], Any], choices: Sequence[str] | None = None
             ) -> Callable[[str], list[Any]]:
    """An argparse ``type``: comma-separated values of ``kind``, each one of ``choices``."""
    def parse(text: str) -> list[Any]:
        items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {', '.join(map(str, bad))} (choose from {', '.join(choices)})")
        return items

    return parse


def add_measuring_options(parser: argparse.ArgumentParser, output: str, retries: int) -> None:
    """The shapes, the output and the noise control; ``output`` is the default file name in
    :data:`DEFAULT_DIR`, ``retries`` the default of ``--retries`` outside ``--quick``."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small shapes, one round each (seconds, not minutes)")
    parser.add_argument("--workloads", type=csv_list(str, WORKLOADS), default=None,
                        metavar="LIST",
                        help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: "
                             f"all)")
    parser.add_argument("--concurrency", type=csv_list(int), default=None, metavar="LIST",
                        help="throughput concurrency levels (default: "
                             f"{','.join(map(str, DEFAULT_CONCURRENCY))}; quick: "
                             f"{','.join(map(str, QUICK_CONCURRENCY))})")
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


def concurrency_levels(args: argparse.Namespace) -> list[int]:
    if args.concurrency:
        return list(args.concurrency)
    return list(QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY)


def settle_seconds(args: argparse.Namespace) -> float:
    if args.settle is not None:
        return float(args.settle)
    return 0.0 if args.quick else 20.0


def retries(args: argparse.Namespace, default: int) -> int:
    if args.retries is not None:
        return int(args.retries)
    return 0 if args.quick else default


def missing_extras(prog: str, args: argparse.Namespace) -> str | None:
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
