"""Entry point of the ``anyio-genout`` console script."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, cast

import anyio

from ..errors import GenoutError, UsageError
from . import generate_cmd, run_cmd, serve_cmd
from .backends import anyio_run_arguments, require_backend
from .serve_workers import WORKER_COMMAND

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the full usage is in ``--help``).

    argparse's default prints the whole usage block first, which for these commands is
    twenty lines that bury the one line that matters. Subparsers inherit the class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="anyio-genout",
        description="A structured-concurrency client for vLLM engine cores.")
    parser.add_argument("--version", action="version", version=f"anyio-genout {_version()}",
                        help="print the version and exit")
    subparsers = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
                      parser.add_subparsers(title="commands", required=True, metavar="COMMAND"))
    generate_cmd.add_parser(subparsers)
    run_cmd.add_parser(subparsers)
    serve_cmd.add_parser(subparsers)
    mock = subparsers.add_parser(
        "mock-engine", add_help=False,
        help="run a mock engine core process (see `anyio-genout mock-engine --help`)")
    mock.set_defaults(command=None, passthrough="mock")
    bench = subparsers.add_parser(
        "bench", add_help=False,
        help="benchmark client throughput and cost (see `anyio-genout bench --help`)")
    bench.set_defaults(command=None, passthrough="bench")
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("anyio-genout")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
        return "unknown (not installed)"


def _run_backend(fn: Callable[[argparse.Namespace], Awaitable[int]],
                 args: argparse.Namespace) -> int:
    backend, options = anyio_run_arguments(args.backend)
    result: int = anyio.run(fn, args, backend=backend, backend_options=options)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mock-engine":
        from .mock_cmd import main as mock_main

        return mock_main(argv[1:])
    if argv and argv[0] == "bench":
        from .bench.main import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == WORKER_COMMAND:  # internal: `serve --workers N`
        from .serve_workers import read_worker_spec

        args = read_worker_spec(sys.stdin.buffer)
    elif argv and argv[0] == "serve":  # vLLM's engine flags: passed on or refused
        from .vllm_flags import split_engine_flags

        rest, engine_flags = split_engine_flags(argv[1:])
        args = build_parser().parse_args([argv[0], *rest])
        args.engine_flags = engine_flags
    else:
        args = build_parser().parse_args(argv)
    require_backend(f"anyio-genout {argv[0]}", args.backend)
    _configure_logging(args.debug)
    return _execute(args)


def _execute(args: argparse.Namespace) -> int:
    """Run a parsed command on its backend: its exit status, and errors as one line."""
    try:
        return _run_backend(args.command, args)
    except KeyboardInterrupt:
        return _interrupted()
    except (GenoutError, OSError) as exc:
        return _report(args, exc)
    except BaseExceptionGroup as group:
        errors = _flatten(group)
        # trio raises Ctrl-C inside whichever task runs, so it can arrive wrapped in groups.
        if any(isinstance(error, KeyboardInterrupt) for error in errors):
            return _interrupted()
        if len(errors) == 1 and isinstance(errors[0], GenoutError | OSError):
            return _report(args, errors[0])
        raise


def _configure_logging(debug: bool) -> None:
    """Warnings on stderr as ``anyio-genout: warning: ...``; everything with ``--debug``.

    Without ``--debug`` the library's error records are left out: an error that ends the
    command is reported once, by the command's own closing line.
    """
    if debug:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_LineFormatter())
    handler.addFilter(lambda record: record.levelno < logging.ERROR)
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"anyio-genout: {record.levelname.lower()}: {record.getMessage()}"


def _interrupted() -> int:
    print("anyio-genout: interrupted", file=sys.stderr)
    return 130


def _flatten(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found.extend(_flatten(exc))
        else:
            found.append(exc)
    return found


def _report(args: argparse.Namespace, exc: BaseException) -> int:
    """One line on stderr; exit 2 for the caller's mistakes (nothing was run), else 1."""
    if args.debug:
        traceback.print_exception(exc)
    # Name the error class (the error reference is indexed by it), except the plain base
    # classes the commands raise for their own one-line messages.
    name = "" if type(exc) in (GenoutError, UsageError) else f"{type(exc).__name__}: "
    print(f"anyio-genout: error: {name}{exc}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
