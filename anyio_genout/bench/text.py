"""``anyio-genout bench text``: what detokenizing costs per token, ours and vLLM's.

One *text cell* is one implementation at one concurrency, in a fresh process with its own
mock engine (``--step-time 0``, in corpus mode: the tokens it generates continue the bundled
corpus encoded with the bundled tokenizer, so they decode to real multi-script text). In the
cell, measured rounds of the *variants* alternate (their order rotating), so that the machine's
drifting load hits them alike:

``tokens``
    the token layer: :meth:`Client.generate <anyio_genout.Client.generate>` (vLLM:
    ``detokenize=False``, its tokenizer loaded all the same);
``text``
    detokenization on: :class:`~anyio_genout.text.TextClient` (vLLM: ``detokenize=True``);
``text-stop2``
    the same with two stop strings (:data:`STOP_STRINGS`, absent from the corpus, so every
    request still runs to ``max_tokens`` while the strings are searched and held back);
``text-nodetok`` (ours only)
    :class:`~anyio_genout.text.TextClient` with ``detokenize=False``: the text stream's own
    cost without any decoding, which splits the text layer's cost in two.

Our cells also time :meth:`tokenizers.decoders.DecodeStream.step` alone over the very token
sequences the engine streams (a tight loop, one stream per request seeded with its prompt,
as vLLM seeds it): the floor of any detokenizing front end. Each round pairs the three, so
the text layer's added cost is read per round as ``(CPU/token text - CPU/token tokens) /
step`` (:func:`added_cost`). This module holds the cell description (:class:`TextSpec`), what
both sides share (prompts, stop strings, the model folder) and our side's cell
(:func:`run_ours`; ``python -m anyio_genout.bench.text SPEC_JSON RESULT_PATH``); vLLM's side
is :mod:`.text_vllm`, the command and its report :mod:`~anyio_genout.cli.bench.text_cmd` and
:mod:`.text_report`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final

import anyio

from .. import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
)
from ..text import TextClient, TextRequest, Tokenizer, bundled_model_dir
from ..text.detokenizer import INVALID_PREFIX
from .measure import EngineProcess, Meter, free_port, freeze_gc
from .spec import CellSpec, Result, summarise

__all__ = ["OURS_VARIANTS", "STOP_STRINGS", "VARIANTS", "TextSpec", "added_cost",
           "corpus_token_ids", "engine_args", "main", "make_model_dir", "rotate", "run_ours",
           "text_prompts"]

VARIANTS: Final = ("tokens", "text", "text-stop2")
#: Ours also runs the text layer with ``detokenize=False``: what the stream costs without
#: any decoding (a diagnostic: it splits the added cost into the stream's and the decoder's).
OURS_VARIANTS: Final = ("tokens", "text-nodetok", "text", "text-stop2")
#: Two stop strings of the shapes applications use; neither occurs in the bundled corpus
#: (:func:`corpus_token_ids` checks), so they are searched on every token and never match.
STOP_STRINGS: Final = ("\n\nUser:", "<|endoftext|>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextSpec:
    """One text cell: ``impl`` (``ours`` or ``vllm``) on ``backend`` (ours: asyncio,
    uvloop or trio; vLLM: its event loop) at ``concurrency`` streams of ``tokens`` tokens."""

    impl: str
    backend: str
    concurrency: int
    tokens: int
    #: The model folder (tokenizer files; vLLM also reads its config.json).
    model_dir: str
    #: The mock engine's corpus: a JSON list of token ids.
    corpus_file: str
    variants: tuple[str, ...] = VARIANTS
    stop: tuple[str, ...] = STOP_STRINGS
    prompt_len: int = 16
    #: Rounds per variant: at least ``min_rounds`` and ``min_time`` seconds (each).
    min_rounds: int = 3
    max_rounds: int = 40
    min_time: float = 0.5
    #: Which repeat of the run this cell belongs to (from 1).
    repeat: int = 1
    #: The tokenizer's name (``--tokenizers``: ``model``, or one of
    #: :data:`.tokenizers.BUILT`); ``model_dir`` holds it.
    tokenizer: str = "model"

    @property
    def key(self) -> str:
        return (f"{self.impl}/{self.backend}/text/{self.tokenizer}/{self.concurrency}"
                f"#{self.repeat}")

    def cell(self, variant: str) -> CellSpec:
        """The :class:`CellSpec` a variant's meter counts rounds with (engine shape too)."""
        return CellSpec(impl=f"{self.impl}:{variant}", backend=self.backend,
                        workload="text", concurrency=self.concurrency, tokens=self.tokens,
                        prompt_len=self.prompt_len, min_rounds=self.min_rounds,
                        max_rounds=self.max_rounds, min_time=self.min_time)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TextSpec:
        return cls(**{**data, "variants": tuple(data["variants"]),
                      "stop": tuple(data["stop"])})


