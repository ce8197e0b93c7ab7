"""Where the command line's engines come from: embedded mock, real remote, or managed vLLM."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Literal, cast

import anyio
import anyio.abc
import attrs

from ..engine import (
    BootstrappedTransport,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
)
from ..errors import EngineDeadError, UsageError
from ..generate import Client, ClientConfig
from ..mock import MockEngine, MockEngineConfig
from ..text.tokenizer import Tokenizer
from ..transport import free_tcp_port
from .text_model import MockModel, mock_model

__all__ = ["ClientSession", "EngineSession", "Interrupt", "WorkerSockets", "engines_hint",
           "free_tcp_port", "interruptible"]

#: The embedded mock engine's vocabulary size (its config's default).
_MOCK_VOCAB_SIZE = cast("int", attrs.fields(MockEngineConfig).vocab_size.default)
_MAX_LOGPROBS = cast("int", attrs.fields(EngineCoreClientConfig).max_logprobs.default)


def _client_config(args: argparse.Namespace, handshake: str, vocab_size: int | None,
                   eos: int | None, last_engine_death: Literal["fail", "wait"] = "fail"
                   ) -> ClientConfig:
    """The client's configuration from the options; raises :class:`UsageError` if invalid.

    Built before anything is bound or printed, so a bad option is a one-line error up front.
    """
    managed_or_remote = args.vllm_model or args.handshake_address
    try:
        return ClientConfig(
            engine=EngineCoreClientConfig(
                transport=HandshakeTransport(handshake, advertised_host=args.advertised_host),
                engine_count=args.engine_count if managed_or_remote else args.mock_engines,
                ready_timeout=args.ready_timeout,
                health=HealthConfig(liveness_interval=args.liveness_interval,
                                    liveness_timeout=args.liveness_timeout,
                                    last_engine_death=last_engine_death),
                vocab_size=vocab_size,
                # serve's --max-logprobs (vLLM's); the other commands keep the default
                max_logprobs=_MAX_LOGPROBS if getattr(args, "max_logprobs", None) is None
                else args.max_logprobs,
            ),
            model_name=metrics_model_name(args), eos_token_id=eos, vocab_size=vocab_size)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid engine options: {exc}") from None


def _handshake_address(config: EngineCoreClientConfig) -> str:
    """The address engines dial: the commands' own configurations own the handshake (a
    ``serve --workers`` worker's is bootstrapped, and never starts or hints engines)."""
    transport = config.transport
    if not isinstance(transport, HandshakeTransport):
        raise TypeError(f"expected a HandshakeTransport, got {type(transport).__name__}")
    return transport.address


def metrics_model_name(args: argparse.Namespace) -> str:
    """The metrics' ``model_name`` label: ``--model-name``, else the served model name as
    vLLM labels its metrics (``--served-model-name``, ``--model``, ``--vllm-model``), else
    ``anyio-genout``."""
    name: str = (args.model_name or getattr(args, "served_model_name", None)
                 or getattr(args, "model", None) or args.vllm_model or "anyio-genout")
    return name


def engines_hint(handshake: str, engine_count: int) -> str:
    """What the command line waits for on ``handshake``, and how to start the engines.

    vLLM's engines build their handshake address as ``tcp://HOST:PORT`` from
    ``--data-parallel-address`` and ``--data-parallel-rpc-port``: for any other address the
    hint says so (engines that take a ZeroMQ address, such as the mock, dial it).
    """
    head = f"waiting for {engine_count} engine(s) on {handshake}"
    scheme, _, rest = handshake.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit():
        return (f"{head}; vLLM engines dial only a tcp:// handshake address "
                f"(--data-parallel-address HOST --data-parallel-rpc-port PORT), so give "
                f"--handshake-address tcp://HOST:PORT for them; engines that take any "
                f"ZeroMQ address dial this one, e.g.:\n"
                f"  anyio-genout mock-engine --handshake-address {handshake} --rank 0")
    return (f"{head}; start them with:\n"
            f"  vllm serve <model> --headless --data-parallel-address {host.strip('[]')} "
            f"--data-parallel-rpc-port {port} --data-parallel-size {engine_count} "
            f"--skip-tokenizer-init")


