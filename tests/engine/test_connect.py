"""Connecting, as a user sees it: bad addresses are refused up front, the wait for engines
says what it waits for, and Ctrl-C during it is a plain KeyboardInterrupt."""

from __future__ import annotations

import logging
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from anyio_genout import (
    BootstrappedTransport,
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTimeoutError,
    HandshakeTransport,
)
from anyio_genout.engine import handshake
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.text import bundled_model_dir
from anyio_genout.transport import free_tcp_address

from .fake import FakeEngine

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------- addresses


@pytest.mark.parametrize(("field", "address", "why"), [
    ("address", "127.0.0.1:29550", r"no scheme \(did you mean 'tcp://127.0.0.1:29550'"),
    ("address", "localhost", "no scheme"),
    ("address", "tcp://127.0.0.1", "HOST:PORT"),
    ("address", "tcp://:29550", "HOST:PORT"),
    ("address", "tcp://127.0.0.1:*", "engines must know this port"),
    ("address", "tcp://127.0.0.1:0", "engines must know this port"),
    ("address", "tcp://127.0.0.1:70000", "not a number from 1 to 65535"),
    ("address", "tcp://127.0.0.1:port", "not a number from 1 to 65535"),
    ("address", "tcp://::1:29550", r"brackets: tcp://\[::1\]:29550"),
    ("address", "tcp://[::1:29550", "HOST:PORT"),
    ("address", "tcp://127.0.0.1 :29550", "white space"),
    ("address", "udp://127.0.0.1:29550", "not a transport"),
    ("address", "inproc://engines", "same ZeroMQ context"),
    ("input_address", "ipc://", "needs a path"),
    ("input_address", "ipc:///" + "x" * 120, "at most 107"),
    ("output_address", "127.0.0.1:5555", "no scheme"),
    ("output_address", "tcp://localhost", "HOST:PORT"),
])
def test_a_bad_address_is_refused_naming_the_field_and_the_expected_form(
        field: str, address: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        HandshakeTransport(**{field: address})
    message = str(info.value)
    assert message.startswith(f"{field} {address!r}: ")
    assert "tcp://HOST:PORT (e.g. tcp://127.0.0.1:29550)" in message
    assert "ipc://PATH" in message


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:29550", "tcp://[::1]:29550",
                                     "tcp://*:29550", "tcp://eth0:29550",
                                     "ipc:///tmp/genout.sock", "ipc://@abstract"])
def test_only_sockets_engines_dial_need_a_fixed_port(address: str) -> None:
    transport = HandshakeTransport(address, input_address=address,
                                   output_address="tcp://127.0.0.1:*")
    assert EngineCoreClientConfig(transport=transport).transport == transport
    # Bootstrapped, the engines dial the input and output sockets themselves.
    with pytest.raises(ValueError, match=r"output_address 'tcp://127.0.0.1:\*': engines must"):
        BootstrappedTransport(input_address=address, output_address="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match=r"input_address 'tcp://127.0.0.1:0': engines must"):
        BootstrappedTransport(input_address="tcp://127.0.0.1:0", output_address=address)


# ---------------------------------------------------------------------- waiting


@pytest.fixture
def quick_reminders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "WAITING_NOTICE_AFTER", 0.05, raising=False)
    monkeypatch.setattr(handshake, "WAITING_LOG_INTERVAL", 0.1, raising=False)


def waiting_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "anyio_genout.engine" and "waiting" in r.getMessage()]


@pytest.mark.anyio
@pytest.mark.usefixtures("quick_reminders")
async def test_waiting_for_absent_engines_says_what_and_where(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "anyio_genout.engine")
    address = free_tcp_address()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2,
                                    ready_timeout=0.4)
    with pytest.raises(HandshakeTimeoutError):
        async with EngineCoreClient.connect(config):
            pass
    lines = waiting_lines(caplog)
    first, *reminders = lines
    # At once: what, from whom, where, for how long.
    assert first[0] == logging.INFO
    assert first[1].startswith("connecting: waiting for engines 0, 1 to say HELLO on the "
                               f"handshake socket {address}, up to 0.4 s (ready_timeout)")
    port = address.rpartition(":")[2]
    assert (f"vllm serve <model> --headless --data-parallel-address 127.0.0.1 "
            f"--data-parallel-rpc-port {port} --data-parallel-size 2") in first[1]
    # Then every so often, as a warning: a plain script's logging shows it.
    assert len(reminders) >= 2
    for level, text in reminders:
        assert level == logging.WARNING
        assert re.match(r"still waiting after \d+ s for engines 0, 1 to say HELLO on the "
                        rf"handshake socket {re.escape(address)}", text), text


