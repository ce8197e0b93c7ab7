"""``anyio-genout mock-engine`` (``python -m anyio_genout mock-engine``): a real process,
driven by a blocking pyzmq front end or by our Client, one client after another."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgpack
import pytest
import zmq

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
    TransportError,
    collect_output,
)
from anyio_genout.cli.main import main as console_main
from anyio_genout.cli.mock_cmd import build_parser, main
from anyio_genout.errors import HandshakeTimeoutError
from anyio_genout.mock import greedy_tokens
from tests.support import wait_until

from ..cli.support import Output, cli_process, free_port


@contextmanager
def front_end() -> Iterator[tuple[dict[str, Any], str]]:
    ctx = zmq.Context()
    sockets = {"hs": ctx.socket(zmq.ROUTER), "in": ctx.socket(zmq.ROUTER),
               "out": ctx.socket(zmq.PULL)}
    try:
        for sock in sockets.values():
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
        addresses = {name: f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                     for name, sock in sockets.items()}
        init = msgpack.packb({"addresses": {"inputs": [addresses["in"]],
                                            "outputs": [addresses["out"]]},
                              "parallel_config": {}})
        yield {**sockets, "init": init}, addresses["hs"]
    finally:
        for sock in sockets.values():
            sock.close()
        ctx.term()


def handshake(sockets: dict[str, Any]) -> bytes:
    identity, hello = sockets["hs"].recv_multipart()
    assert msgpack.unpackb(hello) == {"status": "HELLO", "local": False, "headless": True}
    sockets["hs"].send_multipart([identity, sockets["init"]])
    assert msgpack.unpackb(sockets["hs"].recv_multipart()[1])["status"] == "READY"
    assert sockets["in"].recv_multipart()[0] == identity
    return identity  # type: ignore[no-any-return]


@pytest.mark.parametrize(("backend", "signum"), [("asyncio", signal.SIGINT),
                                                 ("trio", signal.SIGTERM)])
def test_cli_serves_until_a_signal(backend: str, signum: int) -> None:
    with front_end() as (sockets, address):
        proc = subprocess.Popen([sys.executable, "-m", "anyio_genout", "mock-engine",
                                 "--handshake-address", address, "--rank", "0",
                                 "--step-time", "0.001", "--no-log-stats",
                                 "--backend", backend])
        try:
            identity = handshake(sockets)
            request = ["r", [1, 2, 3], None, {"temperature": 0.0, "max_tokens": 4}, None, 0.0,
                       None, None, None]
            sockets["in"].send_multipart([identity, b"\x00", msgpack.packb(request)])
            tokens: list[int] = []
            while len(tokens) < 4:
                message = msgpack.unpackb(sockets["out"].recv())
                tokens += [t for row in message[1] for t in row[1]]
            assert tokens == greedy_tokens([1, 2, 3], 4)
            proc.send_signal(signum)
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_exits_1_when_the_engine_dies() -> None:
    with front_end() as (sockets, address):
        proc = subprocess.Popen([sys.executable, "-m", "anyio_genout", "mock-engine",
                                 "--handshake-address", address, "--dead-after-steps", "0"],
                                stderr=subprocess.PIPE, text=True)
        try:
            handshake(sockets)
            assert sockets["out"].recv() == b"ENGINE_CORE_DEAD"
            _, err = proc.communicate(timeout=10)
            assert proc.returncode == 1
            assert "engine died (fault injection: dead after 0 steps)" in err
            assert "Traceback" not in err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rank", "0"])
    assert exc.value.code == 2
    assert "handshake_address" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--backend", "curio", "--handshake-address", "tcp://127.0.0.1:1"])


# ---------------------------------------------------------------------- one client after another

#: The client side runs on both families of event loop; the mock process on its default.
CLIENT_BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


async def generate_once(address: str, request_id: str, n: int) -> list[int]:
    """Connect a Client (failing within 5 s if no engine says READY), generate, leave."""
    config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                        ready_timeout=5))
    async with Client.connect(config) as client:
        request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                  sampling_params=SamplingParams(max_tokens=n, temperature=0.0))
        async with client.generate(request) as stream:
            return (await collect_output(stream)).token_ids


def said(output: Output, text: str) -> int:
    return output.err.count(text)


@CLIENT_BACKENDS
@pytest.mark.anyio
async def test_mock_engine_serves_clients_one_after_another() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--step-time", "0.001") as (process, output):
        with anyio.fail_after(20):
            for n, request_id in ((4, "first"), (6, "second")):
                started = anyio.current_time()
                assert await generate_once(address, request_id, n) == greedy_tokens([1, 2, 3], n)
                assert anyio.current_time() - started < 5
            await wait_until(lambda: said(output, "waiting for the next client") == 2,
                             seconds=5)
        assert process.returncode is None  # still there for a third client
        assert said(output, f"client connected (handshake {address})") == 2
        assert said(output, "client left") == 2
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(10):
            assert await process.wait() == 0
    assert "Traceback" not in output.err


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_a_client_that_starts_while_another_is_served_is_refused_then_served_next(
        ) -> None:
    """The first client keeps its handshake address (restarted engines rejoin there): a
    second one started meanwhile fails at once naming the address; once the first left,
    the engine dials in again and serves the next client."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                        ready_timeout=5))
    async with cli_process("mock-engine", "--handshake-address", address) as (process, output):
        with anyio.fail_after(20):
            async with Client.connect(config) as first:
                with pytest.raises(TransportError, match=f"cannot bind {address}"):
                    await generate_once(address, "second", 3)
                request = GenerateRequest(request_id="first", prompt_token_ids=[1, 2, 3],
                                          sampling_params=SamplingParams(max_tokens=2))
                async with first.generate(request) as stream:
                    assert len((await collect_output(stream)).token_ids) == 2
            assert await generate_once(address, "next", 3) == greedy_tokens([1, 2, 3], 3)
            await wait_until(lambda: said(output, "client connected") == 2, seconds=5)
        assert process.returncode is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_client_that_gives_up_during_start_up_does_not_block_the_next() -> None:
    """The first client leaves while the engine "loads its model": the engine then finds no
    input socket to connect to, and the next client is served all the same."""
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--ready-delay", "2") as (process, output):
        with anyio.fail_after(20):
            await wait_until(lambda: said(output, "waiting for a client") == 1, seconds=10)
            # HELLO has 1.2 s to come (a loaded machine may be slow to dial), the
            # registration cannot come before 2 s ("loading the model"): the stage is certain
            config = ClientConfig(engine=EngineCoreClientConfig(
                transport=HandshakeTransport(address), ready_timeout=1.2))
            with pytest.raises(HandshakeTimeoutError, match="input registration"):
                async with Client.connect(config):
                    pass
            await wait_until(lambda: said(output, "client left") == 1, seconds=5)
            assert await generate_once(address, "next", 3) == greedy_tokens([1, 2, 3], 3)
        assert process.returncode is None


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_once_exits_when_its_client_leaves() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--once") as (process, output):
        with anyio.fail_after(20):
            assert await generate_once(address, "only", 2) == greedy_tokens([1, 2, 3], 2)
            assert await process.wait() == 0
    assert "client left; exiting (--once)" in output.err
    assert "Traceback" not in output.err


