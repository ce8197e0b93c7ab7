"""Reading a Hugging Face model folder offline: the JSON files a :class:`Tokenizer` needs.

What is read, with the rules transformers (and so vLLM) applies:

* ``tokenizer.json`` (required: the fast tokenizer; folders with only a SentencePiece
  ``tokenizer.model`` are not supported);
* ``tokenizer_config.json`` (optional): special tokens as strings or AddedToken objects
  (``{"content": ...}``), ``chat_template`` (a string or a list of ``{"name", "template"}``),
  ``clean_up_tokenization_spaces``; the legacy ``special_tokens_map.json`` fills in special
  tokens it does not name (``add_bos_token``/``add_eos_token`` are not read: with a
  ``tokenizer.json``, transformers 5 ignores them too);
* chat templates in ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (these
  win over the config's, as in transformers), else ``chat_template.json``
  (``{"chat_template": ...}``, the processor file);
* ``generation_config.json`` (``eos_token_id``: an int or a list), else ``config.json``'s;
* ``config.json``: ``vocab_size`` (or ``text_config.vocab_size``).

Every problem is a :class:`~anyio_genout.errors.ModelFolderError` naming the folder and file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import attrs

from ..errors import ModelFolderError

#: The named special tokens transformers passes to chat templates (its
#: ``SPECIAL_TOKENS_ATTRIBUTES``), in its order.
SPECIAL_TOKEN_NAMES: Final = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                              "cls_token", "mask_token")
TOKENIZER_FILE: Final = "tokenizer.json"
DEFAULT_TEMPLATE: Final = "default"


@final
@attrs.frozen
class SpecialToken:
    """A named special token: its text and, when given as an AddedToken object, its flags."""

    content: str
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = False


@final
@attrs.frozen
class ModelFiles:
    """What a model folder's files say, checked for shape (nothing tokenizer-specific yet)."""

    path: Path
    #: The text of ``tokenizer.json``.
    tokenizer_json: str
    #: Its ``pre_tokenizer`` object (None if it has none).
    pre_tokenizer: Mapping[str, Any] | None
    #: ``tokenizer_config.json`` (``{}`` when absent).
    tokenizer_config: Mapping[str, Any]
    #: Named special tokens (``bos_token``, ``eos_token``, ...) that are set.
    special_tokens: Mapping[str, SpecialToken]
    #: Further special tokens (``extra_special_tokens`` / ``additional_special_tokens``).
    extra_special_tokens: tuple[SpecialToken, ...]
    clean_up_tokenization_spaces: bool
    #: Chat templates by name; a single template is named ``"default"``.
    chat_templates: Mapping[str, str]
    #: The EOS ids of ``generation_config.json`` (else ``config.json``), in file order.
    generation_eos_token_ids: tuple[int, ...]
    #: ``config.json``'s vocabulary size, if it gives one.
    vocab_size: int | None

    def error(self, name: str, message: str) -> ModelFolderError:
        """A :class:`ModelFolderError` about file ``name`` of this folder."""
        return folder_error(self.path, name, message)


def folder_error(path: Path, name: str, message: str) -> ModelFolderError:
    """``ModelFolderError("model folder <path>: <name>: <message>")``."""
    return ModelFolderError(f"model folder {path}: {name}: {message}")


