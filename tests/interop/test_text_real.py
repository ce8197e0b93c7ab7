"""Text in, text out against ONE real vLLM engine per backend that loads a real tokenizer.

The model folder is the tiny random Llama (its config and weights, linked) with the bundled
byte-level BPE tokenizer (``anyio_genout/text/bundled``: 1024 tokens, the model's vocabulary
size; ``<s>`` = 1 and ``</s>`` = 2, the model's bos and eos ids). The engine starts WITHOUT
``--skip-tokenizer-init``, so vLLM's engine core loads that tokenizer too (it uses it only to
compile structured-output grammars: stop strings and detokenizing are the front end's work,
here :class:`~anyio_genout.text.TextClient`).

A greedy run gives the model's text; a stop string cut from the middle of that text must
then end the same request early: the truncated text, finish reason STOP with the string as
stop reason, one ABORT to the engine, the request gone from the engine's scheduler stats,
and ``vllm:request_success_total{finished_reason="stop"}`` counting it with no abort.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from anyio_genout import Client, SamplingParams
from anyio_genout.text import (
    CollectedTextOutput,
    TextClient,
    TextOutput,
    TextRequest,
    Tokenizer,
    bundled_model_dir,
    collect_text,
)
from anyio_genout.vllm import VllmEngines

from .conftest import INTEROP_TIMEOUT, RealVllm, running_client, unique_id
from .test_real_generate import StatsLog

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]

PROMPT = "Every evening at a quarter past six, the keeper climbed the steps and wrote"
LABELS = {"model_name": "tiny", "engine": "0"}
#: The stop string starts at the text of this output token (mid-stream).
STOP_AT_TOKEN = 10


@pytest.fixture(scope="module")
def text_model(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config, weights and generation config with the bundled tokenizer."""
    model = Path(real_vllm.model)
    folder = tmp_path_factory.mktemp("tiny-text-model")
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to((model / name).resolve())
    bundled = bundled_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((bundled / name).read_bytes())
    config = json.loads((model / "config.json").read_text())
    tokenizer = Tokenizer.from_model_dir(folder)
    # The model was built with the ids the bundled tokenizer gives its special tokens.
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("</s>", 2)
    assert tokenizer.vocab_size == config["vocab_size"] == 1024
    # The model's generation config names eos 2 only; the tokenizer's also ends a chat turn
    # on <|im_end|> (4): the folder's generation config takes the tokenizer's EOS list.
    generation = json.loads((model / "generation_config.json").read_text())
    bundled_eos = json.loads((bundled / "generation_config.json").read_text())["eos_token_id"]
    assert bundled_eos == [2, 4]
    generation["eos_token_id"] = bundled_eos
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    assert Tokenizer.from_model_dir(folder).eos_token_ids == (2, 4)
    return folder


@dataclasses.dataclass
class Served:
    engines: VllmEngines
    client: Client
    stats: StatsLog
    text: TextClient
    #: The engine's log lines that show its configuration.
    config_lines: list[str]


class _ConfigLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if "skip_tokenizer_init=" in line:
            self.lines.append(line)


@pytest.fixture(scope="module")
async def served(real_vllm: RealVllm, text_model: Path) -> AsyncIterator[Served]:
    real = dataclasses.replace(real_vllm, model=str(text_model))
    lines = _ConfigLines()
    logger = logging.getLogger("tests.interop")  # every engine output line goes there
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        # The engine loads the tokenizer (vLLM's default; the launcher adds
        # --skip-tokenizer-init, which the later flag overrides).
        async with running_client(real, extra_args=("--no-skip-tokenizer-init",)) as (
                engines, client):
            stats = StatsLog()
            client.engine.add_stats_listener(stats)
            yield Served(engines, client, stats,
                         TextClient(client, Tokenizer.from_model_dir(text_model)), lines.lines)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


@pytest.fixture
def text(served: Served) -> Served:
    assert served.engines.running, f"the shared engine died: {served.engines.exit_error}"
    assert served.client.engine.is_healthy, served.client.engine.health_error
    return served


