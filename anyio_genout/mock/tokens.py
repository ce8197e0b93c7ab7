"""The mock engine's "model": deterministic tokens and fake logprobs.

Every generated token is a pure function of a 64-bit *stream key* and the output position,
mixed with SplitMix64 and reduced modulo the vocabulary:

* greedy requests (temperature below 1e-5): the key depends only on the prompt tokens, so the
  same prompt always continues the same way, whatever the request id, engine or seed;
* seeded sampling: the key depends on the prompt and the request's ``seed``;
* unseeded sampling: the key also depends on the engine seed and the request id.

In *corpus mode* (``corpus``: a sequence of token ids, e.g. a text encoded with a tokenizer)
the stream is a stretch of the corpus instead: the token at output position ``p`` is
``corpus[(s + p) mod len(corpus)]``, where the start ``s`` is ``key mod len(corpus)``, or with
``starts`` (positions where the corpus's sentences begin) ``starts[key mod len(starts)]``, so
a greedy request continues the same place of the corpus for the same prompt, the tokens
decode to readable text, and with ``starts`` the text begins with a sentence. Everything
else holds as without a corpus: the three kinds of keys, ``allowed`` (which then wins over
the corpus), the EOS draws, and the redraws ``min_tokens`` and ``bad_words`` make (from the
corpus, at a position drawn from the key).

Logprobs (:func:`fake_logprobs`) show the sampled token and ``k`` distinct top tokens drawn
from the whole vocabulary, or from ``alternatives`` (ids whose token strings are distinct and
readable, so a detokenizing front end shows ``k`` different strings).

:func:`greedy_tokens` and :func:`sampled_tokens` predict what the mock will emit (before stop
conditions and ``min_tokens`` are applied), so tests can choose stop tokens that will occur.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Any, Final

import attrs
import numpy as np

from ..protocol import Logprobs

__all__ = [
    "GREEDY_TEMPERATURE",
    "Alternatives",
    "alternatives_table",
    "corpus_array",
    "fake_logprobs",
    "fake_prompt_logprobs",
    "generate",
    "greedy_continuation",
    "greedy_tokens",
    "sampled_tokens",
    "stream_key",
]

#: Below this temperature vLLM samples greedily.
GREEDY_TEMPERATURE: Final = 1e-5

_MASK: Final = (1 << 64) - 1
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_S30: Final = np.uint64(30)
_S27: Final = np.uint64(27)
_S31: Final = np.uint64(31)
_S32: Final = np.uint64(32)
# Sub-stream tags so tokens, redraws, EOS draws and logprobs never share hash inputs.
_TAG_EOS: Final = 0x51ED27
_TAG_RANK: Final = 0x7A4B11
_TAG_LOGP: Final = 0x3C9D05
_TAG_PROMPT: Final = 0x1F00D5
_MAX_REDRAWS: Final = 64


def _mix(values: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """SplitMix64's finaliser over a uint64 array (wrapping arithmetic, vectorised)."""
    x = values
    x = (x ^ (x >> _S30)) * _MIX1
    x = (x ^ (x >> _S27)) * _MIX2
    return x ^ (x >> _S31)


def _hashes(key: int, positions: np.ndarray[Any, np.dtype[np.uint64]],
            tag: int = 0) -> np.ndarray[Any, np.dtype[np.uint64]]:
    base = np.uint64((key ^ (tag * 0x2545F4914F6CDD1D)) & _MASK)
    return _mix(base + (positions + np.uint64(1)) * _GOLDEN)


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def _prompt_bytes(prompt: Sequence[int]) -> bytes:
    return np.asarray(prompt, dtype="<i8").tobytes()


def stream_key(prompt: Sequence[int], *, greedy: bool, seed: int | None = None,
               engine_seed: int = 0, request_id: str = "") -> int:
    """The 64-bit key of a request's token stream (see the module docstring)."""
    body = _prompt_bytes(prompt)
    if greedy:
        return _digest(b"greedy", body)
    if seed is not None:
        return _digest(b"seeded", body, str(seed).encode())
    return _digest(b"random", body, str(engine_seed).encode(), request_id.encode())


def corpus_array(corpus: Sequence[int] | np.ndarray[Any, Any]
                 ) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """``corpus`` as the array :func:`generate` takes (convert once, pass it every time)."""
    return np.asarray(corpus, dtype=np.uint64)


