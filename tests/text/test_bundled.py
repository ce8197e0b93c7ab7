"""The shipped tokenizer folder: what the tool builds (deterministically), its shape, its corpus."""

from __future__ import annotations

import importlib.util
import json
import sys
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest

from anyio_genout.text.bundled import bundled_corpus, bundled_model_dir, bundled_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


def build_tool() -> ModuleType:
    """tools/build_tokenizer.py, loaded from its path (tools is not a package)."""
    name = "_build_tokenizer_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "build_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_what_the_tool_builds_every_time(tmp_path: Path) -> None:
    tool = build_tool()
    for run in ("a", "b"):
        tool.build(tmp_path / run, bundled_corpus())
    for name in FILES:
        built = (tmp_path / "a" / name).read_bytes()
        assert built == (tmp_path / "b" / name).read_bytes(), f"{name} differs between builds"
        assert built == (bundled_model_dir() / name).read_bytes(), \
            f"{name} is stale: run python tools/build_tokenizer.py"
    assert tool.main(["--check"]) == 0


def test_the_vocabulary_has_1024_tokens_every_byte_and_the_specials_at_fixed_ids() -> None:
    backend = bundled_tokenizer().backend
    vocab = backend.get_vocab(with_added_tokens=True)
    assert len(vocab) == 1024 and sorted(vocab.values()) == list(range(1024))
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    assert [backend.id_to_token(i) for i in range(5)] == specials
    assert set(_byte_level_alphabet()) <= set(vocab)  # every byte has its own token
    assert (bundled_model_dir() / "tokenizer.json").stat().st_size < 200_000


def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", ["नमस्ते", "مرحبا بالعالم", "สวัสดี", "𓀀𓀁 𝄞",
                                  "\x00\x7f\x80\xff"])
def test_text_the_corpus_never_saw_still_encodes_byte_by_byte(text: str) -> None:
    tok = bundled_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) >= len(text)  # no merges for unseen scripts: bytes or byte pairs


def test_the_configs_say_what_the_model_folder_needs() -> None:
    folder = bundled_model_dir()
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "add_bos_token",
                                   "model_max_length", "tokenizer_class")} == {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True,
        "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}
    assert config["chat_template"].startswith("{{ bos_token }}")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}
    model = json.loads((folder / "config.json").read_text())
    assert (model["vocab_size"], model["model_type"], model["max_position_embeddings"]) == \
        (1024, "llama", 2048)


def test_the_corpus_is_multi_script_prose_and_round_trips() -> None:
    corpus = bundled_corpus()
    assert 20_000 <= len(corpus.encode("utf-8")) <= 40_000
    scripts = {unicodedata.name(c, "?").split()[0] for c in corpus if ord(c) > 0x250}
    assert {"CJK", "HIRAGANA", "KATAKANA", "HANGUL", "CYRILLIC", "GREEK"} <= scripts
    assert any(unicodedata.category(c) == "So" and ord(c) > 0x1F000 for c in corpus)  # emoji
    assert "ä" in corpus and "é" in corpus
    tok = bundled_tokenizer()
    ids = tok.encode(corpus)
    assert tok.decode(ids) == corpus
    assert len(corpus) / len(ids) > 2.0  # trained on it: merges make it compress


@pytest.mark.parametrize("token_id", [0, 1, 4, 5, 260, 1023])
def test_every_id_has_a_token_string(token_id: int) -> None:
    assert bundled_tokenizer().token_strings([token_id])[0] != ""
