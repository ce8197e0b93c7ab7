"""The floor: a bare synchronous client, the least any Python front end can spend.

Raw pyzmq (a handshake ROUTER, the input ROUTER and the output PULL, blocking calls), the
handshake done by hand with the :mod:`anyio_genout.protocol` helpers, ADD payloads packed
from a prebuilt wire template, and for each output message only ``msgpack.unpackb`` and a
per-request token count keyed by request id: no objects, no event loop, no validation.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from ..protocol import (
    EngineCoreRequest,
    EngineStatus,
    HandshakeAddresses,
    RequestType,
    SamplingParams,
    decode_ready_response,
    decode_status,
    encode_init,
    encode_utility,
)
from .measure import EngineProcess, Meter, free_port, freeze_gc
from .ours import gate_rounds, latency_figures, prompt
from .spec import CellSpec, Result, summarise

__all__ = ["FloorClient", "run"]

_ADD = RequestType.ADD.value
_FINISH = 5  # index of finish_reason in an EngineCoreOutput row


class FloorClient:
    """Bound sockets and the engine's identity after the handshake."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.handshake = context.socket(zmq.ROUTER)
        self.input = context.socket(zmq.ROUTER)
        self.output = context.socket(zmq.PULL)
        for sock in (self.handshake, self.input, self.output):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        self.handshake_address = f"tcp://127.0.0.1:{free_port()}"
        self.handshake.bind(self.handshake_address)
        self.input_address = f"tcp://127.0.0.1:{self.input.bind_to_random_port('tcp://127.0.0.1')}"
        self.output_address = (
            f"tcp://127.0.0.1:{self.output.bind_to_random_port('tcp://127.0.0.1')}")
        self.identity = b""
        self._calls = 0
        self._templates: dict[int, list[Any]] = {}

    def connect(self, timeout: float = 60.0) -> None:
        """HELLO -> INIT -> (READY, registration), as the engine core expects."""
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.input, zmq.POLLIN)
        ready = registered = False
        deadline = time.monotonic() + timeout
        while not (ready and registered):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("floor client: the engine did not finish the handshake")
            events = dict(poller.poll(int(remaining * 1000)))
            if self.handshake in events:
                identity, data = self.handshake.recv_multipart()
                status = decode_status(data).status
                if status is EngineStatus.HELLO:
                    self.identity = identity
                    init = HandshakeAddresses([self.input_address], [self.output_address])
                    self.handshake.send_multipart([identity, encode_init(init)])
                else:
                    ready = True
            if self.input in events:
                _identity, data = self.input.recv_multipart()
                decode_ready_response(data)
                registered = True

    def template(self, tokens: int, ids: tuple[int, ...]) -> list[Any]:
        """The ADD wire array for ``tokens`` tokens (id and arrival time filled per send)."""
        wire = self._templates.get(tokens)
        if wire is None:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            wire = EngineCoreRequest(request_id="x", prompt_token_ids=ids,
                                     sampling_params=params, arrival_time=0.0).to_wire()
            self._templates[tokens] = wire
        return wire

    def utility(self, method: str, *args: Any) -> None:
        """Send a utility call (its reply, a message without outputs, is read as such)."""
        self._calls += 1
        self.input.send_multipart([self.identity, *encode_utility(0, self._calls, method,
                                                                  args)])

    def pause(self) -> None:
        """Pause the engine's scheduler and wait for the reply (see ``gate_rounds``)."""
        self.utility("pause_scheduler", "keep", False)
        while True:
            message = msgpack.unpackb(self.output.recv_multipart()[0])
            if message[4] is not None and message[4][0] == self._calls:
                return

    def add(self, wire: list[Any], request_id: str) -> None:
        wire[0] = request_id
        wire[5] = time.time()
        self.input.send_multipart([self.identity, _ADD, msgpack.packb(wire)])

    def close(self) -> None:
        for sock in (self.handshake, self.input, self.output):
            sock.close(0)


def run(spec: CellSpec) -> Result:
    context: zmq.Context[Any] = zmq.Context(io_threads=1)
    client = FloorClient(context)
    try:
        with EngineProcess(client.handshake_address, spec) as engine:
            client.connect()
            run_streams(client, min(spec.concurrency, 64), 8, prompt(spec.prompt_len, 1), "warm")
            frozen = freeze_gc()
            meter = Meter(spec, engine)
            extra = _WORKLOADS[spec.workload](client, spec, meter)
            engine.check_alive()
    finally:
        client.close()
        context.term()
    result = summarise(spec, meter.samples, meter.window())
    result.update(extra)
    result["gc_frozen_objects"] = frozen
    return result


