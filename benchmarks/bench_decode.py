"""Decode cost of one realistic ``EngineCoreOutputs`` message: ours vs plain msgpack.

Run: ``.venv/bin/python benchmarks/bench_decode.py [--rounds N] [--outputs N]``.

The message is what a real vLLM 0.32 engine sends during a busy decode step: ``--outputs``
requests (default 256) with one new token each, 18-field output rows (``num_nans_in_logits``
is the only non-nil optional field), and ``scheduler_stats`` present (log stats are on by
default in ``vllm serve``). For each round it times a batch of :func:`decode_outputs` calls
and a batch of bare ``msgpack.unpackb`` calls on the same bytes, alternating which goes first,
and reports the median per-output cost of each over all rounds and their ratio. The target
is a ratio of at most 1.5: validating and typing a message should cost at most half again
what merely parsing it does.

This is a script, not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anyio_genout.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    RequestBatch,
    SchedulerStats,
    decode_outputs,
    encode_outputs,
)


def scheduler_stats_map(running: int) -> dict[str, Any]:
    """vLLM 0.32's ``SchedulerStats`` map as a real engine sends it (log stats on)."""
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": 0,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {
            "waiting_to_start": 0, "in_progress": 0, "completed_waiting": 0,
        },
        "step_counter": 0,
        "current_wave": 0,
        "kv_cache_usage": 0.12524420024420024,
        "iteration_details": None,
        "prefix_cache_stats": {
            "reset": False, "requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0,
            "preempted_queries": 0, "preempted_hits": 0, "hits_by_source": {},
        },
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def build_message(n_outputs: int) -> bytes:
    """Frame 0 of a decode step with ``n_outputs`` one-token outputs (vLLM 0.32 layout)."""
    stats = scheduler_stats_map(n_outputs)
    message = EngineCoreOutputs(
        engine_index=0,
        outputs=[
            EngineCoreOutput(f"cmpl-{i:08x}-0", [(i * 7919) % 32000])
            for i in range(n_outputs)
        ],
        scheduler_stats=SchedulerStats(
            num_running_reqs=n_outputs, kv_cache_usage=stats["kv_cache_usage"], raw=stats
        ),
        timestamp=1047.991969344,
        weight_version="default",
    )
    frames = encode_outputs(message, fields=18)
    assert len(frames) == 1
    return bytes(frames[0])


def time_batch(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=256, help="outputs per message")
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds (median taken)")
    parser.add_argument("--calls", type=int, default=100, help="calls per batch")
    parser.add_argument("--gc", action="store_true",
                        help="leave the garbage collector on while timing (default: off)")
    args = parser.parse_args()

    data = build_message(args.outputs)
    frames = [data]
    decoded = decode_outputs(frames)
    assert isinstance(decoded, RequestBatch)
    assert len(decoded.message.outputs) == args.outputs
    assert decoded.message.scheduler_stats is not None

    def ours() -> object:
        return decode_outputs(frames)

    def plain() -> object:
        return msgpack.unpackb(data)

    def floor() -> object:
        # What the API costs before any validation: parse, then one EngineCoreOutput (a
        # 19-field named tuple) per row. No decoder returning these objects can beat this.
        rows = msgpack.unpackb(data)[1]
        deque(map(list.append, rows, repeat(None)), maxlen=0)
        return list(map(tuple.__new__, repeat(EngineCoreOutput), rows))

    contenders = {"decode_outputs": ours, "msgpack.unpackb": plain, "floor": floor}
    for fn in contenders.values():  # warm up
        time_batch(fn, args.calls)

    per_output: dict[str, list[float]] = {name: [] for name in contenders}
    ratios: list[float] = []
    if not args.gc:
        gc.disable()
    try:
        for round_no in range(args.rounds):
            order = list(contenders.items())
            if round_no % 2:
                order.reverse()
            took = {name: time_batch(fn, args.calls) for name, fn in order}
            for name, seconds in took.items():
                per_output[name].append(seconds / args.calls / args.outputs * 1e6)
            ratios.append(took["decode_outputs"] / took["msgpack.unpackb"])
            if not args.gc:
                gc.collect()
    finally:
        gc.enable()

    ours_us = statistics.median(per_output["decode_outputs"])
    plain_us = statistics.median(per_output["msgpack.unpackb"])
    floor_us = statistics.median(per_output["floor"])
    print(f"message: {len(data)} bytes, {args.outputs} outputs, scheduler_stats present")
    print(f"rounds: {args.rounds} x {args.calls} calls each, interleaved, gc "
          f"{'on' if args.gc else 'off'}; medians:")
    print(f"  decode_outputs   {ours_us:8.3f} us/output")
    print(f"  msgpack.unpackb  {plain_us:8.3f} us/output")
    print(f"  ratio            {ours_us / plain_us:8.2f}x  (median of per-round ratios "
          f"{statistics.median(ratios):.2f}x; target <= 1.5x)")
    print(f"  floor            {floor_us:8.3f} us/output = {floor_us / plain_us:.2f}x "
          f"(unpackb + building the EngineCoreOutput tuples, no validation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
