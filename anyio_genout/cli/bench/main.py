"""``anyio-genout bench``: its parser and dispatch; one module of this package per command::

    anyio-genout bench [--quick] [--workloads ...] [--backends ...] [--concurrency ...]
    anyio-genout bench vllm --model DIR [...]    # the AsyncLLM reference (interop venv)
    anyio-genout bench report [...]              # re-print a saved run (with vLLM figures)
    anyio-genout bench text [--model DIR] [...]  # the text layer's cost (and AsyncLLM's)
    anyio-genout bench server --model DIR [...]  # the OpenAI server vs vllm serve, vllm-rs
    anyio-genout bench routing [...]             # prefix-aware vs load-only routing
    anyio-genout bench profile STACKS.txt        # summarise py-spy's stacks of a cell

This module builds the parser (the measuring run is the command itself; the others are its
subcommands) and dispatches. The commands: :mod:`.run_cmd`, :mod:`.vllm_cmd`,
:mod:`.report_cmd`, :mod:`.text_cmd`, :mod:`.server_cmd`, :mod:`.routing_cmd`,
:mod:`.profile_cmd`; what they share: :mod:`.options` (options, missing extras) and
:mod:`.output` (meta, progress, table, plot). What they measure with is the library
:mod:`anyio_genout.bench` (a cell in a fresh process, retried while the machine was busy, the
quietest attempt kept: :mod:`anyio_genout.bench.attempts`).

Measuring needs the ``bench`` extra (psutil; matplotlib for the plot, pyinstrument for
``--profile``): without it a run says so in one line and exits with status 2, and so does a
backend named in ``--backends`` whose library (uvloop, trio) is missing. ``--help``,
``bench report`` and ``bench profile`` need no extra (``report`` skips the plot without
matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Final

from ..helpformat import HelpFormatter
from . import profile_cmd, report_cmd, routing_cmd, run_cmd, server_cmd, text_cmd, vllm_cmd
from .run_cmd import plan
from .vllm_cmd import plan_vllm

__all__ = ["DEFAULT_PROG", "build_parser", "build_report_parser", "build_vllm_parser", "main",
           "plan", "plan_vllm"]

#: The program name ``--help`` shows when run as ``anyio-genout bench``.
DEFAULT_PROG: Final = "anyio-genout bench"

#: The installed default backends (:func:`.run_cmd.available`), by its former name here.
_available = run_cmd.available


def _build(prog: str) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each subcommand's parser by name."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Benchmark the client against a mock engine core in its own process: "
                    "delivered tokens/s, client CPU per token, latency, churn, memory; with "
                    "a bare floor client and (from `nox -s bench-vllm`) vLLM's AsyncLLM as "
                    f"reference points. `{prog} COMMAND --help` describes each of the other "
                    "commands. Needs the 'bench' extra: pip install 'anyio-genout[bench]'.")
    run_cmd.add_arguments(parser)
    subparsers = parser.add_subparsers(title="other commands", metavar="[COMMAND]")
    commands = {"vllm": vllm_cmd.add_parser(subparsers),
                "report": report_cmd.add_parser(subparsers),
                "text": text_cmd.add_parser(subparsers),
                "server": server_cmd.add_parser(subparsers),
                "routing": routing_cmd.add_parser(subparsers),
                "profile": profile_cmd.add_parser(subparsers)}
    return parser, commands


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """``anyio-genout bench``'s parser (its options are the measuring run's)."""
    return _build(prog)[0]


def build_vllm_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """The parser of ``<prog> vllm``."""
    return _build(prog)[1]["vllm"]


def build_report_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """The parser of ``<prog> report``."""
    return _build(prog)[1]["report"]


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """``anyio-genout bench [COMMAND] ...``; returns the exit status.

    Raises :class:`SystemExit` for ``--help`` (status 0) and bad arguments (status 2), as
    argparse does.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(args_list)
    status: int = args.command(args, args_list)
    return status