def run_streams(client: FloorClient, count: int, tokens: int, ids: tuple[int, ...],
             tag: str, *, release: bool = False) -> int:
    wire = client.template(tokens, ids)
    for i in range(count):
        client.add(wire, f"{tag}-{i}")
    if release:
        client.utility("resume_scheduler")
    counts: dict[str, int] = {}
    done = 0
    recv = client.output.recv_multipart
    unpackb = msgpack.unpackb
    while done < count:
        for row in unpackb(recv()[0])[1]:
            rid = row[0]
            counts[rid] = counts.get(rid, 0) + len(row[1])
            if row[_FINISH] is not None:
                done += 1
    return sum(counts.values())


def _throughput(client: FloorClient, spec: CellSpec, meter: Meter) -> Result:
    ids = prompt(spec.prompt_len)
    complete = True
    rounds = 0
    gate = gate_rounds(spec)
    while meter.more():
        if gate:
            client.pause()
        started = meter.start()
        tokens = run_streams(client, spec.concurrency, spec.tokens, ids, f"t{rounds}",
                          release=gate)
        meter.stop(started, tokens=tokens, requests=spec.concurrency)
        complete = complete and tokens == spec.concurrency * spec.tokens
        rounds += 1
    # One more (unmeasured) round counting messages: outputs per engine message.
    wire = client.template(spec.tokens, ids)
    if gate:
        client.pause()
    for i in range(spec.concurrency):
        client.add(wire, f"count-{i}")
    if gate:
        client.utility("resume_scheduler")
    messages = done = outputs = 0
    while done < spec.concurrency:
        rows = msgpack.unpackb(client.output.recv_multipart()[0])[1]
        if rows:
            messages += 1
        outputs += len(rows)
        done += sum(1 for row in rows if row[_FINISH] is not None)
    return {"complete": complete, "messages_per_round": messages, "gated": gate,
            "outputs_per_message": outputs / messages if messages else None}


def _latency(client: FloorClient, spec: CellSpec, meter: Meter) -> Result:
    ids = prompt(spec.prompt_len)
    wire = client.template(spec.tokens, ids)
    first: list[float] = []
    per_output: list[float] = []
    clock, cpu_clock = time.perf_counter, time.thread_time
    count = spec.requests or 100
    pause = 2 * spec.engine_step_time
    tokens = 0
    recv = client.output.recv_multipart
    for i in range(count):
        time.sleep(pause)
        started = meter.start()
        t0 = clock()
        client.add(wire, f"l{i}")
        previous = 0.0
        finished = False
        n = 0
        while not finished:
            for row in msgpack.unpackb(recv()[0])[1]:
                now = cpu_clock()
                if previous:
                    per_output.append(now - previous)
                else:
                    first.append(clock() - t0)
                previous = now
                n += len(row[1])
                finished = row[_FINISH] is not None
        meter.stop(started, tokens=n, requests=1)
        tokens += n
    return latency_figures(first, per_output, complete=tokens == count * spec.tokens)


def _churn(client: FloorClient, spec: CellSpec, meter: Meter) -> Result:
    ids = prompt(spec.prompt_len)
    wires = [client.template(t, ids) for t in (1, 2, 3, 4)]
    total = spec.requests or 2000
    expected = sum(1 + k % 4 for k in range(total))
    recv = client.output.recv_multipart
    unpackb = msgpack.unpackb
    complete = True
    rounds = 0
    while meter.more():
        started = meter.start()
        sent = done = 0
        counts: dict[str, int] = {}
        while sent < min(spec.concurrency, total):
            client.add(wires[sent % 4], f"c{rounds}-{sent}")
            sent += 1
        while done < total:
            for row in unpackb(recv()[0])[1]:
                rid = row[0]
                counts[rid] = counts.get(rid, 0) + len(row[1])
                if row[_FINISH] is not None:
                    done += 1
                    if sent < total:
                        client.add(wires[sent % 4], f"c{rounds}-{sent}")
                        sent += 1
        tokens = sum(counts.values())
        meter.stop(started, tokens=tokens, requests=total)
        complete = complete and tokens == expected
        rounds += 1
    return {"complete": complete}


_WORKLOADS = {"throughput": _throughput, "latency": _latency, "churn": _churn}
