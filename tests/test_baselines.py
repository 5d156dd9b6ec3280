"""The honest baselines: plain llama-cpp-python (swa_full, its default) and plain llama.cpp with the sliding-window
cache trimmed (swa_full off, as llama-server and llama-cli allocate it), in ``bench speed`` and ``eval ppl``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ahakv_local.bench import SpeedRow, memory_at
from ahakv_local.engine import Engine, EngineConfig, LayerCache
from ahakv_local.evaluation import TRIMMED, evaluate, log_softmax
from ahakv_local.fixture import FixtureSpec
from ahakv_local.info import read_info
from ahakv_local.models import fixture_path

from numerics import sum_rtol

SLIDING_FIXTURE = FixtureSpec(arch="gemma3")  # layer 0 slides (window 24), layer 1 attends fully


def allocated(model, n_ctx: int, swa_full: bool, n_ubatch: int) -> int:
    config = EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, swa_full=swa_full)
    with Engine(model, config) as e:
        return e.kv_bytes()


def test_memory_at_a_context_is_what_the_engine_allocates(gemma_model):
    """Baselines grow with the context (trimmed: only the full-attention cache does), a budget does not."""
    rows = [SpeedRow(label, 512, 512.0, 512, 1.0, 1.0, kv_bytes=12345) for label in ("plain", "trimmed", "ahakv")]
    memory_at(gemma_model, rows, 8192, 64)
    plain, trimmed, ahakv = (r.kv_bytes_at_context for r in rows)
    assert plain == allocated(gemma_model, 8192, True, 64) == 144 * 2**20
    assert trimmed == allocated(gemma_model, 8192, False, 64) == 24 * 2**20 + 768 * 15 * 1024
    assert ahakv == 12345


def stream_nll(engine: Engine, tokens: list[int], prefix: int) -> list[float]:
    """Independent of the controller: the prefix in n_ubatch chunks, then token by token, on a bare engine."""
    n = engine.config.n_ubatch
    logits = list(np.concatenate([engine.decode(tokens[a : a + n], all_logits=True) for a in range(0, prefix, n)]))
    logits += [engine.decode([t]) for t in tokens[prefix:-1]]  # row i predicts token i + 1
    return [-log_softmax(r)[t] for r, t in zip(logits, tokens[1:], strict=True)]


def test_the_trimmed_ppl_row_is_llama_cpps_own_trimmed_cache(license_text):
    """``TRIMMED`` keeps every position in the caches llama.cpp's own swa_full=False engine allocates (its rule pads
    to 256 cells: 512 and 256 here; the row stated our exact window + chunk + 1 = 89 sliding cells, less memory
    than the baseline takes), and llama.cpp reuses the cells of what left the window: its perplexity is that engine's
    and the full cache's. F32 fixture: the runs differ only in which
    cells hold which positions, i.e. in the order of F32 sums over at most 300 cells, a relative sum_rtol(300) per
    logit and layer: over two layers the mean NLL (log ppl) moves by at most 2 sum_rtol(300) x log ppl (measured:
    3.6e-7 relative in ppl, against a bound of 1.6e-3)."""
    model = fixture_path(SLIDING_FIXTURE)
    with Engine(model, EngineConfig(n_ctx=256)) as e:
        tokens = e.tokenize(license_text)[:300]
    results = evaluate(model, tokens, [TRIMMED], prefix=64)
    trimmed, full = results["trimmed"], results["full"]
    with Engine(model, EngineConfig(n_ctx=300, n_batch=64, n_ubatch=64, swa_full=False)) as e:
        assert (e.cache_cells(LayerCache.BASE), e.cache_cells(LayerCache.SLIDING)) == (512, 256)
        reference = float(np.exp(np.mean(stream_nll(e, tokens, 64))))
    tol = np.expm1(2 * sum_rtol(300) * np.log(full.ppl))
    assert trimmed.ppl == pytest.approx(reference, rel=tol) and trimmed.ppl == pytest.approx(full.ppl, rel=tol)
    # the stored full-cache rows are within 7.7e-5 nats of the exact ones (LogProbStore; tests/test_evaluation.py)
    assert trimmed.kl < 1e-4 and trimmed.top1 == 1.0
    # the full row is plain llama-cpp-python's cache (swa_full on), as `info` states it: 512 cells each, padded
    caches = {c.name: c for c in read_info(model).caches(300, True)}
    assert full.kv_bytes == sum(c.cells * c.cell_bytes for c in caches.values()) == 512 * 2 * 128
    assert trimmed.kv_bytes == 512 * caches["full"].cell_bytes + 256 * caches["sliding"].cell_bytes


def test_eval_ppl_adds_the_trimmed_row_for_a_sliding_window_model(tmp_path):
    def run(arch: str) -> list[str]:
        out = tmp_path / arch
        proc = subprocess.run(
            [sys.executable, "-m", "ahakv_local", "eval", "ppl", str(fixture_path(FixtureSpec(arch=arch))),
             "--tokens", "160", "--prefix", "64", "--budgets", "64", "--policies", "h2o", "--out", str(out)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        rows = json.loads((out / "results.json").read_text())["results"]
        assert "| trimmed | full cache |" in (out / "results.md").read_text() or arch == "llama"
        return [r["label"] for r in rows]

    assert run("gemma3") == ["full", "trimmed", "h2o@64"]
    assert run("llama") == ["full", "h2o@64"]  # one cache: nothing to trim


def test_eval_ppl_runs_each_policy_in_each_layout_it_is_given(gemma_model, tmp_path):
    """``eval ppl --layer-budgets shared,natural,adaptive -t 1``: a row per policy and layout, each the number that
    ``evaluate`` gives for that spec in that layout (a second path, in-process, at the same one thread: the same
    bits), and the three layouts apart (Gemma 3 270M: 15 sliding layers and 3 full ones, so adaptive's shares move
    where natural's cannot). eval ppl measured the shared pool only, not the product's layout."""
    from ahakv_local.session import SessionSpec

    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "eval", "ppl", str(gemma_model), "--tokens", "384", "--prefix", "64",
         "--budgets", "96", "--policies", "h2o", "--step", "16", "--layer-budgets", "shared,natural,adaptive",
         "-t", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["label"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert list(rows) == ["full", "trimmed", "h2o@96", "h2o natural@96", "h2o adaptive@96"]
    with Engine(gemma_model, EngineConfig(n_ctx=1024)) as e:
        tokens = e.tokenize(open("/usr/share/common-licenses/GPL-3").read())[:384]
    layouts = ("natural", "adaptive")
    specs = [SessionSpec.bounded("h2o", 96, label=f"h2o {lay}", layer_budgets=lay) for lay in layouts]
    direct = evaluate(gemma_model, tokens, specs, prefix=64, step=16, n_threads=1)
    for lay in layouts:
        assert (rows[f"h2o {lay}@96"]["ppl"], rows[f"h2o {lay}@96"]["kl"]) == (
            direct[f"h2o {lay}"].ppl,
            direct[f"h2o {lay}"].kl,
        )
    assert len({rows[label]["kl"] for label in ("h2o@96", "h2o natural@96", "h2o adaptive@96")}) == 3


def test_bench_speed_rows_and_memory_context(tmp_path):
    model = fixture_path(SLIDING_FIXTURE)
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "bench", "speed", str(model), "--budget", "64", "--policies", "ahakv",
         "--decode-tokens", "4", "--rounds", "1", "--long-context", "", "--memory-context", "4096", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["memory_context"] == 4096
    plain_at, trimmed_at = allocated(model, 4096, True, 64), allocated(model, 4096, False, 64)
    assert trimmed_at < plain_at
    for table in ("generate", "engine"):
        rows = {r["label"]: r for r in data["results"] if r["table"] == table}
        assert list(rows) == ["plain", "trimmed", "ahakv"]
        assert rows["plain"]["kv_bytes_at_context"] == plain_at
        assert rows["trimmed"]["kv_bytes_at_context"] == trimmed_at
        assert rows["ahakv"]["kv_bytes_at_context"] == rows["ahakv"]["kv_bytes"] < trimmed_at
        assert rows["trimmed"]["prompt_tokens"] == rows["plain"]["prompt_tokens"]
    assert "| KV MiB at 4,096 |" in (out / "results.md").read_text()
