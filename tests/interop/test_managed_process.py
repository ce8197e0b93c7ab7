"""The process manager of :mod:`anyio_genout.vllm` with stand-in commands (no vLLM needed).

``spawn_vllm_engines`` runs any command with ``serve MODEL --headless ...`` appended; here the
command is a small Python script that starts a child process (like ``vllm serve`` starts its
EngineCore and Worker) and then behaves well or badly.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

from anyio_genout import EngineDeadError
from anyio_genout.vllm import (
    CPU_TEST_ARGS,
    EngineProcessExitedError,
    VllmEngines,
    build_serve_args,
    parse_handshake_address,
    read_model_eos_token_id,
    read_model_eos_token_ids,
    read_model_vocab_size,
    spawn_vllm_engines,
)

pytestmark = pytest.mark.timeout(60)

ADDRESS = "tcp://127.0.0.1:45678"

# Starts a child, prints both pids, then idles (or ignores SIGTERM, or exits on its own).
_SCRIPT = """
import os, signal, subprocess, sys, time
mode = os.environ.get("FAKE_MODE", "idle")
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "time.sleep(600)", mode])
print("FAKE-READY", os.getpid(), child.pid, flush=True)
print("args:", " ".join(sys.argv[1:]), file=sys.stderr, flush=True)
if mode == "crash":
    print("boom: the engine failed", flush=True)
    sys.exit(3)
