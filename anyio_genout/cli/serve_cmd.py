"""``anyio-genout serve``: the OpenAI-compatible HTTP server (uvicorn or Hypercorn, asyncio
or trio)."""

from __future__ import annotations

import argparse
import contextlib
import os

from ..errors import UsageError
from .backends import extra_message, importable
from .http_server import HTTP_SERVERS, choose_http_server
from .options import add_engine_options
from .serve_http import http_url, listen, listen_unix, serve
from .serve_vllm import add_http_options, check_vllm_args, serve_tokenizer
from .text_model import add_model_option

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI HTTP API (completions, chat completions, ...)",
        description="Serve an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /ping, /version, /metrics, "
                    "/tokenize, /detokenize) in front of the engines, with uvicorn on asyncio "
                    "or Hypercorn on trio. With no engine option an embedded mock engine "
                    "continues the text shipped with anyio-genout. Needs the server extra "
                    "(pip install 'anyio-genout[server]'). Runs until SIGINT (exit 130) or "
                    "SIGTERM (a drain, see --shutdown-timeout; exit 0), or until no engine "
                    "is left (exit 1). A `vllm serve` line works with `vllm` replaced: "
                    "vLLM's engine flags (--gpu-memory-utilization, ...) go to the engines "
                    "it starts (MODEL or --vllm-model), else they are refused "
                    "(docs/server.md \"Coming from vllm serve\").")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="as `vllm serve MODEL`: the model folder; it gives the "
                             "tokenizer (--model) and the served name, and without "
                             "--data-parallel-address or --handshake-address it is also "
                             "--vllm-model (managed engines run it) (default: none)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on the routes of "
                             "--api-key-scope, checked before the body is read (default: "
                             "the VLLM_API_KEY environment variable if set, as vLLM does; "
                             "else none)")
    parser.add_argument("--api-key-scope", choices=("v1", "all"), default="v1",
                        help="what the key guards: 'v1', vLLM's scope (/v1/...; /metrics, "
                             "/tokenize, /detokenize and /health open), or 'all' (every "
                             "route but /health, /ping and /version) (default: %(default)s)")
    parser.add_argument("--api-server-count", "--workers", dest="workers", type=int,
                        default=1, metavar="N",
                        help="server processes sharing the listening socket and the engines "
                             "(each engine gets one input and one output address per "
                             "process, as with vLLM's --api-server-count; default: "
                             "%(default)s)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model name clients send and /v1/models lists (default: "
                             "the --model or --vllm-model argument, else --model-name)")
    parser.add_argument("--http-server", choices=HTTP_SERVERS, default=None,
                        help="the HTTP server under the app: builtin (ours, on httptools; "
                             "every backend), uvicorn (with httptools; asyncio and uvloop "
                             "only) or Hypercorn (default: uvicorn, builtin with --backend "
                             "trio)")
    add_http_options(parser)
    limits = parser.add_argument_group("limits (hostile clients)")
    limits.add_argument("--max-body-size", type=int, default=1 << 20, metavar="BYTES",
                        help="largest request body; a larger one is 413 (default: "
                             "%(default)s, 1 MiB)")
    limits.add_argument("--max-n", type=int, default=16, metavar="N",
                        help="largest n (choices per request); a larger one is 400 "
                             "(default: %(default)s)")
    limits.add_argument("--max-concurrent-requests", type=int, metavar="N",
                        help="completions and chat completions served at once; one more "
                             "is 429 (default: no limit)")
    limits.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="a connection must send a request's head (at most 16 KiB) "
                             "within this long of its start or of its previous response's "
                             "end (slow-loris), and an idle one is closed after it "
                             "(default: %(default)s)")
    limits.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a request body must arrive whole within this long of its "
                             "request's start; else 408 (slow-loris bodies; default: "
                             "%(default)s)")
    limits.add_argument("--read-timeout", type=int, metavar="SECONDS",
                        help="close a connection that sends nothing for this long, even "
                             "while its response streams (not with --http-server uvicorn; "
                             "default: none; set it above your longest response)")
    lifecycle = parser.add_argument_group("shutdown and engines that die")
    lifecycle.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                           help="on SIGTERM, stop accepting connections (/health 503) and let "
                                "open requests finish for up to this long, then abort the "
                                "rest and exit 0; SIGINT aborts at once (default: "
                                "%(default)s, vLLM's: abort at once)")
    lifecycle.add_argument("--engine-rejoin-timeout", type=float, default=None,
                           metavar="SECONDS",
                           help="when every engine has died, keep answering 503 and wait this "
                                "long for a restarted engine to rejoin, then exit 1 naming "
                                "the dead engines (0: exit at once, as vLLM does; default: "
                                "--ready-timeout with --handshake-address, whose engines "
                                "something else restarts, else 0)")
    limits.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a chat template a request brings (chat_template, or "
                             "chat_template_kwargs.chat_template), as vLLM's flag; without "
                             "it such a request is 400 (a template is a program: "
                             "CVE-2025-61620)")
    add_model_option(parser)
    add_engine_options(parser)
    parser.set_defaults(command=run)


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad options before anything starts, and resolve vLLM's spellings (the
    positional model, the data-parallel address); raises :class:`UsageError`."""
    check_vllm_args(args)
    needs = {"builtin": ("fastapi", "httptools"),
             "uvicorn": ("fastapi", "uvicorn", "httptools"),
             "hypercorn": ("fastapi", "hypercorn")}[choose_http_server(args)]
    if not all(map(importable, needs)):
        raise UsageError(extra_message("anyio-genout serve", "server"))
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    if args.api_key == "":
        raise UsageError("--api-key must not be empty")
    for option in ("max_body_size", "max_n", "max_concurrent_requests", "read_timeout",
                   "workers"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    for option in ("shutdown_timeout", "engine_rejoin_timeout"):
        value = getattr(args, option)
        if value is not None and not value >= 0:
            raise UsageError(f"--{option.replace('_', '-')} must be 0 or more, got {value}")
    for option in ("keep_alive_timeout", "body_timeout"):
        if not getattr(args, option) > 0:
            raise UsageError(f"--{option.replace('_', '-')} must be positive, got "
                             f"{getattr(args, option)}")


async def run(args: argparse.Namespace) -> int:
    check_serve_args(args)
    if args.api_key is None:  # as vLLM: --api-key first, else a non-empty VLLM_API_KEY
        args.api_key = os.environ.get("VLLM_API_KEY") or None
    tokenizer = serve_tokenizer(args)
    if args.workers > 1:
        from .serve_workers import supervise  # imports the engine handshake only if used

        return await supervise(args, tokenizer)
    if args.uds is not None:
        sock = listen_unix(args.uds)
        try:
            return await serve(args, tokenizer, sock.detach(), announce=f"unix:{args.uds}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.uds)
    sock = listen(args.host, args.port)
    url = http_url(sock, tls=args.ssl_certfile is not None)
    return await serve(args, tokenizer, sock.detach(), announce=url)  # Hypercorn owns it


