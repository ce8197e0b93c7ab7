"""The mock's corpus mode: generated tokens continue a given token sequence (readable text
for a detokenizing front end), and every rule of the token streams still holds."""

from __future__ import annotations

import pytest

from anyio_genout import GenerateRequest, SamplingParams, collect_output
from anyio_genout.mock import MockEngineConfig, greedy_tokens, sampled_tokens, tokens
from tests.cluster import generate_client

#: A corpus with every id distinct, so a stretch of it shows where it started.
CORPUS = tuple(range(500, 800))
ADDRESS = "tcp://127.0.0.1:1"


def is_stretch(found: list[int], corpus: tuple[int, ...] = CORPUS) -> bool:
    """``found`` is a contiguous (cyclic) stretch of ``corpus``."""
    start = corpus.index(found[0])
    return found == [corpus[(start + i) % len(corpus)] for i in range(len(found))]


def test_greedy_continues_the_corpus_from_a_place_chosen_by_the_prompt() -> None:
    first = greedy_tokens([1, 2, 3], 400, corpus=CORPUS)  # longer than the corpus: it wraps
    assert is_stretch(first)
    assert first == greedy_tokens([1, 2, 3], 400, corpus=CORPUS)  # same prompt, same text
    key = tokens.stream_key([1, 2, 3], greedy=True)
    assert first[0] == CORPUS[key % len(CORPUS)]
    assert tokens.generate(key, 50, 10, 32000, corpus=CORPUS) == first[50:60]
    others = {greedy_tokens([1, 2, i], 1, corpus=CORPUS)[0] for i in range(4, 24)}
    assert len(others) > 10  # other prompts start elsewhere
    assert first != greedy_tokens([1, 2, 3], 400)  # not the corpus-free stream


def test_seeded_and_unseeded_keys_pick_their_own_places() -> None:
    seeded = sampled_tokens([1, 2, 3], 30, seed=7, corpus=CORPUS)
    assert is_stretch(seeded)
    assert seeded == sampled_tokens([1, 2, 3], 30, seed=7, corpus=CORPUS)
    assert seeded != sampled_tokens([1, 2, 3], 30, seed=8, corpus=CORPUS)
    keys = [tokens.stream_key([1, 2, 3], greedy=False, request_id=r) for r in ("a", "b")]
    runs = [tokens.generate(k, 0, 30, 32000, corpus=CORPUS) for k in keys]
    assert all(is_stretch(run) for run in runs) and runs[0] != runs[1]


def test_allowed_eos_draws_and_min_tokens_redraws_still_apply() -> None:
    key = tokens.stream_key([9], greedy=True)
    assert set(tokens.generate(key, 0, 200, 32000, allowed=[5, 9], corpus=CORPUS)) == {5, 9}
    with_eos = tokens.generate(key, 0, 1000, 32000, eos_token_id=2, eos_probability=0.25,
                               corpus=CORPUS)
    assert 150 < with_eos.count(2) < 350
    assert set(with_eos) - {2} <= set(CORPUS)
    plain = tokens.generate(key, 0, 40, 32000, corpus=CORPUS)
    avoid = set(plain[:5])
    redrawn = tokens.generate(key, 0, 40, 32000, corpus=CORPUS, avoid=avoid, avoid_before=5)
    assert not avoid & set(redrawn[:5])
    assert set(redrawn[:5]) <= set(CORPUS)  # redrawn from the corpus, so still text
    assert redrawn[5:] == plain[5:]


@pytest.mark.parametrize(("corpus", "problem"), [
    ((), "non-empty"),
    ((1, 2, 32000), "vocab_size=32000"),
    ((1, -1), "non-empty"),
    (("a", "b"), "integers"),
])
def test_a_corpus_outside_the_vocabulary_is_refused(corpus: tuple[object, ...],
                                                     problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        MockEngineConfig(handshake_address=ADDRESS, corpus_token_ids=corpus)  # type: ignore[arg-type]


def test_the_corpus_is_kept_out_of_the_config_repr() -> None:
    config = MockEngineConfig(handshake_address=ADDRESS, corpus_token_ids=list(CORPUS))
    assert config.corpus_token_ids == CORPUS
    assert "corpus" not in repr(config)
    assert MockEngineConfig(handshake_address=ADDRESS).corpus_token_ids is None


@pytest.mark.anyio
async def test_a_mock_engine_in_corpus_mode_sends_the_predicted_stretch() -> None:
    async with generate_client(mock={"corpus_token_ids": CORPUS}) as (client, _):
        greedy = GenerateRequest(request_id="g", prompt_token_ids=[4, 5, 6],
                                 sampling_params=SamplingParams(temperature=0.0, max_tokens=40))
        seeded = GenerateRequest(request_id="s", prompt_token_ids=[4, 5, 6],
                                 sampling_params=SamplingParams(seed=3, max_tokens=40))
        async with client.generate(greedy) as stream:
            assert (await collect_output(stream)).token_ids == greedy_tokens(
                [4, 5, 6], 40, corpus=CORPUS)
        async with client.generate(seeded) as stream:
            assert (await collect_output(stream)).token_ids == sampled_tokens(
                [4, 5, 6], 40, seed=3, corpus=CORPUS)
