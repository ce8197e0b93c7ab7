"""The benchmarks' built tokenizers: deterministic, cached, and model folders the text layer
and the mock engine read (a 32k vocabulary in ``config.json``, bos/eos, a chat template)."""

from __future__ import annotations

from pathlib import Path

import pytest

from anyio_genout.bench.server_procs import model_vocab_size
from anyio_genout.bench.text import engine_args
from anyio_genout.bench.tokenizers import BUILT, build_model_dir
from anyio_genout.text import Tokenizer
from anyio_genout.text.byte_table import byte_table
from anyio_genout.text.fallback_table import fallback_table

TEXT = "Hello world, naïve café 日本語 🙂 def f(x): return x  # done"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", BUILT)
def test_a_build_is_the_same_twice_and_cached(name: str, tmp_path: Path) -> None:
    first = build_model_dir(name, tmp_path / "a")
    second = build_model_dir(name, tmp_path / "b")
    assert first.name == second.name and first.name.startswith(f"{name}-")
    for file in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert build_model_dir(name, tmp_path / "a") == first  # cached: not built again
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.name]  # no leftovers

    tokenizer = Tokenizer.from_model_dir(first)
    assert tokenizer.vocab_size == model_vocab_size(first) == 32768
    assert engine_args("c.json", first) == ["--corpus-token-ids", "c.json",
                                            "--vocab-size", "32768"]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode()) / 2  # merges learnt: well under a token a byte
    assert tokenizer.bos_token_id is not None and tokenizer.eos_token_id is not None
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith(str(tokenizer.bos_token)) and "hi" in prompt
    backend = tokenizer.backend
    if name.startswith("bpe-"):  # byte-level: the byte table's fast path
        assert byte_table(backend, True) is not None
        assert fallback_table(backend, True) is None
    else:  # byte fallback: its own table, byte pieces in the vocabulary
        assert byte_table(backend, True) is None
        assert fallback_table(backend, True) is not None
        assert backend.token_to_id("<0xE6>") is not None
        assert backend.token_to_id("<0xE6>") not in backend.get_added_tokens_decoder()


def test_an_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'wordpiece' is not one of bpe-bytelevel-32k"):
        build_model_dir("wordpiece", tmp_path)


def test_a_folder_without_a_vocabulary_size_gets_the_tiny_models(tmp_path: Path) -> None:
    assert model_vocab_size(tmp_path) == 1024
    assert engine_args("c.json", tmp_path) == ["--corpus-token-ids", "c.json"]