# ---------------------------------------------------------------------- help and extras


def test_help_names_the_command_it_was_run_as(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        console_main(["mock-engine", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: anyio-genout mock-engine ")
    proc = subprocess.run([sys.executable, "-m", "anyio_genout", "mock-engine", "--help"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: anyio-genout mock-engine ")


def help_entries(help_text: str) -> dict[str, str]:
    """Option -> its entry in ``--help`` (the option line and its wrapped description)."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (--?[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current is not None and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def assert_every_option_documented(parser: Any) -> None:
    entries = help_entries(parser.format_help())
    undocumented = []
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        entry = entries.get(action.option_strings[0], "")
        if not action.help or "default" not in entry:
            undocumented.append(action.option_strings[0])
    assert undocumented == []


def test_every_option_has_a_description_that_shows_its_default() -> None:
    parser = build_parser()
    assert_every_option_documented(parser)
    entries = help_entries(parser.format_help())
    assert "(default: 256)" in entries["--max-num-seqs"]
    assert "(default: asyncio)" in entries["--backend"]


@pytest.mark.parametrize(("argv", "extra"), [
    (["--backend", "uvloop"], "uvloop"),
    (["--uvloop"], "uvloop"),
    (["--backend", "trio"], "trio"),
])
def test_a_missing_backend_is_one_line_naming_the_extra(
        argv: list[str], extra: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, extra, None)  # `import uvloop` now fails
    with pytest.raises(SystemExit) as exc:
        console_main(["mock-engine", "--handshake-address", "tcp://127.0.0.1:1",
                      "--handshake-timeout", "0.1", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"anyio-genout mock-engine --backend {extra} needs the '{extra}' extra: "
        f"pip install 'anyio-genout[{extra}]'\n")


def test_no_front_end_within_the_handshake_timeout_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--handshake-address", f"tcp://127.0.0.1:{free_port()}",
                 "--handshake-timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert "no front end sent INIT within 0.2 s" in err
    assert "Traceback" not in err
