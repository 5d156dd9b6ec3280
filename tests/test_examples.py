"""The examples, run as a user runs them, on the embedded default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("depth", [0.2, 0.8])
def test_long_document_qa_finds_the_key_it_hid(gemma_model, license_text, tmp_path, depth):
    """examples/long_document_qa.py hides a pass key in a document, reads it through 256 cells with the question
    guiding what is kept, and scores the answer: the known answer is the key given (not the example's default).
    The document is GPL-3's first ~1,900 tokens (8x over the budget, where the suite's guided AhaKV finds the key
    at every depth and keeps about half of its sentence on an AVX2-only AMD EPYC too: test_query_reading.py), not
    the whole text at 30x that the example reads by default; the text went through the budget, not around it."""
    document = tmp_path / "gpl3-start.txt"
    document.write_text(license_text[: license_text.rfind("\n\n", 0, 8500)])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "long_document_qa.py"), "--document", str(document),
         "--key", "58213", "--depth", str(depth)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"answer: '58213\b.*\(correct: the key is 58213\)", proc.stdout), proc.stdout
    seen, used, budget = map(int, re.search(r"\[(\d+) tokens read through (\d+)/(\d+) cells", proc.stderr).groups())
    assert seen > 1800 and used <= budget == 256


def test_chat_app_answers_and_ends_with_its_input():
    """examples/chat_app.py: one turn through the 512-cell cache, then the input's end quits (an EOFError traceback
    before)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "chat_app.py")],
        input="Name a colour.\n", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    used, budget, seen = map(int, re.search(r"\[cache (\d+)/(\d+) cells, (\d+) tokens seen", proc.stdout).groups())
    assert budget == 512 and used == seen > 0  # one short turn: nothing evicted yet
