"""Tokenizer.from_model_dir: what a model folder's files mean, and the errors for bad ones.

The folders are built here: copies of the bundled one with files changed, and a small
SentencePiece-style tokenizer (Unigram with byte fallback, Metaspace pre-tokenizer and
Llama-2's decoder) for what only such tokenizers do (leading-space markers, cut characters).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, processors

from anyio_genout.errors import InvalidRequestError, ModelFolderError
from anyio_genout.text.bundled import bundled_model_dir, bundled_tokenizer
from anyio_genout.text.tokenizer import Tokenizer
from tests.text.tokenizer_kinds import kind_dir, load

TEXTS = [
    "Hello, world! The keeper's ledger.",
    "Größe, Äpfel und Übermut; élève, garçon, naïve.",
    "河边有一座老茶馆，每天早上都坐满了人。",  # noqa: RUF001 (a Chinese comma)
    "駅前の小さなパン屋は、朝六時に店を開ける。",
    "서울의 오래된 골목에는 작은 책방이 하나 있다.",
    "Зимой в нашей деревне рано темнеет.",
    "Στο μικρό νησί, το καράβι έρχεται.",
    "Weather: ☀️⛅🌧️ and a cat 🐈 👩‍👩‍👧 🇯🇵",
    "  leading spaces,\ttabs\r\nand\n\nnewlines  ",
    "",
]

SP_WORDS = ["▁hello", "hello", "▁world", "▁", "h", "e", "l", "o", "w", "r", "d"]


def copy_bundled(tmp_path: Path) -> Path:
    """A writable copy of the bundled folder (without the corpus)."""
    folder = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), folder, ignore=shutil.ignore_patterns("corpus.txt"))
    return folder


def edit_json(path: Path, **changes: Any) -> None:
    """Set (or, with value None, remove) top-level keys of the JSON object in ``path``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def write_sentencepiece_folder(folder: Path) -> Path:
    """A Llama-2-shaped folder: Unigram pieces with ``▁`` for spaces, byte fallback
    (``<0xC3>``...) for every character not in the tiny vocabulary, ``<s>`` prepended."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    pieces += [(word, -1.0 - len(pieces) / 1000) for word in SP_WORDS]
    backend = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in ("<unk>", "<s>", "</s>")])
    backend.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0",
                                                           special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": False,
                      "rstrip": False, "single_word": False},
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast"}), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


# -- the bundled folder ------------------------------------------------------------------------


def test_the_bundled_folder_reads_as_its_configs_say() -> None:
    tok = bundled_tokenizer()
    assert tok.model_dir == bundled_model_dir()
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == \
        ("<s>", 1, "</s>", 2)
    assert tok.eos_token_ids == (2, 4)  # primary first, then generation_config's others
    assert tok.add_bos_token is True
    assert tok.special_token_ids == frozenset(range(5))
    assert tok.vocab_size == 1024
    assert tok.chat_template is not None and tok.chat_template.startswith("{{ bos_token }}")
    assert tok.backend.get_vocab_size(with_added_tokens=True) == 1024


@pytest.mark.parametrize("text", TEXTS)
def test_text_in_every_script_round_trips_and_starts_with_bos(text: str) -> None:
    tok = bundled_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == 1
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_special_tokens_in_text_are_single_tokens_and_skipped_on_decode() -> None:
    tok = bundled_tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|></s>", add_special_tokens=False)
    assert ids[0] == 3 and ids[-2:] == [4, 2]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|></s>"


def test_a_multibyte_character_spans_several_tokens() -> None:
    tok = bundled_tokenizer()
    ids = tok.encode("茶馆 🐈", add_special_tokens=False)
    strings = tok.token_strings(ids)
    assert len(ids) > 3
    assert any(s.endswith("\ufffd") for s in strings)  # a token alone is part of a character
    assert tok.decode(ids) == "茶馆 🐈"


def test_token_strings_are_each_id_decoded_alone_with_specials_kept() -> None:
    tok = bundled_tokenizer()
    ids = tok.encode("Hello world")
    assert tok.token_strings(ids) == ["<s>", "H", "ell", "o", " wor", "ld"]
    assert tok.token_strings([]) == []
    assert tok.token_strings([4, 10**6, -1]) == ["<|im_end|>", "", ""]  # unknown ids: no text


def test_decode_refuses_negative_ids_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        bundled_tokenizer().decode([5, -1])
    assert exc.value.field == "token_ids"


def test_encode_refuses_non_text() -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        bundled_tokenizer().encode(b"bytes")  # type: ignore[arg-type]


@settings(derandomize=True, database=None, max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips(text: str) -> None:
    tok = bundled_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < 1024 for i in ids)


@settings(derandomize=True, database=None, max_examples=300, deadline=None)
@given(kind=st.sampled_from(["byte_level", "sentencepiece"]), text=st.text(max_size=200),
       specials=st.booleans())
def test_encode_gives_the_ids_the_library_s_own_encode_gives(kind: str, text: str,
                                                              specials: bool) -> None:
    """``encode`` takes the library's fast path (no offsets, the GIL released): the ids are
    those of the library's plain ``Tokenizer.encode``, with and without the specials."""
    tok = Tokenizer.from_model_dir(kind_dir(kind))
    try:
        expected = load(kind).encode(text, add_special_tokens=specials).ids
    except TypeError:  # a lone surrogate: refused by ours, naming the text (tested below)
        return
    assert tok.encode(text, add_special_tokens=specials) == expected


