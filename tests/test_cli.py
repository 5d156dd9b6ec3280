"""The command line as a user meets it: real processes, exit codes, one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys


def ahakv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ahakv_local", *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.match(pattern, lines[0]), lines[0]


def test_missing_model_file(tmp_path):
    assert_one_line_error(ahakv("run", str(tmp_path / "nope.gguf")), r"error: model file not found: .*nope\.gguf")


def test_not_a_gguf(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert_one_line_error(ahakv("run", str(text)), r"error: not a GGUF file: .*notes\.gguf")


def test_budget_too_small(fixture_model):
    assert_one_line_error(ahakv("run", str(fixture_model), "--budget", "3"), r"error: --budget must be at least 8")


def test_run_holds_the_budget_and_reports(fixture_model):
    proc = ahakv("run", str(fixture_model), "-p", "the quick brown fox " * 8, "-n", "40", "--budget", "16")
    assert proc.returncode == 0, proc.stderr
    m = re.search(
        r"generated (\d+) tok at [\d.]+ t/s \| cache (\d+)/(\d+) cells, [\d.]+ MiB KV \| evicted (\d+)", proc.stderr
    )
    assert m, proc.stderr
    generated, used, _cells, evicted = map(int, m.groups())
    assert generated == 40
    assert used <= 16 + 1  # the budget, plus the token decoded after the last eviction
    assert evicted > 0


def test_build_is_a_no_op_when_up_to_date():
    proc = ahakv("build")
    assert proc.returncode == 0 and "engine up to date" in proc.stdout
