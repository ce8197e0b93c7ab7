"""``anyio-genout serve``'s spellings of ``vllm serve``'s front-end flags, and the engine
flags it passes on or refuses (docs/server.md "Coming from vllm serve").

Every flag is honoured or refused, never accepted and ignored: the parsers' flags
(``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``) choose
how chat outputs are read (an unknown name is exit 2, listing the known ones); an engine
flag (:mod:`.vllm_flags`) goes to the engines this server starts, else it is refused.
"""

from __future__ import annotations

import argparse
import codecs
import json
import ssl

import attrs

from ..errors import InvalidRequestError, UsageError
from ..parsers import reasoning_parser_class, tool_parser
from ..parsers.registry import REASONING_PARSERS, TOOL_PARSERS
from ..text.model_dir import read_model_files
from ..text.tokenizer import Tokenizer
from .options import check_address
from .text_model import load_tokenizer, tokenizer_folder

__all__ = ["DEFAULT_RPC_PORT", "FINGERPRINT_MODES", "add_fingerprint_options",
           "add_http_options", "add_tool_options", "check_fingerprint_args", "check_tool_args",
           "check_vllm_args", "serve_tokenizer"]

#: vLLM's ``--data-parallel-rpc-port`` default.
DEFAULT_RPC_PORT = 29550
#: vLLM's ``--fingerprint-mode`` choices (``anyio_genout.server.fingerprint``'s, spelled
#: here so that parsing the flags needs no server extra).
FINGERPRINT_MODES = ("full", "hash", "custom", "none")



def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a JSON list of strings as vLLM takes it, e.g. '[\"*\"]', got {text!r}"
        ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_http_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's front-end flags (as `vllm serve` takes them)")
    group.add_argument("--data-parallel-address", metavar="HOST",
                       help="serve engines that dial HOST:--data-parallel-rpc-port (`vllm "
                            "serve MODEL --headless --data-parallel-address HOST ...`); "
                            "the same as --handshake-address tcp://HOST:PORT (default: none)")
    group.add_argument("--data-parallel-rpc-port", type=int, metavar="PORT",
                       help="with --data-parallel-address, the port engines dial "
                            f"(default: {DEFAULT_RPC_PORT}, vLLM's)")
    group.add_argument("--uds", metavar="PATH",
                       help="listen on this Unix domain socket instead of --host/--port "
                            "(default: none)")
    group.add_argument("--ssl-keyfile", metavar="FILE",
                       help="serve HTTPS with this private key (with --ssl-certfile; "
                            "default: none, HTTP)")
    group.add_argument("--ssl-certfile", metavar="FILE",
                       help="serve HTTPS with this certificate chain (with --ssl-keyfile; "
                            "default: none, HTTP)")
    group.add_argument("--allowed-origins", type=_json_list, default=[], metavar="JSON",
                       help="CORS: origins allowed, a JSON list (default: [], no "
                            "cross-origin access)")
    group.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                       help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    group.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                       help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (default: off)")
    group.add_argument("--root-path", metavar="PATH",
                       help="the ASGI root_path behind a path-based proxy: routes answer "
                            "with and without the prefix (default: none)")
    group.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                       help="the chat template for every request, instead of the model "
                            "folder's: a file, or the template inline, as vLLM takes it "
                            "(default: the folder's)")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="the tokenizer folder this server tokenizes with, as vLLM's "
                            "front end does (the same as --model DIR); passed on to engines "
                            "this server starts (default: --model's)")
    group.add_argument("--max-logprobs", type=int, metavar="N",
                       help="most logprobs (and prompt_logprobs) a request may ask; more is "
                            "400; -1: the vocabulary; passed on to engines this server "
                            "starts (default: 20, vLLM's)")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="where a request's unset sampling fields (temperature, top_p, "
                            "top_k, min_p, the penalties; max_tokens from max_new_tokens) "
                            "take their defaults, as vLLM's: the model folder's "
                            "generation_config.json (auto), none (vllm), or DIR's "
                            "(default: %(default)s)")
    group.add_argument("--override-generation-config", metavar="JSON",
                       help="a JSON object laid over the generation config, as vLLM's "
                            "(e.g. '{\"temperature\": 0.5}'; default: none)")
    group.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="a streamed chunk holds at least N tokens (the first tokens and "
                            "the end go at once), or a request's stream_interval if larger, "
                            "as vLLM's (default: %(default)s, every token as it comes)")
    add_fingerprint_options(parser)
    add_tool_options(parser)


