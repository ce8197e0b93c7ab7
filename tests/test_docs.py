"""The documentation cannot rot: its examples run and its links resolve.

* Every ```python block in ``README.md`` and ``docs/*.md`` whose first line is
  ``# doctest: run`` is executed in a fresh interpreter (a temp file, a timeout) and must
  exit 0, print something if it calls ``print``, and leak nothing that Python reports on
  exit. Such blocks are complete programs: each starts its own mock engine on a free port.
  Unmarked blocks (fragments, the README's example that needs real engines) must still
  compile.
* The ``anyio-genout run`` example of the quickstart runs on its JSONL example.
* Each command of README.md's "Command line" block that runs on the embedded mock runs as
  written and prints what it says it prints (the ones that wait for remote engines, and
  the benchmark, are named in ``_NOT_RUN``).
* Every relative link (and ``#anchor``) in those files points to something that exists.
* The metrics and errors references name every metric family, bucket constant and error.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUN_MARKER = "# doctest: run"
#: Seconds one example may take (pytest-timeout allows 60 per test).
TIMEOUT = 45

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s.*)?$")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Fenced:
    language: str
    line: int  # 1-based line of the opening fence
    source: str


def fenced_blocks(text: str) -> list[Fenced]:
    """The fenced code blocks of a Markdown text, in order."""
    blocks: list[Fenced] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None or (match["fence"][0] == "`" and "`" in match["info"]):
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                break
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        info = match["info"].strip()
        blocks.append(Fenced(info.split()[0].lower() if info else "", i + 1,
                             "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def prose_lines(text: str, *, strip_code_spans: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code, with inline code spans removed if asked."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match is not None:
            fence = match["fence"]
            continue
        if fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                fence = None
            continue
        yield number, _CODE_SPAN.sub("", line) if strip_code_spans else line


@dataclass(frozen=True)
class PythonBlock:
    path: Path
    index: int  # among the file's python blocks
    line: int
    source: str

    @property
    def runnable(self) -> bool:
        return self.source.startswith(RUN_MARKER)

    @property
    def id(self) -> str:
        return f"{rel(self.path)}-block{self.index}"


def python_blocks(path: Path) -> list[PythonBlock]:
    found = [b for b in fenced_blocks(path.read_text(encoding="utf-8")) if b.language == "python"]
    return [PythonBlock(path, i, b.line, b.source) for i, b in enumerate(found)]


ALL_BLOCKS = [block for path in doc_files() for block in python_blocks(path)]
RUNNABLE = [block for block in ALL_BLOCKS if block.runnable]


# ------------------------------------------------------------------------------ examples


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in RUNNABLE])
def test_runnable_example(block: PythonBlock, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.source, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    where = f"{rel(block.path)}:{block.line}"
    try:
        result = subprocess.run(
            [sys.executable, "-W", "error", str(script)], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{where}: the example did not finish within {TIMEOUT} s\n"
                    f"stdout:\n{exc.stdout!r}\nstderr:\n{exc.stderr!r}")
    report = f"{where}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, report
    if re.search(r"\bprint\(", block.source):
        assert result.stdout.strip(), report
    assert "Exception ignored" not in result.stderr, report


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ALL_BLOCKS])
def test_python_block_compiles(block: PythonBlock) -> None:
    """Fragments too: top-level ``await`` / ``async with`` / ``async for`` are allowed."""
    try:
        compile(block.source, f"{rel(block.path)}:{block.line}", "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        pytest.fail(f"{rel(block.path)}:{block.line + (exc.lineno or 0)}: {exc.msg}")


@pytest.mark.parametrize("page, minimum", [("quickstart.md", 3), ("concepts.md", 3),
                                           ("metrics.md", 1), ("errors.md", 1)])
def test_pages_have_runnable_examples(page: str, minimum: int) -> None:
    count = sum(1 for b in RUNNABLE if b.path == DOCS / page)
    assert count >= minimum, f"docs/{page}: {count} runnable example(s), expected {minimum}+"


def test_readme_example_is_not_marked_runnable() -> None:
    """It needs real engines on port 29550: it must only compile, never run."""
    readme = [b for b in ALL_BLOCKS if b.path == ROOT / "README.md"]
    assert readme
    assert not any(b.runnable for b in readme)


def test_quickstart_batch_example(tmp_path: Path) -> None:
    """The quickstart's ``anyio-genout run`` command, on its JSONL example, as written."""
    blocks = fenced_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8"))
    jsonl = [b for b in blocks if b.language == "jsonl"]
    assert len(jsonl) == 1
    commands = [line.strip() for b in blocks if b.language == "bash"
                for line in b.source.splitlines() if line.strip().startswith("anyio-genout run")]
    assert len(commands) == 1
    argv = shlex.split(commands[0])
    requests = [json.loads(line) for line in jsonl[0].source.splitlines() if line.strip()]
    (tmp_path / argv[2]).write_text(jsonl[0].source, encoding="utf-8")
    output = tmp_path / argv[argv.index("-o") + 1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "anyio_genout.cli.main", *argv[1:], "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr
    results = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["request_id"] for r in results) == sorted(r["request_id"] for r in requests)
    for line in results:
        assert line["finish_reason"] in {"stop", "length"}, line
        assert line["token_ids"], line


