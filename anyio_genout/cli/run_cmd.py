"""``anyio-genout run``: a batch job over a JSONL file of requests.

Each input line is ``{"request_id": ..., "prompt_token_ids": [...], "sampling_params":
{...}}``, or has a ``"prompt"`` (text) or ``"messages"`` (chat) instead of the token ids; with
a tokenizer (see ``--model``) each result also has its ``"text"``. Each finished request
becomes one output line, written as soon as it finishes, so an interrupted or failed run
keeps every completed result; ``--resume`` then runs only the rest. The input is read as it
is needed: memory stays bounded by --concurrency, whatever its size. Exit codes: 0 every
request finished, 1 some requests failed, input lines were skipped or the engines died, 2 a
usage error or bad input with ``--strict``, 130 interrupted (Ctrl-C / SIGTERM: every
in-flight request is aborted in the engine first).
"""

# This module is the command: its parser, its entry and the loop feeding requests to the
# workers (run_all). The input is read by run_input.py, --resume reads what an earlier run
# finished with run_resume.py, and run_output.py makes result lines, progress and the report.
# (This module's docstring is the command's --help text.)

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import IO, BinaryIO

import anyio

from ..errors import UsageError
from ..generate import Client, GenerateRequest
from ..text.client import TextClient
from ..text.request import TextRequest
from .engines import ClientSession, interruptible
from .options import add_engine_options, dumps, positive_int
from .run_batch import BatchItem, BatchParser, BatchRunner, batch_line_id, first_line, is_batch_line
from .run_input import (
    BadLine,
    LineParser,
    LineReader,
    Scan,
    check_all,
    in_thread,
    line_id,
    open_input,
    scan,
    spool,
)
from .run_output import EXIT_BAD_INPUT, Job, open_output, run_one
from .run_resume import DoneIds, read_done
from .serve_vllm import (
    add_fingerprint_options,
    add_tool_options,
    check_fingerprint_args,
    check_tool_args,
)
from .text_model import NO_TOKENIZER, add_model_option, load_tokenizer

__all__ = ["BadLine", "DoneIds", "Job", "LineParser", "LineReader", "Scan", "add_parser",
           "read_done", "run", "run_all", "scan"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run", help="run a JSONL file of requests and write JSONL results",
        description=__doc__.split("\n", 2)[2].replace("``", "`") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", help="JSONL file of requests ('-' for stdin); "
                        "or -i, as `vllm run-batch` takes it")
    parser.add_argument("-i", "--input-file", metavar="FILE",
                        help="the same as the positional INPUT, spelled as `vllm run-batch "
                             "-i` (give one of them; default: none)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="JSONL file for the results, rewritten unless --resume; '-' "
                             "writes them to stdout (progress and summary stay on stderr) "
                             "(required)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished results already in --output and run only the "
                             "other requests, appending their results; error lines and a "
                             "truncated last line are dropped and run again (default: off)")
    parser.add_argument("--concurrency", type=positive_int, default=64, metavar="N",
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--strict", action="store_true",
                        help="check every input line first and refuse to start if any is "
                             "invalid (default: off, report and skip it)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the Prometheus metrics over HTTP while running "
                             "(default: none)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="interface for --metrics-port (default: %(default)s, loopback "
                             "only)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines while running (default: off)")
    add_tool_options(parser)
    add_fingerprint_options(parser)
    add_model_option(parser)
    add_engine_options(parser)
    parser.set_defaults(command=run)


def _tool_flags(args: argparse.Namespace) -> dict[str, object]:
    """The tool flags as the server's ``ToolServing.from_names`` takes them (OpenAI batch
    lines' chat bodies are served with them, as ``vllm run-batch`` serves them)."""
    return {"enable_auto_tool_choice": args.enable_auto_tool_choice,
            "tool_call_parser": args.tool_call_parser,
            "reasoning_parser": args.reasoning_parser}


def _model_name(args: argparse.Namespace) -> str:
    """The model OpenAI batch lines' responses name when a body names none."""
    return str(args.model or args.vllm_model or args.model_name or "anyio-genout")


async def run(args: argparse.Namespace) -> int:
    if args.resume and args.output == "-":
        raise UsageError("--resume needs an output file (it reads what an earlier run wrote)")
    if (args.input is None) == (args.input_file is None):
        raise UsageError("give the input file once: INPUT or -i/--input-file")
    args.input = args.input if args.input is not None else args.input_file
    check_tool_args(args)
    check_fingerprint_args(args)
    source = open_input(args.input)
    try:
        if args.strict and not source.seekable():
            # --strict reads the input twice: a pipe is copied to a temporary file first.
            spooled = await anyio.to_thread.run_sync(spool, source, abandon_on_cancel=True)
            with spooled:
                return await _run(args, spooled)
        return await _run(args, source)
    finally:
        if source is not sys.stdin.buffer:
            source.close()


async def _run(args: argparse.Namespace, source: BinaryIO) -> int:
    job = Job(not args.no_progress)
    out: IO[str] | None = None
    tokenizer = load_tokenizer(args, required=False)
    text = tokenizer is not None
    try:
        # The signal watcher also covers the scans and the start-up (waiting for engines).
        async with interruptible() as interrupted:
            repeated = None
            if source.seekable():
                found: Scan = await in_thread(scan, source)
                job.total, repeated = found.total, found.repeated
            # The first line decides the format of the whole file (OpenAI batch lines or ours).
            lines = LineReader(source)
            first = (await in_thread(first_line, source) if source.seekable()
                     else await lines.first_line())
            batch = first is not None and is_batch_line(first)
            if batch and tokenizer is None:
                raise UsageError(f"OpenAI batch lines {NO_TOKENIZER}")
            model = _model_name(args)
            parser: LineParser | BatchParser = (
                BatchParser(model, _tool_flags(args)) if batch
                else LineParser(repeated, text=text))
            if args.strict:
                problems = await in_thread(check_all, source,
                                           BatchParser(model, _tool_flags(args)) if batch
                                           else LineParser(repeated, text=text))
                if problems:
                    print(f"anyio-genout: {problems} invalid line(s); nothing was run "
                          "(--strict)", file=sys.stderr)
                    return EXIT_BAD_INPUT
            done: DoneIds | None = None
            if args.resume:
                done, dropped = await in_thread(read_done, Path(args.output))
                print(f"anyio-genout: resuming: {len(done)} finished result(s) in "
                      f"{args.output} kept" + (f", {dropped} error or truncated line(s) "
                                                "dropped to run again" if dropped else ""),
                      file=sys.stderr)
            out = open_output(args.output, append=done is not None)
            async with ClientSession(args, tokenizer=tokenizer) as client:
                text_client = None
                if tokenizer is not None:
                    try:
                        text_client = TextClient(client, tokenizer)
                    except ValueError as exc:
                        raise UsageError(str(exc)) from None
                await _serve(args, client, lines, parser, done, out, job, text_client)
    finally:
        if out is sys.stdout:
            out.flush()
        elif out is not None:
            out.close()
        job.end_progress()
    return job.report(args.output, bool(interrupted))


async def _serve(args: argparse.Namespace, client: Client, lines: LineReader,
                 parser: LineParser | BatchParser, done: DoneIds | None, out: IO[str], job: Job,
                 text_client: TextClient | None = None) -> None:
    server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        server = start_http_server(args.metrics_port, addr=args.metrics_host,
                                   registry=client.metrics.registry)
    try:
        job.restart()
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.show)
            runner = (BatchRunner(text_client, _tool_flags(args), model=_model_name(args),
                                  fingerprint_mode=args.fingerprint_mode,
                                  fingerprint_value=args.fingerprint_value)
                      if isinstance(parser, BatchParser)
                      and text_client is not None else None)
            await run_all(client, lines, parser, done, args.concurrency, out, job,
                          text_client, batch=runner)
            tg.cancel_scope.cancel()
    finally:
        if server is not None:
            server[0].shutdown()


