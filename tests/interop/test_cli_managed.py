"""The command line with --vllm-model: it starts a real engine, generates, and stops it."""

from __future__ import annotations

import shlex
import subprocess
import sys

import psutil
import pytest

from .conftest import GREEDY_16, INTEROP_TIMEOUT, PROMPT, RealVllm

pytestmark = pytest.mark.timeout(INTEROP_TIMEOUT)


def test_generate_with_a_managed_vllm_engine(real_vllm: RealVllm) -> None:
    before = {p.pid for p in psutil.process_iter()}
    done = subprocess.run(
        [sys.executable, "-m", "anyio_genout", "generate",
         "--prompt-token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8",
         "--vllm-model", real_vllm.model,
         "--vllm-command", " ".join(shlex.quote(part) for part in real_vllm.command),
         "--ready-timeout", "240"],
        capture_output=True, text=True, timeout=INTEROP_TIMEOUT - 30, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert tuple(int(t) for t in done.stdout.split()) == GREEDY_16[:8]
    assert "finish_reason=length" in done.stderr and "output_tokens=8" in done.stderr
    # The engine processes it started are gone.
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"])
                 if p.info["pid"] not in before and "serve" in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
