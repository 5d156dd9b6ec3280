"""The evaluation code is itself tested against a second code path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ahakv_local import evaluation
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.evaluation import FULL, LogProbStore, _open, evaluate, log_softmax
from ahakv_local.session import SessionSpec

from numerics import FORWARD_RTOL, log_softmax32_atol


def one_pass_logits(model, tokens, **kw) -> np.ndarray:
    with Engine(model, EngineConfig(n_ctx=512, n_batch=512, n_ubatch=512, **kw)) as e:
        return e.decode(tokens, all_logits=True)  # one prompt decode, every row


def one_pass_ppl(model, tokens, **kw) -> float:
    logits = one_pass_logits(model, tokens, **kw)
    return float(np.exp(np.mean([-log_softmax(r)[t] for r, t in zip(logits[:-1], tokens[1:], strict=True)])))


def test_streaming_full_cache_equals_one_pass_perplexity(fixture_model, gemma_model, license_text):
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:300]
    streamed = evaluate(fixture_model, tokens, [], prefix=64)["full"].ppl
    # F32 fixture: each path's logits are within FORWARD_RTOL of the largest from exact, so two paths within twice
    # that; a token's log-probability moves by at most twice a logit's change (its logit and the log-sum-exp)
    largest = float(np.abs(one_pass_logits(fixture_model, tokens)).max())
    assert abs(np.log(streamed / one_pass_ppl(fixture_model, tokens))) <= 4 * FORWARD_RTOL * largest

    # Gemma 3 Q4_K_M: llama.cpp's single-token and batched matmul kernels differ (their own activation quantization
    # and block order), so no rounding unit bounds streamed against one-pass perplexity there (0.07-0.84% measured:
    # benchmarks/decode_paths.py). The second path runs the same kernels instead: the session evaluate opens, read
    # through the controller token by token, scored in float64 (lockstep_reference); evaluate's float32 rows give
    # its perplexity to float32 rounding (as in the compact-store test below, which covers steps of 16)
    with Engine(gemma_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:300]
    ref = lockstep_reference(gemma_model, tokens, "h2o", 96, prefix=64, step=1)
    streamed = evaluate(gemma_model, tokens, [], prefix=64)["full"].ppl
    assert abs(np.log(streamed / ref["ppl_full"])) <= log_softmax32_atol(ref["n_vocab"], ref["span"])


def test_stepping_in_chunks_scores_every_token_and_holds_the_budget(fixture_model, license_text):
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:300]
    one_pass = one_pass_ppl(fixture_model, tokens)
    results = evaluate(fixture_model, tokens, [SessionSpec.bounded("h2o", 64, label="h2o")], prefix=64, step=16)
    # F32 fixture: chunked == one pass, within the bound of two batchings (the first test's)
    batchings = 4 * FORWARD_RTOL * float(np.abs(one_pass_logits(fixture_model, tokens)).max())
    assert abs(np.log(results["full"].ppl / one_pass)) <= batchings
    # held at every step: a step's 16 tokens go on top of the 64 - (16 - 1) an eviction keeps, so the cache peaks one
    # cell over the budget, as the product's steps do (the newest token's cell, which the caches are sized for); the
    # peak is counted before the step's eviction (it was read after it: 64)
    assert results["h2o"].max_cells == 64 + 1 and results["h2o"].ppl != results["full"].ppl
    # the cells held after each step and their share of the tokens seen: every token (full), or the budget
    # less the room the next step needs (an eviction every 16 tokens goes 16 - 1 cells below it: controller.py)
    seen = np.minimum(np.arange(64 + 16, 300 + 15, 16), 300)
    assert results["full"].mean_cells == pytest.approx(seen.mean()) and results["full"].mean_share == 1.0
    held = 64 - (16 - 1)
    assert results["h2o"].mean_cells == held and results["h2o"].mean_share == pytest.approx(np.mean(held / seen))
    by_token = evaluate(fixture_model, tokens, [SessionSpec.bounded("h2o", 64, label="h2o")], prefix=64, step=1)
    assert abs(np.log(by_token["full"].ppl / results["full"].ppl)) <= batchings


def test_kl_of_the_full_cache_against_itself_is_zero(fixture_model, license_text):
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:120]
    told = []  # what on_result hears, run by run: the full cache first, then each spec in order
    results = evaluate(
        fixture_model, tokens, [SessionSpec("full again"), SessionSpec.bounded("h2o", 48, label="h2o")], prefix=32,
        on_result=lambda label, r: told.append((label, r)),
    )  # fmt: skip
    assert told == list(results.items()) and [label for label, _ in told] == ["full", "full again", "h2o"]
    again, h2o = results["full again"], results["h2o"]
    # the stored rows are within e = scale / 2 of the exact ones, so KL(p' || p) is at most e exp(e) per
    # token; the fixture's rows span < 10 nats (at most 7.6 on GPL-3): e < 10 / 65535 / 2 = 7.7e-5 (LogProbStore)
    assert 0 <= again.kl < 7.7e-5 and again.top1 == 1.0 and again.ppl == results["full"].ppl  # (never below 0)
    assert h2o.kl > 0.01 and h2o.max_cells == 48 + 1  # token by token: the newest on top of the budget


def test_a_kept_reference_is_read_instead_of_running_the_full_cache_again(
    fixture_model, license_text, tmp_path, monkeypatch
):
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:160]
    opened = []  # the configurations each evaluation runs
    real_open = evaluation._open

    def opening(model, n_tokens, spec, *args):
        opened.append(spec.label)
        return real_open(model, n_tokens, spec, *args)

    monkeypatch.setattr(evaluation, "_open", opening)
    specs = [SessionSpec.bounded("h2o", 64, label="h2o")]

    def run(tokens: list[int]) -> dict:
        opened.clear()
        results = evaluate(fixture_model, tokens, specs, prefix=32, step=16, reference_dir=tmp_path)
        measured = {label: (r.ppl, r.kl, r.top1) for label, r in results.items()}
        return measured | {"full seconds": results["full"].seconds, "opened": list(opened)}

    first = run(tokens)
    assert first["opened"] == ["full", "h2o"] and sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".logp"]
    # the same evaluation again: the full cache's rows and result (its seconds too) come from the reference, and the
    # configuration compares against the same stored rows: the same KL and top-1 to the last bit
    assert run(tokens) == first | {"opened": ["h2o"]}
    # other tokens are another reference; a reference whose result was never written (a stopped run) is not read
    assert run(tokens[:-16])["opened"] == ["full", "h2o"] and len(list(tmp_path.glob("*.json"))) == 2
    stopped = next(tmp_path.glob("*.json"))
    stopped.unlink()
    dead = _finished_pid()
    stale = tmp_path / f"{stopped.stem}.logp.{dead}.part"  # the rows a stopped run left
    stale.write_bytes(b"\0" * 100)
    with subprocess.Popen(["sleep", "60"]) as running:  # the rows another run of this evaluation is writing now
        busy = tmp_path / f"{stopped.stem}.logp.{running.pid}.part"
        busy.write_bytes(b"\1" * 100)
        try:
            assert sum(run(t)["opened"] == ["full", "h2o"] for t in (tokens, tokens[:-16])) == 1
        finally:
            running.kill()
    assert list(tmp_path.glob("*.part")) == [busy] and busy.read_bytes() == b"\1" * 100
    assert len(list(tmp_path.glob("*.json"))) == 2


def _finished_pid() -> int:
    """The pid of a process that has ended (its rows, had it written any, belong to nobody)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def lockstep_reference(model, tokens, policy, budget, prefix, step) -> dict[str, float]:
    """The old lockstep evaluation, in float64 and without a store: the full cache and one configuration
    side by side, every row compared exactly; plus the bound on the store's KL error (LogProbStore):
    per row (exp(e) - 1) E_p|log p - log q| + e exp(e), e = half the quantization step."""
    runs = [_open(model, len(tokens), spec, 64, step) for spec in (FULL, SessionSpec.bounded(policy, budget))]
    try:
        rows = [r.ctl.prefill(tokens[:prefix], all_logits=True) for r in runs]
        span = max(float((r.max(axis=1) - r.min(axis=1)).max()) for r in rows)  # of every row scored
        nll = [[-log_softmax(x)[t] for x, t in zip(r[:-1], tokens[1:prefix], strict=True)] for r in rows]
        last = [r[-1] for r in rows]
        kl, bound, top1 = [], [], []
        for start in range(prefix, len(tokens), step):
            chunk = tokens[start : start + step]
            logp = []
            for i, run in enumerate(runs):
                out = run.ctl.step(chunk[0])[None] if step == 1 else run.ctl.prefill(chunk, all_logits=True, chunk=step)
                logp.append(log_softmax(np.concatenate([last[i][None], out[:-1]])))  # float64
                span = max(span, float((logp[i].max(axis=1) - logp[i].min(axis=1)).max()))
                last[i] = out[-1]
                nll[i] += (-logp[i][np.arange(len(chunk)), chunk]).tolist()
            p = np.exp(logp[0])
            kl += np.einsum("ij,ij->i", p, logp[0] - logp[1]).tolist()
            e = (logp[0].max(axis=1) - logp[0].min(axis=1)) / 65535 / 2
            bound += ((np.exp(e) - 1) * np.einsum("ij,ij->i", p, np.abs(logp[0] - logp[1])) + e * np.exp(e)).tolist()
            top1 += (logp[0].argmax(axis=1) == logp[1].argmax(axis=1)).tolist()
    finally:
        for run in runs:
            run.session.close()
    ppl = [float(np.exp(np.mean(n))) for n in nll]
    return {"ppl_full": ppl[0], "ppl": ppl[1], "kl": np.mean(kl), "bound": np.mean(bound), "top1": np.mean(top1),
            "n_vocab": rows[0].shape[1], "span": span}  # fmt: skip


