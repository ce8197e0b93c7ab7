"""The client's own CPU per request and per token, with the engine faked in-process.

Run: ``.venv/bin/python benchmarks/bench_inprocess.py [--backend asyncio|trio]
[--workload churn|steps|batched] [--no-gc] [--rounds 5]``.

A real :class:`~anyio_genout.Client` connects to a mock engine process (for the handshake
only); then its ADD sends are captured instead of sent, and a task in the same event loop
plays the engine: each step it takes the new requests, builds one ``EngineCoreOutputs``
message (the first output of a request carries prefill stats, the last one a finish
reason), encodes it with the protocol encoder and hands the frames to the client's reader
dispatch, exactly as the reader would after a receive. The fake engine's own time is
measured and subtracted, so what is reported is the client's main-thread CPU from
``generate()`` to the last output, decode included, sockets excluded: free of the other
three threads (two ZeroMQ I/O threads and the engine) that share the machine's cores in
``anyio-genout bench``, so A/B comparisons of a change repeat to within a few percent.

Workloads (the best of ``--rounds`` rounds is reported):

* ``churn``: 4,000 requests of 1..4 tokens, 64 at a time (the bench's churn cell);
* ``steps``: 256 streams (``--streams``) of 128 tokens (``--tokens``), one message per step
  and a yield after each, so every consumer wakes for every token (what a real engine's
  millisecond steps give);
* ``batched``: the same with 32 steps per yield (``--steps-per-yield``), so outputs pile up
  as they do in the bench's 256-stream cell, where the mock engine outruns the client.

``--no-gc`` disables the garbage collector after warm-up (the bench keeps it on), which
shows what the collector costs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    HandshakeTransport,
)
from anyio_genout.bench.measure import EngineProcess, free_port, freeze_gc
from anyio_genout.bench.ours import churn_params, run_churn, run_streams
from anyio_genout.bench.spec import CellSpec
from anyio_genout.protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    PrefillStats,
    decode_request,
    encode_outputs,
)
from anyio_genout.protocol.request_decode import AddRequest
from anyio_genout.testing import capture_input, deliver_output

PROMPT = tuple(range(4, 20))


class FakeEngine:
    """Plays the engine inside the client's event loop (see the module docstring)."""

    def __init__(self, client: Client, steps_per_yield: int) -> None:
        self.engine = client.engine
        self.sent: list[Any] = []
        capture_input(self.engine, self.sent.append)
        self.running: dict[str, list[int]] = {}
        self.steps_per_yield = steps_per_yield
        self.own_time = 0.0
        self.stopped = False

    async def run(self) -> None:
        step = 0
        while not self.stopped:
            if not self.sent and not self.running:
                await anyio.lowlevel.checkpoint()
                continue
            started = time.thread_time()
            for frames in self.sent:
                add = decode_request([bytes(f) for f in frames[1:]])  # after the identity
                assert isinstance(add, AddRequest)
                max_tokens = add.request.sampling_params.max_tokens
                assert max_tokens is not None
                self.running[add.request.request_id] = [max_tokens, 0]
            self.sent.clear()
            outputs = []
            for rid, state in list(self.running.items()):
                state[1] += 1
                done = state[1] >= state[0]
                outputs.append(EngineCoreOutput(
                    rid, [7 + state[1]],
                    finish_reason=EngineCoreFinishReason.LENGTH if done else None,
                    prefill_stats=PrefillStats(16, 16, 0, 0, 0, 0) if state[1] == 1 else None))
                if done:
                    del self.running[rid]
            step += 1
            frames = [zmq.Frame(bytes(part)) for part in
                      encode_outputs(EngineCoreOutputs(0, outputs, timestamp=float(step)))]
            self.own_time += time.thread_time() - started
            deliver_output(self.engine, frames)
            if step % self.steps_per_yield == 0:
                await anyio.lowlevel.checkpoint()


async def main(args: argparse.Namespace) -> float:
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = CellSpec(impl="ours", backend=args.backend, workload="churn")
    with EngineProcess(address, spec):
        config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                            ready_timeout=60.0))
        async with Client.connect(config) as client:
            fake = FakeEngine(client, args.steps_per_yield if args.workload == "batched" else 1)
            params = churn_params()
            best = float("inf")
            async with anyio.create_task_group() as tg:
                tg.start_soon(fake.run)
                await run_churn(client, 500, 64, PROMPT, params, "warm")
                freeze_gc()
                if args.no_gc:
                    gc.disable()
                for r in range(args.rounds):
                    fake.own_time = 0.0
                    started = time.thread_time()
                    if args.workload == "churn":
                        await run_churn(client, 4000, 64, PROMPT, params, f"r{r}")
                        units = 4000
                    else:
                        units = await run_streams(client, args.streams, args.tokens, PROMPT,
                                                  f"r{r}")
                    spent = time.thread_time() - started - fake.own_time
                    best = min(best, spent / units * 1e6)
                fake.stopped = True
            gc.enable()
            return best


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--workload", choices=("churn", "steps", "batched"), default="churn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=256, help="steps, batched: streams")
    parser.add_argument("--tokens", type=int, default=128, help="steps, batched: per stream")
    parser.add_argument("--steps-per-yield", type=int, default=32, help="batched: steps "
                        "the fake engine runs (messages the reader dispatches) per yield")
    parser.add_argument("--no-gc", action="store_true")
    args = parser.parse_args()
    best = anyio.run(main, args, backend=args.backend)
    unit = "request" if args.workload == "churn" else "token"
    print(f"{args.workload} on {args.backend}{' (gc off)' if args.no_gc else ''}: "
          f"{best:.2f} us of client CPU per {unit} (best of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