def generate(key: int, start: int, count: int, vocab_size: int, *,
             avoid: Collection[int] = (), avoid_before: int = 0,
             allowed: Sequence[int] | None = None, eos_token_id: int | None = None,
             eos_probability: float = 0.0,
             corpus: Sequence[int] | np.ndarray[Any, Any] | None = None,
             starts: Sequence[int] | None = None,
             bad_words: Sequence[Sequence[int]] = (), history: Sequence[int] = ()
             ) -> list[int]:
    """Tokens at output positions ``start .. start+count-1`` of stream ``key``.

    ``allowed`` restricts the choice (vLLM's ``allowed_token_ids``). Tokens in ``avoid`` are
    redrawn at positions before ``avoid_before`` (``min_tokens`` holding back stop tokens). A
    model EOS token, if given, replaces a position's token with probability
    ``eos_probability``. A non-empty ``corpus`` (see the module docstring; an array from
    :func:`corpus_array` saves a conversion per call) is continued instead of drawing tokens
    from the whole vocabulary, from one of ``starts`` if given (corpus positions).

    ``bad_words`` (vLLM's ``bad_words_token_ids``) are banned as vLLM's sampler bans them: a
    one-token word's token is redrawn wherever it comes, a longer word's last token where
    the output tokens just before it are the rest of the word (the output only, never the
    prompt). ``history`` is the output before ``start`` (its last tokens are enough: one
    fewer than the longest word's).
    """
    if count <= 0:
        return []
    positions = np.arange(start, start + count, dtype=np.uint64)
    h = _hashes(key, positions)
    table_c = None
    if allowed is not None:
        table = np.asarray(allowed, dtype=np.uint64)
        tokens = table[h % np.uint64(len(table))]
    elif corpus is not None and len(corpus):
        table_c = corpus_array(corpus)  # no copy for an array from corpus_array
        size = np.uint64(len(table_c))
        first = starts[key % len(starts)] if starts else key % len(table_c)
        tokens = table_c[(np.uint64(first) + positions % size) % size]
    else:
        tokens = h % np.uint64(vocab_size)
    if eos_token_id is not None and eos_probability > 0.0:
        draw = _hashes(key, positions, _TAG_EOS) >> np.uint64(11)
        threshold = np.uint64(int(eos_probability * float(1 << 53)))
        tokens = np.where(draw < threshold, np.uint64(eos_token_id), tokens)
    out: list[int] = tokens.tolist()
    if bad_words:
        _ban(out, key, start, bad_words, history, avoid, avoid_before, allowed, table_c,
             vocab_size)
    elif avoid and start < avoid_before:
        for i in range(min(count, avoid_before - start)):
            attempt = 1
            while out[i] in avoid and attempt <= _MAX_REDRAWS:
                out[i] = _redraw(key, start + i, attempt, allowed, table_c, vocab_size)
                attempt += 1
    return out


def _redraw(key: int, position: int, attempt: int, allowed: Sequence[int] | None,
            table: np.ndarray[Any, np.dtype[np.uint64]] | None, vocab_size: int) -> int:
    """The ``attempt``-th other token at ``position`` (of ``allowed``, the corpus, or the
    vocabulary)."""
    value = int(_hashes(key, np.asarray([position], dtype=np.uint64), attempt)[0])
    if allowed is not None:
        return int(allowed[value % len(allowed)])
    if table is not None:
        return int(table[value % len(table)])
    return value % vocab_size


def _ban(out: list[int], key: int, start: int, bad_words: Sequence[Sequence[int]],
         history: Sequence[int], avoid: Collection[int], avoid_before: int,
         allowed: Sequence[int] | None, table: np.ndarray[Any, np.dtype[np.uint64]] | None,
         vocab_size: int) -> None:
    """Redraw, in place and in order, the tokens of ``out`` that ``bad_words`` ban where
    they come (vLLM's ``apply_bad_words``), and those of ``avoid`` before ``avoid_before``."""
    singles = {int(w[0]) for w in bad_words if len(w) == 1}
    longer = [(tuple(int(t) for t in w[:-1]), int(w[-1])) for w in bad_words if len(w) > 1]
    keep = max((len(prefix) for prefix, _ in longer), default=0)
    past = [int(t) for t in history[max(0, len(history) - keep):]] if keep else []
    for i in range(len(out)):
        banned = set(singles)
        for prefix, last in longer:
            if len(past) >= len(prefix) and tuple(past[len(past) - len(prefix):]) == prefix:
                banned.add(last)
        if start + i < avoid_before:
            banned.update(avoid)
        attempt = 1
        while out[i] in banned and attempt <= _MAX_REDRAWS:
            out[i] = _redraw(key, start + i, attempt, allowed, table, vocab_size)
            attempt += 1
        if keep:
            past.append(out[i])
            if len(past) > keep:
                del past[0]