@pytest.mark.parametrize(("model_name", "step"), [("fixture_model", 1), ("gemma_model", 16)])
def test_kl_from_the_compact_store_equals_the_exact_lockstep_kl(model_name, step, request, license_text):
    model = request.getfixturevalue(model_name)
    with Engine(model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:224]
    ref = lockstep_reference(model, tokens, "h2o", 96, prefix=64, step=step)
    got = evaluate(model, tokens, [SessionSpec.bounded("h2o", 96, label="h2o")], prefix=64, step=step)
    # perplexities: each run's own float32 rows, never quantized: the float64 ones to float32 log-softmax rounding
    rounding = log_softmax32_atol(ref["n_vocab"], ref["span"])
    assert abs(np.log(got["full"].ppl / ref["ppl_full"])) <= rounding
    assert abs(np.log(got["h2o"].ppl / ref["ppl"])) <= rounding
    # KL: within the bound the quantization step implies (mean over tokens of the per-row bound), plus
    # 1e-5 for float32 log-softmax rows (entries within ~4e-6 of float64 even at -40 nats)
    assert ref["kl"] > 0.01 and abs(got["h2o"].kl - ref["kl"]) <= ref["bound"] + 1e-5
    assert got["h2o"].top1 == ref["top1"]  # the argmax is stored exactly


