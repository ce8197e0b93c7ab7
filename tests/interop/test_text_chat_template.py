"""Differential: our Tokenizer against transformers (what vLLM loads) and vLLM's own helpers.

For four folders (the bundled ChatML one, as shipped and with ``add_bos_token``/
``add_eos_token`` that its tokenizer.json contradicts; a Llama-3-style one with its template in
``chat_template.jinja``, header tokens, a default system prompt and ``loop.first`` checks;
a SentencePiece-style one with byte fallback and an ``[INST]`` template that relies on
``trim_blocks``/``lstrip_blocks`` and renders ``tools | tojson``), over hypothesis-generated
conversations (derandomized):

* ``apply_chat_template`` equals ``AutoTokenizer.from_pretrained(dir).apply_chat_template(
  messages, tokenize=False, add_generation_prompt=...)``, or both refuse (the template
  raises);
* ``encode`` equals transformers' ``encode`` (with and without special tokens) on text in
  several scripts and on the rendered prompts;
* ``token_strings`` equals vLLM's ``convert_ids_list_to_tokens`` for every id of each
  vocabulary, and, with ``context``, what vLLM's logprobs processor makes of sampled
  sequences (``_verify_tokens``: characters cut by byte fallback).

Needs transformers and vLLM importable (the interop venv: ``nox -s interop --
tests/interop/test_text_chat_template.py -v -s``), no engine. Prints the case counts.
"""

from __future__ import annotations

import collections
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from anyio_genout.errors import ChatTemplateError
from anyio_genout.text.bundled import bundled_model_dir
from anyio_genout.text.tokenizer import Tokenizer
from tests.text.test_tokenizer import TEXTS, write_sentencepiece_folder

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    transformers = pytest.importorskip("transformers", reason="needs transformers (interop venv)")
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