def greedy_continuation(prompt: Sequence[int], lookback: int, vocab_size: int, *,
                        min_tokens: int = 0, avoid: Collection[int] = (),
                        allowed: Sequence[int] | None = None,
                        eos_token_id: int | None = None, eos_probability: float = 0.0,
                        corpus: Sequence[int] | np.ndarray[Any, Any] | None = None,
                        starts: Sequence[int] | None = None) -> tuple[int, int] | None:
    """Whether a greedy ``prompt`` continues an earlier greedy request: ``(key, offset)``.

    A real model's greedy continuation of ``prompt + the first k tokens it generated`` is
    the rest of that generation (a front end that moves a request to another engine relies
    on it). The mock's keys hash the whole prompt, so it looks for the longest ``k`` (at most
    ``lookback``, leaving at least one prompt token) whose last ``k`` prompt tokens are what
    a greedy request on the rest would generate first (``min_tokens`` is the continuation's:
    the original one held stop tokens back for ``k + min_tokens`` tokens); the request then
    generates that stream from position ``k``. None if there is no such ``k``.
    """
    n = len(prompt)
    body = _prompt_bytes(prompt)
    plain = allowed is None and corpus is None and (eos_token_id is None
                                                    or eos_probability <= 0.0)
    for k in range(min(lookback, n - 1), 0, -1):
        m = n - k
        key = _digest(b"greedy", body[:8 * m])
        if plain and not avoid:
            # The first token by hand (this runs for every candidate): _hashes at 0.
            x = ((key & _MASK) + 0x9E3779B97F4A7C15) & _MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            if (x ^ (x >> 31)) % vocab_size != prompt[m]:
                continue
        tail = generate(key, 0, k, vocab_size, avoid=avoid, avoid_before=k + min_tokens,
                        allowed=allowed, eos_token_id=eos_token_id,
                        eos_probability=eos_probability, corpus=corpus, starts=starts)
        if tail == list(prompt[m:]):
            return key, k
    return None


def greedy_tokens(prompt: Sequence[int], count: int, vocab_size: int = 32000, *,
                  corpus: Sequence[int] | None = None,
                  starts: Sequence[int] | None = None) -> list[int]:
    """What the mock generates for a greedy request on ``prompt`` (no stops applied); pass
    the engine's ``corpus_token_ids`` (and ``corpus_starts``) as ``corpus`` (and ``starts``)
    for a mock in corpus mode."""
    return generate(stream_key(prompt, greedy=True), 0, count, vocab_size, corpus=corpus,
                    starts=starts)


def sampled_tokens(prompt: Sequence[int], count: int, seed: int,
                   vocab_size: int = 32000, *,
                   corpus: Sequence[int] | None = None,
                   starts: Sequence[int] | None = None) -> list[int]:
    """What the mock generates for a seeded sampling request (no stops applied)."""
    return generate(stream_key(prompt, greedy=False, seed=seed), 0, count, vocab_size,
                    corpus=corpus, starts=starts)


def _stride(vocab_size: int) -> int:
    for stride in (7919, 104729, 1):
        if np.gcd(stride, vocab_size) == 1:
            return stride
    return 1  # pragma: no cover


@attrs.frozen(eq=False)
class Alternatives:
    """The token ids top-logprob columns are drawn from (:func:`alternatives_table`)."""

    table: np.ndarray[Any, np.dtype[np.int64]]
    #: Index of a token id in ``table`` (by id, -1: not in it).
    where: np.ndarray[Any, np.dtype[np.int64]]


def alternatives_table(ids: Sequence[int]) -> Alternatives:
    """``ids`` (distinct, non-negative) as the table :func:`fake_logprobs` takes."""
    table = np.asarray(ids, dtype=np.int64)
    where = np.full(int(table.max()) + 1 if len(table) else 0, -1, dtype=np.int64)
    where[table] = np.arange(len(table), dtype=np.int64)
    return Alternatives(table, where)