def add_fingerprint_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--fingerprint-mode`` and ``--fingerprint-value`` (``serve`` and ``run``, as
    ``vllm serve`` and ``vllm run-batch`` take them)."""
    group = parser.add_argument_group("system_fingerprint (responses)")
    group.add_argument("--fingerprint-mode", choices=FINGERPRINT_MODES, default="full",
                       help="the system_fingerprint responses carry: 'full' "
                            "anyio-genout-<version>[-dpN]-<hash8> (hash8: of the served "
                            "model name and folder, max_model_len, vocabulary size and "
                            "engine count; vLLM's hashes its engine config, which a front "
                            "end never gets), 'hash' without -dpN, 'custom' "
                            "--fingerprint-value, 'none' no fingerprint (default: "
                            "%(default)s, as vLLM's)")
    group.add_argument("--fingerprint-value", metavar="TEXT",
                       help="the fingerprint with --fingerprint-mode custom (needed then, "
                            "refused otherwise; default: none)")


def add_tool_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``
    (``serve`` and ``run``, as ``vllm serve`` and ``vllm run-batch`` take them)."""
    tools = parser.add_argument_group("tool calls and reasoning (chat completions)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice='auto' (and tools without a tool_choice) "
                            "with --tool-call-parser; without it such a request is 400, as "
                            "in vLLM (default: off)")
    tools.add_argument("--tool-call-parser", metavar="NAME",
                       help="the tool-call format the model writes, vLLM's names: "
                            f"{', '.join(TOOL_PARSERS)}, or a plugin's (default: none)")
    tools.add_argument("--reasoning-parser", metavar="NAME",
                       help="split <think> reasoning into message.reasoning, vLLM's names: "
                            f"{', '.join(REASONING_PARSERS)}, or a plugin's (default: "
                            "none)")


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse what this server does not do, and resolve vLLM's spellings into its own.

    Raises :class:`UsageError` (exit 2, one line): an unknown parser name; a
    ``--fingerprint-value`` without ``--fingerprint-mode custom`` or that without it; an
    engine flag without engines this server starts; ``--data-parallel-address`` with
    ``--handshake-address``; an SSL file alone or unreadable; ``--uds`` with several
    server processes.
    """
    check_tool_args(args)
    check_fingerprint_args(args)
    if args.data_parallel_address is not None or args.data_parallel_rpc_port is not None:
        if args.handshake_address is not None:
            raise UsageError("give --data-parallel-address/--data-parallel-rpc-port or "
                             "--handshake-address, not both")
        host = args.data_parallel_address or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        port = args.data_parallel_rpc_port or DEFAULT_RPC_PORT
        try:
            args.handshake_address = check_address(f"tcp://{host}:{port}")
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--data-parallel-address/--data-parallel-rpc-port: {exc}") \
                from None
    if args.tokenizer is not None:
        # vLLM's front end tokenizes with --tokenizer: so does this one (its --model)
        if args.model is not None and args.model != args.tokenizer:
            raise UsageError(f"--tokenizer {args.tokenizer!r} and --model {args.model!r} both "
                             "name the tokenizer folder: give one")
        args.model = args.tokenizer
    if args.model_tag is not None:
        args.model = args.model or args.model_tag
        if args.handshake_address is None and not args.vllm_model:
            args.vllm_model = args.model_tag  # `vllm serve MODEL`: the engines run it
    engine_flags: list[str] = getattr(args, "engine_flags", [])
    if engine_flags and not args.vllm_model:
        flag = engine_flags[0].split("=", 1)[0]
        raise UsageError(f"{flag} concerns the engine: give it to the engine (`vllm serve "
                         f"MODEL --headless {flag} ...`); anyio-genout serve passes engine "
                         "flags on only to engines it starts (MODEL or --vllm-model)")
    if args.max_logprobs is not None:
        if args.max_logprobs < -1:
            raise UsageError(f"--max-logprobs must be -1 or more, got {args.max_logprobs}")
        if args.vllm_model:
            engine_flags = [*engine_flags, f"--max-logprobs={args.max_logprobs}"]
    if args.tokenizer is not None and args.vllm_model:  # vLLM's engines get it too
        engine_flags = [*engine_flags, f"--tokenizer={args.tokenizer}"]
    if args.stream_interval < 1:
        raise UsageError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if isinstance(args.override_generation_config, str):
        try:
            override = json.loads(args.override_generation_config)
        except ValueError:
            override = None
        if not isinstance(override, dict):
            raise UsageError("--override-generation-config must be a JSON object, got "
                             f"{args.override_generation_config!r}")
        args.override_generation_config = override
    if args.reasoning_parser in REASONING_PARSERS and args.vllm_model:
        # vLLM's own flag too: the engine's structured outputs wait for the reasoning's end
        engine_flags = [*engine_flags, f"--reasoning-parser={args.reasoning_parser}"]
    args.vllm_arg = [*args.vllm_arg, *engine_flags]
    args.engine_flags = []
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together: give both")
    if args.ssl_certfile is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--ssl-certfile/--ssl-keyfile: cannot load them: {exc}") \
                from None
    if args.chat_template is not None:  # read once here: the workers get the text
        args.chat_template = _chat_template(args.chat_template)
    if args.uds is not None and args.workers > 1:
        raise UsageError("--uds with --api-server-count above 1 is not supported yet")


def check_tool_args(args: argparse.Namespace) -> None:
    """Refuse an unknown parser name (one line listing the known ones), and
    ``--enable-auto-tool-choice`` without ``--tool-call-parser`` (as vLLM does)."""
    try:
        if args.tool_call_parser is not None:
            tool_parser(args.tool_call_parser)
        if args.reasoning_parser is not None:
            reasoning_parser_class(args.reasoning_parser)
    except InvalidRequestError as exc:
        flag = "--" + (exc.field or "tool_call_parser").replace("_", "-")
        raise UsageError(f"{flag}: {exc.message}") from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice requires --tool-call-parser")


def check_fingerprint_args(args: argparse.Namespace) -> None:
    """Refuse ``--fingerprint-mode custom`` without ``--fingerprint-value``, and a value
    with another mode (vLLM sends no fingerprint for the first and ignores the second)."""
    if args.fingerprint_mode == "custom" and args.fingerprint_value is None:
        raise UsageError("--fingerprint-mode custom needs --fingerprint-value (the "
                         "system_fingerprint responses carry)")
    if args.fingerprint_mode != "custom" and args.fingerprint_value is not None:
        raise UsageError(f"--fingerprint-value is used only with --fingerprint-mode custom "
                         f"(the mode is {args.fingerprint_mode})")


def _chat_template(value: str) -> str:
    """``--chat-template``'s text, resolved as vLLM's ``load_chat_template``: a file if it
    opens, else the template inline (its escapes decoded) if it has ``{``, ``}`` or a new
    line; else :class:`UsageError` (a path that does not open)."""
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in value for c in "{}\n"):
            raise UsageError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read: {exc}") from None
    return codecs.decode(value, "unicode_escape")


def serve_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer ``serve`` uses: the folder's, with ``--chat-template`` (resolved by
    :func:`check_vllm_args`) as its one template. Raises what :func:`load_tokenizer`
    raises."""
    tokenizer = load_tokenizer(args, required=True)
    assert tokenizer is not None
    if args.chat_template is None:
        return tokenizer
    folder = tokenizer_folder(args)
    assert folder is not None  # the tokenizer was read from it
    files = read_model_files(folder)
    return Tokenizer(attrs.evolve(files, chat_templates={"default": args.chat_template}))
