"""The long-document suite: its prompts (exact lengths, every hidden sentence at its depth, the answer
recoverable from the text), its scoring, the command on the fixture and the real model's full cache."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ahakv_local.budget import NO_EVICTION, Budget, guide_room
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.fixture import FixtureSpec
from ahakv_local.longdoc import (
    INTROS,
    TASKS,
    Filler,
    LongdocTrial,
    accuracy_table,
    default_filler_files,
    make_item,
    parse_compressions,
    run_longdoc,
    score_answer,
    specs_rule,
)
from ahakv_local.models import file_sha256, fixture_path
from ahakv_local.session import SessionSpec


@pytest.fixture(scope="module")
def gemma_tokens(gemma_model):
    """A Gemma engine for tokenizing, and the default filler."""
    texts = [p.read_text(encoding="utf-8") for p in default_filler_files()]
    with Engine(gemma_model, EngineConfig(n_ctx=256)) as e:
        yield e, Filler(e, texts)


def answer_from_text(task: str, text: str, question: str) -> tuple[str, ...]:
    """The answer, worked out from the prompt's text alone (independently of the generator's bookkeeping)."""
    if task == "single":
        return tuple(dict.fromkeys(re.findall(r"The pass key is (\d+)\.", text)))
    if task == "multikey":
        name = re.search(r"pass key of (\w+)\?", question).group(1)
        return tuple(dict.fromkeys(re.findall(rf"The pass key of {name} is (\d+)\.", text)))
    if task == "multivalue":
        name = re.search(r"pass keys of (\w+)\?", question).group(1)
        return tuple(sorted(re.findall(rf"One of the pass keys of {name} is (\d+)\.", text)))
    if task == "vartrack":
        value = re.search(r"the value (\d+)\?", question).group(1)
        holds: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})\.", text):
            holds[name] = holds[rhs[4:]] if rhs.startswith("VAR ") else rhs  # in reading order
        return tuple(n for n, v in holds.items() if v == value)
    subject = re.search(r"What is the (.+)\?", question).group(1)
    return tuple(re.findall(rf"The {subject} is (\w+)\.", text))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [600, 1500])
def test_items_have_the_length_the_sentences_at_their_depths_and_the_question_last(gemma_tokens, task, length):
    e, filler = gemma_tokens
    for depth in (0.0, 0.4, 1.0):
        item = make_item(e, filler, task, length, depth, seed=7)
        assert len(item.prompt) == length and item.prompt[0] == e.tokenize("")[0]  # BOS
        text = e.detokenize(item.prompt)
        question = e.detokenize(item.question)
        # the question's own tokens sit just before the answer prefix, at the very end
        tail = item.prompt[-len(item.question) - 20 :]
        assert any(tail[i : i + len(item.question)] == item.question for i in range(20 + 1))
        assert question.startswith("\n\nWh") and "?" in question and question.strip() in text[-160:]
        assert text.rstrip().endswith((" is", " is number", " are:", " are VAR"))
        # every hidden sentence once, after `depth` of the filler (the intro, the sentences and the question
        # with its answer prefix are the only tokens that are not filler)
        head = len(e.tokenize(INTROS[task]))
        pieces = [e.tokenize(f"\n\n{s}\n\n", add_bos=False) for s in item.sentences]
        q_end = max(i for i in range(length) if item.prompt[i - len(item.question) : i] == item.question)
        n_fill = length - head - sum(map(len, pieces)) - len(item.question) - (length - q_end)
        starts = []
        for piece in pieces:
            found = [i for i in range(length) if item.prompt[i : i + len(piece)] == piece]
            assert len(found) == 1
            starts.append(found[0])
        for start, d in zip(starts, item.depths, strict=True):
            before = start - head - sum(len(p) for s, p in zip(starts, pieces, strict=True) if s < start)
            assert before == pytest.approx(d * n_fill, abs=1)
        assert item.depth == item.depths[0]
        # the expected answer is what the text says
        expected = tuple(sorted(item.expected)) if task == "multivalue" else item.expected  # any order
        assert answer_from_text(task, text, question) == expected
        assert item.score(" ".join(item.expected)) == 1.0


def test_items_are_seeded_and_their_keys_distinct(gemma_tokens):
    e, filler = gemma_tokens
    a = make_item(e, filler, "multikey", 800, 0.5, seed=3)
    assert make_item(e, filler, "multikey", 800, 0.5, seed=3).prompt == a.prompt
    others = [make_item(e, filler, "multikey", 800, 0.5, seed=s) for s in (4, 5, 6)]
    assert all(o.prompt != a.prompt for o in others)
    assert len({o.expected for o in [a, *others]}) == 4
    for seed in range(5):
        keys = re.findall(r"\b\d{5}\b", " ".join(make_item(e, filler, "multikey", 800, 0.5, seed=seed).sentences))
        assert len(set(keys)) == 4 and len(keys) == 4  # four people, a key each
        mv = make_item(e, filler, "multivalue", 800, 0.5, seed=seed)
        assert len(set(mv.expected)) == 3 and all(re.fullmatch(r"\d{5}", k) for k in mv.expected)
        vt = make_item(e, filler, "vartrack", 800, 0.5, seed=seed)
        names = re.findall(r"VAR ([A-Z]{5}) =", " ".join(vt.sentences))
        assert len(set(names)) == 8 and len(vt.expected) == 4


def test_a_vartrack_item_counts_its_decoy_chain_against_an_answer(gemma_tokens):
    e, filler = gemma_tokens
    item = make_item(e, filler, "vartrack", 800, 0.5, seed=0)
    decoys = sorted(set(re.findall(r"VAR ([A-Z]{5})", " ".join(item.sentences))) - set(item.expected))
    assert len(decoys) == 4
    assert item.score(" ".join(item.expected)) == 1.0
    assert item.score(" ".join([*item.expected, *decoys])) == 0.5  # every variable of the prompt
    assert item.score(" ".join([*item.expected, decoys[0]])) == 4 / 5


def test_a_length_too_short_or_a_filler_too_small_is_refused(gemma_tokens):
    e, filler = gemma_tokens
    with pytest.raises(ValueError, match="too short"):
        make_item(e, filler, "vartrack", 100, 0.5)
    with pytest.raises(ValueError, match="filler"):
        make_item(e, Filler(e, ["just a few words"]), "single", 600, 0.5)
    with pytest.raises(ValueError, match="unknown task"):
        make_item(e, filler, "summary", 600, 0.5)


def test_scoring():
    assert score_answer("single", ("48213",), "48213. Remember") == 1.0
    assert score_answer("single", ("48213",), "the key, 48213") == 1.0
    assert score_answer("single", ("48213",), "48 213") == 0.0
    assert score_answer("multikey", ("48213",), "51234, not 48213") == 0.0  # the first number counts
    assert score_answer("multivalue", ("11111", "22222", "33333"), "22222, 11111 and 44444.") == pytest.approx(2 / 3)
    assert score_answer("multivalue", ("11111", "22222", "33333"), "33333, 22222, 11111") == 1.0
    assert score_answer("multivalue", ("11111", "22222", "33333"), "111112") == 0.0
    assert score_answer("vartrack", ("ABCDE", "FGHIJ"), "VAR ABCDE and FGHIJK.") == 0.5
    assert score_answer("vartrack", ("ABCDE", "FGHIJ"), "FGHIJ, ABCDE") == 1.0
    # naming the decoy chain's variables too is not telling the chains apart (it scored 1)
    assert score_answer("vartrack", ("ABCDE", "FGHIJ"), "ABCDE, FGHIJ, KLMNO", wrong=("KLMNO", "PQRST")) == 2 / 3
    assert score_answer("vartrack", ("ABCDE", "FGHIJ"), "ABCDE FGHIJ KLMNO PQRST", wrong=("KLMNO", "PQRST")) == 0.5
    assert score_answer("fact", ("cinnamon",), "a Cinnamon.") == 1.0
    assert score_answer("fact", ("cinnamon",), "ginger, not cinnamon") == 0.0
    assert score_answer("fact", ("cinnamon",), "") == 0.0


def test_compressions_and_the_configurations_per_length():
    assert parse_compressions("4,8x, 2.5") == [4.0, 8.0, 2.5]
    for bad in ("0.5", "x", "inf", "-4"):
        with pytest.raises(ValueError):
            parse_compressions(bad)
    assert parse_compressions("4,4x,8") == [4.0, 8.0]  # each once: "4,4x" ran twice into one row
    # two factors labelled alike ran as two configurations whose rows merged into one
    with pytest.raises(ValueError, match="compressions 4.0 and 4.0000001 are both labelled 4x"):
        parse_compressions("4,4.0000001")
    rule = specs_rule(["h2o", "ahakv"], [4, 8], ["plain", "query"], n_sink=4, n_recent=16)
    specs = rule(2048)
    # h2o cannot be guided by a question, so it reads plainly once
    assert [s.label for s in specs] == [
        "full", "h2o@4x", "ahakv@4x", "ahakv@4x+query", "h2o@8x", "ahakv@8x", "ahakv@8x+query",
    ]  # fmt: skip
    assert specs[0] == SessionSpec()
    assert [s.budget for s in specs[1:]] == [Budget.parse(n) for n in (512, 512, 512, 256, 256, 256)]
    assert [s.reading for s in specs] == ["plain", "plain", "plain", "query", "plain", "plain", "query"]
    assert {s.n_recent for s in specs[1:]} == {16}
    assert [str(s.budget) for s in rule(1000)[1:3]] == ["250 cells", "250 cells"]
    # surprisal needs no question: every policy reads by it (h2o's was run plainly, or not at all when alone)
    read = specs_rule(["h2o", "ahakv"], [4], ["surprisal", "reconstruct"])(2048)
    assert [(s.label, s.reading) for s in read] == [
        ("full", "plain"), ("h2o@4x+surprisal", "surprisal"), ("h2o@4x", "plain"),
        ("ahakv@4x+surprisal", "surprisal"), ("ahakv@4x+reconstruct", "reconstruct"),
    ]  # fmt: skip
    # each configuration in each layout, named outside the shared pool; the cells are the layout's full layers'
    laid = specs_rule(["ahakv"], [8], ["query"], ["shared", "adaptive"])(2048)
    assert [(s.label, s.layer_budgets, str(s.budget)) for s in laid] == [
        ("full", "shared", "full cache"),
        ("ahakv@8x+query", "shared", "256 cells"),
        ("ahakv@8x+query adaptive", "adaptive", "256 cells"),
    ]


def test_the_table_puts_the_full_cache_first_and_averages():
    def trial(label, task, length, score, seconds=1.0):
        reading = label.split("+")[1].split(" ")[0] if "+" in label else "plain"
        return LongdocTrial(
            label, label, NO_EVICTION, reading, task, length, 0.5, 0, "1", "", score, score == 1, 1, seconds
        )

    rows = [
        trial("h2o@4x", "single", 100, 0.0, 2.0), trial("full", "single", 100, 1.0), trial("full", "single", 100, 0.0),
        trial("full", "fact", 200, 1.0, 4.0), trial("h2o@4x", "fact", 200, 1.0, 2.0),
        trial("h2o@4x+query", "fact", 200, 1.0, 2.5), trial("h2o@4x+query", "single", 100, 1.0, 3.5),
        trial("h2o@4x adaptive", "single", 100, 1.0, 4.0), trial("h2o@4x+query adaptive", "single", 100, 1.0, 5.0),
    ]  # fmt: skip
    lines = accuracy_table(rows)
    assert lines[0] == "| configuration | single 100 | single 200 | fact 100 | fact 200 | average | read s | x plain |"
    assert lines[2] == "| full | 50% |  |  | 100% | 75% | 2.00 |  |"
    assert lines[3] == "| h2o@4x | 0% |  |  | 100% | 50% | 2.00 |  |"
    assert lines[4] == "| h2o@4x+query | 100% |  |  | 100% | 100% | 3.00 | 1.50 |"  # (2.5 + 3.5) / 2 / 2.0
    # a guided reading is timed against the same layout's plain one
    assert lines[6] == "| h2o@4x+query adaptive | 100% |  |  |  | 100% | 5.00 | 1.25 |"


def longdoc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ahakv_local", "eval", "longdoc", *args], capture_output=True, text=True, timeout=900
    )


def test_eval_longdoc_command_writes_every_output(fixture_model, tmp_path):
    out = tmp_path / "longdoc"
    proc = longdoc(
        str(fixture_model), "--lengths", "300,400", "--tasks", "single,multikey", "--depths", "0.5",
        "--compressions", "4", "--policies", "h2o,ahakv", "--reading", "plain,query", "--recent", "8",
        "-t", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # h2o has no question score: its query row is its plain one, said so (the table lost the row without a word)
    assert "--reading query: h2o cannot be guided by a question; they read plainly (one row each)" in proc.stderr
    data = json.loads((out / "results.json").read_text())
    rows = data["results"]
    configs = ["full", "h2o@4x", "ahakv@4x", "ahakv@4x+query"]
    assert [(r["label"], r["task"], r["length"]) for r in rows] == [
        (c, task, n) for c in configs for task in ("single", "multikey") for n in (300, 400)
    ]
    budgets = {(r["label"], r["length"]): r["budget"] for r in rows}
    assert budgets[("full", 300)] == "full cache" and budgets[("h2o@4x", 300)] == "75 cells"
    assert budgets[("ahakv@4x+query", 400)] == "100 cells"
    assert {r["reading"] for r in rows if r["label"] == "ahakv@4x+query"} == {"query"}
    # the cache held at most the budget, one prompt chunk (64 tokens) and the newest token, and a guided reading the
    # question's room behind a chunk too (the peak is counted before each eviction); the full cache holds the prompt
    for r in rows:
        room = guide_room(r["reading"], 64) if r["label"].startswith("ahakv") else 0
        if r["label"] != "full":
            assert r["length"] // 4 < r["peak_cells"] <= r["length"] // 4 + 64 + 1 + room, r
    assert all(r["peak_cells"] >= r["length"] for r in rows if r["label"] == "full")
    assert all(0 <= r["score"] <= 1 and r["solved"] == (r["score"] == 1) for r in rows)
    assert all(re.fullmatch(r"\d{5}", r["expected"]) and r["prompt_seconds"] > 0 for r in rows)
    assert data["config"]["model_sha256"] and data["config"]["tasks"] == ["single", "multikey"]
    # each filler file hashed (the report's "GPL-3 (then 13 more texts as a length needs)" hashed none)
    files = data["config"]["filler_files"]
    assert files and data["config"]["text_sha256"] == {f: file_sha256(Path(f)) for f in files}
    assert data["config"]["threads"] == 1
    assert (out / "results.csv").read_text().count("\n") == len(rows) + 1 == 17
    md = (out / "results.md").read_text()
    assert "| configuration | single 300 | single 400 | multikey 300 | multikey 400 | average |" in md
    assert md.index("| full |") < md.index("| h2o@4x |") < md.index("| ahakv@4x+query |")
    assert "| full |" in proc.stdout
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_longdoc_runs_each_configuration_in_each_layout(tmp_path):
    # layer 0 slides (window 24) on this fixture; the others alternate, so both kinds have layers of their own
    model = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    out = tmp_path / "laid"
    proc = longdoc(
        str(model), "--lengths", "300", "--tasks", "single", "--depths", "0.5", "--compressions", "4",
        "--policies", "ahakv", "--reading", "query", "--recent", "8", "--layer-budgets", "shared,natural,adaptive",
        "-t", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["layer_budgets"] == ["shared", "natural", "adaptive"]
    rows = [(r["label"], r["layer_budgets"], r["reading"], r["budget"]) for r in data["results"]]
    assert rows == [
        ("full", "shared", "plain", "full cache"),
        ("ahakv@4x+query", "shared", "query", "75 cells"),
        ("ahakv@4x+query natural", "natural", "query", "75 cells"),
        ("ahakv@4x+query adaptive", "adaptive", "query", "75 cells"),
    ]
    # every layout holds the budget plus at most one prompt chunk (64 tokens), the newest token and the question's room
    assert all(75 < r["peak_cells"] <= 75 + 64 + 1 + guide_room("query", 64) for r in data["results"][1:])
    assert "| ahakv@4x+query adaptive |" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "args, message, code",
    [
        # a bad option value: exit code 2, as click's own types give (README), and as generate's --reading gives
        (["--tasks", "single,summary"], "Invalid value for '--tasks': unknown task", 2),
        (["--lengths", "300,abc"], "Invalid value for '--lengths': token counts", 2),
        (["--lengths", "32"], "Invalid value for '--lengths': a length must be at least 64", 2),
        (["--compressions", "0.5"], "Invalid value for '--compressions': a compression must be at least 1", 2),
        (["--reading", "skim"], "Invalid value for '--reading': plain, query", 2),
        (["--depths", "1.5"], "Invalid value for '--depths': each must lie between 0 and 1", 2),
        (["--depths", "0.5,x"], "Invalid value for '--depths': fractions", 2),
        (["--layer-budgets", "flat"], "Invalid value for '--layer-budgets': layer budgets must be shared, natural", 2),
        # what the values ask of the model: a user's mistake, exit code 1
        (["--lengths", "5000"], "past the model's trained context 4096", 1),
        (["--compressions", "16"], "smaller than sinks + recent", 1),
        (["--layer-budgets", "shared,adaptive"], "needs a model with sliding-window and full-attention layers", 1),
    ],
)
def test_eval_longdoc_refuses_bad_input_in_one_line(fixture_model, tmp_path, args, message, code):
    proc = longdoc(str(fixture_model), "--lengths", "300", *args, "--out", str(tmp_path / "x"))
    assert proc.returncode == code
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "x").exists()


def test_gemma_full_cache_solves_the_single_task_at_2048_tokens(gemma_model):
    trials = run_longdoc(gemma_model, lambda n: [SessionSpec()], ["single"], [2048], [0.1, 0.5, 0.9])
    assert [(t.label, t.length, t.depth) for t in trials] == [("full", 2048, d) for d in (0.1, 0.5, 0.9)]
    assert all(t.peak_cells >= 2048 and t.prompt_seconds > 0 for t in trials)
    assert all(t.solved and t.answer.startswith(t.expected) for t in trials), [(t.expected, t.answer) for t in trials]


def test_gemma_full_cache_answers_the_multivalue_task_with_its_pass_keys(gemma_model):
    """The multi-value answer prefix ended " ... are numbers", which invites a full stop: every answer of the full
    cache began with "." and went on with licence text, so the task scored 0 whatever the cache held. After
    " ... are:" the model lists numbers; a 270M model copies one key and counts on from it ("19030, 19031, ..."), so
    what is asserted is that the answers start with a number and recall keys, not how many."""
    trials = run_longdoc(gemma_model, lambda n: [SessionSpec()], ["multivalue"], [1024], [0.1, 0.3, 0.5, 0.7, 0.9])
    answers = [(t.expected, t.answer) for t in trials]
    assert not any(t.answer.startswith(".") for t in trials), answers
    assert sum(t.score for t in trials) >= 2 / 3, answers  # at least two pass keys recalled over the five items


def test_the_heatmap_shows_every_label_whole(tmp_path, monkeypatch):
    """At one task and one length the figure was ~2.5 inches wide: the row labels and the title were cut."""
    import matplotlib.pyplot as plt

    from ahakv_local.plots import plot_longdoc

    shown = []
    monkeypatch.setattr(plt, "close", shown.append)  # keep the figure to measure it
    labels = ["full", "ahakv@4x+reconstruct adaptive", "snapkv@8x+surprisal natural"]
    rows = [
        LongdocTrial(x, x, NO_EVICTION, "plain", "single", 1024, 0.5, 0, "1", "", 1.0, True, 1, 1.0) for x in labels
    ]
    plot_longdoc(rows, tmp_path / "accuracy.png")
    (fig,) = shown
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for text in [*ax.get_yticklabels(), ax.title]:
        extent = text.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()
    plt.close(fig)
