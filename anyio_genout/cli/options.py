"""Command-line options shared by the subcommands, and their translation to configs."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from typing import Any, Final

from ..engine import EngineCoreClientConfig, HandshakeTransport
from ..errors import InvalidRequestError
from ..protocol import SamplingParams

__all__ = ["add_engine_options", "add_sampling_options", "check_address",
           "non_negative_float",
           "parse_token_ids", "positive_float", "positive_int", "sampling_from_args",
           "sampling_from_mapping", "seconds_or_off"]


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def check_address(text: str) -> str:
    """A ZeroMQ address engines can dial: ``tcp://HOST:PORT`` or ``ipc://PATH``.

    The check is :class:`HandshakeTransport`'s own; raises
    :class:`argparse.ArgumentTypeError` (a one-line usage error) with its message, which
    names the problem and shows the expected form.
    """
    try:
        HandshakeTransport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("address ")) from None
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def seconds_or_off(text: str) -> float | None:
    """A positive number of seconds, or ``off`` / ``0`` (None: switched off)."""
    if text.strip().lower() in ("off", "0", "0.0", "none"):
        return None
    return positive_float(text)


#: The engine-core client's defaults (the CLI never restates them).
_DEFAULTS: Final = EngineCoreClientConfig()


def _off(value: object) -> object:
    return "off" if value is None else value


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "engines", "without --handshake-address or --vllm-model: embedded mock engines")
    group.add_argument("--handshake-address", metavar="tcp://HOST:PORT", type=check_address,
                       help="serve real vLLM engines that dial this address "
                            "(`vllm serve ... --headless --data-parallel-address HOST "
                            "--data-parallel-rpc-port PORT`); ipc://PATH works too "
                            "(default: none, an embedded mock engine)")
    group.add_argument("--data-parallel-size", "--engine-count", dest="engine_count",
                       type=positive_int, default=1, metavar="N",
                       help="number of engines (data-parallel ranks) to wait for or start "
                            "(default: %(default)s)")
    group.add_argument("--advertised-host", default="127.0.0.1", metavar="HOST",
                       help="address engines use to reach this client's sockets "
                            "(default: %(default)s)")
    group.add_argument("--vllm-model", metavar="PATH",
                       help="start `vllm serve PATH --headless` engines as child processes "
                            "(default: none)")
    group.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for managed vLLM engines (repeatable; "
                            "default: none)")
    group.add_argument("--vllm-command", metavar="CMD",
                       help="command that runs vLLM's CLI for --vllm-model, e.g. 'vllm' or "
                            "'/venv/bin/python -m anyio_genout.vllm.cli' (default: this "
                            "Python with -m anyio_genout.vllm.cli)")
    group.add_argument("--ready-timeout", type=positive_float,
                       default=_DEFAULTS.ready_timeout, metavar="SECONDS",
                       help="give up if the engines are not all ready by then (a real engine "
                            "loads its model first) (default: %(default)s)")
    group.add_argument("--liveness-interval", type=seconds_or_off,
                       default=_DEFAULTS.health.liveness_interval, metavar="SECONDS",
                       help="ping every engine this often to notice one that died without a "
                            "word; 'off' disables (default: "
                            f"{_off(_DEFAULTS.health.liveness_interval)})")
    group.add_argument("--liveness-timeout", type=positive_float,
                       default=_DEFAULTS.health.liveness_timeout, metavar="SECONDS",
                       help="an engine that does not answer a ping within this is dead "
                            "(default: %(default)s)")
    group.add_argument("--mock-engines", type=positive_int, default=1, metavar="N",
                       help="embedded mock engines to start (default: %(default)s)")
    group.add_argument("--mock-step-time", type=non_negative_float, default=0.002,
                       metavar="SECONDS",
                       help="embedded mock engine step time (default: %(default)s)")
    group.add_argument("--model-name", metavar="NAME",
                       help="model_name label of the metrics (default: the served model "
                            "name: --served-model-name, --model, --vllm-model, else "
                            "anyio-genout)")
    group.add_argument("--vocab-size", type=positive_int, metavar="N",
                       help="refuse token ids >= N before they reach an engine (default: "
                            "the embedded mock's vocabulary, the --vllm-model's config, "
                            "else no check)")
    group.add_argument("--eos-token-id", type=int, metavar="ID",
                       help="end-of-sequence token for requests that name none (default: "
                            "the --vllm-model's config, else none)")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio",
                        help="event loop to run on (default: %(default)s)")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and debug logs (default: off)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                       help="tokens to generate at most; more than the model's context "
                            "leaves after the prompt is refused (default: %(default)s)")
    group.add_argument("--min-tokens", type=int, default=0, metavar="N",
                       help="tokens to generate before EOS or a stop token may end the "
                            "generation (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="nucleus sampling probability mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0,
                       help="sample from the K most likely tokens; 0 means all "
                            "(default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than MIN_P times the most likely one "
                            "(default: %(default)s)")
    group.add_argument("--seed", type=int,
                       help="seed of this request's random sampling (default: none)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="penalty on tokens already present (default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="penalty proportional to a token's count so far "
                            "(default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="multiplicative penalty on repeated tokens; 1 is none "
                            "(default: %(default)s)")
    group.add_argument("--stop-token-ids", type=parse_token_ids, default=[], metavar="IDS",
                       help="comma-separated token ids that end the generation "
                            "(default: none)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token (default: off)")
    group.add_argument("--logprobs", type=int, metavar="N",
                       help="print each generated token's logprob and rank and the N most "
                            "likely tokens at its position: stdout then has one line per "
                            "token, tab-separated: TOKEN LOGPROB RANK ID:LOGPROB... "
                            "(default: none, token ids only)")


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