class Interrupt:
    """Set by :func:`interruptible` when SIGINT or SIGTERM cancelled its body."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


class interruptible:
    """``async with interruptible() as interrupted``: the first SIGINT/SIGTERM cancels the body.

    The body leaves by cancellation, so every open ``client.generate`` scope aborts its
    request in the engine and the client flushes those ABORTs as it closes; afterwards
    ``interrupted`` is true. Handling the signals explicitly (instead of relying on
    KeyboardInterrupt) covers SIGTERM and trio alike, and a process started with SIGINT
    ignored still stops. A second signal, after the first was handled, gets the default
    behaviour (KeyboardInterrupt / termination), so a stuck shutdown can still be forced.

    A class rather than a generator-based context manager, so no generator straddles the
    task group's cancel scope, and an exception from the body passes through unwrapped.
    """

    def __init__(self) -> None:
        self._interrupt = Interrupt()
        self._tg = anyio.create_task_group()

    async def _watch(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                self._interrupt.signal = signum
                self._tg.cancel_scope.cancel()
                return

    async def __aenter__(self) -> Interrupt:
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._watch)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self._interrupt

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool:
        self._tg.cancel_scope.cancel()
        if self._interrupt and isinstance(exc, anyio.get_cancelled_exc_class()):
            # Our own cancellation (the signal): the task group's scope absorbs it.
            return bool(await self._tg.__aexit__(exc_type, exc, tb))
        await self._tg.__aexit__(None, None, None)
        return False


@attrs.frozen
class WorkerSockets:
    """What a front-end worker process is given by its supervisor (``serve --workers``):
    its ``client_index`` and the input/output listening sockets bound for it (the engines
    were told their addresses in the supervisor's handshake)."""

    client_index: int
    input_address: str
    output_address: str
    input_fd: int
    output_fd: int


class ClientSession:
    """``async with ClientSession(args) as client``: engines started or awaited, then a Client.

    * no engine option: ``--mock-engines`` mock engines run as tasks in this process;
    * ``--handshake-address``: wait for real engines to dial in (printing the command line
      that starts them);
    * ``--vllm-model``: start ``vllm serve --headless`` child processes; a child that exits
      makes the client unhealthy at once (also during start-up).

    With a ``tokenizer`` (text), the client refuses ids outside its vocabulary (unless
    ``--vocab-size`` says otherwise), and the embedded mock engines pass for its model
    (:func:`~.text_model.mock_model`): its vocabulary, its EOS token, the shipped corpus
    encoded with it (corpus mode, each stream from a sentence's start), logprob
    alternatives with distinct readable strings.

    For ``serve --workers``: with ``worker``, a client that starts no engine but adopts the
    sockets its supervisor bound and waits for the engines to register there (the
    supervisor's half is :class:`EngineSession`). ``last_engine_death``: the client's
    (``serve`` waits for engines to rejoin: ``"wait"``).
    """

    def __init__(self, args: argparse.Namespace, *, quiet: bool = False,
                 tokenizer: Tokenizer | None = None,
                 worker: WorkerSockets | None = None,
                 last_engine_death: Literal["fail", "wait"] = "fail") -> None:
        self._args = args
        self._last_engine_death = last_engine_death
        self._quiet = quiet
        self._tokenizer = tokenizer
        self._worker = worker
        self._stack = AsyncExitStack()
        self.mock_engines: list[MockEngine] = []
        #: The ``--vllm-model`` child processes once started (``start_engines``).
        self.managed_engines: Any = None
        self._model: MockModel | None = None
        #: Say how to start remote engines in :meth:`_start` (the supervisor's half, which
        #: binds later); a client says it once its handshake address is bound.
        self._hint_now = False

    def _say(self, text: str) -> None:
        if not self._quiet:
            print(text, file=sys.stderr, flush=True)

    async def __aenter__(self) -> Client:
        args = self._args
        await self._stack.__aenter__()
        try:
            return await self._enter(args)
        except BaseException as exc:
            await self._stack.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def _enter(self, args: argparse.Namespace) -> Client:
        config = self._configure(args)
        worker = self._worker
        if worker is not None:
            engine = attrs.evolve(
                config.engine, client_index=worker.client_index,
                transport=BootstrappedTransport(
                    input_address=worker.input_address, output_address=worker.output_address,
                    input_listener_fd=worker.input_fd, output_listener_fd=worker.output_fd))
            return await self._stack.enter_async_context(
                Client.connect(attrs.evolve(config, engine=engine)))
        await self._start(args, config)
        if self.managed_engines is None:
            if args.handshake_address is not None:
                return await self._connect_remote(config)
            client = await self._stack.enter_async_context(Client.connect(config))
            if self.mock_engines:
                client.engine.add_death_explainer(self._explain_mock_death)
            return client
        return await self._connect_managed(config, self.managed_engines)

    async def _start_only(self) -> ClientConfig:
        await self._stack.__aenter__()
        try:
            config = self._configure(self._args)
            await self._start(self._args, config)
        except BaseException as exc:
            await self._stack.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return config

    def _configure(self, args: argparse.Namespace) -> ClientConfig:
        """The client's configuration, checked; computes the embedded mock's corpus."""
        handshake = args.handshake_address
        if handshake is None:
            handshake = f"tcp://{args.advertised_host}:{free_tcp_port(args.advertised_host)}"
        vocab_size, eos = args.vocab_size, args.eos_token_id
        tokenizer = self._tokenizer
        model = None
        if args.vllm_model:
            from ..vllm import read_model_eos_token_id, read_model_vocab_size

            vocab_size = vocab_size or read_model_vocab_size(args.vllm_model)
            eos = eos if eos is not None else read_model_eos_token_id(args.vllm_model)
        elif args.handshake_address is None:
            # The embedded mock's vocabulary (the tokenizer's, so every id it generates
            # decodes): the client refuses what would kill it.
            if tokenizer is not None:
                model = mock_model(tokenizer)
                eos = eos if eos is not None else model.eos_token_id
            vocab_size = vocab_size or (model.vocab_size if model is not None
                                        else _MOCK_VOCAB_SIZE)
        elif tokenizer is not None:
            vocab_size = vocab_size or tokenizer.vocab_size
        self._model = model
        # The whole configuration is checked before anything is bound, started or printed.
        return _client_config(args, handshake, vocab_size, eos, self._last_engine_death)

    async def _start(self, args: argparse.Namespace, config: ClientConfig) -> None:
        """Start the embedded mock engines or the managed vLLM engines, or say how to start
        remote ones; they dial ``config``'s handshake address."""
        handshake = _handshake_address(config.engine)
        vocab_size, eos, model = config.vocab_size, config.eos_token_id, self._model
        if args.vllm_model:
            from ..vllm import spawn_vllm_engines

            command = shlex.split(args.vllm_command) if args.vllm_command else None
            engines = self.managed_engines = await self._stack.enter_async_context(
                spawn_vllm_engines(args.vllm_model, handshake_address=handshake,
                                   engine_count=args.engine_count, extra_args=args.vllm_arg,
                                   command=command))
            self._say(f"started vLLM engine process(es) {engines.pids}; waiting for READY...")
        elif args.handshake_address is not None:
            if self._hint_now:
                self._say(engines_hint(handshake, args.engine_count))
        else:
            fields = model.config_fields() if model is not None else {}
            fields.update(vocab_size=vocab_size or _MOCK_VOCAB_SIZE, eos_token_id=eos)
            if model is not None and fields["vocab_size"] != model.vocab_size:
                # --vocab-size differs from the tokenizer's: its alternatives may not fit.
                fields.pop("alternative_token_ids")
            try:  # the default linger: a dying mock's ENGINE_CORE_DEAD leaves before its
                # sockets close (with none it was dropped whenever ZeroMQ's I/O thread had not
                # sent it yet, and the client saw a disconnect, not the reason); closing waits
                # for such final messages only, so a normal exit does not wait
                mocks = [MockEngineConfig(
                    rank=rank, handshake_address=handshake, step_time=args.mock_step_time,
                    keep_history=False, **fields)
                    for rank in range(args.mock_engines)]
            except ValueError as exc:
                raise UsageError(f"invalid mock engine options: {exc}") from None
            tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._stack.callback(tg.cancel_scope.cancel)
            for mock in mocks:
                engine = MockEngine(mock)
                self.mock_engines.append(engine)
                tg.start_soon(engine.serve)

    async def _connect_remote(self, config: ClientConfig) -> Client:
        """Connect to remote engines, saying how to start them once the handshake address
        is bound (not before a bind that fails)."""
        failed = False

        async def say_once_bound() -> None:
            # Client.connect binds before its first checkpoint: when this task first runs
            # after it, the bind is done, or it failed (and ``failed`` is set by then).
            await anyio.lowlevel.checkpoint()
            if not failed:
                self._say(engines_hint(_handshake_address(config.engine),
                                       config.engine.engine_count))

        # Ends by itself: cancelling its task group's scope would cancel everything entered
        # after it, the caller's code included.
        hint = await self._stack.enter_async_context(anyio.create_task_group())
        hint.start_soon(say_once_bound)
        try:
            return await self._stack.enter_async_context(Client.connect(config))
        except BaseException:
            failed = True
            raise

    def _explain_mock_death(self) -> str | None:
        """Why embedded mock engines sent ENGINE_CORE_DEAD, for the client's error."""
        return "; ".join(f"engine {engine.config.rank} (mock): {engine.death_reason}"
                         for engine in self.mock_engines if engine.dead) or None

    async def _connect_managed(self, config: ClientConfig, engines: Any) -> Client:
        """Connect while watching the child processes: a child that dies fails the start."""
        died: list[EngineDeadError] = []
        started = time.monotonic()
        # Long-lived scopes, exited in reverse order by the exit stack (never straddled).
        scope = self._stack.enter_context(anyio.CancelScope())

        def on_exit(error: EngineDeadError) -> None:
            died.append(error)
            scope.cancel()

        unregister = engines.on_exit(on_exit)
        # The progress task ends by itself once connected: cancelling its task group's scope
        # would cancel everything entered after it, the caller's code included.
        connected = anyio.Event()
        progress = await self._stack.enter_async_context(anyio.create_task_group())
        progress.start_soon(self._progress, started, connected)
        try:
            client = await self._stack.enter_async_context(Client.connect(config))
        except BaseException:
            if died:
                raise died[0] from None
            raise
        finally:
            connected.set()
            unregister()
        engines.on_exit(client.engine.fail)
        client.engine.add_death_explainer(engines.explain_death)
        self._say(f"engines ready after {time.monotonic() - started:.1f} s")
        return client

    async def _progress(self, started: float, connected: anyio.Event) -> None:
        show = not self._quiet and sys.stderr.isatty()
        while not connected.is_set():
            with anyio.move_on_after(0.5):
                await connected.wait()
            if show and not connected.is_set():
                print(f"\rwaiting for engines: {time.monotonic() - started:5.1f} s", end="",
                      file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        return await self._stack.__aexit__(exc_type, exc, tb)


class EngineSession:
    """``async with EngineSession(args, tokenizer=...) as config``: the engines started (or
    announced) as :class:`ClientSession` does, but no client: the ``serve --workers``
    supervisor's half, which then performs the handshake for its workers. ``config`` is the
    client configuration whose handshake address the engines dial; the engines stop when
    the block is left."""

    def __init__(self, args: argparse.Namespace, *, tokenizer: Tokenizer | None = None) -> None:
        self._session = ClientSession(args, tokenizer=tokenizer)

    @property
    def managed_engines(self) -> Any:
        """The ``--vllm-model`` child processes, or None."""
        return self._session.managed_engines

    async def __aenter__(self) -> ClientConfig:
        self._session._hint_now = True
        return await self._session._start_only()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        return await self._session.__aexit__(exc_type, exc, tb)