time.sleep(600)
"""
FAKE_COMMAND = [sys.executable, "-c", _SCRIPT]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


async def _wait_ready(engines: VllmEngines) -> tuple[int, int]:
    with anyio.fail_after(20):
        while True:
            for line in engines.log_tail:
                if line.startswith("FAKE-READY"):
                    _, parent, child = line.split()
                    return int(parent), int(child)
            await anyio.sleep(0.02)


async def _wait_gone(*pids: int, limit: float = 5.0) -> None:
    with anyio.fail_after(limit):
        while True:
            if not any(_alive(pid) for pid in pids):
                return
            await anyio.sleep(0.02)


def fake(mode: str = "idle", grace_period: float = 5.0) -> VllmEngines:
    return spawn_vllm_engines("/models/fake", handshake_address=ADDRESS, command=FAKE_COMMAND,
                              env={"FAKE_MODE": mode}, grace_period=grace_period)


# ---------------------------------------------------------------------------- pure helpers


def test_serve_args_carry_the_headless_dp_flags() -> None:
    args = build_serve_args("/m", handshake_address="tcp://10.1.2.3:5555", engine_count=2)
    assert args[:2] == ["serve", "/m"]
    text = " ".join(args)
    for flag in ("--headless", "--data-parallel-address 10.1.2.3",
                 "--data-parallel-rpc-port 5555", "--data-parallel-size 2",
                 "--data-parallel-size-local 2",
                 "--max-model-len 512", "--kv-cache-memory-bytes 67108864", "--enforce-eager"):
        assert flag in text
    assert "--data-parallel-start-rank" not in text
    # "/m" is no local folder (a hub id, as vllm serve takes it): it has a tokenizer, so the
    # engines keep theirs (structured outputs need it; tests/vllm/test_serve_args.py)
    assert "--skip-tokenizer-init" not in text


def test_extra_args_replace_the_same_default_flag() -> None:
    args = build_serve_args("/m", handshake_address=ADDRESS,
                            extra_args=["--max-model-len=1024", "--no-enforce-eager",
                                        "--disable-log-stats"])
    assert "512" not in args and "--enforce-eager" not in args
    assert args[-3:] == ["--max-model-len=1024", "--no-enforce-eager", "--disable-log-stats"]
    assert "--dtype" in args  # untouched defaults stay
    bare = build_serve_args("/m", handshake_address=ADDRESS, default_args=())
    assert not set(CPU_TEST_ARGS) & set(bare[2:]) - {"0"}


def test_start_rank_for_a_second_host() -> None:
    args = build_serve_args("/m", handshake_address=ADDRESS, engine_count=2, start_rank=2,
                            data_parallel_size=4)
    text = " ".join(args)
    assert "--data-parallel-size 4" in text and "--data-parallel-size-local 2" in text
    assert "--data-parallel-start-rank 2" in text
    with pytest.raises(ValueError):
        build_serve_args("/m", handshake_address=ADDRESS, engine_count=2, start_rank=3,
                         data_parallel_size=4)
    with pytest.raises(ValueError):
        build_serve_args("/m", handshake_address=ADDRESS, engine_count=0)


@pytest.mark.parametrize("address", ["127.0.0.1:5", "ipc:///tmp/x", "tcp://host", "tcp://:5"])
def test_bad_handshake_addresses(address: str) -> None:
    with pytest.raises(ValueError):
        parse_handshake_address(address)


def test_handshake_addresses() -> None:
    assert parse_handshake_address("tcp://127.0.0.1:62100") == ("127.0.0.1", 62100)
    assert parse_handshake_address("tcp://[::1]:7") == ("::1", 7)


def test_model_facts(tmp_path: Path) -> None:
    assert read_model_vocab_size(tmp_path) is None
    assert read_model_eos_token_id(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024, "eos_token_id": 2}))
    assert read_model_vocab_size(tmp_path) == 1024
    assert read_model_eos_token_id(tmp_path) == 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert read_model_eos_token_ids(tmp_path) == (7, 8)
    assert read_model_eos_token_id(tmp_path) == 7
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 99}}))
    assert read_model_vocab_size(tmp_path) == 99
    assert read_model_vocab_size(tmp_path / "missing") is None


# ---------------------------------------------------------------------------- processes


@pytest.mark.anyio
async def test_leaving_the_block_stops_the_whole_process_group() -> None:
    seen: list[EngineDeadError] = []
    async with fake() as engines:
        engines.on_exit(seen.append)
        parent, child = await _wait_ready(engines)
        assert engines.pids == [parent] and engines.running
        assert engines.returncodes == [None]
        rpc_dir = engines._rpc_dir
        assert rpc_dir is not None and await anyio.Path(rpc_dir).is_dir()
    assert not _alive(parent) and not _alive(child)
    assert engines.returncodes == [-signal.SIGTERM]
    assert engines.exit_error is None  # a stop we asked for is not an error...
    assert len(seen) == 1 and isinstance(seen[0], EngineProcessExitedError)
    assert seen[0].expected  # ...but callbacks still learn that the engine is gone
    assert not await anyio.Path(rpc_dir).exists()
    assert any(line.startswith("args: serve /models/fake --headless") for line in
               engines.log_tail)


@pytest.mark.anyio
async def test_sigterm_ignored_escalates_to_sigkill() -> None:
    async with fake("stubborn", grace_period=0.5) as engines:
        parent, child = await _wait_ready(engines)
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 5
    assert not _alive(parent) and not _alive(child)
    assert engines.returncodes == [-signal.SIGKILL]


@pytest.mark.anyio
async def test_cancellation_still_stops_everything() -> None:
    pids: tuple[int, int] | None = None
    with anyio.move_on_after(30) as scope:
        async with fake() as engines:
            pids = await _wait_ready(engines)
            scope.cancel()
            await anyio.sleep(600)
    assert scope.cancelled_caught and pids is not None
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.anyio
async def test_keyboard_interrupt_still_stops_everything() -> None:
    pids: tuple[int, int] | None = None
    with pytest.raises(KeyboardInterrupt):
        async with fake("stubborn", grace_period=0.3) as engines:
            pids = await _wait_ready(engines)
            raise KeyboardInterrupt
    assert pids is not None and not any(_alive(pid) for pid in pids)


@pytest.mark.anyio
async def test_unexpected_exit_reports_the_exit_code_and_log_tail(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="anyio_genout.vllm")
    seen: list[EngineDeadError] = []
    async with fake("crash") as engines:
        engines.on_exit(seen.append)
        parent, child = await _wait_ready(engines)
        with anyio.fail_after(10):
            assert await engines.wait() == [3]
        error = engines.exit_error
        assert isinstance(error, EngineProcessExitedError) and isinstance(error, EngineDeadError)
        assert error.pid == parent and error.exit_code == 3 and not error.expected
        assert any("boom: the engine failed" in line for line in error.log_tail)
        assert f"vLLM engine process {parent} exited with code 3" in str(error)
        assert "boom: the engine failed" in str(error)
        assert seen == [error]
        await _wait_gone(child)  # the orphaned child was killed with the group
        late: list[EngineDeadError] = []
        engines.on_exit(late.append)  # registering after the exit calls back at once
        assert late == [error]
    assert seen == [error]  # no second call when the block ends
    assert any("FAKE-READY" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_a_failing_callback_does_not_stop_the_others() -> None:
    seen: list[EngineDeadError] = []

    def broken(error: EngineDeadError) -> None:
        raise RuntimeError("callback bug")

    async with fake("crash") as engines:
        engines.on_exit(broken)
        unregister = engines.on_exit(lambda error: seen.append(error))
        engines.on_exit(seen.append)
        unregister()
        with anyio.fail_after(10):
            await engines.wait()
    assert len(seen) == 1
