"""Command line of the mock engine core (``python -m anyio_genout.mock``).

Example, dialling a front end like ``vllm serve --headless`` does::

    python -m anyio_genout.mock --handshake-address tcp://127.0.0.1:29550 --rank 0

or, bootstrapped (no handshake socket)::

    python -m anyio_genout.mock --input-address tcp://127.0.0.1:5000 \\
        --output-address tcp://127.0.0.1:5001 --rank 3

It runs until SIGINT or SIGTERM (exit status 0) or until the engine dies (status 1).
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Sequence

import anyio

from .config import MockEngineConfig, MockFaults
from .engine import MockEngine

__all__ = ["build_parser", "config_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m anyio_genout.mock",
        description="Run a mock vLLM engine core speaking the real wire protocol.",
    )
    where = parser.add_argument_group("addresses")
    where.add_argument("--handshake-address", help="front end handshake ROUTER to dial")
    where.add_argument("--input-address", help="bootstrapped mode: input ROUTER to dial")
    where.add_argument("--output-address", action="append", default=[],
                       help="bootstrapped mode: output PULL to dial (repeat per client)")
    where.add_argument("--rank", type=int, default=0, help="data-parallel rank (identity)")
    model = parser.add_argument_group("model and scheduler")
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--step-time", type=float, default=0.0,
                       help="seconds per step (0: as fast as possible)")
    model.add_argument("--steps-per-checkpoint", type=int, default=16,
                       help="with --step-time 0: steps between two yields to the event loop "
                            "and input reads (nothing else runs in this process's loop)")
    model.add_argument("--max-model-len", type=int, default=4096)
    model.add_argument("--vocab-size", type=int, default=32000)
    model.add_argument("--eos-token-id", type=int, default=None)
    model.add_argument("--num-speculative-tokens", type=int, default=0)
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True)
    model.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True,
                       help="scheduler stats and events (--no-log-stats: like "
                            "--disable-log-stats)")
    model.add_argument("--vllm-version", default="0.32.0")
    model.add_argument("--output-fields", type=int, choices=(18, 19), default=18)
    model.add_argument("--keep-history", action=argparse.BooleanOptionalAction, default=False,
                       help="record every request (memory grows with the run)")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--ready-delay", type=float, default=0.0)
    faults.add_argument("--dead-after-steps", type=int, default=None)
    faults.add_argument("--silent-after-steps", type=int, default=None)
    faults.add_argument("--garbage-after-steps", type=int, default=None)
    faults.add_argument("--late-outputs-after-abort", type=int, default=0)
    faults.add_argument("--preempt-every", type=int, default=None)
    faults.add_argument("--abort-on-shutdown", action="store_true")
    run = parser.add_argument_group("runtime")
    run.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    run.add_argument("--uvloop", action="store_true", help="asyncio backend with uvloop")
    return parser


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    return MockEngineConfig(
        rank=args.rank,
        handshake_address=args.handshake_address,
        input_address=args.input_address,
        output_addresses=tuple(args.output_address),
        max_num_seqs=args.max_num_seqs,
        step_time=args.step_time,
        steps_per_checkpoint=args.steps_per_checkpoint,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        num_speculative_tokens=args.num_speculative_tokens,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        log_stats=args.log_stats,
        vllm_version=args.vllm_version,
        output_fields=args.output_fields,
        keep_history=args.keep_history,
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


async def _run(config: MockEngineConfig) -> int:
    engine = MockEngine(config)
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(stop_on_signal)
            await engine.serve()
            tg.cancel_scope.cancel()  # the engine died: stop watching signals
    return 1 if engine.dead else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the engine, return the exit status."""
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    backend_options = {"use_uvloop": True} if args.uvloop and args.backend == "asyncio" else {}
    try:
        return anyio.run(_run, config, backend=args.backend, backend_options=backend_options)
    except KeyboardInterrupt:  # a signal before the receiver was installed
        return 0
