"""The passkey task: its prompt, its scoring, and the real model solving it with the full cache."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.needle import INTRO, NEEDLE, QUESTION, answer_key, build_prompt, run_needle
from ahakv_local.session import SessionSpec


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_the_length_and_the_key_at_its_depth(gemma_model, license_text, depth):
    with Engine(gemma_model, EngineConfig(n_ctx=256)) as e:
        filler = e.tokenize(license_text, add_bos=False)
        prompt = build_prompt(e, filler, 700, depth, "48213")
        needle = e.tokenize(NEEDLE.format(key="48213"), add_bos=False)
        head = len(e.tokenize(INTRO, add_bos=True))
        tail = len(e.tokenize(QUESTION, add_bos=False))
        text = e.detokenize(prompt)
    assert len(prompt) == 700
    starts = [i for i in range(len(prompt)) if prompt[i : i + len(needle)] == needle]
    assert len(starts) == 1
    assert text.count("48213") == 2 and text.rstrip().endswith("The pass key is")
    # the needle sits after the intro and `depth` of the filler (rounded to a token): exactly there
    assert starts[0] == head + round(depth * (len(prompt) - head - len(needle) - tail))
    assert text.startswith("There is an important") and license_text[:200].split()[0] in text


def test_answer_scoring():
    assert answer_key(" 48213. Remember") == "48213"
    assert answer_key(" forty") is None
    assert answer_key("48 213") == "48"


def test_gemma_finds_the_key_with_the_full_cache(gemma_model, license_text):
    trials = run_needle(gemma_model, license_text, [1024], [0.1, 0.5, 0.9], [SessionSpec()], trials=2, seed=1)
    assert len(trials) == 6 and all(t.max_cells >= 1024 for t in trials)
    assert all(t.solved for t in trials), [(t.depth, t.key, t.answer) for t in trials]


def test_eval_needle_command_writes_every_output(fixture_model, tmp_path):
    out = tmp_path / "needle"
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "eval", "needle", str(fixture_model), "--lengths", "300,400",
         "--depths", "0.5", "--budgets", "64", "--policies", "h2o,ahakv", "--recent", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"AHAKV_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    # how it was run, threads and workers included (ppl and needle kept neither)
    assert data["config"]["command"].endswith("eval needle")
    assert (data["config"]["options"]["threads"], data["config"]["options"]["rpc"]) == (1, None)
    rows = data["results"]
    assert [(r["label"], r["budget"], r["length"]) for r in rows] == [
        ("full", "full cache", 300), ("full", "full cache", 400), ("h2o@64", "64 cells", 300),
        ("h2o@64", "64 cells", 400), ("ahakv@64", "64 cells", 300), ("ahakv@64", "64 cells", 400),
    ]  # fmt: skip
    # the cache holds the budget plus at most one prompt chunk (64 tokens) before each compression
    assert all(r["max_cells"] <= 64 + 64 for r in rows if r["label"] != "full")
    assert data["config"]["model_sha256"]
    # (read as CSV: a random model's answer may hold a line break, quoted in its field)
    with (out / "results.csv").open(newline="") as f:
        assert [(r["label"], r["key"]) for r in csv.DictReader(f)] == [(r["label"], r["key"]) for r in rows]
    assert "| ahakv | 64 cells |" in (out / "results.md").read_text()


def test_an_item_has_its_key_whatever_else_the_run_asks(fixture_model, license_text):
    """Keys were drawn in the grid's order: reversing --depths, or adding a length, hid another key at the same
    length and depth, so a narrower rerun of one item measured another. Each item's key now comes from the item."""
    from ahakv_local.needle import run_needle
    from ahakv_local.session import SessionSpec

    def keys(lengths: list[int], depths: list[float], trials: int = 1) -> dict:
        runs = run_needle(fixture_model, license_text, lengths, depths, [SessionSpec()], trials=trials, n_threads=1)
        first = {}  # (length, depth): the key of its first trial
        for r in runs:
            first.setdefault((r.length, r.depth), r.key)
        return first

    wide = keys([300, 400], [0.1, 0.9], trials=2)
    assert keys([400], [0.9, 0.1]) == {(400, 0.9): wide[400, 0.9], (400, 0.1): wide[400, 0.1]}
    assert len(set(wide.values())) == 4 and all(k.isdigit() and len(k) == 5 for k in wide.values())


def test_max_cells_is_the_most_the_cache_held(fixture_model, license_text, monkeypatch):
    """max_cells was read after each prompt call, once its eviction had taken the cache back: a 64-token chunk on
    top of the budget never showed. The reference: llama.cpp's own count of cells in use after every decode."""
    held = []
    decode = Engine.decode

    def counted(self, tokens, all_logits=False):
        rows = decode(self, tokens, all_logits)
        held.append(self.n_used())
        return rows

    monkeypatch.setattr(Engine, "decode", counted)
    [trial] = run_needle(fixture_model, license_text, [400], [0.5], [SessionSpec.bounded("h2o", 96)], n_threads=1)
    assert trial.max_cells == max(held) > 96 + 1  # a chunk on top of what an eviction keeps


def test_a_budget_that_holds_a_length_s_prompt_is_not_run_there(fixture_model, license_text, tmp_path):
    """``--lengths 256,1024 --budgets 512``: the 512-cell budget held every 256-token prompt, evicted nothing, and its
    cell of the table was the full cache's under the budget's name (max_cells the full cache's). It is run only where
    it evicts; that cell is blank, the full cache's row beside it."""
    from ahakv_local.needle import accuracy_table, run_needle
    from ahakv_local.session import SessionSpec

    specs = [SessionSpec(), SessionSpec.bounded("streaming", 512, n_recent=8)]
    progress = []
    runs = run_needle(
        fixture_model, license_text, [256, 1024], [0.5], specs, n_threads=1, progress=lambda d, t: progress.append(t)
    )
    assert sorted((r.policy, r.length) for r in runs) == [("full", 256), ("full", 1024), ("streaming", 1024)]
    assert set(progress) == {3}  # the runs made, not the grid
    bounded = next(r for r in runs if r.policy == "streaming")
    assert bounded.max_cells < 1024  # evicting
    row = next(line for line in accuracy_table(runs) if line.startswith("| streaming"))
    assert row.split("|")[3].strip() == ""  # the 256-token column


def test_the_command_s_bar_counts_the_runs_made(fixture_model, license_text, tmp_path, monkeypatch):
    """The bar's total was the grid's (12 trials) where the run skips a budget that holds a length's prompt: it
    stopped at 10/12. It takes the run's own count (``run_needle``'s progress, checked above)."""
    from click.testing import CliRunner

    from ahakv_local import cli_eval
    from ahakv_local.cli import main

    bars = []
    make_bar = cli_eval._bar
    monkeypatch.setattr(cli_eval, "_bar", lambda *a, **k: bars.append(make_bar(*a, **k)) or bars[-1])
    filler = tmp_path / "filler.txt"
    filler.write_text(license_text)
    args = [
        "eval", "needle", str(fixture_model), "--filler", str(filler), "--lengths", "256,1024", "--depths", "0,1",
        "--budgets", "200,512", "--policies", "streaming", "--recent", "8", "-t", "1", "--out", str(tmp_path / "o"),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    # the full cache at 2 lengths x 2 depths, 200 cells at both lengths, 512 at 1024 only: 10
    [bar] = bars
    assert bar.n == bar.total == 10
