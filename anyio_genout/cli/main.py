"""Entry point of the ``anyio-genout`` console script."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from ..errors import GenoutError
from . import generate_cmd, run_cmd

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anyio-genout",
        description="A structured-concurrency client for vLLM engine cores.")
    subparsers = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    generate_cmd.add_parser(subparsers)
    run_cmd.add_parser(subparsers)
    mock = subparsers.add_parser(
        "mock-engine", add_help=False,
        help="run a mock engine core process (see `anyio-genout mock-engine --help`)")
    mock.set_defaults(command=None, passthrough="mock")
    bench = subparsers.add_parser(
        "bench", add_help=False,
        help="benchmark client throughput and cost (see `anyio-genout bench --help`)")
    bench.set_defaults(command=None, passthrough="bench")
    return parser


def _run_backend(fn: Callable[[argparse.Namespace], Awaitable[int]],
                 args: argparse.Namespace) -> int:
    backend, options = args.backend, {}
    if backend == "uvloop":
        backend, options = "asyncio", {"use_uvloop": True}
    result: int = anyio.run(fn, args, backend=backend, backend_options=options)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mock-engine":
        from ..mock.cli import main as mock_main

        return mock_main(argv[1:])
    if argv and argv[0] == "bench":
        from ..bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_backend(args.command, args)
    except KeyboardInterrupt:
        print("anyio-genout: interrupted", file=sys.stderr)
        return 130
    except (GenoutError, OSError) as exc:
        return _report(args, exc)
    except BaseExceptionGroup as group:
        errors = _flatten(group)
        if len(errors) == 1 and isinstance(errors[0], GenoutError | OSError):
            return _report(args, errors[0])
        raise


def _flatten(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found.extend(_flatten(exc))
        else:
            found.append(exc)
    return found


def _report(args: argparse.Namespace, exc: BaseException) -> int:
    if args.debug:
        traceback.print_exception(exc)
    print(f"anyio-genout: error: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
