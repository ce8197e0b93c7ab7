"""``anyio-genout bench text [--model DIR] [...]``: the text layer's cost, ours and vLLM's.

One run measures, on the same mock engine (step time 0, corpus mode: the bundled corpus
encoded with the bundled tokenizer), our client with detokenization off (the token layer)
and on (:class:`~anyio_genout.text.TextClient`, without and with two stop strings), the
cost of ``DecodeStream.step`` alone, and vLLM's ``AsyncLLM`` with its tokenizer loaded
(detokenizing or not), at each concurrency. The run repeats ``--repeats`` times, the cells
of a repeat interleaved (ours, then vLLM; the other way round in the next repeat), every
cell in a fresh process with its own engine; the report takes medians
(:mod:`~anyio_genout.bench.text_report`).

vLLM runs in ``--vllm-python`` (default: this interpreter, if it has vLLM); ``nox -s
bench-text`` runs the whole command in the interop environment, where it has. Its model
folder is ``--model``'s config with the bundled tokenizer
(:func:`~anyio_genout.bench.text.make_model_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ...bench.spec import BACKENDS, Result, tokens_for
from ...bench.tokenizers import BUILT_HELP, TOKENIZERS
from ..backends import importable
from ..helpformat import HelpFormatter
from .options import DEFAULT_DIR, csv_list, missing_extras
from .output import meta

__all__ = ["add_parser", "plan_text", "run"]

DEFAULT_LEVELS: Final = (1, 64, 256)
QUICK_LEVELS: Final = (1, 64)
REPEATS: Final = 3


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
               ) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "text", formatter_class=HelpFormatter,
        help="the text layer's CPU per token (detokenization on vs off, vs DecodeStream.step "
             "alone and vs vLLM's AsyncLLM detokenizing)",
        description="Measure what detokenization costs per token: our client with the text "
                    "layer on and off, DecodeStream.step alone, and vLLM's AsyncLLM with its "
                    "tokenizer loaded, on the same mock engine generating the bundled "
                    "corpus. `nox -s bench-text` runs it where vLLM is installed.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small shapes, one repeat, one round per variant")
    parser.add_argument("--concurrency", type=csv_list(int), default=None, metavar="LIST",
                        help=f"stream counts (default: {','.join(map(str, DEFAULT_LEVELS))}; "
                             f"quick: {','.join(map(str, QUICK_LEVELS))})")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help=f"repeats of the whole run, medians reported (default: "
                             f"{REPEATS}; quick: 1)")
    parser.add_argument("--backends", type=csv_list(str, BACKENDS), default=None,
                        metavar="LIST",
                        help="our backends (default: uvloop if installed, else asyncio)")
    parser.add_argument("--tokenizers", type=csv_list(str, TOKENIZERS), default=None,
                        metavar="LIST",
                        help="tokenizers measured, each with its own corpus encoding: model "
                             f"(the bundled tokenizer, --model's config), {BUILT_HELP}")
    parser.add_argument("--model", default=os.environ.get("ANYIO_GENOUT_VLLM_MODEL"),
                        metavar="DIR",
                        help="the model whose config vLLM reads, beside the bundled "
                             "tokenizer (default: $ANYIO_GENOUT_VLLM_MODEL)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="the interpreter with vLLM (default: this one, if it has vLLM)")
    parser.add_argument("--vllm-loop", choices=("asyncio", "uvloop"), default="uvloop",
                        help="AsyncLLM's event loop (default: uvloop)")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false",
                        help="measure ours only (default: vLLM too, where it can run)")
    parser.add_argument("--min-time", type=float, default=None, metavar="SECONDS",
                        help="seconds of measured rounds per variant and cell at least "
                             "(default: 1.0; quick: 0)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help=f"JSON results path (default: {DEFAULT_DIR}/text.json)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="seconds before a cell (vLLM: a repeat) is given up")
    parser.add_argument("--settle", type=float, default=None, metavar="SECONDS",
                        help="before each repeat, wait up to this many seconds until other "
                             "processes use under --quiet cores (default: 20; quick: 0)")
    parser.add_argument("--quiet", type=float, default=0.2, metavar="CORES",
                        help="other processes' CPU, in cores, that counts as quiet")
    parser.set_defaults(command=run, prog=parser.prog)
    return parser


def plan_text(*, impl: str, backend: str, levels: Sequence[int], quick: bool, repeat: int,
              model_dir: str, corpus_file: str, min_time: float | None,
              tokenizer: str = "model") -> list[Result]:
    """A repeat's cells of one implementation and tokenizer, as JSON specs
    (:class:`.text.TextSpec`)."""
    from ...bench.text import OURS_VARIANTS, VARIANTS, TextSpec

    rounds: dict[str, Any] = ({"min_rounds": 1, "max_rounds": 1, "min_time": 0.0} if quick else
              {"min_rounds": 5, "max_rounds": 200,
               "min_time": 1.0 if min_time is None else min_time})
    if quick and min_time is not None:
        rounds.update(min_time=min_time, max_rounds=200)
    return [TextSpec(impl=impl, backend=backend, concurrency=c,
                     tokens=32 if quick else tokens_for(c), model_dir=model_dir,
                     corpus_file=corpus_file, repeat=repeat, tokenizer=tokenizer,
                     variants=OURS_VARIANTS if impl == "ours" else VARIANTS, **rounds).to_json()
            for c in levels]


def _run_json(cmd: list[str], specs: list[Result], timeout: float) -> list[Result]:
    """Run a cell process that writes a JSON result (or a list of them); an ``error`` key
    per spec if it failed; its output is shown only then."""
    with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-text-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            proc = subprocess.run([*cmd, str(out)], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            return [{**s, "error": f"timed out after {timeout:g} s"} for s in specs]
        if not out.exists():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
            return [{**s, "error": f"exited with status {proc.returncode}"} for s in specs]
        found = json.loads(out.read_text())
        results: list[Result] = found if isinstance(found, list) else [found]
        if any("error" in r for r in results):
            sys.stderr.write(proc.stderr[-6000:])
        return results


def _vllm_python(args: argparse.Namespace, prog: str) -> str | None:
    if not args.vllm:
        return None
    if args.vllm_python:
        return str(args.vllm_python)
    if importable("vllm"):
        return sys.executable
    print(f"{prog}: vLLM is not installed here, measuring ours only (--vllm-python PATH, or "
          f"`nox -s bench-text`, adds AsyncLLM)", file=sys.stderr)
    return None


def _progress(result: Result, seconds: float) -> str:
    what = (f"{result['impl']}/{result['backend']}/{result.get('tokenizer', 'model')}/"
            f"{result['concurrency']}#{result['repeat']}")
    if "error" in result:
        return f"{what}: ERROR {result['error']}"
    bits = [f"{v} {f.get('tokens_per_s', 0):,.0f} tok/s {f.get('cpu_us_per_token') or 0:.2f} "
            f"us/tok" for v, f in result.get("variants", {}).items()]
    if "decode_step_us" in result:
        bits.append(f"step {result['decode_step_us']:.2f} us/tok")
    return f"{what}: {'; '.join(bits)} ({seconds:.1f} s)"


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Measure, write the results, print the table and the targets; exit status 1 if a cell
    failed, 2 if an extra is missing or vLLM is asked for without ``--model``."""
    from ...bench.measure import wait_until_quiet
    from ...bench.text import corpus_token_ids, make_model_dir
    from ...bench.text_report import build_text_report, format_text_table
    from ...bench.tokenizers import build_model_dir
    from ...text import Tokenizer, bundled_corpus

    prog: str = args.prog
    missing = missing_extras(prog, args)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    python = _vllm_python(args, prog)
    if python is not None and not args.model:
        print(f"{prog}: vLLM needs a model folder: give --model (or set "
              f"ANYIO_GENOUT_VLLM_MODEL), or --no-vllm", file=sys.stderr)
        return 2
    backends = args.backends or (["uvloop"] if importable("uvloop") else ["asyncio"])
    levels = list(args.concurrency or (QUICK_LEVELS if args.quick else DEFAULT_LEVELS))
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else REPEATS)
    settle = args.settle if args.settle is not None else (0.0 if args.quick else 20.0)
    output = Path(args.output or Path(DEFAULT_DIR) / "text.json")
    info = meta("quick" if args.quick else "full", argv)
    info.update(backends=backends, vllm_python=python, vllm_loop=args.vllm_loop,
                repeats=repeats, model=args.model if python else None)
    results: list[Result] = []
    started = time.monotonic()
    names = list(dict.fromkeys(args.tokenizers or TOKENIZERS))
    info["tokenizers"] = names
    with tempfile.TemporaryDirectory(prefix="anyio-genout-text-model-") as tmp:
        folders: dict[str, tuple[str, str]] = {}  # name -> (model folder, corpus file)
        corpus_tokens: dict[str, int] = {}
        for name in names:
            if name == "model":
                model_dir = make_model_dir(Path(tmp) / "model", args.model if python else None)
            else:
                t0 = time.monotonic()
                model_dir = build_model_dir(name)
                print(f"bench text: tokenizer {name}: {model_dir} "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
            corpus = corpus_token_ids(Tokenizer.from_model_dir(model_dir), bundled_corpus())
            corpus_file = Path(tmp) / f"corpus-{name}.json"
            corpus_file.write_text(json.dumps(corpus))
            corpus_tokens[name] = len(corpus)
            folders[name] = (str(model_dir), str(corpus_file))
        info["corpus_tokens"] = corpus_tokens
        info["tokenizer_dirs"] = {name: folder for name, (folder, _) in folders.items()}
        common = {"levels": levels, "quick": args.quick, "min_time": args.min_time}
        cells = len(levels) * len(backends) * len(names)
        print(f"bench text: {repeats} repeat(s) of {cells} cell(s) of "
              f"ours{' and one AsyncLLM process per tokenizer' if python else ''}, each in a "
              f"fresh process with its own engine", file=sys.stderr)
        for repeat in range(1, repeats + 1):
            if settle:
                wait_until_quiet(args.quiet, settle)
            for name, (model_dir_s, corpus_s) in folders.items():
                where = {**common, "model_dir": model_dir_s, "corpus_file": corpus_s,
                         "tokenizer": name}
                jobs: list[tuple[list[str], list[Result]]] = []
                for backend in backends:
                    for spec in plan_text(impl="ours", backend=backend, repeat=repeat,
                                          **where):
                        jobs.append(([sys.executable, "-m", "anyio_genout.bench.text",
                                      json.dumps(spec)], [spec]))
                if python is not None:
                    specs = plan_text(impl="vllm", backend=args.vllm_loop, repeat=repeat,
                                      **where)
                    vllm_job = ([python, "-m", "anyio_genout.bench.text_vllm", "--loop",
                                 args.vllm_loop, json.dumps(specs)], specs)
                    # AsyncLLM takes its turn first every other repeat: drift hits both alike.
                    jobs = [vllm_job, *jobs] if repeat % 2 == 0 else [*jobs, vllm_job]
                for cmd, specs in jobs:
                    t0 = time.monotonic()
                    found = _run_json(cmd, specs, args.timeout * len(specs))
                    for result in found:
                        print(_progress(result, time.monotonic() - t0), file=sys.stderr)
                    results.extend(found)
    info["seconds"] = round(time.monotonic() - started, 1)
    rows, targets = build_text_report(results)
    table = format_text_table(rows, targets)
    print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": info, "results": results, "rows": rows,
                                  "targets": targets}, indent=1, default=str))
    print(f"results: {output}")
    return 1 if any("error" in r for r in results) else 0
