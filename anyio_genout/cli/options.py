"""Command-line options shared by the subcommands, and their translation to configs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError
from ..protocol import SamplingParams

__all__ = ["add_engine_options", "add_sampling_options", "parse_token_ids",
           "sampling_from_args", "sampling_from_mapping"]


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "engines", "with none of these, an embedded mock engine is started in-process")
    group.add_argument("--handshake-address", metavar="tcp://HOST:PORT",
                       help="serve real vLLM engines that dial this address "
                            "(`vllm serve ... --headless --data-parallel-address HOST "
                            "--data-parallel-rpc-port PORT`)")
    group.add_argument("--engine-count", type=int, default=1, metavar="N",
                       help="number of engines (data-parallel ranks) to wait for")
    group.add_argument("--advertised-host", default="127.0.0.1", metavar="HOST",
                       help="address engines use to reach this client's sockets")
    group.add_argument("--vllm-model", metavar="PATH",
                       help="start `vllm serve PATH --headless` engines as child processes")
    group.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for managed vLLM engines (repeatable)")
    group.add_argument("--vllm-command", metavar="CMD",
                       help="command that runs vLLM's CLI for --vllm-model, e.g. 'vllm' or "
                            "'/venv/bin/python -m anyio_genout.vllm.cli' (default: this "
                            "Python with -m anyio_genout.vllm.cli)")
    group.add_argument("--ready-timeout", type=float, default=600.0, metavar="SECONDS")
    group.add_argument("--mock-engines", type=int, default=1, metavar="N",
                       help="embedded mock engines to start (default 1)")
    group.add_argument("--mock-step-time", type=float, default=0.002, metavar="SECONDS",
                       help="embedded mock engine step time")
    group.add_argument("--model-name", default="anyio-genout",
                       help="model_name label of the metrics")
    group.add_argument("--vocab-size", type=int, metavar="N",
                       help="refuse token ids >= N before they reach an engine")
    group.add_argument("--eos-token-id", type=int, metavar="ID",
                       help="end-of-sequence token for requests that name none")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio",
                        help="event loop to run on")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop-token-ids", type=parse_token_ids, default=[], metavar="IDS")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


_SAMPLING_KEYS = frozenset(f.name for f in SamplingParams.__attrs_attrs__)


def sampling_from_mapping(value: object) -> SamplingParams:
    """SamplingParams from a JSON object; unknown keys are an error naming them."""
    if value is None:
        return SamplingParams()
    if not isinstance(value, Mapping):
        raise InvalidRequestError("sampling_params", "must be a JSON object")
    unknown = sorted(set(value) - _SAMPLING_KEYS)
    if unknown:
        raise InvalidRequestError("sampling_params", f"unknown key(s) {', '.join(unknown)}")
    try:
        params = SamplingParams(**value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError("sampling_params", str(exc)) from None
    params.validate()
    return params


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