def _candidates(sampled: np.ndarray[Any, Any], ranks: np.ndarray[Any, Any], hashes:
                np.ndarray[Any, np.dtype[np.uint64]], k: int, vocab_size: int,
                alternatives: Alternatives | None = None
                ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Token ids ``[T, k+1]`` and logprobs ``[T, k+1]``: column 0 sampled, then ranks 1..k.

    The top-k columns are distinct tokens (of ``alternatives`` if given, but for the sampled
    one); the sampled token sits at column ``rank`` when its rank is at most ``k``.
    Logprobs strictly decrease with rank.
    """
    rows = sampled.shape[0]
    cols = np.arange(1, k + 1, dtype=np.int64)
    if alternatives is None:
        stride = _stride(vocab_size)
        offsets = (cols[None, :] - ranks[:, None]) * stride
        top = (sampled[:, None].astype(np.int64) + offsets) % vocab_size
    else:
        table, where = alternatives.table, alternatives.where
        size = len(table)
        stride = _stride(size)
        inside = sampled < len(where)
        found = np.where(inside, where[np.where(inside, sampled, 0)], -1)
        # A sampled token of the table is found at its rank, the others around it; one
        # outside it (say EOS) takes the rank's column, the others from a hashed place.
        anchor = np.where(found >= 0, found, (hashes % np.uint64(size)).astype(np.int64))
        offsets = (cols[None, :] - ranks[:, None]) * stride
        top = table[(anchor[:, None] + offsets) % size]
        own = (found < 0)[:, None] & (cols[None, :] == ranks[:, None])
        top = np.where(own, sampled[:, None].astype(np.int64), top)
    ids = np.empty((rows, k + 1), dtype=np.int32)
    ids[:, 0] = sampled
    ids[:, 1:] = top
    base = -0.01 - (hashes % np.uint64(1000)).astype(np.float64) / 500.0
    lps = np.empty((rows, k + 1), dtype=np.float32)
    lps[:, 1:] = base[:, None] - (cols[None, :] - 1) * 0.75
    lps[:, 0] = base - (ranks - 1) * 0.75
    return ids, lps


def fake_logprobs(key: int, tokens: Sequence[int], start: int, k: int, vocab_size: int, *,
                  greedy: bool, alternatives: Alternatives | None = None) -> Logprobs:
    """Sample logprobs for ``tokens`` at output positions ``start..``: ``[T, k+1]`` arrays.

    Greedy tokens have rank 1; sampled ones rank 1 to 4 (deterministically). The top
    tokens come from ``alternatives`` if given (``k`` then at most their number).
    """
    k = min(k, vocab_size if alternatives is None else len(alternatives.table))
    sampled = np.asarray(tokens, dtype=np.int64)
    positions = np.arange(start, start + len(tokens), dtype=np.uint64)
    hashes = _hashes(key, positions, _TAG_LOGP)
    if greedy:
        ranks = np.ones(len(tokens), dtype=np.int64)
    else:
        ranks = 1 + (_hashes(key, positions, _TAG_RANK) % np.uint64(4)).astype(np.int64)
    ids, lps = _candidates(sampled, ranks, hashes, k, vocab_size, alternatives)
    return Logprobs(ids, lps, ranks)


def fake_prompt_logprobs(prompt: Sequence[int], k: int, vocab_size: int, *,
                         alternatives: Alternatives | None = None) -> Logprobs | None:
    """Prompt logprobs ``[P-1, k+1]`` (the first prompt token has none); None for P < 2.
    The top tokens come from ``alternatives`` if given."""
    if len(prompt) < 2:
        return None
    k = min(k, vocab_size if alternatives is None else len(alternatives.table))
    key = _digest(b"prompt", _prompt_bytes(prompt))
    sampled = np.asarray(prompt[1:], dtype=np.int64) % vocab_size
    positions = np.arange(1, len(prompt), dtype=np.uint64)
    hashes = _hashes(key, positions, _TAG_LOGP)
    ranks = 1 + (_hashes(key, positions, _TAG_PROMPT) % np.uint64(8)).astype(np.int64)
    ids, lps = _candidates(sampled, ranks, hashes, k, vocab_size, alternatives)
    ids[:, 0] = np.asarray(prompt[1:], dtype=np.int64)
    return Logprobs(ids, lps, ranks.astype(np.int32))