def greedy(max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def generate_text(text: TextClient, request: TextRequest) -> CollectedTextOutput:
    async with text.generate(request) as stream:
        return await collect_text(stream)


def metric(client: Client, name: str, **labels: str) -> float:
    value = client.metrics.registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if value is None else value


def pick_stop(tokenizer: Tokenizer, token_ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string from the middle of ``text``: (string, where it starts in the text,
    the output tokens up to the one that completes it)."""
    start = len(tokenizer.decode(token_ids[:STOP_AT_TOKEN]))
    for length in range(3, 9):
        stop = text[start:start + length]
        if stop.strip() and "\ufffd" not in stop and text.find(stop) == start:
            break
    else:  # repetitive text: the first occurrence decides, wherever it is
        stop = text[start:start + 3]
    where = text.find(stop)
    kept = next(n for n in range(1, len(token_ids) + 1)
                if stop in tokenizer.decode(token_ids[:n]))
    return stop, where, kept


async def test_text_prompt_in_text_out(text: Served) -> None:
    assert text.config_lines, "the engine did not log its configuration"
    assert all("skip_tokenizer_init=False" in line for line in text.config_lines)
    assert all(re.search(r"tokenizer='[^']*tiny-text-model", line)
               for line in text.config_lines)
    tokenizer = text.text.tokenizer
    out = await generate_text(text.text, TextRequest(request_id=unique_id("text"),
                                                     prompt=PROMPT, sampling_params=greedy()))
    assert out.prompt_token_ids == tuple(tokenizer.encode(PROMPT))
    assert out.prompt_token_ids[0] == 1  # <s>: add_bos_token
    assert len(out.token_ids) > STOP_AT_TOKEN + 2, out
    assert out.text == tokenizer.decode(out.token_ids)
    assert out.text.strip()
    again = await generate_text(text.text, TextRequest(request_id=unique_id("text"),
                                                       prompt=PROMPT, sampling_params=greedy()))
    assert (again.text, again.token_ids) == (out.text, out.token_ids)  # greedy: the same


async def test_stop_string_mid_stream_truncates_and_frees_the_request(text: Served) -> None:
    client, tokenizer = text.client, text.text.tokenizer
    undisturbed = await generate_text(text.text, TextRequest(
        request_id=unique_id("whole"), prompt=PROMPT, sampling_params=greedy()))
    stop, where, kept = pick_stop(tokenizer, undisturbed.token_ids, undisturbed.text)
    assert where > 0 and kept < len(undisturbed.token_ids), (stop, undisturbed)
    await text.stats.wait_idle()
    aborts_sent = client.engine.aborts_sent
    stops = metric(client, "vllm:request_success_total", finished_reason="stop")
    aborts = metric(client, "vllm:request_success_total", finished_reason="abort")

    outputs: list[TextOutput] = []
    request = TextRequest(request_id=unique_id("stop"), prompt=PROMPT,
                          sampling_params=greedy(), stop=(stop,))
    with anyio.fail_after(60):
        async with text.text.generate(request) as stream:
            async for out in stream:
                outputs.append(out)

    final = outputs[-1]
    assert final.finish_reason is not None and final.finish_reason.as_str() == "stop"
    assert final.finish_reason.stop_reason == stop
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert "".join(o.text for o in outputs) == undisturbed.text[:where]
    assert [t for o in outputs for t in o.token_ids] == undisturbed.token_ids[:kept]
    # The engine had not finished the request: the layer sent one ABORT for it ...
    with anyio.fail_after(10):
        while True:
            if client.engine.aborts_sent >= aborts_sent + 1:
                break
            await anyio.sleep(0.01)
    assert client.engine.aborts_sent == aborts_sent + 1
    assert client.engine.in_flight == 0
    # ... the engine dropped it (a later step's scheduler stats show nothing running) ...
    idle = await text.stats.wait_idle()
    assert idle.num_running_reqs == 0 and idle.num_waiting_reqs == 0
    assert metric(client, "vllm:num_requests_running") == 0.0
    # ... and the metrics count a stop, not an abort.
    assert metric(client, "vllm:request_success_total", finished_reason="stop") == stops + 1
    assert metric(client, "vllm:request_success_total", finished_reason="abort") == aborts


async def test_collected_stop_string_output(text: Served) -> None:
    tokenizer = text.text.tokenizer
    undisturbed = await generate_text(text.text, TextRequest(
        request_id=unique_id("whole"), prompt=PROMPT, sampling_params=greedy()))
    stop, where, kept = pick_stop(tokenizer, undisturbed.token_ids, undisturbed.text)
    out = await generate_text(text.text, TextRequest(
        request_id=unique_id("stop"), prompt=PROMPT, sampling_params=greedy(),
        stop=(stop,), include_stop_str_in_output=True))
    assert out.text == undisturbed.text[:where + len(stop)]
    assert out.token_ids == undisturbed.token_ids[:kept]
    assert out.finish_reason.as_str() == "stop" and out.finish_reason.stop_reason == stop
    assert out.usage.output_token_count == kept
    await text.stats.wait_idle()

