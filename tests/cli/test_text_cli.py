"""The command line with text, as a user runs it: ``generate --prompt/--chat`` streams readable
text from the embedded mock (the shipped tokenizer, the mock continuing the shipped corpus),
``--stop`` cuts it, ``run`` takes text lines and writes the text of each result."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from anyio_genout.cli.text_model import mock_model
from anyio_genout.mock import tokens
from anyio_genout.text.bundled import bundled_corpus, bundled_model_dir, bundled_tokenizer

from .support import COMMAND_TIMEOUT, cli, read_results, write_lines

PROMPT = "Once upon a time"
SUMMARY = re.compile(r"^finish_reason=(\S+) prompt_tokens=(\d+) output_tokens=(\d+) ")


def summary(stderr: str) -> re.Match[str]:
    match = SUMMARY.match(stderr.strip().splitlines()[-1])
    assert match, stderr
    return match


def predicted_text(prompt_ids: list[int], count: int) -> str:
    """What the CLI's embedded mock generates greedily (its EOS draws included), as text."""
    tok = bundled_tokenizer()
    model = mock_model(tok)
    ids = tokens.generate(tokens.stream_key(prompt_ids, greedy=True), 0, count,
                          model.vocab_size, eos_token_id=tok.eos_token_id,
                          eos_probability=1 / 256, corpus=model.corpus,
                          starts=model.corpus_starts)
    if tok.eos_token_id in ids:
        ids = ids[:ids.index(tok.eos_token_id)]
    return tok.decode(ids)


