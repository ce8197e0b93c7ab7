"""``anyio-genout run -i INPUT -o OUTPUT``, as ``vllm run-batch -i -o`` spells it."""

from __future__ import annotations

from pathlib import Path

from tests.cli.support import cli, read_results, request_line, write_lines


def test_run_takes_the_input_as_vllm_run_batch_does(tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", [request_line("a", [1, 2, 3], max_tokens=2)])
    for spelling in (["-i", str(source)], ["--input-file", str(source)], [str(source)]):
        out = tmp_path / "out.jsonl"
        done = cli("run", *spelling, "-o", str(out))
        assert done.returncode == 0, done.stderr
        assert [r["request_id"] for r in read_results(out)] == ["a"]


def test_run_wants_the_input_once(tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", [request_line("a", [1], max_tokens=1)])
    for spelling in ([], [str(source), "-i", str(source)]):
        done = cli("run", *spelling, "-o", str(tmp_path / "out.jsonl"))
        assert done.returncode == 2
        assert done.stderr.splitlines()[-1] == (
            "anyio-genout: error: give the input file once: INPUT or -i/--input-file")