def readme_commands() -> list[str]:
    """The command lines of README.md's "Command line" block, as written (comments too)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in fenced_blocks(section) if b.language == "bash")
    return [line.strip() for line in block.source.splitlines() if line.strip()]


#: README commands that need engines or time the suite does not have, and why.
_NOT_RUN = {"--handshake-address": "waits for remote engines", "bench": "a benchmark"}


def _not_run(argv: list[str]) -> str | None:
    return next((why for word, why in _NOT_RUN.items() if word in argv), None)


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "anyio_genout", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False,
                          stdin=subprocess.DEVNULL)


def _free_port() -> str:
    from anyio_genout.transport import free_tcp_port

    return str(free_tcp_port("127.0.0.1"))


def test_readme_commands_are_run_or_named() -> None:
    """Each README command runs in test_readme_command, or needs what _NOT_RUN says."""
    commands = readme_commands()
    assert len(commands) >= 10
    run = [c for c in commands if _not_run(shlex.split(c, comments=True)) is None]
    assert any("generate" in c for c in run) and any(" run " in c for c in run)
    assert any(" serve " in c for c in run)


def _check_generate(argv: list[str], done: subprocess.CompletedProcess[str]) -> None:
    out = done.stdout
    if "--logprobs" in argv:  # one line per token: id, logprob, rank, alternatives
        rows = [line.split("\t") for line in out.splitlines()]
        assert rows and all(len(row) == 4 and len(row[3].split()) == 2 for row in rows), out
    elif "--prompt-token-ids" in argv:  # token ids in and out
        ids = out.split()
        assert len(ids) == int(argv[argv.index("--max-tokens") + 1]), out
        assert all(i.isdigit() for i in ids), out
    else:  # text, cut before the stop string if there is one
        text = out.strip()
        assert len(text.split()) >= 3 and "\ufffd" not in text, out
        if "--stop" in argv:
            assert argv[argv.index("--stop") + 1] not in text, out


@pytest.mark.parametrize("command", [c for c in readme_commands()
                                     if _not_run(shlex.split(c, comments=True)) is None])
def test_readme_command(command: str, tmp_path: Path) -> None:
    """Each command of README.md's Command line block that runs on the embedded mock, as
    written (a free port for a fixed one), prints what it says it prints."""
    argv = shlex.split(command, comments=True)
    assert argv[0] == "anyio-genout"
    for option in ("--port", "--metrics-port"):
        if option in argv:
            argv[argv.index(option) + 1] = _free_port()
    if argv[1] == "generate":
        done = _cli(argv, tmp_path)
        assert done.returncode == 0, done.stderr
        _check_generate(argv, done)
        assert done.stderr.startswith("finish_reason="), done.stderr  # the summary line
    elif argv[1] == "run":
        blocks = fenced_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8"))
        example = next(b for b in blocks if b.language == "jsonl").source
        (tmp_path / argv[2]).write_text(example, encoding="utf-8")
        count = len([line for line in example.splitlines() if line.strip()])
        output = tmp_path / argv[argv.index("-o") + 1]
        if "--resume" in argv:  # an interrupted job: the first result only was written
            first = _cli([*argv[:2], argv[2], "-o", argv[argv.index("-o") + 1]], tmp_path)
            assert first.returncode == 0, first.stderr
            kept = output.read_text(encoding="utf-8").splitlines()[:1]
            output.write_text(kept[0] + "\n", encoding="utf-8")
        done = _cli(argv, tmp_path)
        assert done.returncode == 0, done.stderr
        results = [json.loads(line) for line in output.read_text().splitlines()]
        assert len(results) == count and all(r["token_ids"] for r in results), results
        if "--resume" in argv:
            assert "resuming: 1 finished result(s)" in done.stderr, done.stderr
    else:
        assert argv[1] == "serve", command
        _check_serve(argv, tmp_path)


def _check_serve(argv: list[str], cwd: Path) -> None:
    import httpx

    port = argv[argv.index("--port") + 1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = subprocess.Popen([sys.executable, "-m", "anyio_genout", *argv[1:]], cwd=cwd,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL)
    headers = {}
    if "--api-key" in argv:
        headers["authorization"] = f"Bearer {argv[argv.index('--api-key') + 1]}"
    try:
        from tests.server.support import wait_for_health

        wait_for_health(f"http://127.0.0.1:{port}", child)
        # ignore_eos: the mock engine samples at random, and about one chat in 250 meets
        # its end-of-sequence token first and answers "" (finish_reason "stop").
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers,
                            json={"messages": [{"role": "user", "content": "Hello"}],
                                  "max_tokens": 16, "ignore_eos": True}, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip()
    finally:
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=TIMEOUT)
    assert child.returncode == 130, err


# ------------------------------------------------------------------------------ links


def github_slugs(path: Path) -> set[str]:
    """The anchors GitHub generates for the headings of a Markdown file."""
    slugs: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8"), strip_code_spans=False):
        match = _HEADING.match(line)
        if match is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match["text"]).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def relative_links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            yield number, match["target"]
        reference = _REFERENCE.match(line)
        if reference is not None:
            yield number, reference["target"]


@pytest.mark.parametrize("path", [pytest.param(p, id=rel(p)) for p in doc_files()])
def test_relative_links_resolve(path: Path) -> None:
    problems: list[str] = []
    for number, target in relative_links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{rel(path)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in github_slugs(resolved):
            problems.append(f"{where}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ references


def test_metrics_reference_names_every_family() -> None:
    from anyio_genout.metrics import Metrics

    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    exposed = {family.name + ("_total" if family.type == "counter" else "")
               for family in Metrics().registry.collect()}
    documented = set(re.findall(r"`((?:vllm|anyio_genout):[a-z0-9_]+)`", text))
    assert exposed - documented == set(), "metrics missing from docs/metrics.md"
    assert documented - exposed == set(), "docs/metrics.md names metrics that do not exist"


def test_metrics_reference_buckets_match_the_code() -> None:
    from anyio_genout.metrics import buckets

    rows = re.findall(r"^\|[^|]*\|\s*`([A-Z_]+_BUCKETS)`\s*\|([^|]*)\|",
                      (DOCS / "metrics.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert len(rows) == 6
    for name, bounds in rows:
        listed = [float(v) for v in re.findall(r"\d+(?:\.\d+)?", bounds.split("(")[0])]
        expected = [b for b in getattr(buckets, name) if math.isfinite(b)]
        assert listed == expected, name


def test_errors_reference_names_every_error() -> None:
    from anyio_genout import errors

    text = (DOCS / "errors.md").read_text(encoding="utf-8")
    headed = set(re.findall(r"^###\s+`(\w+)", text, re.MULTILINE))
    leaves = {name for name in errors.__all__
              if name not in {"GenoutError", "UsageError", "OperationalError"}}
    assert leaves | {"TransportError"} <= headed
    for name in [*errors.__all__, "TransportError"]:
        assert re.search(rf"\b{name}\b", text.split("## Where errors come from")[0]), name
