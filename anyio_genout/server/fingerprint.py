"""The ``system_fingerprint`` of responses, as vLLM 0.32's ``--fingerprint-mode`` chooses it.

vLLM's modes: ``full`` (its default) ``vllm-<version>[-tp2][-pp2][-dp2][-ep]-<hash8>``,
``hash`` the same without the parallelism parts, ``custom`` the literal
``--fingerprint-value``, ``none`` no fingerprint. vLLM's ``hash8`` is of its engine
configuration (``VllmConfig.compute_hash()``), which the engines never send to a front
end, so ours are ``anyio-genout-<version>[-dpN]-<hash8>`` (``full``) and
``anyio-genout-<version>-<hash8>`` (``hash``), ``hash8`` the first 8 hex digits of a sha256
over what identifies the served setup here: the served model name, the tokenizer's model
folder (absolute), ``max_model_len``, the vocabulary size and the engine count (vLLM's
data-parallel size). It is the same after a restart of the same setup, and for every
``--api-server-count`` process of one server. It is computed once per server.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from typing import Final, Literal, get_args

from ..errors import InvalidRequestError
from ..text.client import TextClient

__all__ = ["FINGERPRINT_MODES", "FingerprintMode", "check_fingerprint_options",
           "fingerprint_hash", "system_fingerprint"]

FingerprintMode = Literal["full", "hash", "custom", "none"]
#: vLLM's ``--fingerprint-mode`` choices; ``full`` is its default.
FINGERPRINT_MODES: Final[tuple[str, ...]] = get_args(FingerprintMode)

try:
    _VERSION = importlib.metadata.version("anyio-genout")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
    _VERSION = "unknown"


def fingerprint_hash(*, model_name: str, model_path: str | None, max_model_len: int,
                     vocab_size: int, engine_count: int) -> str:
    """The first 8 hex digits of the sha256 of the served setup (canonical JSON)."""
    setup = {"served_model_name": model_name,
             "model": None if model_path is None else os.path.abspath(model_path),
             "max_model_len": max_model_len, "vocab_size": vocab_size,
             "data_parallel_size": engine_count}
    canonical = json.dumps(setup, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def check_fingerprint_options(mode: str, value: str | None) -> None:
    """Raises InvalidRequestError: an unknown ``mode`` (naming ``fingerprint_mode``), mode
    ``custom`` without ``value``, or a ``value`` with another mode (naming
    ``fingerprint_value``: it would do nothing)."""
    if mode not in FINGERPRINT_MODES:
        raise InvalidRequestError("fingerprint_mode", f"{mode!r} is not one of "
                                  f"{', '.join(FINGERPRINT_MODES)}")
    if mode == "custom" and value is None:
        raise InvalidRequestError("fingerprint_value", "needed with fingerprint mode "
                                  "custom (the fingerprint responses carry)")
    if mode != "custom" and value is not None:
        raise InvalidRequestError("fingerprint_value", f"only with fingerprint mode custom "
                                  f"(the mode is {mode})")


def system_fingerprint(text_client: TextClient, *, model_name: str,
                       mode: FingerprintMode = "full",
                       value: str | None = None) -> str | None:
    """The fingerprint responses served as ``model_name`` over ``text_client`` carry (None:
    none, mode ``none``); ``value`` is mode ``custom``'s, and needs it. Modes ``full`` and
    ``hash`` read the engines' ``max_model_len``: call it once they are connected.

    Raises what :func:`check_fingerprint_options` raises.
    """
    check_fingerprint_options(mode, value)
    if mode == "custom":
        return value
    if mode == "none":
        return None
    engine = text_client.client.engine
    tokenizer = text_client.tokenizer
    engines = engine.config.engine_count
    model_dir = tokenizer.model_dir
    hash8 = fingerprint_hash(model_name=model_name,
                             model_path=None if model_dir is None else str(model_dir),
                             max_model_len=engine.max_model_len,
                             vocab_size=tokenizer.vocab_size, engine_count=engines)
    parts = [f"anyio-genout-{_VERSION}"]
    if mode == "full" and engines > 1:
        parts.append(f"dp{engines}")
    parts.append(hash8)
    return "-".join(parts)
