"""``anyio-genout run`` as a user runs it: bad input lines, --strict, metrics over HTTP."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .support import CLI, cli, free_port, read_results, request_line, write_lines

BAD_JSON_LINE = 50
BAD_PARAM_LINE = 120


def two_hundred_lines(path: Path) -> tuple[Path, dict[str, int]]:
    """200 request lines: line 50 is not JSON, line 120 has temperature -1.

    Returns the file and the ``max_tokens`` of every valid request by id.
    """
    lines: list[str] = []
    valid: dict[str, int] = {}
    for number in range(1, 201):
        rid = f"req-{number:03d}"
        max_tokens = 4 + number % 13
        if number == BAD_JSON_LINE:
            lines.append('{"request_id": "req-050", "prompt_token_ids": [1, 2')
            continue
        if number == BAD_PARAM_LINE:
            lines.append(request_line(rid, [7, 8], max_tokens=4, temperature=-1))
            continue
        # A mix of greedy, seeded and unseeded sampling; ignore_eos keeps lengths exact.
        extra = ({"temperature": 0.0} if number % 3 == 0 else
                 {"temperature": 0.8, "seed": number} if number % 3 == 1 else
                 {"temperature": 1.0, "top_p": 0.9})
        lines.append(request_line(rid, [1 + number % 50, 2, 3, number], max_tokens=max_tokens,
                                  ignore_eos=True, **extra))
        valid[rid] = max_tokens
    return write_lines(path, lines), valid


def test_run_skips_bad_lines_and_writes_one_result_per_valid_request(tmp_path: Path) -> None:
    requests, valid = two_hundred_lines(tmp_path / "requests.jsonl")
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--concurrency", "16")
    assert done.returncode == 1, done.stderr  # input lines were skipped
    assert "Traceback" not in done.stderr
    problems = [line for line in done.stderr.splitlines() if re.match(r"anyio-genout: line ",
                                                                       line)]
    assert len(problems) == 2, done.stderr
    assert problems[0].startswith(f"anyio-genout: line {BAD_JSON_LINE}: not valid JSON")
    assert problems[1].startswith(f"anyio-genout: line {BAD_PARAM_LINE}: ")
    assert "temperature" in problems[1]
    # The closing line counts the skipped lines, agreeing with the exit code.
    assert done.stderr.strip().splitlines()[-1].startswith(
        "anyio-genout: 198/200 done, 0 failed, 2 skipped, ")

    lines = read_results(results)
    assert len(lines) == 198
    by_id = {line["request_id"]: line for line in lines}
    assert by_id.keys() == valid.keys()  # exactly one line per valid request
    for rid, result in by_id.items():
        assert "error" not in result, result
        assert result["finish_reason"] == "length"
        assert len(result["token_ids"]) == valid[rid]
        assert result["usage"]["output_tokens"] == valid[rid]
        assert result["usage"]["prompt_tokens"] == 4
        assert isinstance(result["ttft"], float) and result["ttft"] >= 0
        assert result["e2e_latency"] >= result["ttft"]


def test_run_with_only_valid_lines_exits_0(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(f"r{i}", [1, 2, i], max_tokens=3, ignore_eos=True)
                            for i in range(10)])
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert sorted(r["request_id"] for r in read_results(results)) == sorted(
        f"r{i}" for i in range(10))
    # Running again rewrites the file: no duplicated request ids.
    again = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert len(read_results(results)) == 10


def test_strict_refuses_to_start(tmp_path: Path) -> None:
    requests, _ = two_hundred_lines(tmp_path / "requests.jsonl")
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--strict")
    assert done.returncode == 2
    assert f"line {BAD_JSON_LINE}:" in done.stderr and f"line {BAD_PARAM_LINE}:" in done.stderr
    assert "nothing was run (--strict)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not results.exists() or results.read_text() == ""


def test_a_missing_input_file_is_a_one_line_usage_error_exit_2(tmp_path: Path) -> None:
    """The help says usage errors exit 2: a missing input file is one (it exited 1)."""
    done = cli("run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"anyio-genout: error: cannot read the input file {tmp_path / 'missing.jsonl'}: "
        "No such file or directory"]
    assert not (tmp_path / "out.jsonl").exists()  # nothing started


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return None


def test_metrics_port_serves_prometheus_while_running(tmp_path: Path) -> None:
    # A slow embedded mock (10 ms steps, 100 tokens a request) keeps the run going ~6 s.
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line(f"r{i}", [1, 2, i], max_tokens=100, ignore_eos=True)
                            for i in range(64)])
    port = free_port()
    process = subprocess.Popen(
        [*CLI, "run", str(requests), "-o", str(tmp_path / "out.jsonl"), "--concurrency", "16",
         "--mock-step-time", "0.01", "--metrics-port", str(port), "--no-progress"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        finished = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="length"'
                              r"[^}]*\} ([1-9][0-9]*)\.0$", re.MULTILINE)
        text = None
        deadline = time.monotonic() + 15
        for _ in range(300):  # bounded: at most 300 scrapes of 127.0.0.1, within 15 s
            if time.monotonic() > deadline or process.poll() is not None:
                break
            text = scrape(port)
            if text is not None and finished.search(text):
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before the metrics were seen"
        assert text is not None, "nothing answered on the metrics port"
        assert "vllm:request_success_total" in text
        assert finished.search(text), text
        assert "vllm:time_to_first_token_seconds" in text
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert scrape(port) is None  # the server stopped with the run


def test_each_kind_of_bad_line_is_reported_with_its_number(tmp_path: Path) -> None:
    bad = ["[1, 2]",
           '{"request_id": "e", "prompt_token_ids": []}',
           '{"request_id": "s", "prompt_token_ids": [1], "sampling_params": {"bogus": 1}}',
           '{"request_id": "x", "prompt_token_ids": [1], "extra": 1}',
           '{"request_id": "ok", "prompt_token_ids": [1]}',  # a duplicate id
           '{"request_id": "t", "prompt_token_ids": [1, -2]}']
    requests = write_lines(tmp_path / "requests.jsonl",
                           [request_line("ok", [1, 2], max_tokens=2), "", *bad])
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert done.returncode == 1, done.stderr
    reported = [line for line in done.stderr.splitlines()
                if line.startswith("anyio-genout: line ")]
    assert [line.split(":")[1] for line in reported] == [
        f" line {n}" for n in range(3, 3 + len(bad))]  # the blank line 2 is not an error
    assert "bogus" in reported[2] and "extra" in reported[3] and "'ok'" in reported[4]
    assert "Traceback" not in done.stderr
    assert [line["request_id"] for line in read_results(results)] == ["ok"]
