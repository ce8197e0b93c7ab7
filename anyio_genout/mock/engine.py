"""A mock vLLM engine core speaking the real wire protocol over real ZeroMQ sockets.

:class:`MockEngine` behaves like ``vllm serve --headless`` (or a bootstrapped engine core)
as a client sees it: the start-up handshake, continuous batching with a waiting queue, one
``EngineCoreOutputs`` message per client per step, the stop rules of vLLM's ``check_stop``,
logprobs with aux frames, utility calls, scheduler stats, silent idempotent aborts, and the
real engine's failure modes (``ENGINE_CORE_DEAD`` on a duplicate in-flight id or an
out-of-vocabulary token, a deaf input thread after a malformed message). Tokens come from
:mod:`.tokens`, so the output is deterministic.

It runs as one task (no threads): drain all queued input, run one step, yield to the event
loop, repeat. Plain decode rows (no logprobs, events or finish) are packed straight into
msgpack bytes from per-request prefixes, so the mock is never the bottleneck of a client.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import msgpack
import zmq

from ..errors import HandshakeError, HandshakeTimeoutError, ProtocolError
from ..protocol import (
    ENGINE_CORE_DEAD,
    AbortRequest,
    AddRequest,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreReadyResponse,
    EngineStatus,
    SchedulerStats,
    StatusMessage,
    UtilityRequest,
    decode_init,
    decode_request,
    encode_ready_response,
    encode_status,
)
from ..protocol.logprobs import encode_logprobs
from ..transport import ZmqSocket, new_context
from .config import MockEngineConfig
from .tokens import (
    GREEDY_TEMPERATURE,
    fake_logprobs,
    fake_prompt_logprobs,
    generate,
    stream_key,
)

__all__ = ["MockEngine"]

Received = AddRequest | AbortRequest | UtilityRequest

_STOP: Final = int(EngineCoreFinishReason.STOP)
_LENGTH: Final = int(EngineCoreFinishReason.LENGTH)
_ABORT: Final = int(EngineCoreFinishReason.ABORT)
_ERROR: Final = int(EngineCoreFinishReason.ERROR)
_QUEUED: Final = int(EngineCoreEventType.QUEUED)
_SCHEDULED: Final = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED: Final = int(EngineCoreEventType.PREEMPTED)

#: Tokens generated per refill of a request's token buffer.
_CHUNK: Final = 256
_GARBAGE: Final = b"\xc1"  # the one byte msgpack never uses
_DEFAULT_WEIGHT_VERSION: Final = "default"
_SUPPORTED_TASKS: Final = ("generate",)
_PAUSE_MODES: Final = ("abort", "wait", "keep")

_pack: Final[Callable[[Any], bytes]] = functools.partial(msgpack.packb, use_bin_type=True)
_pack_double: Final = struct.Struct(">d").pack


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@functools.lru_cache(maxsize=4)
def _token_table(vocab_size: int) -> tuple[bytes, ...]:
    """msgpack encoding of the one-token list ``[t]`` for every ``t < vocab_size``."""
    table = [b"\x91" + bytes((i,)) for i in range(min(vocab_size, 128))]
    table += [b"\x91\xcc" + bytes((i,)) for i in range(128, min(vocab_size, 256))]
    table += [b"\x91\xcd" + i.to_bytes(2, "big")
              for i in range(256, min(vocab_size, 1 << 16))]
    table += [b"\x91\xce" + i.to_bytes(4, "big") for i in range(1 << 16, vocab_size)]
    return tuple(table)


class _Pause(enum.IntEnum):
    UNPAUSED = 0
    NEW = 1  # new requests queue, running ones keep stepping
    ALL = 2  # nothing steps


@attrs.define(eq=False)
class _Request:
    """Scheduler state of one request (mutable; the hot loop reads it directly)."""

    rid: str
    client: int
    prompt: list[int]
    key: int
    greedy: bool
    limit: int  # output length at which LENGTH fires (max_tokens / max_model_len)
    eos: int | None
    stops: frozenset[int]  # stop_token_ids (STOP with stop_reason)
    checks: frozenset[int]  # stops plus EOS: any of these ends the fast path
    all_stop: frozenset[int]  # held back by min_tokens
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    allowed: list[int] | None
    trace: dict[str, str] | None
    cache_salt: str | None
    oov: bool
    prefix: bytes  # packed row header and request id
    mid: bytes  # packed fields after new_token_ids of a plain row
    alive: bool = True
    num_out: int = 0
    buf: list[int] = attrs.Factory(list)
    buf_start: int = 0
    buf_end: int = 0
    events: list[tuple[int, float]] | None = None
    prefill: dict[str, int] | None = None
    want_prompt_logprobs: bool = False
    scheduled_once: bool = False
    plain: bool = False  # the next row may take the fast path (no logprobs or events)
    fast_end: int = 0  # fast path while num_out < fast_end (plain, buffered, not last)
    num_preemptions: int = 0
    late: int = 0  # outputs still owed after an ABORT (fault injection)


class EngineCoreProc:
    """The utility methods a client may call (named like vLLM's class, so its error texts
    match: an unknown method fails with ``'EngineCoreProc' object has no attribute ...``).
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: MockEngine) -> None:
        self._engine = engine

    def get_supported_tasks(self) -> list[str]:
        return list(_SUPPORTED_TASKS)

    def is_sleeping(self) -> bool:
        e = self._engine
        return e._pause is not _Pause.UNPAUSED or e._sleep_level > 0

    def is_scheduler_paused(self) -> bool:
        return self._engine._pause is not _Pause.UNPAUSED

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> object:
        return self._engine._pause_scheduler(mode, clear_cache, None)

    def resume_scheduler(self) -> None:
        self._engine._pause = _Pause.UNPAUSED

    def sleep(self, level: int = 1, mode: str = "abort") -> object:
        engine = self._engine

        def fall_asleep() -> None:
            engine._sleep_level = level

        return engine._pause_scheduler(mode, level >= 1, fall_asleep if level >= 1 else None)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        engine = self._engine
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            engine._sleep_level = 0
        fully_awake = engine._sleep_level == 0
        if fully_awake:
            engine._pause = _Pause.UNPAUSED
        return fully_awake

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        engine = self._engine
        if engine._running_alive():
            if not reset_running_requests:
                return False  # blocks still in use, as vLLM's block pool refuses
            engine._preempt_all(time.monotonic())
        engine._reset_prefix_cache()
        return True

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def list_loras(self) -> list[int]:
        return []

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: list[Any] | None = None,
                       kwargs: dict[str, Any] | None = None) -> list[str]:
        return [f"engine-{self._engine.config.rank}-worker"]

    def get_weight_version(self) -> str:
        return self._engine._weight_version

    def set_weight_version(self, weight_version: str) -> None:
        self._engine._weight_version = str(weight_version)
        self._engine._weight_version_bytes = _pack(str(weight_version))

    def profile(self, is_start: bool = True, profile_prefix: str | None = None,
                delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None


_DEFERRED: Final = object()  # a utility whose reply waits for the engine to drain


class MockEngine:
    """A mock engine core; :meth:`serve` runs it until cancelled (or until it dies).

    Observable state for tests (read it from the test's task, between awaits):

    * ``received``: decoded requests in arrival order (ADD, ABORT, UTILITY);
    * ``added_ids``; ``aborted_ids`` (every ABORT's ids in order, duplicates kept);
      ``abort_frames`` (ABORT messages received);
    * ``running_ids``, ``waiting_ids``; ``steps`` (steps that generated tokens);
    * ``errors``: protocol violations and fatal conditions it detected;
    * ``last_stats``: the last ``SchedulerStats`` sent (log stats on);
    * ``dead`` (sent ``ENGINE_CORE_DEAD``), ``deaf`` (stopped reading input), ``silent``.
    """

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.received: list[Received] = []
        self.added_ids: list[str] = []
        self.aborted_ids: list[str] = []
        self.abort_frames = 0
        self.steps = 0
        self.errors: list[str] = []
        self.last_stats: SchedulerStats | None = None
        self.dead = False
        self.deaf = False
        self.silent = False
        self.ready = False

        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
        self._zombies: list[_Request] = []  # aborted, still owed late outputs
        self._dirty = False  # aborted requests still sit in _running/_waiting
        self._pause = _Pause.UNPAUSED
        self._sleep_level = 0
        self._pending_pauses: list[tuple[int, int, Callable[[], None] | None]] = []
        self._flush_stats = False
        self._garbage_sent = False
        self._kv_tokens = 0
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()
        self._pc_reset = False
        self._pc_requests = self._pc_queries = self._pc_hits = 0
        self._spec_drafts = self._spec_accepted = 0
        self._spec_accepted_pos: list[int] = [0] * config.num_speculative_tokens
        self._weight_version = _DEFAULT_WEIGHT_VERSION
        self._weight_version_bytes = _pack(_DEFAULT_WEIGHT_VERSION)
        self._utility = EngineCoreProc(self)
        self._current_call: tuple[int, int] = (0, 0)

        fields = config.output_fields
        self._row_header = _array_header(fields)
        self._msg_head = b"\x99" + _pack(config.rank)
        self._tail_fields = b"\xc0" * (fields - 14)  # fields 14.. of a plain row
        self._tokb = _token_table(config.vocab_size)
        self._served = False
        self._context: zmq.Context[Any] | None = None
        self._handshake: ZmqSocket | None = None
        self._input: ZmqSocket | None = None
        self._outputs: list[ZmqSocket] = []
        self._trackers: list[zmq.MessageTracker] = []
        self._blocked: list[tuple[ZmqSocket, list[bytes | memoryview]]] = []

    # ------------------------------------------------------------------ observable state

    @property
    def running_ids(self) -> list[str]:
        return [r.rid for r in self._running if r.alive]

    @property
    def waiting_ids(self) -> list[str]:
        return [r.rid for r in self._waiting if r.alive]

    @property
    def paused(self) -> bool:
        return self._pause is not _Pause.UNPAUSED

    @property
    def weight_version(self) -> str:
        return self._weight_version

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """Connect (handshake or bootstrap), then serve until cancelled or dead.

        ``task_status.started()`` fires once READY (bootstrapped: the registration) was sent.
        Returns after sending ``ENGINE_CORE_DEAD``. Sockets are closed on every exit path.
        """
        if self._served:
            raise RuntimeError("MockEngine.serve() can run only once")
        self._served = True
        self._context = new_context()
        try:
            await self._connect()
            self.ready = True
            task_status.started()
            try:
                await self._loop()
            except anyio.get_cancelled_exc_class():
                if self.config.faults.abort_on_shutdown and not self.dead:
                    self._abort_everything(shutdown=True)
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._flush_tracked()
            self._close()

    def _close(self) -> None:
        for sock in (self._handshake, self._input, *self._outputs):
            if sock is not None:
                sock.close()
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _connect(self) -> None:
        cfg = self.config
        assert self._context is not None
        ctx = self._context
        identity = cfg.identity
        if cfg.handshake_address is not None:
            hs = self._handshake = ZmqSocket(ctx, zmq.DEALER, identity=identity)
            hs.connect(cfg.handshake_address)
            await hs.send([encode_status(StatusMessage(EngineStatus.HELLO, local=False,
                                                       headless=True))])
            with anyio.move_on_after(cfg.handshake_timeout) as scope:
                frames = await hs.receive()
            if scope.cancelled_caught:
                raise HandshakeTimeoutError("INIT", [cfg.rank], cfg.handshake_timeout)
            addresses = decode_init(frames[-1].bytes)
            input_address = addresses.inputs[0]
            output_addresses = list(addresses.outputs)
        else:
            assert cfg.input_address is not None
            input_address = cfg.input_address
            output_addresses = list(cfg.output_addresses)
        if cfg.faults.ready_delay:
            await anyio.sleep(cfg.faults.ready_delay)  # "loading the model"
        inp = self._input = ZmqSocket(ctx, zmq.DEALER, identity=identity)
        inp.connect(input_address)
        await inp.send([self._ready_payload()])
        for address in output_addresses:
            out = ZmqSocket(ctx, zmq.PUSH)
            self._outputs.append(out)
            out.connect(address)
        if self._handshake is not None:
            await self._handshake.send([encode_status(
                StatusMessage(EngineStatus.READY, local=False, headless=True))])

    def _ready_payload(self) -> bytes:
        cfg = self.config
        blocks = cfg.gpu_blocks
        kv_tokens = blocks * cfg.block_size
        response = EngineCoreReadyResponse(
            max_model_len=cfg.max_model_len, num_gpu_blocks=blocks, block_size=cfg.block_size,
            dtype=cfg.dtype, vllm_version=cfg.vllm_version, data_parallel_rank=cfg.rank,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max(cfg.max_model_len, 2048),
            instance_id=f"mock-engine-{cfg.rank}", kv_cache_size_tokens=kv_tokens,
            enable_sleep_mode=True,
        )
        wire = msgpack.unpackb(encode_ready_response(response), raw=False)
        if not isinstance(wire, dict):  # pragma: no cover - encode_ready_response packs a map
            raise HandshakeError("EngineCoreReadyResponse did not encode as a map")
        wire["kv_cache_max_concurrency"] = kv_tokens / cfg.max_model_len
        if _version_at_least(cfg.vllm_version, (0, 33)):
            wire.update(coord_store_port=0, coordinator_input_address=None,
                        coordinator_output_address=None)
        return _pack(wire)

    # ------------------------------------------------------------------ main loop

    async def _loop(self) -> None:
        step_time = self.config.step_time
        steps_per_checkpoint = self.config.steps_per_checkpoint
        next_step = anyio.current_time()
        # With no step time the engine steps back to back, yielding every
        # steps_per_checkpoint steps; input is still read before every step.
        unpaced_steps = 0
        while True:
            if not self.deaf:
                self._drain_input()
            if self._dirty:
                self._purge()
            if self._check_faults():
                return
            if self.silent:
                await anyio.sleep_forever()
            if self._has_step_work():
                if step_time <= 0:
                    self._step()
                    if self._blocked:
                        await self._send_blocked()
                    if self._check_faults():
                        return
                    self._resolve_pauses()
                    unpaced_steps += 1
                    if unpaced_steps >= steps_per_checkpoint:
                        unpaced_steps = 0
                        await anyio.lowlevel.checkpoint()
                    continue
                now = anyio.current_time()
                if now >= next_step:
                    self._step()
                    if self._blocked:
                        await self._send_blocked()
                    if self._check_faults():
                        return
                    self._resolve_pauses()
                    next_step = now + step_time
                timeout = next_step - anyio.current_time()
            else:
                self._idle_duties()
                if self._blocked:
                    await self._send_blocked()
                timeout = math.inf
            unpaced_steps = 0
            await self._wait_input(timeout)

    async def _wait_input(self, seconds: float) -> None:
        """Wait until input may be queued, for at most ``seconds``."""
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
        elif self.deaf:
            await anyio.sleep(seconds)
        else:
            assert self._input is not None
            with anyio.move_on_after(seconds):
                await self._input.wait_readable()

    def _check_faults(self) -> bool:
        """Apply the step-count faults; True when the engine is dead and must stop."""
        faults = self.config.faults
        steps = self.steps
        if faults.dead_after_steps is not None and steps >= faults.dead_after_steps:
            self._die(f"fault injection: dead after {faults.dead_after_steps} steps")
        if self.dead:
            return True
        if (faults.garbage_after_steps is not None and not self._garbage_sent
                and steps >= faults.garbage_after_steps):
            self._garbage_sent = True
            for out in self._outputs:
                self._send(out, [_GARBAGE])
        if faults.silent_after_steps is not None and steps >= faults.silent_after_steps:
            self.silent = True  # the loop stops reading input and stepping
        return False

    def _has_step_work(self) -> bool:
        if self._pause is _Pause.ALL:
            return False
        if self._zombies:
            return True
        return bool(self._running or (self._waiting and self._pause is _Pause.UNPAUSED))

    def _idle_duties(self) -> None:
        self._resolve_pauses()
        if self._flush_stats:
            # After a finish (or an abort) a real engine steps once more with nothing
            # scheduled, sending scheduler stats alone.
            self._flush_stats = False
            if self.config.log_stats and self._outputs:
                self._send_message(0, [], self._stats_bytes(), weight_version=True)

    # ------------------------------------------------------------------ input

    def _drain_input(self) -> None:
        inp = self._input
        assert inp is not None
        while not self.deaf and not self.dead and inp.readable():
            frames = inp.receive_nowait()
            if frames is not None:
                self._handle([f.bytes for f in frames])

    def _handle(self, frames: list[bytes]) -> None:
        kind = bytes(frames[0]) if frames else b""
        if kind == b"\x05":  # WAKEUP: internal, ignored
            return
        if kind == b"\x04":  # EXECUTOR_FAILED: the busy loop raises
            self._die("EXECUTOR_FAILED request received: Executor failed.")
            return
        if kind == b"\x02":
            self.errors.append("Unrecognized input request type encountered: START_DP_WAVE")
            return
        try:
            request = decode_request(frames)
            if isinstance(request, AddRequest):
                _check_private_keys(request)
        except ProtocolError as exc:
            # vLLM decodes in its input thread outside any try: the thread dies and the
            # engine never reads input again, without telling anyone.
            self.errors.append(f"input thread died: {exc}")
            self.deaf = True
            return
        if self.config.keep_history:
            self.received.append(request)
        if isinstance(request, AddRequest):
            self._add(request)
        elif isinstance(request, AbortRequest):
            self._abort(request.request_ids)
        else:
            self._call_utility(request)

    def _add(self, add: AddRequest) -> None:
        cfg = self.config
        req = add.request
        rid = req.request_id
        if rid in self._requests:
            self._die(f"AssertionError: duplicate request id {rid!r}")
            return
        if cfg.keep_history:
            self.added_ids.append(rid)
        if not 0 <= req.client_index < len(self._outputs):
            self.errors.append(f"request {rid!r}: client_index {req.client_index} has no "
                               f"output socket; dropped")
            return
        if req.max_tokens is None:
            # Request.from_engine_core_request asserts max_tokens is set; vLLM turns the
            # preprocessing failure into a request-scoped ERROR output.
            self.errors.append(f"request {rid!r}: max_tokens is nil")
            self._send_finish_outputs(req.client_index, [(rid, None)], _ERROR)
            return
        r = self._new_request(add)
        self._requests[rid] = r
        self._waiting.append(r)
        if cfg.log_stats:
            r.events = [(_QUEUED, time.monotonic())]

    def _new_request(self, add: AddRequest) -> _Request:
        cfg = self.config
        req = add.request
        wire = add.sampling_wire
        params = req.sampling_params
        prompt = list(req.prompt_token_ids)
        greedy = params.temperature < GREEDY_TEMPERATURE
        seed = params.seed if params.seed != -1 else None
        key = stream_key(prompt, greedy=greedy, seed=seed, engine_seed=cfg.seed,
                         request_id=req.request_id)
        stops = frozenset(params.stop_token_ids)
        eos = wire.get("_eos_token_id")
        all_stop = frozenset(wire.get("_all_stop_token_ids") or ()) | stops
        checks = stops | {eos} if eos is not None else stops
        vocab = cfg.vocab_size
        oov = any(t < 0 or t >= vocab for t in prompt) or any(
            t < 0 or t >= vocab for t in all_stop)
        assert req.max_tokens is not None
        limit = min(req.max_tokens, cfg.max_model_len - len(prompt))
        logprobs = params.logprobs
        if logprobs is not None and logprobs < 0:
            logprobs = vocab
        prompt_logprobs = params.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs < 0:
            prompt_logprobs = vocab
        trace = dict(req.trace_headers) if req.trace_headers else None
        mid = (b"\xc0" * 8 + (b"\xc0" if trace is None else _pack(trace))
               + b"\xc0\xc0\x00" + self._tail_fields)
        return _Request(
            rid=req.request_id, client=req.client_index, prompt=prompt, key=key,
            greedy=greedy, limit=limit, eos=eos, stops=stops, checks=checks,
            all_stop=all_stop, min_tokens=params.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            allowed=list(params.allowed_token_ids) if params.allowed_token_ids else None,
            trace=trace, cache_salt=req.cache_salt, oov=oov,
            prefix=self._row_header + _pack(req.request_id), mid=mid,
        )

    def _abort(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        self.abort_frames += 1
        if self.config.keep_history:
            self.aborted_ids.extend(ids)
        late = self.config.faults.late_outputs_after_abort
        for rid in ids:
            r = self._requests.pop(rid, None)
            if r is None:
                continue  # unknown or finished: ignored
            r.alive = False
            self._dirty = True
            if late and r.scheduled_once and r in self._running:
                r.late = late
                self._zombies.append(r)
        if self.config.log_stats:
            self._flush_stats = True

    def _purge(self) -> None:
        """Drop aborted requests from the queues (batched: aborts can come by the thousand)."""
        self._dirty = False
        running = [r for r in self._running if r.alive]
        for r in self._running:
            if not r.alive:
                self._kv_tokens -= len(r.prompt) + r.num_out
        self._running = running
        self._waiting = deque(r for r in self._waiting if r.alive)

    # ------------------------------------------------------------------ utilities

    def _call_utility(self, call: UtilityRequest) -> None:
        if not 0 <= call.client_index < len(self._outputs):
            self.errors.append(f"utility {call.method!r}: client_index {call.client_index} "
                               f"has no output socket; dropped")
            return
        self._current_call = (call.client_index, call.call_id)
        method = call.method
        try:
            if method.startswith("_"):
                raise AttributeError(f"'EngineCoreProc' object has no attribute '{method}'")
            result = getattr(self._utility, method)(*call.args)
        except Exception as exc:
            self._send_utility(call.client_index, call.call_id,
                               f"Call to {method} method failed: {exc}", None)
            return
        if result is _DEFERRED:
            return
        self._send_utility(call.client_index, call.call_id, None, result)

    def _pause_scheduler(self, mode: str, clear_cache: bool,
                         then: Callable[[], None] | None) -> object:
        if mode not in _PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            self._abort_everything(shutdown=False)
        self._pause = _Pause.ALL if mode == "keep" else _Pause.NEW
        if clear_cache:
            self._reset_prefix_cache()
        if mode == "wait" and self._running_alive():
            self._pending_pauses.append((*self._current_call, then))
            return _DEFERRED
        if then is not None:
            then()
        return None

    def _resolve_pauses(self) -> None:
        if not self._pending_pauses or self._running_alive():
            return
        pending, self._pending_pauses = self._pending_pauses, []
        for client, call_id, then in pending:
            if then is not None:
                then()
            self._send_utility(client, call_id, None, None)

    def _running_alive(self) -> bool:
        return any(r.alive for r in self._running)

    def _reset_prefix_cache(self) -> None:
        self._prefix_cache.clear()
        self._pc_reset = True

    # ------------------------------------------------------------------ scheduling

    def _admit(self, now: float) -> None:
        """Move waiting requests into the running batch (FIFO, up to max_num_seqs)."""
        cfg = self.config
        waiting = self._waiting
        running = self._running
        while waiting and len(running) < cfg.max_num_seqs:
            r = waiting.popleft()
            if not r.alive:
                continue
            if r.oov:
                # The worker indexes the embedding table with it and dies.
                self._die(f"request {r.rid!r}: token id out of vocabulary "
                          f"(vocab_size={cfg.vocab_size}): IndexError: index out of range "
                          f"in self")
                return
            if cfg.log_stats:
                if r.events is None:
                    r.events = []
                r.events.append((_SCHEDULED, now))
            if not r.scheduled_once:
                r.scheduled_once = True
                r.prefill = self._prefill_stats(r)
                r.want_prompt_logprobs = r.prompt_logprobs is not None
            _set_plain(r, False)
            running.append(r)
            self._kv_tokens += len(r.prompt) + r.num_out

    def _prefill_stats(self, r: _Request) -> dict[str, int]:
        cfg = self.config
        n = len(r.prompt)
        cached = created = 0
        if cfg.enable_prefix_caching:
            bs = cfg.block_size
            hashes = []
            h = hash(("salt", r.cache_salt))
            for i in range(n // bs):
                h = hash((h, tuple(r.prompt[i * bs:(i + 1) * bs])))
                hashes.append(h)
            cache = self._prefix_cache
            hits = 0
            if r.prompt_logprobs is None:  # prompt logprobs skip reading the cache
                for h in hashes[:(n - 1) // bs]:  # the last prompt token is always computed
                    if h not in cache:
                        break
                    hits += 1
            for h in hashes:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > cfg.gpu_blocks:
                cache.popitem(last=False)
            cached = hits * bs
            created = max(0, len(hashes) * bs - cached)
            self._pc_requests += 1
            self._pc_queries += n
            self._pc_hits += cached
        return {
            "num_prompt_tokens": n, "num_computed_tokens": n - cached,
            "num_cached_tokens": cached, "num_local_cached_tokens": cached,
            "num_external_cached_tokens": 0, "num_cache_creation_tokens": created,
        }

    def _preempt(self, r: _Request, now: float) -> None:
        self._running.remove(r)
        self._kv_tokens -= len(r.prompt) + r.num_out
        r.num_preemptions += 1
        if self.config.log_stats:
            if r.events is None:
                r.events = []
            r.events.append((_PREEMPTED, now))
            _set_plain(r, False)
        self._waiting.appendleft(r)

    def _preempt_all(self, now: float) -> None:
        for r in reversed([r for r in self._running if r.alive]):
            self._preempt(r, now)

    # ------------------------------------------------------------------ the step

    def _step(self) -> None:
        cfg = self.config
        now = time.monotonic()
        self.steps += 1
        self._flush_stats = False
        preempt_every = cfg.faults.preempt_every
        if preempt_every is not None and self.steps % preempt_every == 0 and self._running:
            self._preempt(self._running[-1], now)  # the scheduler admits nobody this step
        elif self._pause is _Pause.UNPAUSED:
            self._admit(now)
            if self.dead:
                return
        # Per client: packed rows, three parts per row (row bytes may be split in three).
        rows: list[list[bytes]] = [[] for _ in self._outputs]
        aux: dict[int, list[bytes | memoryview]] = {}
        finished: list[_Request] = []
        if cfg.num_speculative_tokens:
            emitted = self._generate_spec(rows, aux, finished, now)
        else:
            emitted = self._generate(rows, aux, finished, now)
        if self._zombies:
            self._generate_late(rows)
        self._kv_tokens += emitted
        if finished:
            for r in finished:
                del self._requests[r.rid]
                self._kv_tokens -= len(r.prompt) + r.num_out
            self._running = [r for r in self._running if r.alive]
            if cfg.log_stats:
                self._flush_stats = True
        stats = self._stats_bytes() if cfg.log_stats else b"\xc0"
        sent = False
        for client, parts in enumerate(rows):
            if parts:
                self._send_message(client, parts, stats, weight_version=True,
                                   aux=aux.get(client))
                stats = b"\xc0"  # vLLM attaches the stats to the first client's message
                sent = True
        if not sent and cfg.log_stats:
            self._send_message(0, [], stats, weight_version=True)

    def _generate(self, rows: list[list[bytes]], aux: dict[int, list[bytes | memoryview]],
                  finished: list[_Request], now: float) -> int:
        """One token per running request: the hot loop."""
        tokb = self._tokb
        running = self._running
        for r in running:
            n = r.num_out
            if n < r.fast_end:
                tok = r.buf[n - r.buf_start]
                r.num_out = n + 1
                if tok not in r.checks:
                    rows[r.client].extend((r.prefix, tokb[tok], r.mid))
                    continue
            else:
                if n >= r.buf_end:
                    self._refill(r, 1)
                tok = r.buf[n - r.buf_start]
                r.num_out = n + 1
            finish, reason = _check_stop(r, tok, n + 1)
            rows[r.client].extend((self._row(r, [tok], finish, reason, aux, now), b"", b""))
            if finish is not None:
                r.alive = False
                finished.append(r)
        return len(running)

    def _generate_spec(self, rows: list[list[bytes]], aux: dict[int, list[bytes | memoryview]],
                       finished: list[_Request], now: float) -> int:
        """Speculative decoding: 1 to 1+k accepted tokens per request per step."""
        k = self.config.num_speculative_tokens
        tokb = self._tokb
        emitted = 0
        accepted_pos = self._spec_accepted_pos
        for r in self._running:
            n = r.num_out
            if n + k + 1 > r.buf_end:
                self._refill(r, k + 1)
            accept = ((r.key ^ (n * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 >> 40) % (k + 1)
            self._spec_drafts += 1
            self._spec_accepted += accept
            for i in range(accept):
                accepted_pos[i] += 1
            toks: list[int] = []
            finish: int | None = None
            reason: int | None = None
            base = n - r.buf_start
            for tok in r.buf[base:base + accept + 1]:
                toks.append(tok)
                n += 1
                finish, reason = _check_stop(r, tok, n)
                if finish is not None:
                    break
            r.num_out = n
            emitted += len(toks)
            if r.plain and finish is None:
                packed = _array_header(len(toks)) + b"".join([tokb[t][1:] for t in toks])
                rows[r.client].extend((r.prefix, packed, r.mid))
                continue
            rows[r.client].extend((self._row(r, toks, finish, reason, aux, now), b"", b""))
            if finish is not None:
                r.alive = False
                finished.append(r)
        return emitted

    def _generate_late(self, rows: list[list[bytes]]) -> None:
        """Outputs owed for aborted requests (``late_outputs_after_abort``)."""
        tokb = self._tokb
        for r in self._zombies:
            if r.num_out >= r.buf_end:
                self._refill(r, 1)
            tok = r.buf[r.num_out - r.buf_start]
            r.num_out += 1
            r.late -= 1
            rows[r.client].extend((r.prefix, tokb[tok], r.mid))
        self._zombies = [r for r in self._zombies if r.late > 0]

    def _refill(self, r: _Request, need: int) -> None:
        cfg = self.config
        start = r.num_out
        count = max(min(_CHUNK, r.limit - start), need)
        r.buf = generate(
            r.key, start, count, cfg.vocab_size,
            avoid=r.all_stop if r.min_tokens else (), avoid_before=r.min_tokens,
            allowed=r.allowed, eos_token_id=cfg.eos_token_id,
            eos_probability=cfg.eos_probability,
        )
        r.buf_start = start
        r.buf_end = start + len(r.buf)
        _set_plain(r, r.plain)

    def _row(self, r: _Request, toks: list[int], finish: int | None, reason: int | None,
             aux: dict[int, list[bytes | memoryview]], now: float) -> bytes:
        """The general (slow) path: a row with logprobs, events, prefill stats or a finish."""
        cfg = self.config
        frames: list[bytes | memoryview] | None = None
        logprobs = None
        if r.logprobs is not None:
            frames = aux.setdefault(r.client, [b""])
            lp = fake_logprobs(r.key, toks, r.num_out - len(toks), r.logprobs, cfg.vocab_size,
                               greedy=r.greedy)
            logprobs = encode_logprobs(lp, frames)
        prompt_logprobs = None
        if r.want_prompt_logprobs:
            r.want_prompt_logprobs = False
            assert r.prompt_logprobs is not None
            plp = fake_prompt_logprobs(r.prompt, r.prompt_logprobs, cfg.vocab_size)
            if plp is not None:
                frames = aux.setdefault(r.client, [b""])
                prompt_logprobs = encode_logprobs(plp, frames, prompt=True)
        events = None
        if r.events:
            events = [{"type": kind, "timestamp": ts} for kind, ts in r.events]
        r.events = None
        prefill, r.prefill = r.prefill, None
        row: list[Any] = [
            r.rid, toks, logprobs, prompt_logprobs, None, finish, reason, events, None, None,
            r.trace, prefill, None, 0, None, None, None, None, None,
        ]
        _set_plain(r, r.logprobs is None)
        return _pack(row[:cfg.output_fields])

    # ------------------------------------------------------------------ messages

    def _stats_bytes(self) -> bytes:
        cfg = self.config
        num_running = len(self._running)  # purged: only live requests remain
        num_waiting = len(self._waiting)
        used_blocks = -(-max(self._kv_tokens, 0) // cfg.block_size)
        usage = min(1.0, used_blocks / cfg.gpu_blocks)
        prefix_cache: dict[str, Any] | None = None
        if cfg.enable_prefix_caching:
            prefix_cache = {
                "reset": self._pc_reset, "requests": self._pc_requests,
                "queries": self._pc_queries, "hits": self._pc_hits,
                "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
                "hits_by_source": {},
            }
            self._pc_reset = False
            self._pc_requests = self._pc_queries = self._pc_hits = 0
        spec = None
        if cfg.num_speculative_tokens:
            k = cfg.num_speculative_tokens
            spec = {
                "num_spec_tokens": k, "num_drafts": self._spec_drafts,
                "num_draft_tokens": self._spec_drafts * k,
                "num_accepted_tokens": self._spec_accepted,
                "num_accepted_tokens_per_pos": self._spec_accepted_pos,
                "num_draft_tokens_per_pos": [self._spec_drafts] * k,
            }
            self._spec_drafts = self._spec_accepted = 0
            self._spec_accepted_pos = [0] * k
        stats: dict[str, Any] = {
            "num_running_reqs": num_running,
            "num_waiting_reqs": num_waiting,
            "num_skipped_waiting_reqs": 0,
            "num_kv_fetch_reqs_by_stage": {"waiting_to_start": 0, "in_progress": 0,
                                           "completed_waiting": 0},
            "step_counter": 0,
            "current_wave": 0,
            "kv_cache_usage": float(usage),
            "iteration_details": None,
            "prefix_cache_stats": prefix_cache,
            "connector_prefix_cache_stats": None,
            "kv_cache_eviction_events": [],
            "spec_decoding_stats": spec,
            "kv_connector_stats": None,
            "ec_connector_stats": None,
            "waiting_lora_adapters": {},
            "running_lora_adapters": {},
            "cudagraph_stats": None,
            "perf_stats": None,
        }
        self.last_stats = SchedulerStats(
            num_running_reqs=num_running, num_waiting_reqs=num_waiting,
            kv_cache_usage=float(usage),
            prefix_cache_queries=prefix_cache["queries"] if prefix_cache else 0,
            prefix_cache_hits=prefix_cache["hits"] if prefix_cache else 0, raw=stats,
        )
        return _pack(stats)

    def _send_message(self, client: int, rows: list[bytes], stats: bytes, *,
                      weight_version: bool,
                      aux: list[bytes | memoryview] | None = None) -> None:
        """Assemble ``EngineCoreOutputs`` from row parts (three per row) and send it."""
        main = b"".join([
            self._msg_head, _array_header(len(rows) // 3), *rows, stats,
            b"\xcb", _pack_double(time.monotonic()), b"\xc0\xc0\xc0\xc0",
            self._weight_version_bytes if weight_version else b"\xc0",
        ])
        frames: list[bytes | memoryview] = [main]
        if aux is not None:
            frames.extend(aux[1:])
        self._send(self._outputs[client], frames)

    def _send_utility(self, client: int, call_id: int, failure: str | None,
                      result: object) -> None:
        wrapped = None if failure is not None else [None, result]
        message = [self.config.rank, [], None, time.monotonic(), [call_id, failure, wrapped],
                   None, None, None, None]
        try:
            payload = _pack(message)
        except (TypeError, ValueError, OverflowError) as exc:
            payload = _pack([self.config.rank, [], None, time.monotonic(),
                             [call_id, f"Call to utility failed: {exc}", None],
                             None, None, None, None])
        self._send(self._outputs[client], [payload])

    def _send_finish_outputs(self, client: int, requests: list[tuple[str, dict[str, str] | None]],
                             reason: int, *, tracked: bool = False) -> None:
        """Rows with no tokens and ``reason`` plus ``finished_requests`` (no stats)."""
        fields = self.config.output_fields
        rows: list[list[Any]] = [
            [rid, [], None, None, None, reason, None, None, None, None, trace, None, None, 0,
             None, None, None, None, None][:fields]
            for rid, trace in requests
        ]
        message = [self.config.rank, rows, None, time.monotonic(), None,
                   [rid for rid, _ in requests], None, None, None]
        frames: list[bytes | memoryview] = [_pack(message)]
        if tracked:
            self._send_tracked(self._outputs[client], frames)
        else:
            self._send(self._outputs[client], frames)

    def _abort_everything(self, *, shutdown: bool) -> None:
        """Finish every request with ABORT outputs (pause mode "abort", or SIGTERM)."""
        by_client: dict[int, list[tuple[str, dict[str, str] | None]]] = {}
        for r in [*self._running, *self._waiting]:
            if r.alive:
                r.alive = False
                self._requests.pop(r.rid, None)
                by_client.setdefault(r.client, []).append((r.rid, r.trace))
        self._running = []
        self._waiting = deque()
        self._zombies = []
        self._kv_tokens = 0
        for client, requests in by_client.items():
            self._send_finish_outputs(client, requests, _ABORT, tracked=shutdown)

    def _die(self, reason: str) -> None:
        """Send ENGINE_CORE_DEAD on every output socket; the loop then stops."""
        if self.dead:
            return
        self.dead = True
        self.errors.append(reason)
        for out in self._outputs:
            self._send_tracked(out, [ENGINE_CORE_DEAD])

    # ------------------------------------------------------------------ sending

    def _send(self, sock: ZmqSocket, frames: list[bytes | memoryview]) -> None:
        if self._blocked or not sock.send_nowait(frames):
            self._blocked.append((sock, frames))  # keep order: later sends queue behind

    async def _send_blocked(self) -> None:
        blocked, self._blocked = self._blocked, []
        for sock, frames in blocked:
            await sock.send(frames)

    def _send_tracked(self, sock: ZmqSocket, frames: list[bytes | memoryview]) -> None:
        """Send now with a tracker, so closing can wait until the bytes left (linger)."""
        if self._blocked or sock.closed:
            self._send(sock, frames)
            return
        raw = sock.raw
        threshold = raw.copy_threshold
        raw.copy_threshold = 0  # a copied frame's tracker is done at once: track the real one
        try:
            tracker = raw.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
        except zmq.ZMQError as exc:
            self.errors.append(f"could not send final message: {exc}")
            return
        finally:
            raw.copy_threshold = threshold
        if tracker is not None:
            self._trackers.append(tracker)

    async def _flush_tracked(self) -> None:
        """Wait (at most ``linger`` seconds) until tracked final messages were sent."""
        with anyio.move_on_after(self.config.linger):
            for tracker in self._trackers:
                while True:
                    if tracker.done:
                        break
                    await anyio.sleep(0.002)
        self._trackers.clear()


def _set_plain(r: _Request, plain: bool) -> None:
    r.plain = plain
    r.fast_end = min(r.buf_end, r.limit - 1) if plain else 0


def _check_stop(r: _Request, tok: int, n: int) -> tuple[int | None, int | None]:
    """vLLM's ``check_stop`` for the ``n``-th output token ``tok``."""
    if tok == r.eos:
        return _STOP, None
    if tok in r.stops:
        return _STOP, tok
    if n >= r.limit:
        return _LENGTH, None
    return None, None


def _check_private_keys(add: AddRequest) -> None:
    """Type-check the private sampling keys msgspec would validate (set[int], int|None)."""
    all_stop = add.sampling_wire.get("_all_stop_token_ids")
    if all_stop is not None and (type(all_stop) is not list
                                 or not all(type(t) is int for t in all_stop)):
        raise ProtocolError("EngineCoreRequest.sampling_params._all_stop_token_ids: "
                            "expected an array of int")
    eos = add.sampling_wire.get("_eos_token_id")
    if eos is not None and type(eos) is not int:
        raise ProtocolError("EngineCoreRequest.sampling_params._eos_token_id: expected int")


def _version_at_least(version: str, minimum: tuple[int, int]) -> bool:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= minimum
