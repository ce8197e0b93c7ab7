"""``anyio-genout serve`` freezes its start-up heap once it has started, as vLLM's server
does (``gc.freeze``), so no full collection while serving walks the modules, the tokenizer
and the app: one of a large heap holds the GIL, and with it every stream, for tenths of a
second. The CLI as a subprocess, on each backend, watched through a ``sitecustomize`` that
reports the freeze on stderr."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.server.support import serve_process

#: Imported by the child's interpreter at start-up (its directory is on PYTHONPATH).
_REPORTER = '''
import gc, sys
_freeze = gc.freeze
def freeze():
    _freeze()
    print(f"gc.freeze: {gc.get_freeze_count()} objects", file=sys.stderr, flush=True)
gc.freeze = freeze
'''


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_serve_freezes_its_start_up_heap_before_it_serves(tmp_path: Path, backend: str
                                                          ) -> None:
    (tmp_path / "sitecustomize.py").write_text(_REPORTER)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    with serve_process("--backend", backend, env={"PYTHONPATH": path},
                       exit_code=130) as server:
        # ignore_eos: the mock samples at random and may end early on its EOS (1/256 a token).
        answer = httpx.post(f"{server.base}/v1/completions", timeout=30, json={
            "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 5
        lines = list(server.lines)
    frozen = [i for i, line in enumerate(lines) if line.startswith("gc.freeze: ")]
    announced = [i for i, line in enumerate(lines) if re.match(r"serving '.*' on ", line)]
    assert len(frozen) == 1 and announced, server.err
    assert frozen[0] < announced[0], server.err  # frozen before it says it serves
    # The whole start-up heap: modules, the app, the tokenizer (tens of thousands).
    count = int(lines[frozen[0]].split()[1])
    assert count > 20_000, lines[frozen[0]]
