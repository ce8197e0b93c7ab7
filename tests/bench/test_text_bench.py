"""``anyio-genout bench text``: a quick run measures every variant, the report's ratios, and
the mock engine's ``--corpus-token-ids`` that makes its tokens real text.

Only the shape of the results is checked, never timings (they depend on the machine).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from anyio_genout.bench.text_report import build_text_report
from anyio_genout.cli.mock_cmd import build_parser, config_from_args
from tests.mock.test_cli import front_end, handshake


@pytest.mark.timeout(60)
def test_quick_text_run_measures_every_variant_on_real_text(tmp_path: Path) -> None:
    output = tmp_path / "text.json"
    proc = subprocess.run(
        [sys.executable, "-m", "anyio_genout", "bench", "text", "--quick", "--no-vllm",
         "--backends", "asyncio", "--concurrency", "1,4", "--tokenizers", "model",
         "--output", str(output)],
        capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets:" in proc.stdout
    document = json.loads(output.read_text())
    results = document["results"]
    assert [(r["impl"], r["concurrency"]) for r in results] == [("ours", 1), ("ours", 4)]
    assert {r["tokenizer"] for r in results} == {"model"}
    for r in results:
        assert "error" not in r, r
        assert r["complete"] is True  # no stop string matched: every stream ran 32 tokens
        assert set(r["variants"]) == {"tokens", "text-nodetok", "text", "text-stop2"}
        assert r["decode_step_us"] > 0
        assert set(r["added_x_step"]) == {"text-nodetok", "text", "text-stop2"}
        figures = r["variants"]
        assert all(f["delivered_tokens"] == r["concurrency"] * 32 for f in figures.values())
        # The engine streams the corpus: the text variants decode it to text, the others
        # deliver tokens only.
        assert figures["tokens"]["chars"] == figures["text-nodetok"]["chars"] == 0
        assert 0.5 < figures["text"]["chars"] / figures["text"]["delivered_tokens"] < 8
        assert figures["text-stop2"]["chars"] == figures["text"]["chars"]
    statuses = {(t["target"][:20], t["status"]) for t in document["targets"]}
    assert {s for _, s in statuses} <= {"PASS", "MISS", "N/A"}
    assert all(t["status"] == "N/A" for t in document["targets"] if "AsyncLLM" in t["target"])


@pytest.mark.timeout(120)
def test_quick_text_run_reports_each_built_tokenizer_on_its_own_corpus(tmp_path: Path
                                                                       ) -> None:
    output = tmp_path / "text.json"
    names = ["sp-bytefallback-32k", "bpe-bytelevel-32k"]
    proc = subprocess.run(
        [sys.executable, "-m", "anyio_genout", "bench", "text", "--quick", "--no-vllm",
         "--backends", "asyncio", "--concurrency", "4", "--tokenizers", ",".join(names),
         "--output", str(output)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    document = json.loads(output.read_text())
    assert [r["tokenizer"] for r in document["results"]] == names
    for r in document["results"]:
        assert "error" not in r, r
        assert r["complete"] is True
        text = r["variants"]["text"]
        assert 0.5 < text["chars"] / text["delivered_tokens"] < 12
    # A 32k vocabulary encodes the corpus in fewer tokens than the bundled one.
    corpus_tokens = document["meta"]["corpus_tokens"]
    assert set(corpus_tokens) == set(names)
    rows = document["rows"]
    assert {(row["tokenizer"], row["variant"]) for row in rows} == {
        (n, v) for n in names for v in ("tokens", "text-nodetok", "text", "text-stop2")}
    table = proc.stdout
    assert all(f"| {n} | ours/asyncio | text |" in table for n in names)


def test_report_keeps_tokenizers_apart_and_reads_results_without_one() -> None:
    old = _cell("ours", 64, 1, {"tokens": (1e5, 3.0), "text": (9e4, 4.0)},
                decode_step_us=1.0, added_x_step={"text": 1.0})
    built = {**_cell("ours", 64, 1, {"tokens": (1e5, 3.0), "text": (5e4, 6.0)},
                     decode_step_us=2.0, added_x_step={"text": 1.5}),
             "tokenizer": "sp-bytefallback-32k"}
    vllm = {**_cell("vllm", 64, 1, {"tokens": (1e5, 3.0), "text": (2.5e4, 9.0)}),
            "tokenizer": "sp-bytefallback-32k"}
    rows, targets = build_text_report([built, old, vllm])
    text = {(r["tokenizer"], r["impl"]): r for r in rows if r["variant"] == "text"}
    assert text["model", "ours"]["cpu_us_per_token"] == 4.0  # not mixed with the other
    assert text["model", "ours"]["added_us_per_token"] == pytest.approx(1.0)
    assert "tps_x_vllm" not in text["model", "ours"]  # no vLLM cell on that tokenizer
    assert text["sp-bytefallback-32k", "ours"]["tps_x_vllm"] == pytest.approx(2.0)
    assert rows[0]["tokenizer"] == "model"  # the default order
    assert {t["tokenizer"] for t in targets} == {"model", "sp-bytefallback-32k"}


def _cell(impl: str, concurrency: int, repeat: int, figures: dict[str, tuple[float, float]],
          **extra: Any) -> dict[str, Any]:
    return {"impl": impl, "backend": "uvloop", "concurrency": concurrency, "tokens": 128,
            "repeat": repeat, "complete": True, **extra,
            "variants": {v: {"tokens_per_s_median_round": tps,
                             "cpu_us_per_token_median_round": cpu}
                         for v, (tps, cpu) in figures.items()}}


def test_report_takes_medians_over_repeats_and_checks_both_targets() -> None:
    ours = [
        _cell("ours", 256, k, {"tokens": (3e5, 3.0), "text": (tps, cpu)},
              decode_step_us=1.0, added_x_step={"text": added})
        for k, (tps, cpu, added) in enumerate([(2e5, 4.0, 1.0), (1e5, 9.0, 5.0),
                                               (2.2e5, 4.4, 1.4)], 1)
    ]
    vllm = [_cell("vllm", 256, k, {"tokens": (2e5, 5.0), "text": (tps, 8.0)})
            for k, tps in enumerate([1.0e5, 1.2e5, 0.9e5], 1)]
    vllm.append({"impl": "vllm", "backend": "uvloop", "concurrency": 64, "repeat": 1,
                 "error": "timed out"})
    rows, targets = build_text_report([*ours, *vllm])
    text = next(r for r in rows if r["impl"] == "ours" and r["variant"] == "text")
    assert text["repeats"] == 3
    assert text["tokens_per_s"] == 2e5 and text["cpu_us_per_token"] == 4.4  # medians
    assert text["added_x_step"] == 1.4
    assert text["added_us_per_token"] == pytest.approx(1.4)  # 4.4 - 3.0
    assert text["tps_x_vllm"] == pytest.approx(2e5 / 1.0e5)
    found = {(t["target"].split()[1], t["status"]) for t in targets}
    assert found == {("text", "PASS")}  # 1.4 <= 1.5 and 2.0 >= 2.0
    worse = [_cell("ours", 256, 1, {"tokens": (3e5, 3.0), "text": (1.5e5, 6.0)},
                   decode_step_us=1.0, added_x_step={"text": 3.0}), *vllm]
    _, targets = build_text_report(worse)
    assert [t["status"] for t in targets] == ["MISS", "MISS"]
    _, alone = build_text_report(worse[:1])
    assert [t["status"] for t in alone] == ["MISS", "N/A"]  # no vLLM figures: not judged


def test_mock_engine_generates_the_corpus_given_on_its_command_line(tmp_path: Path) -> None:
    corpus = list(range(100, 140))
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(corpus))
    with front_end() as (sockets, address):
        proc = subprocess.Popen([sys.executable, "-m", "anyio_genout", "mock-engine",
                                 "--handshake-address", address, "--no-log-stats",
                                 "--vocab-size", "1024", "--corpus-token-ids", str(path)])
        try:
            identity = handshake(sockets)
            request = ["r", [1, 2, 3], None, {"temperature": 0.0, "max_tokens": 60}, None,
                       0.0, None, None, None]
            sockets["in"].send_multipart([identity, b"\x00", msgpack.packb(request)])
            tokens: list[int] = []
            while len(tokens) < 60:
                message = msgpack.unpackb(sockets["out"].recv())
                tokens += [t for row in message[1] for t in row[1]]
        finally:
            proc.kill()
            proc.wait()
    start = corpus.index(tokens[0])
    assert tokens == [corpus[(start + i) % len(corpus)] for i in range(60)]


@pytest.mark.parametrize(("content", "message"), [
    (None, "--corpus-token-ids: cannot read"), ("{not json", "--corpus-token-ids: cannot read"),
    ('{"a": 1}', "--corpus-token-ids: " + "{path} is not a JSON list of token ids"),
    ("[1, 2, 5000]", "corpus_token_ids must be a non-empty sequence of token ids in "
                     "[0, vocab_size=1024)"),
])
def test_mock_engine_names_a_bad_corpus_file(tmp_path: Path, content: str | None,
                                             message: str) -> None:
    path = tmp_path / "corpus.json"
    if content is not None:
        path.write_text(content)
    args = build_parser().parse_args(["--handshake-address", "tcp://127.0.0.1:1",
                                      "--vocab-size", "1024", "--corpus-token-ids", str(path)])
    with pytest.raises(ValueError, match=re.escape(message.format(path=path))):
        config_from_args(args)


def test_mock_engine_exits_2_on_a_bad_corpus_file(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "anyio_genout", "mock-engine",
                           "--handshake-address", "tcp://127.0.0.1:1",
                           "--corpus-token-ids", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "--corpus-token-ids: cannot read" in proc.stderr
