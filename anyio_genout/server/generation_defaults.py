"""The model's sampling defaults, as ``vllm serve`` applies them (``--generation-config``).

vLLM 0.32's server takes a model's ``generation_config.json`` sampling values as the
defaults of every request that does not set them (``ModelConfig.get_diff_sampling_param``
and the request models' ``to_sampling_params``): ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, and
``max_new_tokens`` as the ``max_tokens`` of a request that gives none (cut to the room the
context leaves, never refused; a completion's is 16 even when sent as null, as vLLM's
``normalize_null_max_tokens`` has it). ``--generation-config auto`` (the default) reads the
model folder's file, ``vllm`` takes none (vLLM's neutral defaults), a folder path reads that
folder's; ``--override-generation-config`` (a JSON object) is laid over the result. The
``max_new_tokens`` of a named folder, or else of the override, also caps every request's
``max_tokens`` (vLLM's ``override_max_tokens``; a request above the context is still
refused). With transformers 5 every value the file sets is one (its defaults are all unset).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ..errors import ModelFolderError, UsageError
from ..text.model_dir import read_json
from .models import ChatCompletionRequest, CompletionRequest

__all__ = ["SAMPLING_DEFAULTS", "generation_defaults", "with_defaults"]

#: The request fields a generation config gives defaults for (vLLM's ``available_params``,
#: ``max_new_tokens`` aside).
SAMPLING_DEFAULTS: Final = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                            "temperature", "top_k", "top_p", "min_p")

#: The file a model folder keeps them in.
GENERATION_CONFIG: Final = "generation_config.json"

Body = CompletionRequest | ChatCompletionRequest


def generation_defaults(source: str, model_dir: Path | None,
                        override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults of ``source`` (``"auto"``: ``model_dir``'s generation config,
    ``"vllm"``: none, else a folder holding a ``generation_config.json``), ``override`` laid
    over them; ``max_new_tokens`` comes out as ``max_tokens``, and as ``max_tokens_cap``
    too where it caps every request (with a named folder, or when the override gives one;
    the value after the override either way, as vLLM's ``override_max_tokens``).

    Raises:
        UsageError: the file cannot be read, is not UTF-8 or not a JSON object, a value is
            not a number (an int of at least 1 for ``max_new_tokens``), or ``source`` is a
            folder that does not exist.
    """
    config: dict[str, Any] = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else Path(source)
        if source != "auto" and not Path(source).is_dir():
            raise UsageError(f"--generation-config {source!r}: not 'auto', 'vllm' or a folder")
        if folder is not None:
            config = _read(folder)
    # vLLM's override_max_tokens: the resulting max_new_tokens, with a named folder, or
    # when the override gives one
    caps = source not in ("auto", "vllm") or "max_new_tokens" in (override or {})
    config.update(override or {})
    found: dict[str, Any] = {}
    for name in (*SAMPLING_DEFAULTS, "max_new_tokens"):
        value = config.get(name)
        if value is None:
            continue
        if name == "max_new_tokens":
            if type(value) is not int or value < 1:
                raise UsageError(f"generation config: max_new_tokens must be an integer of at "
                                 f"least 1, not {value!r}")
            found["max_tokens"] = value
            if caps:
                found["max_tokens_cap"] = value
        elif type(value) not in (int, float) or not math.isfinite(value):
            raise UsageError(f"generation config: {name} must be a number, not {value!r}")
        else:
            found[name] = value
    return found


def _read(folder: Path) -> dict[str, Any]:
    """``folder``'s generation config ({} without one), read as the model folder's files
    are (:func:`~anyio_genout.text.model_dir.read_json`)."""
    try:
        config = read_json(folder, GENERATION_CONFIG)
    except ModelFolderError as exc:
        raise UsageError(str(exc)) from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(f"{folder / GENERATION_CONFIG}: must be a JSON object")
    return config


def with_defaults(body: Body, defaults: Mapping[str, Any], max_model_len: int | None
                  ) -> Body:
    """``body`` with ``defaults`` for the sampling fields it does not set, and its
    ``max_tokens`` as vLLM's ``get_max_tokens`` makes it: the request's (a completion's null
    is 16), else the default (at most ``max_model_len``), then at most the cap (unless the
    request's is above ``max_model_len``: refused later, as in vLLM)."""
    update: dict[str, Any] = {}
    completion = isinstance(body, CompletionRequest)
    if completion and body.max_tokens is None:
        update["max_tokens"] = 16  # vLLM's normalize_null_max_tokens
    if not defaults and not update:
        return body
    update.update({name: value for name, value in defaults.items()
                   if name in SAMPLING_DEFAULTS and getattr(body, name) is None})
    field = "max_tokens" if isinstance(body, CompletionRequest) \
        or body.max_completion_tokens is None else "max_completion_tokens"
    given = update.get("max_tokens", getattr(body, field))
    if given is None and defaults.get("max_tokens") is not None:
        given = defaults["max_tokens"]
        given = given if max_model_len is None else min(given, max_model_len)
    cap = defaults.get("max_tokens_cap")  # there is one only with a default max_tokens
    if cap is not None and given is not None \
            and (max_model_len is None or given <= max_model_len):
        given = min(given, cap)
    if given != getattr(body, field):
        update[field] = given
    return body.model_copy(update=update) if update else body
