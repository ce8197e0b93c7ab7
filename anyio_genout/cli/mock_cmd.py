"""Command line of the mock engine core, ``anyio-genout mock-engine`` (or ``python -m
anyio_genout mock-engine``): its options, and serving one client after another.

Example, dialling a front end like ``vllm serve --headless`` does::

    anyio-genout mock-engine --handshake-address tcp://127.0.0.1:29550 --rank 0

or, bootstrapped (no handshake socket)::

    anyio-genout mock-engine --input-address tcp://127.0.0.1:5000 \\
        --output-address tcp://127.0.0.1:5001 --rank 3

It serves clients one after another: when a client leaves (its sockets close, or its process
dies), a fresh engine dials the handshake address again for the next one. This is the one
place the mock differs on purpose from a real ``vllm serve --headless``, which handshakes
once per process and must be restarted for a new front end. ``--once`` exits after the
first client instead. Connections and departures are reported on stderr.

It runs until SIGINT or SIGTERM (exit status 0), until the engine dies (status 1), or with
``--once`` until its client leaves (status 0). A bad option or a backend whose library is
not installed exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from ..errors import GenoutError, HandshakeTimeoutError, ModelFolderError
from ..mock.config import MockEngineConfig, MockFaults
from ..mock.engine import MockEngine
from ..mock.waves import WaveGroup
from ..text.tokenizer import Tokenizer
from .backends import BACKENDS, anyio_run_arguments, require_backend
from .engines import interruptible
from .helpformat import HelpFormatter
from .text_model import mock_model

__all__ = ["DEFAULT_PROG", "build_parser", "config_from_args", "main"]

#: The program name ``--help`` shows when run as ``anyio-genout mock-engine``.
DEFAULT_PROG = "anyio-genout mock-engine"


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Run a mock vLLM engine core speaking the real wire protocol over "
                    "ZeroMQ, with a deterministic fake model. It dials a front end's "
                    "handshake address like `vllm serve --headless` and serves clients one "
                    "after another (a real engine serves one front end per process).")
    where = parser.add_argument_group("addresses")
    where.add_argument("--handshake-address", metavar="tcp://HOST:PORT",
                       help="front end handshake ROUTER to dial (default: none; give it, or "
                            "--input-address and --output-address)")
    where.add_argument("--input-address", metavar="tcp://HOST:PORT",
                       help="bootstrapped mode: input ROUTER to dial (default: none)")
    where.add_argument("--output-address", action="append", default=[],
                       metavar="tcp://HOST:PORT",
                       help="bootstrapped mode: output PULL to dial, repeat per client "
                            "(default: none)")
    where.add_argument("--rank", type=int, default=0, metavar="N",
                       help="data-parallel rank (the engine's ZeroMQ identity)")
    model = parser.add_argument_group("model and scheduler")
    model.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                       help="requests running at once; more wait in a FIFO queue")
    model.add_argument("--step-time", type=float, default=0.0, metavar="SECONDS",
                       help="seconds per engine step (0: as fast as possible)")
    model.add_argument("--steps-per-checkpoint", type=int, default=16, metavar="N",
                       help="with --step-time 0: steps between two yields to the event loop "
                            "and input reads (nothing else runs in this process's loop)")
    model.add_argument("--max-model-len", type=int, default=4096, metavar="N",
                       help="prompt + output tokens at most (finish reason length)")
    model.add_argument("--model", metavar="DIR", default=None,
                       help="pass for the model of this folder's tokenizer (tokenizer.json, "
                            "...), as the embedded mock does: ids in its vocabulary, its EOS "
                            "token, text from the corpus shipped with anyio-genout encoded "
                            "with it, logprob alternatives with distinct readable strings "
                            "(default: none, hashed ids in --vocab-size)")
    model.add_argument("--vocab-size", type=int, default=None, metavar="N",
                       help="generated ids are below N; a prompt id >= N kills the engine, "
                            "as it kills a real one (default: the --model tokenizer's size, "
                            "else 32000)")
    model.add_argument("--eos-token-id", type=int, default=None, metavar="ID",
                       help="the fake model's end-of-sequence token (default: the --model "
                            "tokenizer's, else none: the model never emits one)")
    model.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                       help="K > 0: each step emits 1 to 1+K tokens per request")
    model.add_argument("--seed", type=int, default=0,
                       help="seed of unseeded random sampling")
    model.add_argument("--corpus-token-ids", default=None, metavar="FILE",
                       help="corpus mode: generated tokens continue this JSON list of token "
                            "ids (an encoded text) (default: none, hashed ids)")
    model.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="report cached prompt prefixes in the prefill stats")
    model.add_argument("--prefix-cache-blocks", type=int, default=None, metavar="N",
                       help="blocks the prefix cache keeps, least recently used evicted "
                            "(default: the KV cache's, enough for every sequence at full "
                            "length)")
    model.add_argument("--prefill-time-per-token", type=float, default=0.0,
                       metavar="SECONDS",
                       help="with --step-time > 0: extra seconds a step takes per admitted "
                            "prompt token not found cached (0: prefill is free)")
    model.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True,
                       help="scheduler stats and events (--no-log-stats: like "
                            "--disable-log-stats)")
    model.add_argument("--vllm-version", default="0.32.0", metavar="VERSION",
                       help="vLLM version reported in the ready response")
    model.add_argument("--output-fields", type=int, choices=(18, 19), default=18,
                       help="EngineCoreOutput layout: 18 fields (vLLM 0.32) or 19 (0.33)")
    model.add_argument("--keep-history", action=argparse.BooleanOptionalAction, default=False,
                       help="record every request (memory grows with the run)")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--ready-delay", type=float, default=0.0, metavar="SECONDS",
                        help="wait between INIT and registering (a model loading)")
    faults.add_argument("--dead-after-steps", type=int, default=None, metavar="N",
                        help="send ENGINE_CORE_DEAD after N steps and exit 1 (default: "
                             "never)")
    faults.add_argument("--silent-after-steps", type=int, default=None, metavar="N",
                        help="stop reading input and stepping after N steps, staying alive "
                             "(default: never)")
    faults.add_argument("--garbage-after-steps", type=int, default=None, metavar="N",
                        help="send one undecodable message after N steps (default: never)")
    faults.add_argument("--late-outputs-after-abort", type=int, default=0, metavar="N",
                        help="token outputs still sent for a request after its ABORT")
    faults.add_argument("--preempt-every", type=int, default=None, metavar="N",
                        help="preempt the newest running request every N steps (default: "
                             "never)")
    faults.add_argument("--abort-on-shutdown", action="store_true",
                        help="on SIGINT/SIGTERM, finish every request with ABORT first, "
                             "like a real EngineCore process")
    run = parser.add_argument_group("runtime")
    run.add_argument("--once", action="store_true",
                     help="exit (status 0) when the first client leaves, instead of serving "
                          "the next one")
    run.add_argument("--handshake-timeout", type=float, default=None, metavar="SECONDS",
                     help="exit 1 if no front end sends INIT this long after HELLO (default: "
                          "wait as long as it takes; a real engine gives up after 300)")
    run.add_argument("--dp-wave-group", type=int, default=None, metavar="N",
                     help="run N engines (ranks --rank .. --rank+N-1) in this process as one "
                          "data-parallel MoE group in lockstep waves (see docs/routing.md, "
                          "Data-parallel waves; handshake mode only; default: one engine, no "
                          "waves)")
    run.add_argument("--backend", choices=BACKENDS, default="asyncio",
                     help="event loop to run on")
    run.add_argument("--uvloop", action="store_true",
                     help="the same as --backend uvloop")
    return parser


def _corpus_file(path: str | None) -> list[int] | None:
    """The token ids of ``--corpus-token-ids``; raises :class:`ValueError` naming it."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            ids = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--corpus-token-ids: cannot read {path}: {exc}") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError(f"--corpus-token-ids: {path} is not a JSON list of token ids")
    return ids