def read_model_files(path: str | os.PathLike[str]) -> ModelFiles:
    """Read and check the files of the model folder ``path``.

    Raises:
        ModelFolderError: ``path`` is not a folder, has no ``tokenizer.json``, or a file is
            not valid JSON / not of the expected shape.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {folder}: not a folder")
    if not (folder / TOKENIZER_FILE).is_file():
        found = " (it has only a SentencePiece tokenizer.model)" \
            if (folder / "tokenizer.model").is_file() else ""
        raise ModelFolderError(
            f"no fast tokenizer ({TOKENIZER_FILE}) in {folder}{found}: slow-only (SentencePiece) "
            "folders are not supported; write tokenizer.json with transformers "
            "(AutoTokenizer.from_pretrained(folder).save_pretrained(folder))")
    tokenizer_json = _read_text(folder, TOKENIZER_FILE)
    parsed = _parse_json(folder, TOKENIZER_FILE, tokenizer_json)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), dict):
        raise folder_error(folder, TOKENIZER_FILE, "must hold a JSON object with a 'model'")
    pre_tokenizer = parsed.get("pre_tokenizer")
    config = _read_object(folder, "tokenizer_config.json") or {}
    legacy = _read_object(folder, "special_tokens_map.json") or {}
    specials: dict[str, SpecialToken] = {}
    for name in SPECIAL_TOKEN_NAMES:
        source, raw = ("tokenizer_config.json", config.get(name)) if config.get(name) is not None \
            else ("special_tokens_map.json", legacy.get(name))
        if raw is not None:
            specials[name] = _special_token(folder, source, name, raw)
    extras = _extra_tokens(folder, config, legacy)
    generation = _read_object(folder, "generation_config.json")
    model_config = _read_object(folder, "config.json")
    eos_ids: tuple[int, ...] = ()
    if generation is not None and generation.get("eos_token_id") is not None:
        eos_ids = _id_list(folder, "generation_config.json", generation["eos_token_id"])
    elif model_config is not None:
        raw_eos = _text_config_get(model_config, "eos_token_id")
        if raw_eos is not None:
            eos_ids = _id_list(folder, "config.json", raw_eos)
    vocab = None if model_config is None else _text_config_get(model_config, "vocab_size")
    if vocab is not None and (type(vocab) is not int or vocab <= 0):
        raise folder_error(folder, "config.json", f"vocab_size must be a positive integer, "
                           f"not {vocab!r}")
    return ModelFiles(
        path=folder, tokenizer_json=tokenizer_json, tokenizer_config=config,
        pre_tokenizer=pre_tokenizer if isinstance(pre_tokenizer, dict) else None,
        special_tokens=specials, extra_special_tokens=extras,
        clean_up_tokenization_spaces=bool(
            _optional_bool(folder, config, "clean_up_tokenization_spaces")),
        chat_templates=_chat_templates(folder, config), generation_eos_token_ids=eos_ids,
        vocab_size=vocab)


def _read_text(folder: Path, name: str) -> str:
    try:
        return (folder / name).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise folder_error(folder, name, f"not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from None
    except OSError as exc:
        raise folder_error(folder, name, f"cannot be read ({exc.strerror or exc})") from None


def _parse_json(folder: Path, name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise folder_error(folder, name, f"not valid JSON (line {exc.lineno} column "
                           f"{exc.colno}: {exc.msg})") from None


def read_json(folder: Path, name: str) -> Any:
    """The JSON value in ``folder/name``, or None if there is no such file.

    Raises:
        ModelFolderError: the file cannot be read, is not UTF-8 or is not valid JSON.
    """
    if not (folder / name).is_file():
        return None
    return _parse_json(folder, name, _read_text(folder, name))


def _read_object(folder: Path, name: str) -> dict[str, Any] | None:
    """The JSON object in ``folder/name``, or None if there is no such file."""
    value = read_json(folder, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise folder_error(folder, name, f"must hold a JSON object, not {type(value).__name__}")
    return value


def _text_config_get(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, else ``config["text_config"][key]`` (multimodal configs)."""
    value = config.get(key)
    text_config = config.get("text_config")
    if value is None and isinstance(text_config, dict):
        value = text_config.get(key)
    return value


def _special_token(folder: Path, source: str, name: str, raw: Any) -> SpecialToken:
    if isinstance(raw, str):
        return SpecialToken(raw)
    if isinstance(raw, dict) and isinstance(raw.get("content"), str):
        flags = {key: raw.get(key, False) for key in ("lstrip", "rstrip", "single_word",
                                                       "normalized")}
        if all(isinstance(flag, bool) for flag in flags.values()):
            return SpecialToken(raw["content"], **flags)
    raise folder_error(folder, source, f"{name} must be a string or an AddedToken object "
                       f"with a string 'content', not {raw!r}")


def _extra_tokens(folder: Path, config: Mapping[str, Any],
                  legacy: Mapping[str, Any]) -> tuple[SpecialToken, ...]:
    tokens: list[SpecialToken] = []
    for source, data in (("tokenizer_config.json", config), ("special_tokens_map.json", legacy)):
        for key in ("extra_special_tokens", "additional_special_tokens"):
            raw = data.get(key)
            if raw is None:
                continue
            values = list(raw.values()) if isinstance(raw, dict) else raw
            if not isinstance(values, list):
                raise folder_error(folder, source, f"{key} must be a list, not {raw!r}")
            tokens.extend(_special_token(folder, source, key, value) for value in values)
        if tokens:
            break
    return tuple(tokens)


def _optional_bool(folder: Path, config: Mapping[str, Any], key: str) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise folder_error(folder, "tokenizer_config.json", f"{key} must be true or false, "
                           f"not {value!r}")
    return value


def _id_list(folder: Path, name: str, raw: Any) -> tuple[int, ...]:
    values = raw if isinstance(raw, list) else [raw]
    if not all(type(v) is int and v >= 0 for v in values):
        raise folder_error(folder, name, f"eos_token_id must be a token id or a list of token "
                           f"ids, not {raw!r}")
    return tuple(dict.fromkeys(values))


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates[DEFAULT_TEMPLATE] = _read_text(folder, "chat_template.jinja")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            name = f"additional_chat_templates/{file.name}"
            templates[file.name.removesuffix(".jinja")] = _read_text(folder, name)
    if templates:
        return templates
    raw = config.get("chat_template")
    source = "tokenizer_config.json"
    if raw is None:
        legacy = _read_object(folder, "chat_template.json")
        raw, source = (None if legacy is None else legacy.get("chat_template")), \
            "chat_template.json"
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {DEFAULT_TEMPLATE: raw}
    if isinstance(raw, list) and all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                     and isinstance(item.get("template"), str) for item in raw):
        return {item["name"]: item["template"] for item in raw}
    raise folder_error(folder, source, "chat_template must be a string or a list of "
                       "{\"name\": ..., \"template\": ...} objects")
