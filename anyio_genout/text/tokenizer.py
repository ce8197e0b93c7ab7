"""A model folder's tokenizer: the fast ``tokenizers`` tokenizer plus what the folder's
configs say about it (bos/eos, ``add_bos_token``, the chat template, the vocabulary size).

It behaves like ``transformers.AutoTokenizer.from_pretrained(folder)`` of transformers 5 (what
vLLM 0.32 loads) on the points the text layer uses: named special tokens become special added
tokens; ``tokenizer.json``'s post-processor decides what ``encode`` adds (transformers 5 drops
the config's ``add_bos_token``/``add_eos_token`` when there is a ``tokenizer.json``; 4.x
rebuilt the post-processor from them); no truncation or padding; ``token_strings`` decodes
one id at a time as vLLM's logprobs do. No transformers, no torch, no network.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import tokenizers

from ..errors import ChatTemplateError, InvalidRequestError
from ..protocol.validation import check_text
from .chat_template import chat_messages, render_chat_template
from .model_dir import (
    DEFAULT_TEMPLATE,
    TOKENIZER_FILE,
    ModelFiles,
    SpecialToken,
    read_model_files,
)

_REPLACEMENT: Final = "\ufffd"
#: How many preceding sampled tokens vLLM's logprobs correction looks at.
_CONTEXT_TOKENS: Final = 4
_CLEANUPS: Final = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                    (" 're", "'re"))


def _leading_space_marker(pre_tokenizer: Mapping[str, Any] | None) -> str | None:
    """The Metaspace replacement character (whose leading run decode() strips), if any."""
    if pre_tokenizer is None:
        return None
    parts = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    for part in parts or ():
        if isinstance(part, Mapping) and part.get("type") == "Metaspace":
            marker = part.get("replacement", "\u2581")
            return marker if isinstance(marker, str) else None
    return None


def _special_added_tokens(backend: tokenizers.Tokenizer,
                          tokens: Sequence[SpecialToken]) -> list[tokenizers.AddedToken]:
    """What transformers makes of the named special tokens: the tokenizer.json added token of
    that content if there is one, else a new one with the config's flags; all special."""
    existing = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    result = []
    for token in tokens:
        found = existing.get(token.content)
        result.append(tokenizers.AddedToken(
            token.content, special=True,
            lstrip=token.lstrip if found is None else found.lstrip,
            rstrip=token.rstrip if found is None else found.rstrip,
            single_word=token.single_word if found is None else found.single_word,
            normalized=token.normalized if found is None else found.normalized))
    return result


