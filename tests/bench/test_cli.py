"""``anyio-genout bench`` on an install without the extras it needs, and its ``--help``.

A missing library is simulated by ``sys.modules[name] = None`` (``import name`` then fails),
in a child process for psutil (the bench modules may already be imported here) and in this
process otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from anyio_genout.bench.spec import BACKENDS
from anyio_genout.cli.bench import main as bench_cli

from ..mock.test_cli import assert_every_option_documented, help_entries


def run_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``anyio-genout ARGV`` in a child process where ``import MODULE`` fails."""
    shim = (f"import sys; sys.modules[{module!r}] = None; "
            f"from anyio_genout.cli.main import main; sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", shim], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, check=False)


def test_without_psutil_bench_says_which_extra_to_install(tmp_path: Path) -> None:
    proc = run_without("psutil", "bench", "--quick", "--output", str(tmp_path / "b.json"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("anyio-genout bench needs the 'bench' extra: "
                           "pip install 'anyio-genout[bench]'\n")
    assert not (tmp_path / "b.json").exists()


def test_without_psutil_help_and_report_still_work(tmp_path: Path) -> None:
    proc = run_without("psutil", "bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: anyio-genout bench ")
    saved = tmp_path / "bench.json"
    saved.write_text('{"meta": {}, "results": []}')
    proc = run_without("psutil", "bench", "report", "--results", str(saved), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("backend", ["uvloop", "trio"])
def test_a_named_backend_that_is_not_installed_is_one_line(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, backend, None)
    code = bench_cli.main(["--backends", f"asyncio,{backend}", "--quick", "--no-floor",
                           "--workloads", "throughput", "--no-plot",
                           "--output", str(tmp_path / "b.json")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"anyio-genout bench --backends {backend} needs the '{backend}' extra: "
        f"pip install 'anyio-genout[{backend}]'\n")


def test_by_default_a_missing_backend_is_skipped_naming_its_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert bench_cli._available("anyio-genout bench", BACKENDS) == ["asyncio", "trio"]
    assert capsys.readouterr().err == (
        "anyio-genout bench: skipping the uvloop backend (anyio-genout bench --backends "
        "uvloop needs the 'uvloop' extra: pip install 'anyio-genout[uvloop]')\n")


def test_profile_without_pyinstrument_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pyinstrument", None)
    code = bench_cli.main(["--profile", str(tmp_path), "--quick", "--no-floor",
                           "--backends", "asyncio", "--workloads", "throughput",
                           "--concurrency", "1", "--no-plot",
                           "--output", str(tmp_path / "b.json")])
    assert code == 2
    assert capsys.readouterr().err == (
        "anyio-genout bench --profile needs the 'bench' extra: "
        "pip install 'anyio-genout[bench]'\n")


@pytest.mark.parametrize("build", ["build_parser", "build_vllm_parser", "build_report_parser"])
def test_every_option_has_a_description_that_shows_its_default(build: str) -> None:
    parser: argparse.ArgumentParser = getattr(bench_cli, build)()
    assert_every_option_documented(parser)


def test_help_shows_the_real_defaults() -> None:
    entries = help_entries(bench_cli.build_parser().format_help())
    assert "(default: bench-results/bench.json)" in entries["--output"]
    assert "(default: 300.0)" in entries["--timeout"]
    assert "(default: 1,64,256,1024; quick: 1,64)" in entries["--concurrency"]


def test_bench_profile_summarises_py_spy_stacks_without_the_extra(tmp_path: Path) -> None:
    """``anyio-genout bench profile STACKS.txt``: the summary of py-spy's collapsed stacks
    (the stacks outside ``--within`` left out), with no extra installed."""
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        "run_forever (asyncio/base_events.py:1);decode (anyio_genout/protocol/x.py:3) 3\n"
        "run_forever (asyncio/base_events.py:1);recv (anyio_genout/transport.py:9) 1\n"
        "import_module (importlib/__init__.py:5) 50\n")
    proc = run_without("psutil", "bench", "profile", str(stacks), "--top", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "4 samples"
    assert lines[lines.index("self time by area:") + 1] == \
        "   75.0%  anyio_genout.protocol (decode)"
    assert lines[lines.index("top functions by self time:") + 1] == \
        "   75.0%  decode (anyio_genout/protocol/x.py)"


def test_bench_profile_help_documents_every_option() -> None:
    parser = bench_cli._build(bench_cli.DEFAULT_PROG)[1]["profile"]
    assert_every_option_documented(parser)
