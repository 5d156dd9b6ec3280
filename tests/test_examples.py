"""The examples, run as a user runs them, on the embedded default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# an 8-digit key: the answer's 8 tokens cut it to 7 digits (Gemma writes one token a digit), always "wrong"
@pytest.mark.parametrize("depth, key", [(0.2, "58213"), (0.8, "58213946")])
def test_long_document_qa_finds_the_key_it_hid(gemma_model, license_text, tmp_path, depth, key):
    """examples/long_document_qa.py hides a pass key in a document, reads it through 256 cells with the question
    guiding what is kept, and scores the answer: the known answer is the key given (not the example's default).
    The document is GPL-3's first ~1,900 tokens (8x over the budget, where the suite's guided AhaKV finds the key
    at every depth and keeps about half of its sentence on an AVX2-only AMD EPYC too: test_query_reading.py), not
    the whole text at 30x that the example reads by default; the text went through the budget, not around it."""
    document = tmp_path / "gpl3-start.txt"
    document.write_text(license_text[: license_text.rfind("\n\n", 0, 8500)])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "long_document_qa.py"), "--document", str(document),
         "--key", key, "--depth", str(depth)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(rf"answer: '{key}\b.*\(correct: the key is {key}\)", proc.stdout), proc.stdout
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


def test_chat_app_quits_on_ctrl_c_without_a_traceback():
    """Ctrl-C at the prompt, the first key a new user presses to quit, was a KeyboardInterrupt traceback. The child
    takes SIGINT whatever its parent ignores (a CI run started in the background ignores it)."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "chat_app.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        prompt, deadline = "", time.monotonic() + 300
        while not prompt.endswith("you> ") and time.monotonic() < deadline:  # the model is loaded, input awaited
            prompt += proc.stdout.read(1)
        assert prompt.endswith("you> "), prompt
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--document", "/nonexistent"], "cannot read /nonexistent: No such file or directory"),
        (["--budget", "0"], "budget must be a positive whole number"),
        (["--depth", "3"], "--depth is a fraction of the paragraphs, from 0 to 1, not 3.0"),
        (["--key", "12.5"], "--key must be a number, not '12.5'"),
    ],
)
def test_long_document_qa_refuses_a_bad_argument_in_one_line(args, message):
    """A missing document or a budget of 0 was a traceback and exit 1, the status of a wrong answer; a depth of 3 put
    the key at the end and passed; a key that is not a number could never be scored right."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "long_document_qa.py"), *args], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # one line, as its docstring says (argparse's usage came first)
    assert line.startswith(f"long_document_qa.py: error: {message}"), proc.stderr


def test_attention_tap_scores_the_prompts_last_rows_and_evicts_to_its_budget():
    """examples/attention_tap.py: the tap on for the prompt's last 32 rows only (it summed 32 rows of every n_batch
    call: 64 rows from two places on GPL-3's first 3,000 characters), the cache evicted to 256 cells."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "attention_tap.py")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    said = re.search(r"(\d+) query rows scored (\d+) prompt tokens, evicted (\d+), cache now (\d+) cells", proc.stdout)
    assert said, proc.stdout
    rows, n, freed, used = map(int, said.groups())
    assert rows == 32 and used == 256 and freed == n - 256


SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_name_a_script_takes_from_the_package_is_there(script):
    """A benchmark or an example imports names from ahakv_local that a change of the package can move (LICENSES
    left longdoc.py for textfile.py, and frontier_merge.py failed to start, through benchmarks/common.py): every
    ``from ahakv_local.X import Y`` of each script names a module and a name that exist, read without running it."""
    import ast
    import importlib

    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ahakv_local":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{script.name}: {node.module} has no {alias.name}"
                )
