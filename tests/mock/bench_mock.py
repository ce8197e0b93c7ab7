"""Throughput of the mock engine (not a test; run it by hand).

    .venv/bin/python -m tests.mock.bench_mock [--seconds 5] [--concurrency 1024]
        [--max-tokens 0] [--no-log-stats] [--backend asyncio|trio] [--uvloop]

The engine runs in its own process (``python -m anyio_genout mock-engine``); this process plays a
plain synchronous pyzmq front end: it handshakes, keeps ``--concurrency`` requests in flight
(re-adding one whenever one finishes) and drains the output PULL, decoding every message with
msgpack to count tokens. ``--max-tokens 0`` means "never finish during the run" (pure decode
steps); a small value exercises admission, first outputs and finishes every step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import msgpack
import zmq

from anyio_genout.protocol.outputs import OUTPUT_FIELDS, OUTPUTS_FIELDS

#: Where the fields read here sit in the raw arrays (the protocol's names for them).
_OUTPUTS = OUTPUTS_FIELDS.index("outputs")
_TOKENS = OUTPUT_FIELDS.index("new_token_ids")
_FINISH = OUTPUT_FIELDS.index("finish_reason")

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--backend", default="asyncio")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()

    ctx = zmq.Context()
    hs = ctx.socket(zmq.ROUTER)
    inp = ctx.socket(zmq.ROUTER)
    out = ctx.socket(zmq.PULL)
    for s in (hs, inp, out):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SNDHWM, 0)
    hs_port = hs.bind_to_random_port("tcp://127.0.0.1")
    inp_addr = f"tcp://127.0.0.1:{inp.bind_to_random_port('tcp://127.0.0.1')}"
    out_addr = f"tcp://127.0.0.1:{out.bind_to_random_port('tcp://127.0.0.1')}"
    max_model_len = 1 << 30 if args.max_tokens == 0 else 1 << 16
    cmd = [sys.executable, "-m", "anyio_genout", "mock-engine", "--handshake-address",
           f"tcp://127.0.0.1:{hs_port}", "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(max_model_len), "--backend", args.backend,
           "--log-stats" if args.log_stats else "--no-log-stats"]
    if args.uvloop:
        cmd.append("--uvloop")
    proc = subprocess.Popen(cmd)
    try:
        ident, _hello = hs.recv_multipart()
        hs.send_multipart([ident, msgpack.packb({
            "addresses": {"inputs": [inp_addr], "outputs": [out_addr], "coordinator_input":
                          None, "coordinator_output": None,
                          "frontend_stats_publish_address": None},
            "parallel_config": {}})])
        hs.recv_multipart()
        inp.recv_multipart()
        max_tokens = args.max_tokens or (1 << 29)
        counter = 0

        def add() -> None:
            nonlocal counter
            counter += 1
            prompt = [(counter * 7 + i) % 32000 for i in range(args.prompt_len)]
            payload = msgpack.packb([f"r{counter}", prompt, None,
                                     {"temperature": 0.0, "max_tokens": max_tokens}, None,
                                     time.time(), None, None, None])
            inp.send_multipart([ident, b"\x00", payload])

        for _ in range(args.concurrency):
            add()
        tokens = messages = finished = 0
        start = deadline = 0.0
        while True:
            frames = out.recv_multipart()
            now = time.perf_counter()
            if not start:
                start, deadline = now, now + args.seconds
            if now >= deadline:
                break
            messages += 1
            main = frames[0]
            if not args.max_tokens:  # nothing finishes: count rows from the array header
                head = main[2]
                tokens += head & 0x0F if head & 0xF0 == 0x90 else int.from_bytes(main[3:5])
                continue
            rows = msgpack.unpackb(main, raw=False)[_OUTPUTS]
            for row in rows:
                tokens += len(row[_TOKENS])
                if row[_FINISH] is not None:
                    finished += 1
                    add()
        elapsed = time.perf_counter() - start
        loop = args.backend + ("+uvloop" if args.uvloop else "")
        print(f"concurrency={args.concurrency} max_tokens={args.max_tokens or 'inf'} "
              f"log_stats={args.log_stats} backend={loop}: "
              f"{tokens / elapsed:,.0f} tokens/s, {messages / elapsed:,.0f} msgs/s, "
              f"{finished / elapsed:,.0f} finished/s")
    finally:
        proc.terminate()
        proc.wait(10)
        for s in (hs, inp, out):
            s.close(0)
        ctx.term()


if __name__ == "__main__":
    main()