@pytest.mark.anyio
@pytest.mark.usefixtures("quick_reminders")
async def test_waiting_for_a_loading_engine_is_logged_but_not_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "anyio_genout.engine")
    address = free_tcp_address()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=0.5)
    engine = FakeEngine()
    try:
        async with anyio.create_task_group() as tg:
            # HELLO, then nothing more: the engine is "loading its model".
            tg.start_soon(lambda: engine.handshake(address, send_ready=False, register=False))
            with pytest.raises(HandshakeTimeoutError, match="input registration"):
                async with EngineCoreClient.connect(config):
                    pass
    finally:
        engine.close()
    loading = [(level, text) for level, text in waiting_lines(caplog)
               if "to finish starting (input registration is missing)" in text]
    assert loading, waiting_lines(caplog)
    assert {level for level, _ in loading} == {logging.INFO}
    assert "after HELLO an engine loads its model" in loading[0][1]


@pytest.mark.anyio
async def test_a_prompt_start_up_warns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "anyio_genout.engine")
    address = free_tcp_address()
    async with anyio.create_task_group() as tg:
        tg.start_soon(MockEngine(MockEngineConfig(handshake_address=address, linger=0)).serve)
        config = EngineCoreClientConfig(transport=HandshakeTransport(address))
        async with EngineCoreClient.connect(config):
            pass
        tg.cancel_scope.cancel()
    lines = waiting_lines(caplog)
    assert [level for level, _ in lines] == [logging.INFO]  # the line at the start, only
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------- the README example


def _terminal_sigint() -> None:  # pragma: no cover - runs in the child before exec
    """Ctrl-C as a terminal delivers it: SIGINT at its default and not blocked, whatever the
    test worker's own state (a child inherits an ignored or blocked SIGINT, and Python then
    never raises KeyboardInterrupt; two CI runs of the whole suite timed out so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def readme_example(address: str, backend: str) -> str:
    """The README's Python example (which needs real engines), for ``address``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    [source] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                if "Client.connect" in block]
    assert '"tcp://127.0.0.1:29550"' in source and 'backend="trio"' in source
    source = source.replace('"tcp://127.0.0.1:29550"', repr(address))
    # The example's model folder is the reader's own; the shipped one stands in for it.
    assert '"/models/my-model"' in source
    source = source.replace('"/models/my-model"', repr(str(bundled_model_dir())))
    # A marker on stdout once the script runs, so the test knows when it waits.
    return ("print('started', flush=True)\n"
            + source.replace('backend="trio"', f"backend={backend!r}"))


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_readme_example_without_engines_says_so_and_ctrl_c_is_plain(
        tmp_path: Path, backend: str) -> None:
    script = tmp_path / "example.py"
    address = free_tcp_address()
    script.write_text(readme_example(address, backend), encoding="utf-8")
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          preexec_fn=_terminal_sigint) as process:
        try:
            assert process.stdout is not None and process.stderr is not None
            assert process.stdout.readline() == "started\n"
            # The plain script configured no logging: the warning reaches stderr anyway.
            started = time.monotonic()
            readable, _, _ = select.select([process.stderr], [], [], 5)
            line = process.stderr.readline() if readable else ""
            waited = time.monotonic() - started
            process.send_signal(signal.SIGINT)
            sent = time.monotonic()
            _, err = process.communicate(timeout=10)
            exit_time = time.monotonic() - sent
        finally:
            if process.returncode is None:
                process.kill()
    err = line + err
    # A plain KeyboardInterrupt, not an exception group, and promptly.
    assert "ExceptionGroup" not in err, err
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert process.returncode == -signal.SIGINT
    assert exit_time < 3, exit_time
    assert line.startswith("still waiting after 1 s for engine 0 to say HELLO on the handshake "
                           f"socket {address}, up to 600 s (ready_timeout)"), err
    assert "--data-parallel-rpc-port" in line
    assert waited < 5, waited
