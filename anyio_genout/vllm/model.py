"""Read the few facts the client needs from a Hugging Face model folder.

A client started with ``--skip-tokenizer-init`` engines has to validate token ids itself (a token
id >= the vocabulary size kills a real engine) and has to send ``_eos_token_id`` itself (the
engine only stops on EOS when the request carries it). Both come from the model folder's
``config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_model_eos_token_id", "read_model_eos_token_ids", "read_model_vocab_size"]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _as_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def read_model_vocab_size(model_dir: str | os.PathLike[str]) -> int | None:
    """The model's vocabulary size from ``config.json``, or ``None`` if it cannot be read.

    Multimodal configs keep it under ``text_config``; that is looked at too. A name that is not
    a local folder (a hub id) gives ``None``.
    """
    config = _read_json(Path(model_dir) / "config.json")
    if config is None:
        return None
    size = _as_int(config.get("vocab_size"))
    if size is None and isinstance(config.get("text_config"), dict):
        size = _as_int(config["text_config"].get("vocab_size"))
    return size


def read_model_eos_token_ids(model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """Every EOS token id the model declares (may be several), or ``()``.

    ``generation_config.json`` wins over ``config.json``, as in vLLM and transformers.
    """
    folder = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        data = _read_json(folder / name)
        if data is None:
            continue
        value = data.get("eos_token_id")
        if value is None and isinstance(data.get("text_config"), dict):
            value = data["text_config"].get("eos_token_id")
        if isinstance(value, list):
            ids = tuple(i for i in (_as_int(v) for v in value) if i is not None)
            if ids:
                return ids
        elif (single := _as_int(value)) is not None:
            return (single,)
    return ()


def read_model_eos_token_id(model_dir: str | os.PathLike[str]) -> int | None:
    """The model's (first) EOS token id, or ``None`` if it declares none.

    Send it as ``SamplingParams(eos_token_id=...)``: a real engine stops on EOS only when the
    request names it.
    """
    ids = read_model_eos_token_ids(model_dir)
    return ids[0] if ids else None
