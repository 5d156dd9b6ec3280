"""The examples, run as a user runs them, on the embedded default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_long_document_qa_finds_the_key_it_hid(gemma_model):
    """examples/long_document_qa.py hides a pass key in the GPL-3 text (~7,600 tokens), reads it through 256 cells
    with the question guiding what is kept, and scores the answer: the known answer is the key given (not its
    default, so nothing rests on one number), and the text went through the budget, not around it."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "long_document_qa.py"), "--key", "58213"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"answer: '58213\b.*\(correct: the key is 58213\)", proc.stdout), proc.stdout
    seen, used, budget = map(int, re.search(r"\[(\d+) tokens read through (\d+)/(\d+) cells", proc.stderr).groups())
    assert seen > 7000 and used <= budget == 256