CASES = 600
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if date_string is defined %}
    {{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('a system message is allowed only first') }}
    {%- endif %}
    {%- if loop.first and message['role'] != 'user' %}
        {{- raise_exception('the conversation must start with a user message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
    {%- if loop.last and message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
INST_TEMPLATE = """{{ bos_token }}
{% if tools %}
[TOOLS]{{ tools | tojson }}[/TOOLS]
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'] }} [/INST]
    {% elif message['role'] == 'assistant' %}
{{ message['content'] }}{{ eos_token }}
    {% elif message['role'] == 'system' %}
<<SYS>>
{{ message['content'] }}
<</SYS>>
    {% else %}
{{ raise_exception('Only user, assistant and system roles are supported!') }}
    {% endif %}
{% endfor %}
"""
CONTENTS = [*(t for t in TEXTS if t), "  padded  ", "<|im_end|> in text", "<s>", "{{ x }}"]


def write_llama3_folder(folder: Path) -> Path:
    """The bundled BPE with Llama-3's header tokens added, bos/eos named by the config, the
    template in ``chat_template.jinja``, no ``add_bos_token`` (tokenizer.json decides)."""
    backend = tokenizers.Tokenizer.from_file(str(bundled_model_dir() / "tokenizer.json"))
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in LLAMA3_SPECIALS])
    bos_id = backend.token_to_id(LLAMA3_SPECIALS[0])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_SPECIALS[0]}:0 $A:0", special_tokens=[(LLAMA3_SPECIALS[0], bos_id)])
    folder.mkdir(parents=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": LLAMA3_SPECIALS[0], "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True, "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    ids = [backend.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


def write_inst_folder(folder: Path) -> Path:
    write_sentencepiece_folder(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = INST_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Any]]:
    """name -> (our tokenizer, transformers' tokenizer) for each folder."""
    root = tmp_path_factory.mktemp("folders")
    bundled = root / "bundled"
    shutil.copytree(bundled_model_dir(), bundled)
    flags = root / "flags"  # add_bos_token/add_eos_token that tokenizer.json contradicts
    shutil.copytree(bundled_model_dir(), flags)
    config = json.loads((flags / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (flags / "tokenizer_config.json").write_text(json.dumps(config))
    paths = {"chatml": bundled, "flags": flags, "llama3": write_llama3_folder(root / "llama3"),
             "inst": write_inst_folder(root / "inst")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: (Tokenizer.from_model_dir(path),
                       transformers.AutoTokenizer.from_pretrained(str(path)))
                for name, path in paths.items()}


def test_the_folders_read_as_transformers_reads_them(
        folders: dict[str, tuple[Tokenizer, Any]]) -> None:
    for name, (ours, hf) in folders.items():
        assert (ours.bos_token, ours.bos_token_id) == (hf.bos_token, hf.bos_token_id), name
        assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id), name
        special = frozenset(i for i, t in hf.added_tokens_decoder.items() if t.special)
        assert ours.special_token_ids == special >= frozenset(hf.all_special_ids), name
        assert ours.decode(range(len(hf))) == hf.decode(range(len(hf)), skip_special_tokens=True)
        assert ours.chat_template == hf.chat_template, name
        assert ours.backend.get_vocab_size(with_added_tokens=True) == len(hf), name


_ROLES = st.sampled_from(["system", "user", "assistant", "user", "assistant", "tool"])
_CONTENT = st.one_of(st.sampled_from(CONTENTS), st.text(max_size=12))


@st.composite
def _conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """An optional system message, then user/assistant turns; sometimes any roles at all."""
    if draw(st.integers(0, 3)) == 0:
        roles = draw(st.lists(_ROLES, min_size=1, max_size=6))
    else:
        turns = draw(st.integers(1, 5))
        roles = ["system"] * draw(st.booleans()) + \
            [("user", "assistant")[i % 2] for i in range(turns)]
    return [{"role": role, "content": draw(_CONTENT)} for role in roles]


_MESSAGES = _conversations()
_KWARGS = st.one_of(st.just({}), st.fixed_dictionaries({"date_string": _CONTENT}),
                    st.fixed_dictionaries({"tools": st.lists(st.fixed_dictionaries(
                        {"name": st.sampled_from(["f", "天气", "<b>"]),
                         "parameters": st.dictionaries(st.sampled_from("xyz"), st.integers())}),
                        min_size=1, max_size=2)}))


def test_chat_templates_render_as_transformers_renders_them(
        folders: dict[str, tuple[Tokenizer, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(name=st.sampled_from(sorted(folders)), messages=_MESSAGES,
           add_generation_prompt=st.booleans(), kwargs=_KWARGS)
    def differential(name: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                     kwargs: dict[str, Any]) -> None:
        ours, hf = folders[name]
        try:
            expected = hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt,
                                              **kwargs)
        except Exception as exc:  # the template refused: so must we
            with pytest.raises(ChatTemplateError) as refused:
                ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
            assert str(exc) in str(refused.value)
            outcomes[f"{name}: both refuse"] += 1
            return
        rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            **kwargs)
        assert rendered == expected
        assert ours.encode(rendered, add_special_tokens=False) == \
            hf.encode(rendered, add_special_tokens=False)
        outcomes[f"{name}: equal"] += 1

    differential()
    with capsys.disabled():
        print(f"\nchat templates vs transformers: {sum(outcomes.values())} cases: " +
              ", ".join(f"{key} {count}" for key, count in sorted(outcomes.items())))
    for name in folders:
        assert outcomes[f"{name}: equal"] >= CASES // 10, outcomes
    assert outcomes["llama3: both refuse"] + outcomes["chatml: both refuse"] > 0


@pytest.mark.parametrize("name", ["chatml", "flags", "llama3", "inst"])
def test_encode_equals_transformers(folders: dict[str, tuple[Tokenizer, Any]],
                                    name: str) -> None:
    ours, hf = folders[name]
    cases = 0

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(text=st.one_of(st.sampled_from(CONTENTS), st.text(max_size=40)),
           add_special_tokens=st.booleans())
    def differential(text: str, add_special_tokens: bool) -> None:
        nonlocal cases
        assert ours.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens)
        cases += 1

    differential()
    assert cases >= 150


@pytest.mark.parametrize("name", ["chatml", "llama3", "inst"])
def test_token_strings_equal_vllms_for_every_id(folders: dict[str, tuple[Tokenizer, Any]],
                                                name: str) -> None:
    ours, hf = folders[name]
    ids = list(range(len(hf)))
    assert ours.token_strings(ids) == convert_ids_list_to_tokens(hf, ids)
    unknown = [len(hf), len(hf) + 7]  # ids a model may sample beyond the tokenizer's size
    assert ours.token_strings(unknown) == ["", ""]
    if name != "inst":  # vLLM raises TypeError here for Metaspace tokenizers
        assert convert_ids_list_to_tokens(hf, unknown) == ["", ""]


def test_logprob_token_strings_with_context_equal_vllms(
        folders: dict[str, tuple[Tokenizer, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    ours, hf = folders["inst"]
    vocab = len(hf)
    cases = 0

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(text=st.one_of(st.sampled_from(CONTENTS), st.text(min_size=1, max_size=12)),
           alternatives=st.lists(st.integers(0, vocab - 1), max_size=3))
    def differential(text: str, alternatives: list[int]) -> None:
        nonlocal cases
        sampled = ours.encode(text, add_special_tokens=False)
        processor = LogprobsProcessor(tokenizer=hf, logprobs=None, prompt_logprobs=None,
                                      cumulative_logprob=None, num_logprobs=None,
                                      num_prompt_logprobs=None)
        for i, token_id in enumerate(sampled):
            position = [token_id, *alternatives]
            context = sampled[max(0, i - 4):i]
            expected = processor._verify_tokens(  # vLLM's per-position correction
                convert_ids_list_to_tokens(hf, position), position, context_token_ids=context)
            assert ours.token_strings(position, context=sampled[:i]) == expected
            cases += 1

    differential()
    with capsys.disabled():
        print(f"\nlogprob token strings vs vLLM: {cases} positions")
    assert cases >= 200