def test_readme_first_command_prints_readable_text() -> None:
    """``anyio-genout generate --prompt "Once upon a time" --max-tokens 32``, verbatim."""
    script = Path(sys.executable).with_name("anyio-genout")
    found = str(script) if script.exists() else shutil.which("anyio-genout")
    command = [found] if found is not None else [sys.executable, "-m", "anyio_genout"]
    done = subprocess.run([*command, "generate", "--prompt", PROMPT, "--max-tokens", "32"],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr
    text = done.stdout.removesuffix("\n")
    assert text == predicted_text(bundled_tokenizer().encode(PROMPT), 32)
    assert len(text.split()) >= 10 and text.strip() in bundled_corpus()  # words, not ids
    match = summary(done.stderr)
    assert match[1] == "length" and match[3] == "32"
    assert int(match[2]) == len(bundled_tokenizer().encode(PROMPT))


def test_stop_cuts_the_text_and_the_summary_names_the_string() -> None:
    full = predicted_text(bundled_tokenizer().encode(PROMPT), 32)
    stop = full.split()[6]
    done = cli("generate", "--prompt", PROMPT, "--max-tokens", "32", "--stop", stop,
               "--stop", "@@never@@")
    assert done.returncode == 0, done.stderr
    assert done.stdout.removesuffix("\n") == full[:full.index(stop)]
    assert summary(done.stderr)[1] == f"stop({stop!r})"
    kept = cli("generate", "--prompt", PROMPT, "--max-tokens", "32", "--stop", stop,
               "--include-stop-str-in-output")
    assert kept.stdout.removesuffix("\n") == full[:full.index(stop) + len(stop)]


def test_chat_goes_through_the_template_of_the_shipped_folder() -> None:
    tok = bundled_tokenizer()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    done = cli("generate", "--system", "Be brief.", "--chat", "Hello", "--max-tokens", "16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.removesuffix("\n") == predicted_text(ids, 16)
    assert int(summary(done.stderr)[2]) == len(ids)


def test_token_ids_stay_token_ids_unless_a_model_is_given() -> None:
    plain = cli("generate", "--prompt-token-ids", "5,6,7", "--max-tokens", "6")
    assert plain.returncode == 0, plain.stderr
    assert len([int(t) for t in plain.stdout.split()]) == 6  # ids, as ever
    text = cli("generate", "--prompt-token-ids", "5,6,7", "--max-tokens", "6",
               "--model", str(bundled_model_dir()))
    assert text.returncode == 0, text.stderr
    assert text.stdout.removesuffix("\n") == predicted_text([5, 6, 7], 6)


def test_logprobs_lines_show_each_tokens_text() -> None:
    done = cli("generate", "--prompt", PROMPT, "--max-tokens", "5", "--logprobs", "1")
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert len(rows) == 5 and all(len(row) == 5 for row in rows)
    strings = bundled_tokenizer().token_strings([int(row[0]) for row in rows])
    assert [json.loads(row[4]) for row in rows] == strings


@pytest.mark.parametrize(("argv", "says"), [
    (["--prompt-token-ids", "1,2", "--stop", "x"], "--stop works on text"),
    (["--prompt", "x", "--model", "{tmp}"], "ModelFolderError: no fast tokenizer"),
    (["--prompt", "x", "--handshake-address", "tcp://127.0.0.1:9"], "needs a tokenizer"),
    (["--system", "x", "--prompt", "y"], "--system goes with --chat"),
])
def test_text_usage_errors_are_one_line_and_exit_2(argv: list[str], says: str,
                                                   tmp_path: Path) -> None:
    done = cli("generate", *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert done.stdout == ""


def test_run_takes_text_lines_and_writes_their_text(tmp_path: Path) -> None:
    tok = bundled_tokenizer()
    full = predicted_text(tok.encode(PROMPT), 24)
    stop = full.split()[4]
    lines = [
        json.dumps({"request_id": "prompt", "prompt": PROMPT,
                    "sampling_params": {"max_tokens": 24, "temperature": 0.0}}),
        json.dumps({"request_id": "stop", "prompt": PROMPT,
                    "sampling_params": {"max_tokens": 24, "temperature": 0.0,
                                        "stop": [stop]}}),
        json.dumps({"request_id": "chat", "messages": [{"role": "user", "content": "Hi"}],
                    "sampling_params": {"max_tokens": 8, "temperature": 0.0}}),
        json.dumps({"request_id": "ids", "prompt_token_ids": [5, 6, 7],
                    "sampling_params": {"max_tokens": 6, "temperature": 0.0}}),
        json.dumps({"request_id": "bad", "prompt": PROMPT, "messages": []}),
    ]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert done.returncode == 1, done.stderr  # the bad line was skipped
    assert "line 5: invalid request: messages: give exactly one of" in done.stderr
    by_id = {r["request_id"]: r for r in read_results(results)}
    assert sorted(by_id) == ["chat", "ids", "prompt", "stop"]
    assert by_id["prompt"]["text"] == full and by_id["prompt"]["finish_reason"] == "length"
    assert by_id["prompt"]["usage"]["prompt_tokens"] == len(tok.encode(PROMPT))
    assert by_id["stop"]["text"] == full[:full.index(stop)]
    assert (by_id["stop"]["finish_reason"], by_id["stop"]["stop_reason"]) == ("stop", stop)
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]),
                          add_special_tokens=False)
    assert by_id["chat"]["text"] == predicted_text(chat_ids, 8)
    assert by_id["ids"]["text"] == tok.decode(by_id["ids"]["token_ids"])
    for result in by_id.values():
        assert tok.decode(result["token_ids"]).startswith(result["text"])


def test_run_without_a_tokenizer_refuses_text_lines_up_front(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", [
        json.dumps({"request_id": "t", "prompt": PROMPT}),
        json.dumps({"request_id": "s", "prompt_token_ids": [1],
                    "sampling_params": {"stop": ["x"]}})])
    done = cli("run", str(requests), "-o", str(tmp_path / "out.jsonl"), "--strict",
               "--handshake-address", "tcp://127.0.0.1:9")
    assert done.returncode == 2, done.stderr
    assert "line 1: invalid request: prompt: needs a tokenizer" in done.stderr
    assert "line 2: invalid request: stop: needs a tokenizer" in done.stderr