def corpus_token_ids(tokenizer: Tokenizer, corpus: str, stop: Sequence[str] = STOP_STRINGS
                     ) -> list[int]:
    """``corpus`` encoded without special tokens; raises :class:`ValueError` if a stop
    string occurs in it (the benchmark's stop strings must never match)."""
    found = [s for s in stop if s in corpus]
    if found:
        raise ValueError(f"stop strings {found!r} occur in the corpus")
    return tokenizer.encode(corpus, add_special_tokens=False)


def text_prompts(corpus: Sequence[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids, each a different stretch of the corpus
    (so the streams differ, as real ones do); the same on both sides of the comparison."""
    n = len(corpus)
    return [[corpus[(i * 7919 + j) % n] for j in range(length)] for i in range(count)]


def engine_args(corpus_file: str, model_dir: str | os.PathLike[str] | None = None
                ) -> list[str]:
    """The mock engine's corpus-mode arguments, and ``model_dir``'s ``config.json``
    ``vocab_size`` if it has one (a built tokenizer's vocabulary is larger than the tiny
    model's, which the engine takes by default)."""
    args = ["--corpus-token-ids", corpus_file]
    if model_dir is not None:
        config = Path(model_dir, "config.json")
        vocab = json.loads(config.read_text()).get("vocab_size") if config.exists() else None
        if isinstance(vocab, int):
            args += ["--vocab-size", str(vocab)]
    return args


def make_model_dir(dest: Path, model: str | os.PathLike[str] | None) -> Path:
    """A model folder in ``dest``: the bundled tokenizer files with ``model``'s config and
    weights (linked), or the bundled folder itself's files without a ``model``.

    The bundled tokenizer's ``<s>``/``</s>`` ids must be ``model``'s ``bos_token_id``
    and ``eos_token_id`` (the tiny model's 1 and 2); its generation config (EOS ids 2 and 4,
    ``<|im_end|>`` ending a chat turn) is the folder's. Raises :class:`ValueError` if the
    ids disagree, :class:`OSError` if a file cannot be read or written.
    """
    bundled = bundled_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "config.json"):
        target = dest / name
        if name == "config.json" and model is not None:
            target.symlink_to(Path(model, name).resolve())
        else:
            shutil.copyfile(bundled / name, target)
    if model is not None:
        for weights in Path(model).glob("*.safetensors"):
            (dest / weights.name).symlink_to(weights.resolve())
        config = json.loads(Path(model, "config.json").read_text())
        tokenizer = Tokenizer.from_model_dir(dest)
        pairs = (("bos_token_id", tokenizer.bos_token_id),
                 ("eos_token_id", tokenizer.eos_token_id),
                 ("vocab_size", tokenizer.vocab_size))
        wrong = [f"{k}: model {config.get(k)!r}, tokenizer {v!r}" for k, v in pairs
                 if config.get(k) != v]
        if wrong:
            raise ValueError(f"{model} does not fit the bundled tokenizer: {'; '.join(wrong)}")
    return dest


def rotate(items: Sequence[str], by: int) -> list[str]:
    """``items`` rotated left by ``by`` (the order of a round's variants)."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


def added_cost(text: float, tokens: float, step: float) -> float:
    """The text layer's added CPU per token in units of ``DecodeStream.step`` alone."""
    return (text - tokens) / step if step > 0 else float("nan")


def decode_floor(tokenizer: Any, prompts: Sequence[Sequence[int]],
                 sequences: Sequence[Sequence[int]]) -> float:
    """Seconds of this thread's CPU per token that ``DecodeStream.step`` alone takes over
    ``sequences`` (each stream seeded with its prompt, special tokens skipped; after the
    library's "invalid prefix" error, which a byte-fallback prompt ending inside a character
    can give, the stream restarts empty from the token, as vLLM's does)."""
    from tokenizers.decoders import DecodeStream

    clock = time.thread_time
    spent = 0.0
    tokens = 0
    for prompt, sequence in zip(prompts, sequences, strict=True):
        stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
        step = stream.step
        started = clock()
        for token_id in sequence:
            try:
                step(tokenizer, token_id)
            except Exception as exc:  # the library raises a plain Exception
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                stream = DecodeStream(skip_special_tokens=True)
                step = stream.step
                step(tokenizer, token_id)
        spent += clock() - started
        tokens += len(sequence)
    return spent / tokens if tokens else float("nan")


StreamOpener = Callable[[int], AbstractAsyncContextManager[Any]]


async def _streams(client: Any, count: int, opener: StreamOpener, gate: bool
                   ) -> tuple[int, int]:
    """``count`` concurrent streams (``opener(i)`` opens stream ``i``), consumed as an
    application would; returns the tokens and the characters of text delivered. ``gate``:
    the engine was paused; resume it once every request is in (see
    :func:`.ours.gate_rounds`)."""
    delivered = 0
    characters = 0
    entered = 0
    all_in = anyio.Event()

    async def one(i: int) -> None:
        nonlocal delivered, characters, entered
        n = 0
        chars = 0
        async with opener(i) as stream:
            entered += 1
            if entered == count:
                all_in.set()
            async for out in stream:
                n += len(out.token_ids)
                chars += len(getattr(out, "text", ""))
        delivered += n
        characters += chars

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
        if gate:
            await all_in.wait()
            await client.engine.resume_scheduler()
    return delivered, characters


def run_ours(spec: TextSpec) -> Result:
    """Start the engine, connect, warm up, freeze the GC heap, measure every variant."""
    address = f"tcp://127.0.0.1:{free_port()}"
    with EngineProcess(address, spec.cell("tokens"),
                       extra=engine_args(spec.corpus_file, spec.model_dir)) as engine:
        backend, options = spec.backend, {}
        if backend == "uvloop":
            backend, options = "asyncio", {"use_uvloop": True}
        corpus = json.loads(Path(spec.corpus_file).read_text())
        result: Result = anyio.run(_ours, spec, corpus, engine, address, backend=backend,
                                   backend_options=options)
        engine.check_alive()
        return result


async def _ours(spec: TextSpec, corpus: list[int], engine: EngineProcess, address: str
                ) -> Result:
    tokenizer = Tokenizer.from_model_dir(spec.model_dir)
    prompts = text_prompts(corpus, spec.concurrency, spec.prompt_len)
    config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                        ready_timeout=60.0))
    gate = spec.concurrency > 1
    async with Client.connect(config) as client:
        texts = TextClient(client, tokenizer)

        def opener(variant: str, tokens: int, tag: str) -> StreamOpener:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            stop = spec.stop if variant == "text-stop2" else ()

            def open_stream(i: int) -> AbstractAsyncContextManager[Any]:
                if variant == "tokens":
                    return client.generate(GenerateRequest(
                        request_id=f"{tag}-{i}", prompt_token_ids=prompts[i],
                        sampling_params=params))
                return texts.generate(TextRequest(
                    request_id=f"{tag}-{i}", prompt_token_ids=prompts[i],
                    sampling_params=params, stop=stop, detokenize=variant != "text-nodetok"))

            return open_stream

        for variant in spec.variants:  # warm-up: every code path, unmeasured
            await _streams(client, min(spec.concurrency, 64), opener(variant, 8, f"w{variant}"),
                           False)
        sequences = await _capture(client, prompts, spec.tokens)
        frozen = freeze_gc()
        meters = {v: Meter(spec.cell(v), engine) for v in spec.variants}
        floor: list[float] = []
        paired: dict[str, list[float]] = {v: [] for v in spec.variants if v != "tokens"}
        chars = dict.fromkeys(spec.variants, 0)
        complete = True
        rounds = 0
        while rounds < spec.min_rounds or (
                rounds < spec.max_rounds
                and min(sum(s.wall for s in m.samples) for m in meters.values())
                < spec.min_time):
            per_token: dict[str, float] = {}
            for variant in rotate(spec.variants, rounds):
                if gate:
                    await client.engine.pause_scheduler("keep", False)
                started = meters[variant].start()
                tokens, text = await _streams(
                    client, spec.concurrency, opener(variant, spec.tokens, f"{variant}{rounds}"),
                    gate)
                chars[variant] += text
                sample = meters[variant].stop(started, tokens=tokens,
                                              requests=spec.concurrency)
                complete = complete and tokens == spec.concurrency * spec.tokens
                per_token[variant] = sample.cpu / tokens if tokens else float("nan")
            step = decode_floor(tokenizer.backend, prompts, sequences)
            floor.append(step)
            if "tokens" in per_token:
                for variant in paired:
                    paired[variant].append(
                        added_cost(per_token[variant], per_token["tokens"], step))
            rounds += 1
    figures: dict[str, Result] = {}
    for variant, meter in meters.items():
        figures[variant] = {**summarise(meter.spec, meter.samples), "chars": chars[variant]}
    return {
        "complete": complete,
        "rounds": rounds,
        "variants": figures,
        "decode_step_us": statistics.median(floor) * 1e6,
        "decode_step_us_rounds": [f * 1e6 for f in floor],
        "added_x_step_rounds": paired,
        "added_x_step": {v: statistics.median(r) for v, r in paired.items() if r},
        "gc_frozen_objects": frozen,
    }


async def _capture(client: Client, prompts: Sequence[Sequence[int]], tokens: int
                   ) -> list[list[int]]:
    """The token ids the engine streams for each prompt (greedy, so every round's)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    sequences: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        request = GenerateRequest(request_id=f"capture-{i}", prompt_token_ids=prompts[i],
                                  sampling_params=params)
        async with client.generate(request) as stream:
            async for out in stream:
                sequences[i].extend(out.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return sequences


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m anyio_genout.bench.text SPEC_JSON RESULT_PATH``: one of our text cells."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m anyio_genout.bench.text SPEC_JSON RESULT_PATH", file=sys.stderr)
        return 2
    spec = TextSpec.from_json(json.loads(args[0]))
    try:
        result = {**spec.to_json(), **run_ours(spec)}
        status = 0
    except BaseException as exc:
        traceback.print_exc()
        result = {**spec.to_json(), "error": f"{type(exc).__name__}: {exc}"}
        status = 1
    Path(args[1]).write_text(json.dumps(result, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