def test_store_round_trip_is_within_half_a_step(tmp_path):
    rng = np.random.default_rng(0)
    logp = log_softmax(rng.standard_normal((5, 1000)) * 5).astype(np.float32)
    store = LogProbStore(1000, tmp_path)
    store.write(logp[:2])
    store.write(logp[2:])
    store.rewind()
    recs = np.concatenate([store.read(3), store.read(2)])
    with pytest.raises(EOFError):
        store.read(1)
    store.close()
    for rec, row in zip(recs, logp, strict=True):
        assert np.abs(LogProbStore.dequantize(rec) - row).max() <= rec["scale"] / 2 * (1 + 1e-9)
        assert rec["top"] == row.argmax() and rec["q"].max() == 65535 and rec["q"].min() == 0


PEAK_SCRIPT = """
import sys
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.evaluation import evaluate
from ahakv_local.session import SessionSpec
from ahakv_local.models import default_model_path
model = default_model_path()
with Engine(model, EngineConfig(n_ctx=256)) as e:
    tokens = e.tokenize(open("/usr/share/common-licenses/GPL-3").read())[:256]
start = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS")))
configs = [SessionSpec.bounded(p, 96) for p in sys.argv[1].split(",")]
evaluate(model, tokens, configs, prefix=64, step=16)
peak = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
print((peak - start) * 1024)
"""