def _model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields of ``--model`` (with ``--vocab-size`` / ``--eos-token-id``
    applied) or of those options alone; raises :class:`ValueError` naming a bad option."""
    fields: dict[str, Any] = {"vocab_size": 32000, "eos_token_id": None,
                              "corpus_token_ids": _corpus_file(args.corpus_token_ids)}
    if args.model is not None:
        if args.corpus_token_ids is not None:
            raise ValueError("--model and --corpus-token-ids exclude each other (--model "
                             "brings its corpus)")
        try:
            tokenizer = Tokenizer.from_model_dir(args.model)
        except ModelFolderError as exc:
            raise ValueError(f"--model: {exc}") from None
        fields = mock_model(tokenizer).config_fields()
        if args.vocab_size is not None and args.vocab_size != fields["vocab_size"]:
            fields.pop("alternative_token_ids")  # they are the tokenizer's
    if args.vocab_size is not None:
        fields["vocab_size"] = args.vocab_size
    if args.eos_token_id is not None:
        fields["eos_token_id"] = args.eos_token_id
    return fields


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    """The engine configuration; raises :class:`ValueError` naming a bad option."""
    return MockEngineConfig(
        rank=args.rank,
        handshake_address=args.handshake_address,
        input_address=args.input_address,
        output_addresses=tuple(args.output_address),
        max_num_seqs=args.max_num_seqs,
        step_time=args.step_time,
        steps_per_checkpoint=args.steps_per_checkpoint,
        max_model_len=args.max_model_len,
        num_speculative_tokens=args.num_speculative_tokens,
        seed=args.seed,
        **_model_fields(args),
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_blocks=args.prefix_cache_blocks,
        prefill_time_per_token=args.prefill_time_per_token,
        log_stats=args.log_stats,
        vllm_version=args.vllm_version,
        output_fields=args.output_fields,
        keep_history=args.keep_history,
        handshake_timeout=(math.inf if args.handshake_timeout is None
                           else args.handshake_timeout),
        # A process of its own may start before its front end: it waits for one as long
        # as for INIT.
        front_end_timeout=math.inf,
        until_client_leaves=True,
        faults=MockFaults(
            ready_delay=args.ready_delay,
            dead_after_steps=args.dead_after_steps,
            silent_after_steps=args.silent_after_steps,
            garbage_after_steps=args.garbage_after_steps,
            late_outputs_after_abort=args.late_outputs_after_abort,
            preempt_every=args.preempt_every,
            abort_on_shutdown=args.abort_on_shutdown,
        ),
    )


class _Say:
    """One line on stderr per event, prefixed with the program and the rank."""

    def __init__(self, prog: str, rank: int) -> None:
        self._prefix = f"{prog} (rank {rank}): "

    def __call__(self, text: str) -> None:
        print(self._prefix + text, file=sys.stderr, flush=True)


class _OnReady:
    """The ``task_status`` :meth:`MockEngine.serve` reports READY to: says so on stderr."""

    def __init__(self, say: _Say, text: str) -> None:
        self._say = say
        self._text = text

    def started(self, value: None = None) -> None:
        self._say(self._text)


async def _serve_clients(config: MockEngineConfig, *, once: bool, say: _Say) -> int:
    """Serve one client after another, each with a fresh engine (``--once``: one)."""
    if config.handshake_address is not None:
        where = f"handshake {config.handshake_address}"
        connected = f"client connected ({where})"
    else:
        where = f"input {config.input_address}"
        connected = f"registered with the front end at {where} (bootstrapped)"
    waiting = "waiting for a client"
    while True:
        say(f"{waiting} (dialing {where})")
        engine = MockEngine(config)
        await engine.serve(task_status=_OnReady(say, connected))
        if engine.dead:
            reason = engine.errors[-1] if engine.errors else "unknown"  # why it died
            say(f"engine died ({reason}): sent ENGINE_CORE_DEAD, exiting")
            return 1
        if once:
            say("client left; exiting (--once)")
            return 0
        say("client left")
        waiting = "waiting for the next client"


async def _serve_wave_groups(config: MockEngineConfig, count: int, *, once: bool,
                             say: _Say) -> int:
    """:func:`_serve_clients` for ``--dp-wave-group``: ``count`` engines in one wave group
    per client; one engine's death ends them all."""
    waiting = "waiting for a client"
    while True:
        say(f"{waiting} (dialing handshake {config.handshake_address}, a wave group of "
            f"{count} engines)")
        waves = WaveGroup()
        engines = [MockEngine(attrs.evolve(config, rank=config.rank + i), waves=waves)
                   for i in range(count)]
        async with anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(_serve_member, engine, tg.cancel_scope)
        dead = [engine for engine in engines if engine.dead]
        if dead:
            reason = dead[0].errors[-1] if dead[0].errors else "unknown"
            say(f"engine {dead[0].config.rank} died ({reason}): sent ENGINE_CORE_DEAD, "
                f"exiting")
            return 1
        if once:
            say("client left; exiting (--once)")
            return 0
        say("client left")
        waiting = "waiting for the next client"


