"""The command line's own promises: --help describes every option, --version, bad addresses
and liveness options are handled up front."""

from __future__ import annotations

import argparse
import importlib.metadata

import anyio
import pytest

from anyio_genout import EngineCoreClientConfig
from anyio_genout.cli.main import build_parser
from anyio_genout.mock import MockFaults
from tests.support import wait_until

from .support import BACKEND_PAIRS, cli, cli_process, engine_for, free_port, running


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found: argparse.ArgumentParser = commands.choices[name]
    return found


@pytest.mark.parametrize("command", ["generate", "run"])
def test_every_option_has_a_description_and_its_default(command: str) -> None:
    for action in subcommand(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = action.help or ""
        assert len(text) > 10, f"{action.option_strings or action.dest} has no description"
        if action.option_strings:  # options, not positionals
            assert "default" in text or action.required, (action.option_strings, text)


def test_help_shows_the_ready_timeout_and_liveness_defaults_of_the_config() -> None:
    done = cli("run", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())  # argparse wraps lines
    defaults = EngineCoreClientConfig()
    assert "--ready-timeout SECONDS give up if the engines" in text
    assert f"(default: {defaults.ready_timeout})" in text
    interval = defaults.health.liveness_interval
    assert f"(default: {'off' if interval is None else interval})" in text
    assert f"(default: {defaults.health.liveness_timeout})" in text
    assert "--resume" in text and "--liveness-interval" in text


def test_version() -> None:
    done = cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"anyio-genout {importlib.metadata.version('anyio-genout')}\n"


GENERATE = ["generate", "--prompt-token-ids", "1,2"]


@pytest.mark.parametrize(("command", "address"), [
    (GENERATE, "127.0.0.1:29550"), (GENERATE, "tcp://127.0.0.1"),
    (GENERATE, "tcp://[::1:29550"), (["run", "-", "-o", "-"], "http://127.0.0.1:29550"),
])
def test_an_address_without_its_form_is_refused_before_waiting(command: list[str],
                                                               address: str) -> None:
    done = cli(*command, "--handshake-address", address, "--ready-timeout", "2")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()  # one line, and no waiting hint before it
    assert "--handshake-address" in line and repr(address) in line
    assert "tcp://127.0.0.1:29550" in line  # an example of the expected form


@pytest.mark.anyio
@BACKEND_PAIRS
async def test_liveness_options_reach_the_client(cli_backend: str) -> None:
    # An engine that goes silent (alive, but reading nothing) is only noticed by the pings.
    address = f"tcp://127.0.0.1:{free_port()}"
    async with engine_for(address, step_time=0.005,
                          faults=MockFaults(silent_after_steps=20)) as engine, \
            cli_process("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "500",
                        "--ignore-eos", "--handshake-address", address,
                        "--liveness-interval", "0.2", "--liveness-timeout", "0.5",
                        "--backend", cli_backend) as (process, output):
        await wait_until(lambda: running(process, output) and engine.silent, seconds=20)
        with anyio.fail_after(5):
            code = await process.wait()
    assert code == 1, output.err
    assert "Traceback" not in output.err
    last = output.err.strip().splitlines()[-1]
    assert last.startswith("anyio-genout: error: EngineDeadError: "), output.err


@pytest.mark.parametrize("command", [["generate", "--prompt-token-ids", "1,2"],
                                     ["run", "-", "-o", "-"]])
@pytest.mark.parametrize("extra", ["uvloop", "trio"])
def test_a_backend_that_is_not_installed_is_one_line_naming_the_extra(
        command: list[str], extra: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from anyio_genout.cli.main import main

    monkeypatch.setitem(sys.modules, extra, None)  # `import uvloop` / `import trio` now fail
    with pytest.raises(SystemExit) as exc:
        main([*command, "--backend", extra])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"anyio-genout {command[0]} --backend {extra} needs the '{extra}' extra: "
        f"pip install 'anyio-genout[{extra}]'\n")