def peak_growth(policies: str) -> int:
    """Peak RSS growth in bytes of evaluating these configurations on Gemma in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, policies], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_peak_memory_does_not_grow_with_the_number_of_configurations(gemma_model):
    one = peak_growth("h2o")
    four = peak_growth("streaming,h2o,tova,ahakv")
    # one engine at a time: four configurations peak where one does, within 64 MiB (allocator and policy
    # state); each engine of its own would add ~450 MiB (weights repacked per model, KV, logits)
    assert four <= one + 64 * 2**20, (one / 2**20, four / 2**20)


def test_a_row_equal_to_the_reference_has_kl_zero_never_below():
    """The stored row is rounded (half a step), so KL against the very row it stores came out below 0 (eval ppl's
    trimmed row, equal to the full cache, read -0.0000): a divergence is never negative; each row is read at 0."""
    rng = np.random.default_rng(3)
    logp = log_softmax(rng.standard_normal((8, 1000)) * 5).astype(np.float32)
    store = LogProbStore(1000)
    store.write(logp)
    store.rewind()
    recs = store.read(8)
    store.close()
    raw = [
        float(np.exp(LogProbStore.dequantize(r)) @ (LogProbStore.dequantize(r) - q))
        for r, q in zip(recs, logp, strict=True)
    ]
    assert min(raw) < 0  # the rounding this is about (seeded: the same rows on every machine)
    kl, top1 = store.compare(recs, logp)
    # the stored row is made a distribution again before it is compared: KL(p' || q) with p' = q e^d / E_q e^d and
    # |d| <= e = half a step is at most e^2 / 2 (Hoeffding's lemma), second order (unnormalized: first order, e e^e);
    # plus |log Z| of the float32 reference row itself, whose exp sums to Z = 1 only up to float32 rounding, and
    # 2^-23, float32 exp's rounding of p (one ulp relative at most, LogProbStore.compare takes p in float32)
    for k, rec, row in zip(kl, recs, logp, strict=True):
        e, log_z = float(rec["scale"]) / 2, abs(float(np.log(np.exp(row.astype(np.float64)).sum())))
        assert 0 <= k <= e * e / 2 + log_z + 2**-23, (k, e, log_z)
    assert all(top1)
    assert np.isnan(store.compare(recs[:1], np.full((1, 1000), np.nan))[0][0])  # a broken run is not a perfect one


def test_eval_ppl_command_writes_every_output(fixture_model, tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    # an earlier eval longdoc's report in this folder, and the user's files, one named like another report's figure
    (out / "results.json").write_text(json.dumps({"config": {"figure": "accuracy.png"}, "results": []}))
    (out / "accuracy.png").write_bytes(b"an earlier eval longdoc's figure")
    (out / "notes.txt").write_text("the user's")
    (out / "long_run.png").write_bytes(b"the user's own picture")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ahakv_local",
            "eval",
            "ppl",
            str(fixture_model),
            "--tokens",
            "160",
            "--prefix",
            "32",
            "--budgets",
            "48,0.5",
            "--policies",
            "tova,ahakv",
            "--recent",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"AHAKV_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    # the command and every option's value, those from the environment and the defaults too: enough to run it again
    assert data["config"]["command"] == "python -m ahakv_local eval ppl"  # as it was run
    options = data["config"]["options"]
    assert options["threads"] == 1 and options["rpc"] is None and options["text_file"].endswith("GPL-3")
    assert (options["budgets"], options["tokens"], options["model"]) == ("48,0.5", 160, str(fixture_model))
    labels = [r["label"] for r in data["results"]]
    assert labels == ["full", "tova@48", "ahakv@48", "tova@80", "ahakv@80"]
    assert data["config"]["model_sha256"] and data["config"]["patch_sha256"] and data["config"]["tokens"] == 160
    # what the run was made with (a q8_0 or a --recent 8 run was told from another by no field)
    settings = {k: data["config"][k] for k in ("prefix", "n_sink", "n_recent", "kv_type", "layer_budgets")}
    assert settings == {"prefix": 32, "n_sink": 4, "n_recent": 8, "kv_type": "f16", "layer_budgets": ["shared"]}
    assert (out / "results.csv").read_text().count("\n") == 6
    assert "| ahakv | 80 cells |" in (out / "results.md").read_text()
    assert (out / "ppl_vs_budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no figure of another run beside this one's results (it described results no longer there); the user's files
    # stay, whatever their names (bench speed deleted a user's long_run.png, which no report had written)
    assert not (out / "accuracy.png").exists() and (out / "notes.txt").read_text() == "the user's"
    assert (out / "long_run.png").read_bytes() == b"the user's own picture"
    assert data["config"]["figure"] == "ppl_vs_budget.png"
    # --tokens cut below the prefix: said so (it read "GPL-3 has only 30 tokens")
    cmd = [sys.executable, "-m", "ahakv_local", "eval", "ppl", str(fixture_model), "--tokens", "30", "--prefix", "32",
           "--budgets", "48", "--out", str(out)]  # fmt: skip
    short = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert short.returncode == 1 and short.stderr.strip() == "error: --tokens 30; need more than --prefix 32 + 1"
    # --tokens past the text's end: the whole text, said so (it was silent), and the report's length is the text's
    text = tmp_path / "short.txt"
    text.write_text(" ".join(f"word{i}" for i in range(60)))
    cmd[cmd.index("--tokens") + 1] = "99999999"
    cmd[cmd.index("--prefix") + 1] = "8"
    cmd += ["--text", str(text), "--policies", "streaming"]
    whole = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    tokens = json.loads((out / "results.json").read_text())["config"]["tokens"]
    assert f"--tokens 99999999: {text} has {tokens} tokens; every one is read" in whole.stderr
    assert 60 <= tokens < 1000


def test_evaluation_budgets_use_the_one_budget_grammar():
    from ahakv_local.cli_eval import _cells
    from ahakv_local.errors import AhakvError

    # a fraction, at least the floor; 0.125 and 12.5% are the same 512 cells, run once (twice, into one row, before)
    assert _cells("256,0.125,12.5%,0.001", 4096, 37) == [256, 512, 37]
    for bad in ("auto", "16MiB", "0", "1.5", "inf", "150%", "x"):  # a byte budget: a TypeError before
        with pytest.raises(AhakvError):
            _cells(bad, 4096, 37)


def test_a_report_removes_only_the_figures_a_report_of_ours_wrote(tmp_path):
    """Each results.json names the figure its report wrote; a folder holding a report from before it did (our
    provenance, no "figure") may hold any of them (an upgrade left another command's figure beside new results);
    a folder without a report of ours keeps its files, whatever their names."""
    from ahakv_local.report import FIGURES, _write

    def folder(name: str, config: dict | None) -> Path:
        out = tmp_path / name
        out.mkdir()
        if config is not None:
            (out / "results.json").write_text(json.dumps({"config": config, "results": []}))
        for figure in FIGURES:
            (out / figure).write_bytes(b"a figure")
        return out

    cases = {  # config of the report already there -> the figures left beside the new long_run.png
        "named": ({"patch_sha256": "x", "figure": "accuracy.png"}, {"ppl_vs_budget.png", "long_run.png"}),
        "older": ({"patch_sha256": "x"}, {"long_run.png"}),
        "theirs": ({"something": "else"}, set(FIGURES)),
        "none": (None, set(FIGURES)),
    }
    for name, (config, left) in cases.items():
        out = folder(name, config)
        _write(out, {"patch_sha256": "y"}, [], ["label"], ["# x"], "long_run.png")
        assert {p.name for p in out.iterdir() if p.suffix == ".png"} == left, name
        assert json.loads((out / "results.json").read_text())["config"]["figure"] == "long_run.png"


def test_a_report_s_csv_writes_a_nul_escaped(tmp_path):
    """A random fixture's needle answer held a NUL: Python 3.10's csv refused it ("need to escape, but no escapechar
    set") and eval needle ended in a traceback there (3.11 wrote it raw). The CSV says \\x00; the JSON keeps the
    text as it was."""
    import csv

    from ahakv_local.report import _write

    rows = [{"label": "a", "answer": "x\0y", "ok": 1}]
    _write(tmp_path, {"patch_sha256": "x"}, rows, ["label", "answer", "ok"], ["# x"])
    with (tmp_path / "results.csv").open(newline="") as f:
        assert list(csv.DictReader(f)) == [{"label": "a", "answer": "x\\x00y", "ok": "1"}]
    assert json.loads((tmp_path / "results.json").read_text())["results"] == rows


def test_a_report_replaces_its_files_whole_and_never_writes_through_a_link(tmp_path, monkeypatch):
    """A report's files are written beside themselves and renamed over (``atomic.replaced``): a link left in the
    folder is replaced, not written through (a user's notes were overwritten with the CSV), and a run that fails
    while writing (a full disk) leaves the last run's files whole and no temporary one (the CSV was emptied)."""
    from ahakv_local import atomic
    from ahakv_local.report import ReportNotWritten, _write

    out = tmp_path / "report"
    _write(out, {"patch_sha256": "x"}, [{"label": "a"}], ["label"], ["# first"])
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    (out / "results.csv").unlink()
    (out / "results.csv").symlink_to(notes)
    _write(out, {"patch_sha256": "x"}, [{"label": "b"}], ["label"], ["# second"])
    assert notes.read_text() == "my notes" and not (out / "results.csv").is_symlink()
    assert (out / "results.csv").read_text().splitlines() == ["label", "b"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(path, text):  # the second file's write fails once some of it is written
        with atomic.replaced(path) as f:
            f.write(text.encode()[:3])
            if path.name == "results.csv":
                raise OSError(28, "No space left on device")
            f.write(text.encode()[3:])

    monkeypatch.setattr("ahakv_local.report.write_text", full_disk)
    with pytest.raises(ReportNotWritten, match=f"^cannot write the report to {out}: No space left") as refused:
        _write(out, {"patch_sha256": "x"}, [{"label": "c"}], ["label"], ["# third"])
    assert refused.value.lines == ["# third"]  # what the command prints instead
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before)  # no temporary file left
    assert after["results.csv"] == before["results.csv"] and after["results.md"] == before["results.md"]


@pytest.mark.parametrize(("n_tokens", "prefix"), [(0, 128), (50, 128), (200, 1000), (200, 0), (200, 199)])
def test_an_evaluation_with_nothing_to_score_says_why(fixture_model, n_tokens, prefix):
    """ "need at least one array to concatenate" (no token after the prefix) or "the KV cache is full" (a negative
    prefix) said nothing of the prefix."""
    with pytest.raises(ValueError, match=f"prefix must be from 1 to two tokens short of the {n_tokens} tokens"):
        evaluate(fixture_model, list(range(5, 5 + n_tokens)), [], prefix=prefix)


def test_a_prefill_of_no_tokens_is_a_value_error(fixture_model):
    from ahakv_local.session import open_session

    with open_session(fixture_model, SessionSpec.bounded("h2o", 64), 256) as s:
        with pytest.raises(ValueError, match="prefill needs at least one token"):
            s.controller.prefill([])


def test_the_reference_is_llama_cpp_s_own_cache_so_trimming_within_the_window_costs_nothing(gemma_model, license_text):
    """The full row's caches were sized exactly to the text (300 cells) where llama.cpp's take 320, and Gemma 3's Q4_K
    kernels round otherwise over 300 cells than over 320: the trimmed row, which keeps the same positions (300 tokens
    fit the 512-token window), read +0.3% perplexity and KL 0.0010 beside it. Both are now llama.cpp's own caches, and
    agree to the bit (up to the quantized store the reference's rows are kept in)."""
    from ahakv_local.evaluation import TRIMMED

    with Engine(gemma_model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:300]
    results = evaluate(gemma_model, tokens, [TRIMMED], prefix=128, step=16)
    full, trimmed = results["full"], results["trimmed"]
    assert trimmed.ppl == full.ppl and trimmed.top1 == 1.0  # the same log-probabilities, to the bit
    # KL against the reference's quantized rows (LogProbStore): for equal rows at most e exp(e) a token, e half a step
    # of a row's span over 65,535 steps; Gemma 3's rows span at most ~61 nats on these texts (its docstring)
    e = 61 / 65535 / 2
    assert 0 <= trimmed.kl <= e * np.exp(e)  # (it was 0.0010 with the exactly sized reference)


def test_a_run_names_its_text_its_engine_s_patches_its_period_and_the_fractions_it_raised(fixture_model, tmp_path):
    """results.json named the text only by the path as typed (a relative name is no file), the patch hash of the
    source tree (edited without a rebuild, not the engine's), and "evict_every": null where each row ran a period of
    its own; and two fractions raised to the floor ran as one row without a word ("0.05,0.06": one row of 10.8x)."""
    from ahakv_local.build import installed_marker, patch_hash_of
    from ahakv_local.models import file_sha256

    text = tmp_path / "words.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and runs far away from here " * 40)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ahakv_local", "eval", "ppl", str(fixture_model), "--text", "words.txt", "-t", "1"]
    cmd += ["--tokens", "400", "--prefix", "64", "--budgets", "0.05,0.06,128", "--policies", "h2o", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    floor = 4 + 32 + 1  # sinks + recent + one eviction period (token by token, at the floor's budget: 1)
    assert (
        f"note: 0.05, 0.06 of 400 tokens is less than sinks + recent + one eviction period: raised to {floor} cells"
        in (proc.stderr)
    )
    report = json.loads((out / "results.json").read_text())
    config, rows = report["config"], {r["label"]: r for r in report["results"]}
    assert config["text_sha256"] == {"words.txt": file_sha256(text)}
    assert config["patch_sha256"] == patch_hash_of(installed_marker()) is not None
    assert set(rows) == {"full", f"h2o@{floor}", "h2o@128"}  # the two fractions: one row, now said
    assert rows["full"]["evict_every"] is None and rows["h2o@128"]["evict_every"] > 1


def test_the_patch_hash_is_the_installed_engine_s():
    """Read from the engine's marker; a marker of before the field, by its key (the key holds the patch hash); None
    where the engine was built from other patches than these."""
    from ahakv_local import build

    bp = build.plan(cmake_args="-DGGML_NATIVE=OFF")
    assert build.patch_hash_of({"key": bp.key, "cmake_args": bp.cmake_args, "patch_sha256": "abc"}) == "abc"
    assert build.patch_hash_of({"key": bp.key, "cmake_args": bp.cmake_args}) == bp.patch_hash  # an older marker
    assert build.patch_hash_of({"key": "another build", "cmake_args": bp.cmake_args}) is None
    assert build.patch_hash_of(None) is None  # no engine ahakv-local built
