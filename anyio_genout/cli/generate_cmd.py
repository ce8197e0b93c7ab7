"""``anyio-genout generate``: stream one generation to stdout (text, or token ids)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import UsageError
from ..generate import FinishReason, GenerateOutput, GenerateRequest, GenerateStream
from ..protocol import SamplingParams
from ..text.client import TextClient
from ..text.output import TextOutput
from ..text.request import TextRequest
from .engines import ClientSession, interruptible
from .options import (
    add_engine_options,
    add_sampling_options,
    parse_token_ids,
    sampling_from_args,
)
from .text_model import add_model_option, add_text_options, load_tokenizer

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text (or tokens) for one prompt and stream it to stdout",
        description="Generate for one prompt, streaming the text to stdout as it arrives "
                    "(--prompt, --chat; or --prompt-token-ids with --model), or the token ids "
                    "(--prompt-token-ids alone: space-separated; one line per token with "
                    "--logprobs), then print a summary (to stderr). With no engine option an "
                    "embedded mock engine is used, with the small tokenizer shipped with "
                    "anyio-genout for text. Exit codes: 0 done, 1 an engine or connection "
                    "failed, 2 a usage error or a request the engine would refuse, "
                    "130 interrupted.")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="the prompt, as text (one of --prompt, --chat and "
                             "--prompt-token-ids is required; default: none)")
    prompt.add_argument("--chat", action="append", metavar="MESSAGE",
                        help="a chat message, put through the model's chat template; repeat "
                             "it for a conversation: the messages alternate user, assistant, "
                             "user, ... (default: none)")
    prompt.add_argument("--prompt-token-ids", type=parse_token_ids, metavar="IDS",
                        help="comma-separated prompt token ids, e.g. 1,2,3; stdout shows the "
                             "token ids, or the text with --model (default: none)")
    parser.add_argument("--system", metavar="TEXT",
                        help="a system message before the --chat messages (default: none)")
    parser.add_argument("--request-id", default="cli", metavar="ID",
                        help="request id (the engine sees it with a random suffix) "
                             "(default: %(default)s)")
    add_model_option(parser)
    add_sampling_options(parser)
    add_text_options(parser)
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


def _text_logprob_lines(out: TextOutput) -> str:
    """As :func:`_logprob_lines`, with the token's text (a JSON string) as a fifth column."""
    rows = out.logprobs or []
    lines = []
    for i, token in enumerate(out.token_ids):
        if i >= len(rows):
            lines.append(f"{token}\n")
            continue
        sampled, *top = rows[i]
        alternatives = " ".join(f"{entry.token_id}:{entry.logprob:.4f}" for entry in top)
        lines.append(f"{token}\t{sampled.logprob:.4f}\t{sampled.rank}\t{alternatives}\t"
                     f"{json.dumps(sampled.token, ensure_ascii=False)}\n")
    return "".join(lines)


def _text_mode(args: argparse.Namespace) -> bool:
    return args.prompt is not None or args.chat is not None or args.model is not None


def _check_args(args: argparse.Namespace) -> None:
    """Text options need text; raises :class:`UsageError` naming the option."""
    if args.system is not None and args.chat is None:
        raise UsageError("--system goes with --chat")
    if not _text_mode(args):
        for option, given in (("--stop", args.stop),
                              ("--include-stop-str-in-output", args.include_stop_str_in_output),
                              ("--no-skip-special-tokens", not args.skip_special_tokens)):
            if given:
                raise UsageError(f"{option} works on text: give --prompt or --chat, or "
                                 "--model DIR with --prompt-token-ids")


def _messages(args: argparse.Namespace) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    roles = ("user", "assistant")
    messages += [{"role": roles[i % 2], "content": text} for i, text in enumerate(args.chat)]
    return messages


