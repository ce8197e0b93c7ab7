"""The mock's deterministic "model": token streams and fake logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from anyio_genout.mock import tokens
from anyio_genout.mock.config import MockEngineConfig, MockFaults


def test_greedy_depends_only_on_prompt_and_position() -> None:
    a = tokens.greedy_tokens([1, 5, 6, 7, 8], 64)
    assert a == tokens.greedy_tokens([1, 5, 6, 7, 8], 64)
    assert a[:10] == tokens.greedy_tokens([1, 5, 6, 7, 8], 10)
    assert a != tokens.greedy_tokens([1, 5, 6, 7, 9], 64)
    key = tokens.stream_key([1, 5, 6, 7, 8], greedy=True, seed=3, engine_seed=9,
                            request_id="x")
    assert tokens.generate(key, 10, 5, 32000) == a[10:15]
    assert all(0 <= t < 32000 for t in a)
    assert all(0 <= t < 7 for t in tokens.greedy_tokens([1, 2], 200, vocab_size=7))


def test_sampling_keys() -> None:
    prompt = [3, 4, 5]
    assert tokens.sampled_tokens(prompt, 20, seed=42) == tokens.sampled_tokens(prompt, 20, 42)
    assert tokens.sampled_tokens(prompt, 20, 42) != tokens.sampled_tokens(prompt, 20, 43)
    unseeded = [tokens.stream_key(prompt, greedy=False, engine_seed=0, request_id=r)
                for r in ("a", "b")]
    assert unseeded[0] != unseeded[1]
    assert unseeded[0] == tokens.stream_key(prompt, greedy=False, request_id="a")
    assert unseeded[0] != tokens.stream_key(prompt, greedy=False, engine_seed=1,
                                            request_id="a")


def test_generate_avoid_allowed_and_eos() -> None:
    key = tokens.stream_key([1], greedy=True)
    avoided = tokens.generate(key, 0, 50, 4, avoid={0, 1}, avoid_before=30)
    assert not {0, 1} & set(avoided[:30])
    assert {0, 1} & set(avoided[30:])
    allowed = tokens.generate(key, 0, 100, 32000, allowed=[5, 9, 11])
    assert set(allowed) == {5, 9, 11}
    eos = tokens.generate(key, 0, 1000, 32000, eos_token_id=2, eos_probability=0.25)
    assert 150 < eos.count(2) < 350
    assert tokens.generate(key, 0, 0, 10) == []



def _banned_where_they_come(out: list[int], words: list[list[int]]) -> list[int]:
    """Positions of ``out`` where vLLM's sampler would have banned the token: a one-token
    word anywhere, a longer word's last token right after the rest of it (outputs only)."""
    past: list[int] = []
    found = []
    for i, tok in enumerate(out):
        for word in words:
            if len(word) <= len(past) + 1 and past[len(past) - len(word) + 1:] == word[:-1] \
                    and tok == word[-1]:
                found.append(i)
        past.append(tok)
    return found


def test_generate_bans_bad_words_as_vllm() -> None:
    key = tokens.stream_key([3, 1], greedy=True)
    free = tokens.generate(key, 0, 400, 8)
    single = [free[5]]
    pair = free[20:22]
    triple = free[40:43]
    words = [single, pair, triple]
    assert _banned_where_they_come(free, words)  # the free stream has them
    banned = tokens.generate(key, 0, 400, 8, bad_words=words)
    assert _banned_where_they_come(banned, words) == []
    assert single[0] not in banned
    # Only the last token of a longer word is banned, and only after the rest of it: the
    # first tokens of the pair still come, and the pair's last token comes elsewhere.
    assert pair[0] in banned and pair[1] in banned
    # The prompt does not count: only ``history`` (the output before ``start``) does.
    lead = tokens.generate(key, 0, 1, 8, bad_words=[[free[0]]])
    assert lead != [free[0]]
    after = tokens.generate(key, 0, 1, 8, bad_words=[[7, free[0]]])
    assert after == [free[0]]  # no output before it: a 2-token word cannot end at 0
    assert tokens.generate(key, 0, 1, 8, bad_words=[[7, free[0]]], history=[7]) != [free[0]]
    # Chunks with their history are the stream in one go (the engine refills by chunks).
    chunked = [*tokens.generate(key, 0, 150, 8, bad_words=words)]
    chunked += tokens.generate(key, 150, 250, 8, bad_words=words, history=chunked[-2:])
    assert chunked == banned
    # With allowed_token_ids the redraws stay in them; avoid still holds before min_tokens.
    allowed = tokens.generate(key, 0, 200, 32000, allowed=[4, 5, 6], bad_words=[[5]],
                              avoid={6}, avoid_before=50)
    assert set(allowed) == {4, 6} and 6 not in allowed[:50]

def test_fake_logprobs_shapes_and_ranks() -> None:
    key = tokens.stream_key([1, 2], greedy=False, seed=1)
    toks = tokens.generate(key, 3, 6, 32000)
    lp = tokens.fake_logprobs(key, toks, 3, 5, 32000, greedy=False)
    assert lp.token_ids.shape == (6, 6) and lp.token_ids.dtype == np.int32
    assert lp.logprobs.shape == (6, 6) and lp.logprobs.dtype == np.float32
    assert lp.ranks.shape == (6,) and lp.ranks.dtype == np.int64
    assert lp.token_ids[:, 0].tolist() == toks
    for row in range(6):
        rank = int(lp.ranks[row])
        assert 1 <= rank <= 4
        assert lp.token_ids[row, rank] == toks[row]  # the sampled token sits at its rank
        assert lp.logprobs[row, 0] == lp.logprobs[row, rank]
        assert len(set(lp.token_ids[row, 1:].tolist())) == 5
        assert np.all(np.diff(lp.logprobs[row, 1:]) < 0)
    greedy = tokens.fake_logprobs(key, toks, 0, 2, 32000, greedy=True)
    assert greedy.ranks.tolist() == [1] * 6
    assert (greedy.token_ids[:, 1] == greedy.token_ids[:, 0]).all()
    assert tokens.fake_logprobs(key, toks, 0, 0, 32000, greedy=True).token_ids.shape == (6, 1)


def test_fake_prompt_logprobs() -> None:
    prompt = list(range(100, 141))
    plp = tokens.fake_prompt_logprobs(prompt, 5, 32000)
    assert plp is not None
    assert plp.token_ids.shape == (40, 6) and plp.ranks.shape == (40,)
    assert plp.token_ids[:, 0].tolist() == prompt[1:]
    assert plp.ranks.min() >= 1
    assert tokens.fake_prompt_logprobs([7], 5, 32000) is None


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="handshake_address"):
        MockEngineConfig()
    with pytest.raises(ValueError, match="excludes"):
        MockEngineConfig(handshake_address="tcp://a:1", input_address="tcp://b:2")
    with pytest.raises(ValueError, match="output_fields"):
        MockEngineConfig(handshake_address="tcp://a:1", output_fields=17)
    with pytest.raises(ValueError, match="max_num_seqs"):
        MockEngineConfig(handshake_address="tcp://a:1", max_num_seqs=0)
    with pytest.raises(ValueError, match="preempt_every"):
        MockFaults(preempt_every=0)
    cfg = MockEngineConfig(input_address="tcp://b:2", output_addresses="tcp://c:3", rank=3)
    assert cfg.output_addresses == ("tcp://c:3",)
    assert cfg.identity == b"\x03\x00"
    assert cfg.gpu_blocks == 256 * 4096 // 16