# -- what the configs say ----------------------------------------------------------------------


def test_tokenizer_json_decides_what_encode_adds_not_the_config_s_add_bos_token(
        tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)  # as transformers 5 (what vLLM 0.32 uses) loads it
    edit_json(folder / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_model_dir(folder)
    assert tok.add_bos_token is True
    assert tok.encode("hi") == [1, 76, 77]
    edit_json(folder / "tokenizer.json", post_processor=None)
    tok = Tokenizer.from_model_dir(folder)
    assert tok.encode("hi") == [76, 77] and tok.add_bos_token is False


def test_eos_may_be_an_added_token_object_and_generation_eos_an_int(tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    edit_json(folder / "tokenizer_config.json",
              eos_token={"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                         "rstrip": False,
                         "normalized": False, "single_word": False, "special": True})
    edit_json(folder / "generation_config.json", eos_token_id=2)
    tok = Tokenizer.from_model_dir(folder)
    assert (tok.eos_token, tok.eos_token_id, tok.eos_token_ids) == ("<|im_end|>", 4, (4, 2))


def test_without_generation_config_eos_comes_from_config_json(tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    (folder / "generation_config.json").unlink()
    edit_json(folder / "config.json", eos_token_id=[4, 2, 4])
    assert Tokenizer.from_model_dir(folder).eos_token_ids == (2, 4)


def test_vocab_size_is_config_json_s_else_the_tokenizer_s_with_added_tokens(
        tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    edit_json(folder / "config.json", vocab_size=1088)
    assert Tokenizer.from_model_dir(folder).vocab_size == 1088
    (folder / "config.json").unlink()
    edit_json(folder / "tokenizer_config.json", unk_token="<unk>")  # a named token not in vocab
    tok = Tokenizer.from_model_dir(folder)
    assert tok.vocab_size == 1025
    assert tok.encode("<unk>", add_special_tokens=False) == [1024]
    assert 1024 in tok.special_token_ids


def test_a_folder_without_optional_files_still_encodes(tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(bundled_model_dir() / "tokenizer.json", folder)
    tok = Tokenizer.from_model_dir(folder)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids, tok.chat_template) == \
        (None, None, (), None)
    assert tok.encode("hi") == [1, 76, 77]  # tokenizer.json's own post-processor
    assert tok.vocab_size == 1024


def test_sentencepiece_style_token_strings_keep_their_leading_space(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(write_sentencepiece_folder(tmp_path / "sp"))
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.token_strings(ids) == ["<s>", " hello", " world"]  # decode alone drops " "
    assert tok.eos_token_ids == (2,)


def test_a_character_cut_by_byte_fallback_is_completed_from_the_context(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(write_sentencepiece_folder(tmp_path / "sp"))
    ids = tok.encode("hello é", add_special_tokens=False)
    lead, trail = ids[-2:]
    assert tok.token_strings([lead, trail]) == ["\ufffd", "\ufffd"]
    assert tok.token_strings([trail], context=[ids[0], lead]) == ["é"]
    assert tok.token_strings([lead], context=[ids[0]]) == [""]  # still incomplete
    assert tok.token_strings([trail, ids[0]], context=[]) == ["", " hello"]  # first position
    assert tok.decode(ids) == "hello é"


# -- missing and malformed files ---------------------------------------------------------------


def test_a_folder_without_tokenizer_json_names_what_is_missing(tmp_path: Path) -> None:
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ModelFolderError) as exc:
        Tokenizer.from_model_dir(folder)
    message = str(exc.value)
    assert f"no fast tokenizer (tokenizer.json) in {folder}" in message
    assert "tokenizer.model" in message and "not supported" in message


def test_a_path_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="not a folder"):
        Tokenizer.from_model_dir(tmp_path / "absent")


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("tokenizer.json", "{not json", r"tokenizer\.json: not valid JSON \(line 1 column 2"),
    ("tokenizer.json", '{"model": {"type": "Nope"}}', r"tokenizer\.json: not a tokenizer"),
    ("tokenizer.json", "[]", r"tokenizer\.json: must hold a JSON object with a 'model'"),
    ("tokenizer.json", b"\xff\xfe", r"tokenizer\.json: not UTF-8"),
    ("tokenizer_config.json", "{", r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_config.json", "[1]", r"tokenizer_config\.json: must hold a JSON object"),
    ("tokenizer_config.json", '{"bos_token": 1}', r"tokenizer_config\.json: bos_token must"),
    ("tokenizer_config.json", '{"eos_token": {"text": "x"}}', r"eos_token must be a string"),
    ("tokenizer_config.json", '{"clean_up_tokenization_spaces": 1}', r"must be true or fal"),
    ("tokenizer_config.json", '{"chat_template": 3}', r"chat_template must be a string or"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "x"}]}', r"chat_template must be"),
    ("generation_config.json", '{"eos_token_id": "2"}', r"generation_config\.json: eos_token_"),
    ("generation_config.json", '{"eos_token_id": [2, -1]}', r"eos_token_id must be a token id"),
    ("config.json", '{"vocab_size": "big"}', r"config\.json: vocab_size must be a positive"),
    ("chat_template.json", "{", r"chat_template\.json: not valid JSON"),
])
def test_a_malformed_file_is_named_with_what_is_wrong(tmp_path: Path, name: str,
                                                       content: str | bytes,
                                                       expected: str) -> None:
    folder = copy_bundled(tmp_path)
    if name == "chat_template.json":
        edit_json(folder / "tokenizer_config.json", chat_template=None)
    path = folder / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ModelFolderError, match=expected) as exc:
        Tokenizer.from_model_dir(folder)
    assert str(folder) in str(exc.value)


def test_encoding_a_lone_surrogate_is_refused_naming_the_text() -> None:
    # The tokenizers library raises a bare TypeError for text that is not valid Unicode.
    from anyio_genout import InvalidRequestError
    from anyio_genout.text import bundled_tokenizer

    with pytest.raises(InvalidRequestError) as caught:
        bundled_tokenizer().encode("ok \ud800")
    assert caught.value.field == "text" and "lone surrogate" in str(caught.value)
