"""Differential test of the logprob token strings against vLLM 0.32's ``LogprobsProcessor``.

Hypothesis generates logprob rows (the position's token first, then the top ones), with many
ids that are part of a character (their text alone ends in U+FFFD: bytes, and byte-level
tokens such as " \\xd0" that hold a character and the start of the next one), on both
tokenizer kinds of tests/text/tokenizer_kinds.py. Prompt logprobs go through vLLM's
``_update_prompt_logprobs`` (context: the prompt tokens of the rows before) and our
``prompt_logprob_rows``; sample logprobs, split into random engine steps, through vLLM's
``_update_sample_logprobs`` (context: the sampled tokens before) and our ``LogprobsDecoder``.
Every position's strings must be vLLM's ``decoded_token`` values (a row's ids are distinct, as
the engine's top ids are, so vLLM's per-position dict keeps them all).
Needs vLLM importable (the interop venv: ``nox -s interop --
tests/interop/test_logprobs_differential.py -v -s``); no engine.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyio_genout.protocol import Logprobs
from anyio_genout.text.logprobs import LogprobsDecoder, prompt_logprob_rows
from anyio_genout.text.tokenizer import Tokenizer
from tests.protocol._hyp import SCALE
from tests.text.tokenizer_kinds import KINDS, kind_dir

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    import torch
    from transformers import AutoTokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

CASES = max(1, int(600 * SCALE))
REPLACEMENT = "\ufffd"


@functools.cache
def tokenizers(kind: str) -> tuple[Tokenizer, Any]:
    folder = kind_dir(kind)
    return Tokenizer.from_model_dir(folder), AutoTokenizer.from_pretrained(str(folder))


@functools.cache
def partial_ids(kind: str) -> list[int]:
    hf = tokenizers(kind)[1]
    return [i for i in range(len(hf)) if hf.decode([i]).endswith(REPLACEMENT)]


@st.composite
def logprob_rows(draw: st.DrawFn) -> tuple[str, np.ndarray[Any, Any], list[int]]:
    """(kind, ids [positions, 1 + top], step sizes): distinct ids per row."""
    kind = draw(st.sampled_from(KINDS))
    vocab = len(tokenizers(kind)[1])
    one = st.one_of(st.sampled_from(partial_ids(kind)), st.integers(0, vocab - 1))
    cols = draw(st.integers(1, 4))
    row = st.lists(one, min_size=cols, max_size=cols, unique=True)
    ids = draw(st.lists(row, min_size=1, max_size=12))
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(draw(st.integers(1, len(ids) - sum(sizes))))
    return kind, np.array(ids, dtype=np.int64), sizes


def logprobs(ids: np.ndarray[Any, Any]) -> Logprobs:
    return Logprobs(ids, np.full(ids.shape, -1.0, np.float32), np.ones(len(ids), np.int32))


def test_logprob_token_strings_equal_vllms(capsys: pytest.CaptureFixture[str]) -> None:
    counts = {"cases": 0, "positions": 0, "positions with a partial token": 0}

    @settings(max_examples=CASES, derandomize=SCALE == 1, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=logprob_rows())
    def differential(case: tuple[str, np.ndarray[Any, Any], list[int]]) -> None:
        kind, ids, sizes = case
        ours, hf = tokenizers(kind)
        rows, cols = ids.shape
        values = np.full(ids.shape, -1.0, np.float32)
        ranks = np.ones(rows, np.int64)

        prompt = LogprobsProcessor(tokenizer=hf, logprobs=None, prompt_logprobs=[None],
                                   cumulative_logprob=None, num_logprobs=None,
                                   num_prompt_logprobs=cols - 1)
        prompt._update_prompt_logprobs(LogprobsTensors(
            torch.tensor(ids), torch.tensor(values), torch.tensor(ranks)))
        theirs = [[lp.decoded_token for lp in row.values()]
                  for row in prompt.prompt_logprobs[1:]]
        mine = [[e.token for e in row] for row in prompt_logprob_rows(ours, logprobs(ids))]
        assert mine == theirs, ("prompt", kind, ids.tolist())

        sample = LogprobsProcessor(tokenizer=hf, logprobs=[], prompt_logprobs=None,
                                   cumulative_logprob=0.0, num_logprobs=cols - 1,
                                   num_prompt_logprobs=None)
        decoder = LogprobsDecoder(ours)
        mine = []
        bounds = [0, *itertools.accumulate(sizes)]
        for start, end in itertools.pairwise(bounds):
            sample._update_sample_logprobs(LogprobsLists(ids[start:end], values[start:end],
                                                         ranks[start:end]))
            mine += [[e.token for e in row]
                     for row in decoder.decode(logprobs(ids[start:end]), end - start)]
        theirs = [[lp.decoded_token for lp in row.values()] for row in sample.logprobs]
        assert mine == theirs, ("sample", kind, ids.tolist(), sizes)

        counts["cases"] += 1
        counts["positions"] += rows
        counts["positions with a partial token"] += sum(
            any(hf.decode([int(t)]).endswith(REPLACEMENT) for t in row) for row in ids)

    differential()
    with capsys.disabled():
        print(f"\nlogprob token strings vs vLLM's LogprobsProcessor: {counts}")
    assert counts["positions with a partial token"] >= CASES