@final
class Tokenizer:
    """The tokenizer of a model folder. Make one with :meth:`from_model_dir`.

    Thread-compatible, not locked: share it between tasks freely, but do not modify
    :attr:`backend`.
    """

    __slots__ = ("_add_bos_token", "_backend", "_bos", "_cleanup", "_default_template", "_eos",
                 "_eos_ids", "_marker", "_max_chars_per_token", "_model_dir",
                 "_named_templates", "_special_ids", "_special_map", "_strings",
                 "_vocab_size")

    def __init__(self, files: ModelFiles) -> None:
        """Build from checked folder files (:meth:`from_model_dir` reads them).

        Raises:
            ModelFolderError: ``tokenizer.json`` is not a tokenizer ``tokenizers`` can load.
        """
        try:
            backend = tokenizers.Tokenizer.from_str(files.tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise files.error(TOKENIZER_FILE, f"not a tokenizer the tokenizers library can "
                              f"load: {exc}") from None
        backend.no_truncation()
        backend.no_padding()
        named = files.special_tokens
        backend.add_special_tokens(_special_added_tokens(
            backend, (*named.values(), *files.extra_special_tokens)))
        self._backend = backend
        self._model_dir: Path | None = files.path
        self._bos = self._named(files, "bos_token")
        self._eos = self._named(files, "eos_token")
        empty = backend.encode("", add_special_tokens=True).ids
        self._add_bos_token = self._bos is not None and empty[:1] == [self._bos[1]]
        primary = () if self._eos is None else (self._eos[1],)
        self._eos_ids: tuple[int, ...] = tuple(dict.fromkeys(
            primary + files.generation_eos_token_ids))
        self._special_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special)
        self._special_map = {name: token.content for name, token in named.items()}
        self._vocab_size = files.vocab_size if files.vocab_size is not None \
            else backend.get_vocab_size(with_added_tokens=True)
        self._max_chars_per_token = max(
            (len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
        templates = dict(files.chat_templates)
        single = len(templates) == 1 and DEFAULT_TEMPLATE in templates
        self._default_template = templates.get(DEFAULT_TEMPLATE)
        self._named_templates = {} if single else templates
        bpe = type(backend.model).__name__ == "BPE"
        self._cleanup = files.clean_up_tokenization_spaces and not bpe
        self._marker = _leading_space_marker(files.pre_tokenizer)
        self._strings: dict[int, str] = {}

    def _named(self, files: ModelFiles, name: str) -> tuple[str, int] | None:
        token = files.special_tokens.get(name)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token.content)
        assert token_id is not None, "added as a special token above"
        return token.content, token_id

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of the Hugging Face model folder ``path`` (offline).

        Raises:
            ModelFolderError: the folder has no ``tokenizer.json`` ("no fast tokenizer
                (tokenizer.json) in <dir>"), or a file is malformed (the message names it).
        """
        return cls(read_model_files(path))

    def __repr__(self) -> str:
        return f"Tokenizer(model_dir={str(self._model_dir)!r}, vocab_size={self._vocab_size})"

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The fast tokenizer (with the folder's special tokens and post-processor applied)."""
        return self._backend

    @property
    def model_dir(self) -> Path | None:
        """The folder it was loaded from."""
        return self._model_dir

    @property
    def vocab_size(self) -> int:
        """``config.json``'s ``vocab_size`` if given, else the tokenizer's size with added
        tokens."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return None if self._bos is None else self._bos[0]

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos is None else self._bos[1]

    @property
    def eos_token(self) -> str | None:
        """The primary EOS token (``tokenizer_config.json``'s ``eos_token``)."""
        return None if self._eos is None else self._eos[0]

    @property
    def eos_token_id(self) -> int | None:
        return None if self._eos is None else self._eos[1]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id: the primary first, then the others of ``generation_config.json``
        (else ``config.json``)."""
        return self._eos_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether :meth:`encode` with ``add_special_tokens=True`` starts with the bos token
        (``tokenizer.json``'s post-processor says; the config's ``add_bos_token`` is ignored,
        as transformers 5 ignores it)."""
        return self._add_bos_token

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (what ``skip_special_tokens`` drops)."""
        return self._special_ids

    @property
    def max_chars_per_token(self) -> int:
        """The longest token of the vocabulary (added tokens too), in characters of its
        vocabulary entry, as vLLM's ``max_chars_per_token``: a text longer than
        ``n * max_chars_per_token`` characters cannot encode to ``n`` tokens or fewer (a
        byte-level entry has one character per byte, and a character is at least one
        byte)."""
        return self._max_chars_per_token

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, or None if the folder has none."""
        return self._default_template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (with the post-processor's bos/eos if
        ``add_special_tokens``). Encoded with the GIL released, so from a worker thread
        (``anyio.to_thread.run_sync``) it leaves the event loop running; about 0.1-0.7 µs a
        character.

        Raises:
            TypeError: ``text`` is not a str.
            InvalidRequestError: ``text`` is not valid Unicode (a lone surrogate, as a JSON
                ``"\\ud800"`` escape gives); field ``"text"``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        if not text.isascii():
            check_text(text, "text")  # the tokenizers library raises a bare TypeError
        # encode_batch_fast releases the GIL (encode holds it throughout: 1 MiB took 1.3-2.2
        # s during which no other thread ran) and skips the offsets, which nothing here
        # reads: the same ids, 10-45 % sooner for texts of 8 tokens or more.
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens
                                               )[0].ids

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` as one token of the vocabulary (added tokens too), or None."""
        found: int | None = self._backend.token_to_id(token)
        return found

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (ids the tokenizer does not know give no text).

        Raises:
            InvalidRequestError: ``token_ids`` holds something that is not a non-negative int.
        """
        try:
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError):
            raise InvalidRequestError("token_ids", "must be non-negative integers") from None

    def _token_string(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is not None:
            return text
        raw = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if raw is None:  # unknown to the tokenizer: no text (and nothing cached)
            return ""
        text = self._hf_decode([token_id])
        if self._marker is not None:
            markers = len(raw) - len(raw.lstrip(self._marker))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                text = " " * missing + text
        self._strings[token_id] = text
        return text

    def _hf_decode(self, token_ids: list[int]) -> str:
        """``transformers`` ``decode(ids)``: special tokens kept, its cleanup if configured."""
        text = self._backend.decode(token_ids, skip_special_tokens=False)
        if self._cleanup:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def token_strings(self, token_ids: Sequence[int], *,
                      context: Sequence[int] | None = None) -> list[str]:
        """One string per id, decoded alone, as vLLM's ``convert_ids_list_to_tokens`` gives
        them: special tokens as their text, leading spaces of Metaspace pieces restored,
        ``""`` for ids the tokenizer does not know.

        ``context`` makes them what vLLM's logprobs processor gives for one position: the
        tokens before it, oldest first (the sampled ones for sample logprobs, ``[]`` at the
        first output position; the prompt tokens of the rows before for prompt logprobs).
        A string ending in U+FFFD (part of a character) is then replaced by the text it
        completes with up to the last 4 of them, or ``""``.
        """
        strings = [self._token_string(token_id) for token_id in token_ids]
        if context is not None:
            recent = list(context[-_CONTEXT_TOKENS:])
            strings = [self._corrected(token_id, recent) if text.endswith(_REPLACEMENT)
                       else text for token_id, text in zip(token_ids, strings, strict=True)]
        return strings

    def _corrected(self, token_id: int, context: list[int]) -> str:
        """vLLM's ``_correct_decoded_token``: the text this token completes in context."""
        for count in range(1, len(context) + 1):
            window = context[-count:]
            full = self._hf_decode([*window, token_id])
            if full.endswith(_REPLACEMENT):
                continue
            clean_end = len(window)
            while clean_end > 0 and self._hf_decode([window[clean_end - 1]]).endswith(
                    _REPLACEMENT):
                clean_end -= 1
            prefix = self._hf_decode(window[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            max_chars: int | None = None,
                            max_seconds: float | None = None,
                            variables: Mapping[str, Any] | None = None,
                            **template_kwargs: Any) -> str:
        """The prompt text of ``messages`` rendered with the folder's chat template (or
        ``chat_template``: a template's name or source), as
        ``transformers``' ``apply_chat_template(..., tokenize=False)`` renders it. The
        template variables are the messages, ``add_generation_prompt``, the named special
        tokens (``bos_token``, ``eos_token``, ...), ``tools``/``documents`` (None) and
        ``template_kwargs``, and ``variables`` (the same, under any name: a request's
        ``chat_template_kwargs`` may use this method's own parameter names). Encode the
        result with ``add_special_tokens=False``: the template places bos itself.
        ``max_seconds``: the rendering's time budget (default ``RENDER_BUDGET``, 1 s).

        Raises:
            ChatTemplateError: there is no template, or it fails to parse or raises while
                rendering (the message names the template line), or the rendering went past
                its budget or ``max_chars`` (a ``RenderLimitError``, stopped).
            InvalidRequestError: ``messages`` is malformed (names the field, e.g.
                ``messages[1].role``).
        """
        given = {**(variables or {}), **template_kwargs}
        source = self._template(chat_template, given.get("tools"))
        return render_chat_template(source, chat_messages(messages),
                                    add_generation_prompt=add_generation_prompt,
                                    variables={**self._special_map, **given},
                                    max_chars=max_chars, seconds=max_seconds)

    def _template(self, chat_template: str | None, tools: object) -> str:
        named = self._named_templates
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if named:
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if DEFAULT_TEMPLATE in named:
                return named[DEFAULT_TEMPLATE]
            raise ChatTemplateError(f"model folder {self._model_dir} has several chat templates "
                                    f"and none named {DEFAULT_TEMPLATE!r}: pass chat_template="
                                    f"one of {sorted(named)}")
        if self._default_template is None:
            raise ChatTemplateError(f"model folder {self._model_dir} has no chat template: "
                                    "pass chat_template=<jinja source>")
        return self._default_template
