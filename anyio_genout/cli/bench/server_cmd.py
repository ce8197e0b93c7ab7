"""``anyio-genout bench server``: our OpenAI server against ``vllm serve`` and ``vllm-rs``.

One run, the same load on each server, every server in front of a fresh mock engine (step
time 0) and reading the same model folder (the interop env's tiny llama: its tokenizer and
config). The load generator is vLLM's Rust ``vllm-rs bench serve`` (none of the servers
wrote it): streaming ``/v1/completions``, random 32-token prompts, 128 output tokens
(``--ignore-eos``), ``--max-concurrency C`` for each C. Per cell:

1. a probe of ``max(2C, 16)`` requests (the warm-up, and the rate that sizes the cell);
2. the measured run of N requests, N a multiple of C sized so that it takes about
   ``--cell-seconds`` at the probe's rate: tokens/s, TTFT and ITL p50/p99 from the load
   generator's result file; CPU seconds of the server's process tree, of the mock engine
   and of the load generator from ``/proc`` before and after, per 1k output tokens.

The servers and their processes: :mod:`~anyio_genout.bench.server_procs`; the binary:
:mod:`~anyio_genout.bench.vllm_rs`; the ratios, the targets and the table:
:mod:`~anyio_genout.bench.server_report`. ``nox -s bench-server`` runs the
command in the interop environment, where ``vllm serve`` is installed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from ...bench.tokenizers import BUILT_HELP, TOKENIZERS
from ..backends import importable
from ..helpformat import HelpFormatter
from ..http_server import HTTP_SERVERS
from .options import DEFAULT_DIR, csv_list

__all__ = ["add_parser", "plan_servers", "run", "size_cell"]

DEFAULT_LEVELS: Final = (1, 64, 256)
QUICK_LEVELS: Final = (1, 64)
INPUT_LEN: Final = 32
OUTPUT_LEN: Final = 128
#: The load generator's random prompts. Seed 0 stops every cell on bpe-bytelevel-32k: its
#: random prompt 106 never re-tokenizes to 32 tokens ("server verification failed to
#: converge after 20 iterations"), against every server; seed 1 converges for all three
#: tokenizers, completions and chat (checked with 8,000 prompts).
LOAD_SEED: Final = 1
CELL_SECONDS: Final = 12.0
QUICK_CELL_SECONDS: Final = 1.5
SERVER_KINDS: Final = ("ours", "vllm", "vllm-rs")
OUR_BACKENDS: Final = ("asyncio", "trio", "uvloop")

Result = dict[str, Any]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "server", formatter_class=HelpFormatter,
        help="our OpenAI server vs vllm serve and vllm-rs on the same mock engine, "
             "loaded by vllm-rs bench serve",
        description="Measure `anyio-genout serve` (each backend, 1 and 2 workers), vLLM's "
                    "Python `vllm serve` and its Rust `vllm-rs frontend`, each in front of a "
                    "fresh mock engine, with vLLM's Rust load generator `vllm-rs bench "
                    "serve` (streamed completions, 32 prompt / 128 output tokens) at each "
                    "concurrency; print the figures, the ratios and issue #26's targets. "
                    "`nox -s bench-server` runs it in the interop environment.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: concurrency 1,64, ~1.5 s cells, the default "
                             "backend only (about a minute)")
    parser.add_argument("--concurrency", type=csv_list(int), default=None, metavar="LIST",
                        help=f"--max-concurrency levels (default: "
                             f"{','.join(map(str, DEFAULT_LEVELS))}; quick: "
                             f"{','.join(map(str, QUICK_LEVELS))})")
    parser.add_argument("--servers", type=csv_list(str, SERVER_KINDS), default=None,
                        metavar="LIST", help=f"subset of {', '.join(SERVER_KINDS)} "
                                             f"(default: all)")
    parser.add_argument("--backends", type=csv_list(str, OUR_BACKENDS), default=None,
                        metavar="LIST",
                        help="our server's backends (default: asyncio,trio,uvloop, those "
                             "installed; quick: asyncio)")
    parser.add_argument("--workers", type=csv_list(int), default=None, metavar="LIST",
                        help="our worker counts (default: 1,2; a count above 1 is skipped "
                             "with a note while `anyio-genout serve` has no --workers)")
    parser.add_argument("--http-servers", type=csv_list(str, HTTP_SERVERS), default=None,
                        metavar="LIST",
                        help=f"our server's HTTP servers, each measured "
                             f"({', '.join(HTTP_SERVERS)}; uvicorn is skipped on trio; "
                             f"default: the server's own default for each backend)")
    parser.add_argument("--endpoints", type=csv_list(str, tuple(ENDPOINTS)), default=None,
                        metavar="LIST",
                        help="what the load streams: completions, chat (chat completions; "
                             "the model folder needs a chat template) (default: "
                             "completions)")
    parser.add_argument("--pythonpath", default=None, metavar="DIR",
                        help="run our server from this source tree (PYTHONPATH), e.g. a "
                             "`git worktree` of another commit, for a before/after in one "
                             "sitting; the mock engine and this harness stay this tree's "
                             "(default: this tree)")
    parser.add_argument("--model", default=os.environ.get("ANYIO_GENOUT_VLLM_MODEL"),
                        metavar="DIR",
                        help="model folder every server and the load generator read "
                             "(default: $ANYIO_GENOUT_VLLM_MODEL)")
    parser.add_argument("--tokenizers", type=csv_list(str, TOKENIZERS), default=None,
                        metavar="LIST",
                        help="model folders measured in turn, each server before a fresh "
                             f"engine for each: model (--model's), {BUILT_HELP}")
    parser.add_argument("--vllm-command", default=None, metavar="CMD",
                        help="the command that runs vLLM's CLI (default: vllm-cpu-cli beside "
                             "this interpreter, else $ANYIO_GENOUT_VLLM_CMD, else vllm)")
    parser.add_argument("--vllm-rs", default=None, metavar="PATH",
                        help="the vllm-rs binary (default: extracted from the vllm 0.33.0 "
                             "wheel into the cache on first use)")
    parser.add_argument("--cell-seconds", type=float, default=None, metavar="SECONDS",
                        help=f"measured seconds per cell, roughly (default: {CELL_SECONDS:g}; "
                             f"quick: {QUICK_CELL_SECONDS:g})")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help=f"JSON results path (default: {DEFAULT_DIR}/server.json)")
    parser.add_argument("--profile-dir", default=None, metavar="DIR",
                        help="after each measured cell of ours at 64 streams or more, one "
                             "more load run with py-spy sampling the server process (and "
                             "its workers): collapsed stacks and a summary in DIR; the "
                             "profiled run counts for no figure")
    parser.add_argument("--py-spy", default="py-spy", metavar="PATH",
                        help="the py-spy binary for --profile-dir (default: py-spy)")
    parser.add_argument("--timeout", type=float, default=240.0, metavar="SECONDS",
                        help="seconds a server may take to become healthy, and a floor for "
                             "each load run's limit")
    parser.set_defaults(command=run, prog=parser.prog)
    return parser


def plan_servers(kinds: Sequence[str], backends: Sequence[str], workers: Sequence[int],
                 workers_supported: bool, http_servers: Sequence[str | None] = (None,)
                 ) -> tuple[list[Any], list[str]]:
    """The :class:`.server_procs.ServerSpec` list to measure, and notes on what is skipped:
    ours for each worker count, backend and HTTP server (None: the server's default),
    then vllm serve, then vllm-rs."""
    from ...bench.server_procs import ServerSpec

    specs: list[ServerSpec] = []
    notes: list[str] = []
    if "ours" in kinds:
        for count in workers:
            if count != 1 and not workers_supported:
                notes.append(f"--workers {count} skipped: `anyio-genout serve --help` lists "
                             f"no --workers option yet")
                continue
            for backend in backends:
                for http in http_servers:
                    if http == "uvicorn" and backend == "trio":
                        notes.append("uvicorn on trio skipped: it runs on asyncio only")
                        continue
                    specs.append(ServerSpec("ours", backend, count, http))
    specs.extend(ServerSpec(kind) for kind in ("vllm", "vllm-rs") if kind in kinds)
    return specs, notes


def size_cell(probe_tokens_per_s: float, concurrency: int, seconds: float) -> int:
    """Requests for a measured run of about ``seconds`` at the probe's rate: a multiple of
    ``concurrency``, at least two rounds of it (and 16 requests)."""
    wanted = seconds * probe_tokens_per_s / OUTPUT_LEN
    rounds = max(2, math.ceil(max(wanted, 16) / concurrency))
    return rounds * concurrency


def _vllm_command(args: argparse.Namespace) -> list[str]:
    if args.vllm_command:
        return shlex.split(args.vllm_command)
    shim = Path(sys.executable).parent / "vllm-cpu-cli"
    if shim.exists():
        return [str(shim)]
    from_env = os.environ.get("ANYIO_GENOUT_VLLM_CMD")
    if from_env:
        found: list[str] = json.loads(from_env)
        return found
    return ["vllm"]


#: ``--endpoints``: the load generator's ``--backend`` and ``--endpoint`` for each.
ENDPOINTS: Final = {"completions": ("openai", "/v1/completions"),
                    "chat": ("openai-chat", "/v1/chat/completions")}


def _load(binary: Path, base_url: str, model: str, concurrency: int, prompts: int,
          folder: Path, name: str, timeout: float, endpoint: str = "completions"
          ) -> tuple[Result, float]:
    """One ``vllm-rs bench serve`` run: (its result figures, its own CPU seconds).

    Raises :class:`RuntimeError` (with its output's tail) if it fails or its result does not
    parse, :class:`subprocess.TimeoutExpired` past ``timeout`` seconds.
    """
    from ...bench.server_report import parse_bench_result

    backend, path = ENDPOINTS[endpoint]
    cmd = [str(binary), "bench", "serve", "--backend", backend, "--base-url", base_url,
           "--endpoint", path, "--model", model, "--dataset-name", "random",
           "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--no-steady-state", "--disable-tqdm", "--seed", str(LOAD_SEED),
           "--percentile-metrics", "ttft,itl,tpot,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(folder), "--result-filename", f"{name}.json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(folder / f"{name}.log", "wb") as log:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result_file = folder / f"{name}.json"
    if proc.returncode != 0 or not result_file.exists():
        tail = (folder / f"{name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm-rs bench serve exited with status {proc.returncode}:\n{tail}")
    try:
        return parse_bench_result(json.loads(result_file.read_text())), cpu
    except ValueError as exc:
        raise RuntimeError(f"vllm-rs bench serve: {exc}") from exc


def _stem(server: Any, concurrency: int, endpoint: str) -> str:
    chat = "-chat" if endpoint == "chat" else ""
    return f"{server.spec.file_stem}{chat}-c{concurrency}"


def _cell(server: Any, binary: Path, model: str, concurrency: int, seconds: float,
          folder: Path, floor_timeout: float, endpoint: str = "completions") -> Result:
    """Probe, size, measure one cell on a running server (see the module docstring)."""
    stem = _stem(server, concurrency, endpoint)
    probe_n = max(2 * concurrency, 16)
    probe, _ = _load(binary, server.base_url, model, concurrency, probe_n, folder,
                     f"{stem}-probe", max(floor_timeout, 120.0), endpoint)
    prompts = size_cell(probe["tokens_per_s"], concurrency, seconds)
    server.server.check_alive()
    server.engine.check_alive()
    cpu0, engine0 = server.server.cpu_seconds(), server.engine.cpu_seconds()
    figures, loadgen_cpu = _load(binary, server.base_url, model, concurrency, prompts, folder,
                                 stem, max(floor_timeout, 10 * seconds + 60), endpoint)
    cpu = server.server.cpu_seconds() - cpu0
    engine = server.engine.cpu_seconds() - engine0
    server.server.check_alive()
    kilo = figures["output_tokens"] / 1000
    return {**figures, "num_prompts": prompts, "probe_prompts": probe_n,
            "probe_tokens_per_s": probe["tokens_per_s"], "server_cpu_s": cpu,
            "engine_cpu_s": engine, "loadgen_cpu_s": loadgen_cpu,
            "server_cpu_s_per_1k": cpu / kilo, "engine_cpu_s_per_1k": engine / kilo,
            "loadgen_cpu_s_per_1k": loadgen_cpu / kilo,
            "server_cores": cpu / figures["duration_s"]}


def _commit() -> str | None:
    """The git commit of the anyio_genout measured (``+dirty`` with local changes)."""
    where = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                "--untracked-files=no", "--", "anyio_genout"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"{head}+dirty" if head and dirty else head or None


def _profile(server: Any, binary: Path, model: str, concurrency: int, seconds: float,
             folder: Path, py_spy: str, profile_dir: Path, tokens_per_s: float,
             endpoint: str = "completions") -> Result:
    """Sample the server with py-spy (``--nonblocking``, every process of its tree) during
    one more load run of about ``seconds``; the stacks and their summary go to
    ``profile_dir``. Returns the summary
    (:func:`~anyio_genout.bench.server_report.summarise_server_stacks`)."""
    from ...bench.server_report import summarise_server_stacks

    stem = _stem(server, concurrency, endpoint)
    stacks = profile_dir / f"{stem}.stacks.txt"
    profile_dir.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(
        [py_spy, "record", "--pid", str(server.server.pid), "--subprocesses", "--nonblocking",
         "--rate", "200", "--duration", str(max(1, int(seconds))), "--format", "raw",
         "--output", str(stacks)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)  # py-spy attaches
        prompts = size_cell(tokens_per_s, concurrency, seconds + 2)
        _load(binary, server.base_url, model, concurrency, prompts, folder, f"{stem}-profiled",
              10 * seconds + 60, endpoint)
        _, err = spy.communicate(timeout=seconds + 30)
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait(10)
    if not stacks.exists():
        raise RuntimeError(f"py-spy wrote no stacks: {err.decode(errors='replace')[-1000:]}")
    summary = summarise_server_stacks(stacks.read_text().splitlines())
    lines = [f"{summary['samples']} samples of {server.spec.label} at {concurrency} streams"]
    for title, key in (("self time by area", "by_area"),
                       ("top functions by self time", "top_self"),
                       ("top functions by total time", "top_total")):
        lines += ["", f"{title}:"] + [f"  {pct:5.1f}%  {name}" for name, _n, pct in summary[key]]
    (profile_dir / f"{stem}.summary.txt").write_text("\n".join(lines) + "\n")
    summary["stacks"] = str(stacks)
    return summary


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every `finally` below


def _write(output: Path, info: Result, cells: list[Result]) -> tuple[list[Result], list[Result]]:
    from ...bench.server_report import build_server_report

    ratios, targets = build_server_report(cells)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": info, "cells": cells, "ratios": ratios,
                                  "targets": targets}, indent=1, default=str))
    return ratios, targets


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Measure every server at every level, write the results after each cell, print the
    table; exit status 1 if a cell or a server failed, 2 on a missing prerequisite."""
    prog: str = args.prog
    if not importable("psutil"):
        print(f"{prog}: needs psutil (pip install 'anyio-genout[bench]')", file=sys.stderr)
        return 2
    if not args.model:
        print(f"{prog}: give --model DIR (or set ANYIO_GENOUT_VLLM_MODEL): the model folder "
              f"every server and the load generator read", file=sys.stderr)
        return 2
    from ...bench.measure import environment
    from ...bench.server_procs import has_workers_option, running
    from ...bench.server_report import format_server_table
    from ...bench.tokenizers import build_model_dir
    from ...bench.vllm_rs import ensure_vllm_rs

    model = str(Path(args.model).resolve())
    names = list(dict.fromkeys(args.tokenizers or TOKENIZERS))
    folders = {name: model if name == "model" else str(build_model_dir(name))
               for name in names}
    kinds = args.servers or list(SERVER_KINDS)
    backends = args.backends or (["asyncio"] if args.quick else
                                 [b for b in OUR_BACKENDS if b == "asyncio" or importable(b)])
    levels = list(args.concurrency or (QUICK_LEVELS if args.quick else DEFAULT_LEVELS))
    endpoints = list(args.endpoints or ["completions"])
    seconds = args.cell_seconds or (QUICK_CELL_SECONDS if args.quick else CELL_SECONDS)
    output = Path(args.output or Path(DEFAULT_DIR) / "server.json")
    binary = Path(args.vllm_rs) if args.vllm_rs else ensure_vllm_rs(
        log=lambda line: print(line, file=sys.stderr))
    workers = args.workers or [1, 2]
    supported = "ours" in kinds and any(w != 1 for w in workers) and \
        has_workers_option(sys.executable)
    specs, notes = plan_servers(kinds, backends, workers, supported,
                                args.http_servers or (None,))
    notes = list(dict.fromkeys(notes))
    for note in notes:
        print(f"{prog}: {note}", file=sys.stderr)
    vllm_command = _vllm_command(args)
    info: Result = {
        "mode": "quick" if args.quick else "full", "argv": list(argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "env": environment(),
        "commit": _commit(), "model": model, "tokenizers": folders, "vllm_rs": str(binary),
        "vllm_command": vllm_command,
        "endpoints": endpoints, "our_pythonpath": args.pythonpath,
        "load": f"vllm-rs bench serve --backend openai --endpoint /v1/completions (chat: "
                f"--backend openai-chat --endpoint /v1/chat/completions) "
                f"--dataset-name random --random-input-len {INPUT_LEN} --random-output-len "
                f"{OUTPUT_LEN} --ignore-eos --no-steady-state (streaming)",
        "engine": "python -m anyio_genout mock-engine --step-time 0 --max-num-seqs 256 "
                  "--no-log-stats, a fresh one per server",
        "cell_seconds": seconds, "levels": levels, "notes": notes,
        "servers": [s.label for s in specs]}
    cells: list[Result] = []
    failed = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-server-") as tmp:
            for (tokenizer, folder), spec in itertools.product(folders.items(), specs):
                logs = Path(tmp) / f"{spec.file_stem}-{tokenizer}"
                logs.mkdir()
                base = {"server": spec.label, "kind": spec.kind, "backend": spec.backend,
                        "workers": spec.workers, "http_server": spec.http_server,
                        "tokenizer": tokenizer}
                label = spec.label if tokenizer == "model" else f"{spec.label} [{tokenizer}]"
                try:
                    with running(spec, model=folder, logs=logs, python=sys.executable,
                                 vllm_command=vllm_command, vllm_rs=binary,
                                 ready_timeout=args.timeout,
                                 our_pythonpath=args.pythonpath) as server:
                        print(f"{label}: ready in {server.startup_s:.1f} s at "
                              f"{server.base_url}", file=sys.stderr)
                        for endpoint, c in itertools.product(endpoints, levels):
                            t0 = time.monotonic()
                            where = f"C={c}" + (" chat" if endpoint == "chat" else "")
                            try:
                                cell = {**base, "endpoint": endpoint, "concurrency": c,
                                        **_cell(server, binary, folder, c, seconds, logs,
                                                args.timeout, endpoint)}
                                if args.profile_dir and spec.kind == "ours" and c >= 64:
                                    cell["profile"] = _profile(
                                        server, binary, folder, c, seconds, logs, args.py_spy,
                                        Path(args.profile_dir) if tokenizer == "model"
                                        else Path(args.profile_dir, tokenizer),
                                        cell["tokens_per_s"],
                                        endpoint)
                                print(f"  {where}: {cell['tokens_per_s']:,.0f} tok/s, TTFT "
                                      f"p50 {cell['ttft_p50_ms']:.1f} ms, server "
                                      f"{cell['server_cpu_s_per_1k']:.3f} CPU s/1k tok "
                                      f"(N={cell['num_prompts']}, "
                                      f"{time.monotonic() - t0:.1f} s)", file=sys.stderr)
                            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                                failed = True
                                cell = {**base, "endpoint": endpoint, "concurrency": c,
                                        "error": str(exc)[-1500:]}
                                print(f"  {where}: ERROR {exc}", file=sys.stderr)
                            cells.append(cell)
                            info["seconds"] = round(time.monotonic() - started, 1)
                            _write(output, info, cells)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    failed = True
                    print(f"{label}: ERROR {exc}", file=sys.stderr)
                    done = {(c.get("endpoint", "completions"), c["concurrency"])
                            for c in cells if c["server"] == spec.label
                            and c.get("tokenizer") == tokenizer}
                    cells.extend({**base, "endpoint": e, "concurrency": c,
                                  "error": str(exc)[-1500:]}
                                 for e, c in itertools.product(endpoints, levels)
                                 if (e, c) not in done)
    finally:
        signal.signal(signal.SIGTERM, previous)
    info["seconds"] = round(time.monotonic() - started, 1)
    ratios, targets = _write(output, info, cells)
    print(format_server_table(cells, ratios, targets))
    print(f"results: {output}")
    return 1 if failed else 0