async def _serve_member(engine: MockEngine, group_scope: anyio.CancelScope) -> None:
    await engine.serve()
    if engine.dead:
        group_scope.cancel()


async def _run(config: MockEngineConfig, once: bool, say: _Say,
               group: int | None = None) -> int:
    async with interruptible():
        if group is not None:
            return await _serve_wave_groups(config, group, once=once, say=say)
        return await _serve_clients(config, once=once, say=say)
    return 0  # SIGINT or SIGTERM


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the engine, return the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(None if argv is None else list(argv))
    if args.uvloop and args.backend == "asyncio":
        args.backend = "uvloop"
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    group: int | None = args.dp_wave_group
    if group is not None and (group < 1 or config.handshake_address is None):
        parser.error("--dp-wave-group needs N >= 1 and --handshake-address")
    require_backend(prog, args.backend)
    backend, options = anyio_run_arguments(args.backend)
    say = _Say(prog, config.rank)
    try:
        return anyio.run(_run, config, args.once, say, group, backend=backend,
                         backend_options=options)
    except KeyboardInterrupt:  # a signal before the receiver was installed
        return 0
    except HandshakeTimeoutError:
        say(f"error: no front end sent INIT within {args.handshake_timeout:g} s "
            f"(--handshake-timeout)")
        return 1
    except GenoutError as exc:
        say(f"error: {exc}")
        return 1