def _text_request(args: argparse.Namespace, params: SamplingParams) -> TextRequest:
    return TextRequest(
        request_id=args.request_id, prompt=args.prompt,
        messages=_messages(args) if args.chat is not None else None,
        prompt_token_ids=args.prompt_token_ids, sampling_params=params, stop=tuple(args.stop),
        include_stop_str_in_output=args.include_stop_str_in_output,
        skip_special_tokens=args.skip_special_tokens)


class _Progress:
    """What the summary line reports."""

    def __init__(self) -> None:
        self.start = time.time()
        self.first: float | None = None
        self.count = 0
        self.prompt_len = 0
        self.finish: FinishReason | None = None

    def tokens(self, count: int) -> None:
        if count and self.first is None:
            self.first = time.time()
        self.count += count


async def run(args: argparse.Namespace) -> int:
    _check_args(args)
    params = sampling_from_args(args)
    progress = _Progress()
    text = _text_mode(args)
    tokenizer = load_tokenizer(args, required=True) if text else None
    async with interruptible() as interrupted, \
            ClientSession(args, tokenizer=tokenizer) as client:
        if tokenizer is None:
            request = GenerateRequest(request_id=args.request_id,
                                      prompt_token_ids=args.prompt_token_ids,
                                      sampling_params=params)
            progress.prompt_len = len(request.prompt_token_ids)
            progress.start = time.time()
            await _stream_tokens(client.generate(request), args, progress)
        else:
            if args.eos_token_id is not None:
                params = params.with_eos_token_id(args.eos_token_id)
            try:
                text_client = TextClient(client, tokenizer)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            await _generate_text(text_client, _text_request(args, params), args, progress)
    end = time.time()
    count, first, start = progress.count, progress.first, progress.start
    if interrupted:
        print(f"anyio-genout: interrupted after {count} token(s)", file=sys.stderr)
        return 130
    ttft = (first - start) if first is not None else float("nan")
    rate = count / (end - first) if first is not None and end > first else float("nan")
    print(f"finish_reason={progress.finish} prompt_tokens={progress.prompt_len} "
          f"output_tokens={count} ttft={ttft * 1000:.1f}ms tokens/s={rate:.1f} "
          f"total={(end - start) * 1000:.1f}ms", file=sys.stderr)
    return 0


async def _stream_tokens(scope: GenerateStream, args: argparse.Namespace,
                         progress: _Progress) -> None:
    """Token ids mode: the ids to stdout as they come (as the command always did)."""
    with_logprobs = args.logprobs is not None
    try:
        async with scope as stream:
            async for out in stream:
                if out.token_ids:
                    progress.tokens(len(out.token_ids))
                    sys.stdout.write(_logprob_lines(out) if with_logprobs else
                                     " ".join(map(str, out.token_ids)) + " ")
                    sys.stdout.flush()
                progress.finish = out.finish_reason
    finally:
        if progress.count and not with_logprobs:
            sys.stdout.write("\n")  # the tokens' line ends, whatever ended the stream
            sys.stdout.flush()


async def _generate_text(text_client: TextClient, request: TextRequest,
                         args: argparse.Namespace, progress: _Progress) -> None:
    """Text mode: the text to stdout as it comes (one line per token with --logprobs)."""
    # Encoded as entering the stream encodes it (off the event loop, the context's bound
    # first), for the prompt's length in the summary. max_tokens is checked by the engine
    # client as for every request (the one rule, protocol.validation.resolve_max_tokens),
    # before anything is sent.
    _, ids = await text_client.encode(request)
    progress.prompt_len = len(ids)
    with_logprobs = args.logprobs is not None
    written = ""
    progress.start = time.time()
    try:
        async with text_client.generate(request) as stream:
            async for out in stream:
                progress.tokens(len(out.token_ids))
                chunk = _text_logprob_lines(out) if with_logprobs else out.text
                if chunk:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                    written = chunk
                progress.finish = out.finish_reason
    finally:
        if written and not written.endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()  # before the summary on stderr
