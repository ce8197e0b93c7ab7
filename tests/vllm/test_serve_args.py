"""The engine command line this project runs (``build_serve_args``): engines on a model folder
with a tokenizer keep it (structured outputs need it, as with ``vllm serve``)."""

from __future__ import annotations

from pathlib import Path

from anyio_genout.text import bundled_model_dir
from anyio_genout.vllm import build_serve_args

ADDRESS = "tcp://127.0.0.1:29550"


def _folder(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_a_folder_with_a_tokenizer_keeps_it(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        args = build_serve_args(_folder(folder, "config.json", name), handshake_address=ADDRESS)
        assert "--skip-tokenizer-init" not in args, name
    assert "--skip-tokenizer-init" not in build_serve_args(bundled_model_dir(),
                                                           handshake_address=ADDRESS)


def test_a_folder_without_a_tokenizer_skips_it(tmp_path: Path) -> None:
    args = build_serve_args(_folder(tmp_path, "config.json"), handshake_address=ADDRESS)
    assert args[:2] == ["serve", str(tmp_path)]
    assert "--skip-tokenizer-init" in args


def test_a_hub_id_keeps_it_and_the_caller_may_ask_for_it() -> None:
    assert "--skip-tokenizer-init" not in build_serve_args("org/model",
                                                           handshake_address=ADDRESS)
    asked = build_serve_args("org/model", handshake_address=ADDRESS,
                             extra_args=["--skip-tokenizer-init"])
    assert asked.count("--skip-tokenizer-init") == 1