async def run_all(client: Client, lines: LineReader, parser: LineParser | BatchParser,
                   done: DoneIds | None, concurrency: int, out: IO[str], job: Job,
                   text_client: TextClient | None = None, *,
                   batch: BatchRunner | None = None) -> None:
    """Feed parsed requests to ``concurrency`` workers, one at a time as they free up.

    The feeder holds at most one parsed request beyond those in flight (the channel has no
    buffer). When the engines die the feeder stops: requests in flight end with an error
    line, the ones not started have no line (``--resume`` runs them). With ``batch`` the
    lines are OpenAI batch lines (``parser`` a :class:`BatchParser`), run by ``batch``.
    """
    send, receive = anyio.create_memory_object_stream[
        GenerateRequest | TextRequest | BatchItem](0)
    id_of = line_id if batch is None else batch_line_id
    feeder = anyio.CancelScope()
    engine = client.engine

    def stop_if_dead() -> bool:
        if engine.is_healthy:
            return False
        job.death = job.death or engine.health_error
        feeder.cancel()
        return True

    async def feed() -> None:
        with feeder, send:
            number = 0
            while (batch := await lines.next_batch()) is not None:
                for line in batch:
                    number += 1
                    if not line.strip():
                        continue
                    if done is not None and (rid := id_of(line, number)) is not None \
                            and rid in done:
                        job.done += 1  # finished in an earlier run: not even parsed
                        job.resumed += 1
                        continue
                    try:
                        request = parser.parse(number, line)
                    except BadLine as exc:
                        job.skip(str(exc))
                        continue
                    try:
                        # A worker is waiting: hand it over without a pass of the event loop,
                        # so a wave of requests reaches the engine together.
                        send.send_nowait(request)
                    except anyio.WouldBlock:
                        await send.send(request)

    async def work() -> None:
        async for request in receive:
            if stop_if_dead():
                return  # not started: no line
            if isinstance(request, BatchItem):
                assert batch is not None
                result, failure, tokens = await batch.run(request)
            else:
                result = await run_one(client, request, text_client)
                failure = result.get("error")
                tokens = len(result.get("token_ids", ()))
            out.write(dumps(result) + "\n")
            out.flush()
            if failure is not None:
                job.fail(request.request_id, failure, engine_dead=stop_if_dead())
            else:
                job.done += 1
                job.tokens += tokens

    with receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            for _ in range(concurrency):
                tg.start_soon(work)
    stop_if_dead()
