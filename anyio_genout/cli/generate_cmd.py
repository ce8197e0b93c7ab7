"""``anyio-genout generate``: stream one generation to stdout."""

from __future__ import annotations

import argparse
import sys
import time

from ..generate import GenerateOutput, GenerateRequest
from .engines import ClientSession, interruptible
from .options import (
    add_engine_options,
    add_sampling_options,
    check_max_tokens,
    parse_token_ids,
    sampling_from_args,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate tokens for one prompt and stream them to stdout",
        description="Generate tokens for one prompt, streaming token ids to stdout as they "
                    "arrive (space-separated; one line per token with --logprobs), then print "
                    "a summary (to stderr). With no engine option an embedded mock engine is "
                    "used. Exit codes: 0 done, 1 an engine or connection failed, 2 a usage "
                    "error or a request the engine would refuse, 130 interrupted.")
    parser.add_argument("--prompt-token-ids", type=parse_token_ids, required=True,
                        metavar="IDS", help="comma-separated prompt token ids, e.g. 1,2,3 "
                                            "(required)")
    parser.add_argument("--request-id", default="cli", metavar="ID",
                        help="request id (the engine sees it with a random suffix) "
                             "(default: %(default)s)")
    add_sampling_options(parser)
    add_engine_options(parser)
    parser.set_defaults(command=run)


def _logprob_lines(out: GenerateOutput) -> str:
    """One line per new token: TOKEN LOGPROB RANK ID:LOGPROB... (tab-separated)."""
    positions = out.logprobs.positions if out.logprobs is not None else []
    lines = []
    for i, token in enumerate(out.token_ids):
        if i >= len(positions):
            lines.append(f"{token}\n")
            continue
        sampled, *top = positions[i]
        alternatives = " ".join(f"{entry.token_id}:{entry.logprob:.4f}" for entry in top)
        lines.append(f"{token}\t{sampled.logprob:.4f}\t{sampled.rank}\t{alternatives}\n")
    return "".join(lines)


async def run(args: argparse.Namespace) -> int:
    request = GenerateRequest(request_id=args.request_id,
                              prompt_token_ids=args.prompt_token_ids,
                              sampling_params=sampling_from_args(args))
    with_logprobs = args.logprobs is not None
    start = time.time()
    first: float | None = None
    count = 0
    finish = None
    async with interruptible() as interrupted, ClientSession(args) as client:
        check_max_tokens(len(request.prompt_token_ids), request.sampling_params.max_tokens,
                         client.engine.max_model_len)
        start = time.time()
        try:
            async with client.generate(request) as stream:
                async for out in stream:
                    if out.token_ids:
                        if first is None:
                            first = time.time()
                        count += len(out.token_ids)
                        sys.stdout.write(_logprob_lines(out) if with_logprobs else
                                         " ".join(map(str, out.token_ids)) + " ")
                        sys.stdout.flush()
                    finish = out.finish_reason
        finally:
            if count and not with_logprobs:
                sys.stdout.write("\n")  # the tokens' line ends, whatever ended the stream
    end = time.time()
    if interrupted:
        print(f"anyio-genout: interrupted after {count} token(s)", file=sys.stderr)
        return 130
    ttft = (first - start) if first is not None else float("nan")
    rate = count / (end - first) if first is not None and end > first else float("nan")
    print(f"finish_reason={finish} prompt_tokens={len(request.prompt_token_ids)} "
          f"output_tokens={count} ttft={ttft * 1000:.1f}ms tokens/s={rate:.1f} "
          f"total={(end - start) * 1000:.1f}ms", file=sys.stderr)
    return 0
