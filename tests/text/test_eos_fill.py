"""The one EOS fill and its precedence: the request's own EOS, else the tokenizer's, else
``ClientConfig.eos_token_id``; the order in which the text and generate layers call it
decides nothing."""

from __future__ import annotations

from typing import Any

import attrs

from anyio_genout import GenerateRequest, SamplingParams
from anyio_genout.text.stream import ModelEos

from .client_support import tokenizer


@attrs.frozen
class _NoEos:
    """A tokenizer whose folder names no EOS but one other EOS id."""

    eos_token_id: None = None
    eos_token_ids: tuple[int, ...] = (4,)


def _sent(params: SamplingParams, eos: ModelEos, config_eos: int | None) -> SamplingParams:
    """What the engine gets: the text layer's fill, then the generate layer's."""
    request = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=eos.fill(
        params))
    return request.to_engine_request("r-1", eos_token_id=config_eos).sampling_params


def test_the_tokenizers_eos_wins_over_the_configs_and_the_requests_over_both() -> None:
    model = ModelEos(tokenizer(), fallback=99)
    assert _sent(SamplingParams(), model, 99).eos_token_id == tokenizer().eos_token_id == 2
    assert _sent(SamplingParams(eos_token_id=9), model, 99).eos_token_id == 9
    assert 4 in _sent(SamplingParams(), model, 99).stop_token_ids  # the folder's other EOS


def test_without_a_tokenizer_eos_the_configs_fills_in() -> None:
    bare: Any = _NoEos()
    sent = _sent(SamplingParams(), ModelEos(bare, fallback=99), 99)
    assert (sent.eos_token_id, sent.stop_token_ids) == (99, (4,))
    # The generate layer alone (token ids, no text layer): the config's EOS.
    alone = GenerateRequest(request_id="r", prompt_token_ids=[1]).to_engine_request(
        "r-1", eos_token_id=99).sampling_params
    assert alone.eos_token_id == 99


def test_ignore_eos_keeps_the_eos_for_min_tokens_but_adds_no_stops() -> None:
    sent = _sent(SamplingParams(ignore_eos=True), ModelEos(tokenizer(), fallback=99), 99)
    assert sent.eos_token_id == 2 and sent.stop_token_ids == ()
    assert "_eos_token_id" not in sent.to_wire() and 2 in sent.to_wire()["_all_stop_token_ids"]
