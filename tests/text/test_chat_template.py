"""Chat templates: the bundled ChatML output, where templates come from in a folder, the
sandbox and transformers' helpers, errors that name the template line, malformed messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from anyio_genout.errors import ChatTemplateError, InvalidRequestError
from anyio_genout.text.bundled import bundled_tokenizer
from anyio_genout.text.chat_template import compile_template
from anyio_genout.text.tokenizer import Tokenizer
from tests.text.test_tokenizer import copy_bundled, edit_json

CONVERSATION = [
    {"role": "system", "content": "You keep a lighthouse."},
    {"role": "user", "content": "Wie ist das Wetter? 天气"},
    {"role": "assistant", "content": "Fog from noon. 🌫️"},
    {"role": "user", "content": "Thanks."},
]
CHATML = ("<s><|im_start|>system\nYou keep a lighthouse.<|im_end|>\n"
          "<|im_start|>user\nWie ist das Wetter? 天气<|im_end|>\n"
          "<|im_start|>assistant\nFog from noon. 🌫️<|im_end|>\n"
          "<|im_start|>user\nThanks.<|im_end|>\n")
USER = [{"role": "user", "content": "hi"}]


def render(template: str, messages: Any = USER, **kwargs: Any) -> str:
    return bundled_tokenizer().apply_chat_template(messages, chat_template=template, **kwargs)


def test_the_bundled_template_renders_chatml_with_bos() -> None:
    tok = bundled_tokenizer()
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == CHATML
    prompt = tok.apply_chat_template(CONVERSATION)
    assert prompt == CHATML + "<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(3) == 5 and ids.count(4) == 4
    assert ids[-5:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_the_bundled_template_refuses_an_unknown_role_naming_its_line() -> None:
    with pytest.raises(ChatTemplateError) as exc:
        bundled_tokenizer().apply_chat_template([{"role": "tool", "content": "42"}])
    assert exc.value.line == 4
    assert "at line 4" in str(exc.value) and "Unknown role: tool" in str(exc.value)


def test_text_parts_are_joined_with_newlines_and_null_content_is_empty() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, "two"]},
                {"role": "assistant", "content": None}]
    assert render("{% for m in messages %}[{{ m.content }}]{% endfor %}", messages) == \
        "[one\ntwo][]"


def test_other_message_keys_reach_the_template() -> None:
    messages = [{"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"}]
    out = render("{% for m in messages %}{{ m.name }}/{{ m.tool_call_id }}={{ m.content }}"
                 "{% endfor %}", messages)
    assert out == "add/c1=4"


def test_special_tokens_generation_prompt_and_extra_kwargs_are_variables() -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|" \
               "{{ tools }}|{{ who }}"
    assert render(template, who="Marta") == "<s>|</s>|<pad>|True|None|Marta"
    assert render(template, add_generation_prompt=False, bos_token="B", tools=[1]) == \
        "B|</s>|<pad>|False|[1]|"


def test_blocks_are_trimmed_as_transformers_trims_them() -> None:
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n" \
               "    {% endif %}\n{% endfor %}\nend\n"
    assert render(template) == "U: hi\nend"


def test_tojson_keeps_non_ascii_and_html_and_takes_json_dumps_options() -> None:
    messages = [{"role": "user", "content": "<é & 茶>"}]
    assert render("{{ messages[0].content | tojson }}", messages) == '"<é & 茶>"'
    assert render("{{ {'b': 1, 'a': [2]} | tojson(indent=1, sort_keys=True) }}") == \
        json.dumps({"a": [2], "b": 1}, indent=1)
    assert render("{{ [1, 2] | tojson(separators=(',', ':')) }}") == "[1,2]"


def test_loop_controls_generation_blocks_and_strftime_now_work() -> None:
    messages = [{"role": "user", "content": str(i)} for i in range(5)]
    template = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}" \
               "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}" \
               "{{ strftime_now('%Y') | length }}"
    assert render(template, messages) == "014"


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
    "{{ ''.__class__.__subclasses__() }}",
])
def test_the_sandbox_refuses_unsafe_access(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="line 1"):
        render(template)


def test_a_template_that_does_not_parse_names_the_line() -> None:
    template = "{{ bos_token }}\n{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    with pytest.raises(ChatTemplateError) as exc:
        render(template)
    assert exc.value.line == 3
    assert "syntax error at line 3 ({{ m.content }): " in str(exc.value)


def test_a_template_that_fails_while_rendering_names_the_line_and_the_error() -> None:
    template = "{% for m in messages %}\n{% set x = 1 %}\n{{ m.content + x }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError) as exc:
        render(template)
    assert exc.value.line == 3
    assert "at line 3 ({{ m.content + x }}): TypeError: " in str(exc.value)
    with pytest.raises(ChatTemplateError, match=r"at line 2 .*'dict object' has no attr"):
        render("ok\n{{ messages[0].missing.deeper }}")


def test_a_macro_that_raises_names_the_line_of_the_raise() -> None:
    template = "{% macro check(m) %}\n{% if m.role != 'system' %}\n" \
               "{{ raise_exception('system first, not ' + m.role) }}\n{% endif %}\n" \
               "{% endmacro %}\n{{ check(messages[0]) }}"
    with pytest.raises(ChatTemplateError) as exc:
        render(template)
    assert exc.value.line == 3 and str(exc.value).endswith("system first, not user")


def test_each_template_source_is_compiled_once() -> None:
    source = "{{ messages | length }} cached"
    assert compile_template(source) is compile_template(source)
    assert render(source) == "1 cached"


def test_a_folder_without_a_template_says_so(tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_model_dir(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.apply_chat_template(USER)
    assert tok.apply_chat_template(USER, chat_template="{{ messages[0].content }}!") == "hi!"


def test_chat_template_jinja_wins_over_the_config_and_chat_template_json_is_the_fallback(
        tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    (folder / "chat_template.jinja").write_text("jinja:{{ messages[0].content }}")
    assert Tokenizer.from_model_dir(folder).apply_chat_template(USER) == "jinja:hi"
    (folder / "chat_template.jinja").unlink()
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ 1 }}"}))
    assert Tokenizer.from_model_dir(folder).apply_chat_template(USER) == "json:1"


def test_named_templates_default_tool_use_and_by_name(tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    edit_json(folder / "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"},
        {"name": "rag", "template": "R"}])
    tok = Tokenizer.from_model_dir(folder)
    assert tok.chat_template == "D"
    assert tok.apply_chat_template(USER) == "D"
    assert tok.apply_chat_template(USER, tools=[{"name": "f"}]) == "T"
    assert tok.apply_chat_template(USER, chat_template="rag") == "R"
    assert tok.apply_chat_template(USER, chat_template="{{ 'src' }}") == "src"
    edit_json(folder / "tokenizer_config.json", chat_template=[{"name": "rag", "template": "R"}])
    tok = Tokenizer.from_model_dir(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match=r"none named 'default'.*\['rag'\]"):
        tok.apply_chat_template(USER)


def test_additional_chat_templates_are_named_by_file(tmp_path: Path) -> None:
    folder = copy_bundled(tmp_path)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "short.jinja").write_text("S")
    (folder / "chat_template.jinja").write_text("J")
    tok = Tokenizer.from_model_dir(folder)
    assert (tok.chat_template, tok.apply_chat_template(USER, chat_template="short")) == ("J", "S")


@pytest.mark.parametrize(("messages", "field", "text"), [
    ("hi", "messages", "must be a list of message objects"),
    ({"role": "user"}, "messages", "must be a list"),
    ([], "messages", "at least one message"),
    (["hi"], "messages[0]", "must be an object"),
    ([{"content": "x"}], "messages[0].role", "is missing"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     "messages[1].role", "must be one of system, developer, user, assistant, tool, not 'robot'"),
    ([{"role": "user", "content": 7}], "messages[0].content", "must be a string, a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]", "only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}],
     "messages[0].content[0]", "only text parts"),
])
def test_malformed_messages_name_the_field(messages: Any, field: str, text: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        bundled_tokenizer().apply_chat_template(messages)
    assert exc.value.field == field
    assert text in exc.value.message
