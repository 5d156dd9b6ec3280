"""benchmarks/frontier_merge.py: the tables RESULTS.md quotes to say which policy/layout pair is lowest.

Two synthetic layer_budgets.py reports on one text; the expected ranks and ratios come from numpy (argsort of the
same numbers), independent of the script's sorting.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "frontier_merge.py"
PAIRS = [("ahakv", "adaptive auto"), ("ahakv", "natural auto"), ("h2o", "uniform auto"), ("tova", "natural auto")]


def report(rows: list[tuple[str, str, str, float, float]]) -> dict:
    return {
        "model": "m.gguf", "text": "/usr/share/common-licenses/GPL-3", "tokens": 4096, "trimmed_bytes": 8 << 20,
        "full_ppl": 10.0,
        "results": [{"policy": p, "layer_budgets": lb, "fraction": f, "budget_bytes": (8 << 20) // int(f[2:]),
                     "kv_bytes": (8 << 20) // int(f[2:]), "ppl": ppl, "kl": kl} for p, lb, f, ppl, kl in rows],
    }  # fmt: skip


def test_matrix_and_versus_rank_every_pair(tmp_path):
    rng = np.random.default_rng(3)
    ppl = {f: 10 + rng.random(len(PAIRS)) for f in ("1/4", "1/8")}
    kl = {f: rng.random(len(PAIRS)) / 10 for f in ("1/4", "1/8")}
    rows = [(*pair, f, float(ppl[f][i]), float(kl[f][i])) for f in ppl for i, pair in enumerate(PAIRS)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(rows[:3])))
    b.write_text(json.dumps(report(rows[3:])))
    cmd = [sys.executable, str(SCRIPT), str(a), str(b), "--out", str(tmp_path / "f.png"), "--matrix",
           "--versus", "ahakv/adaptive auto"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "f.png").stat().st_size > 0
    lines = out.splitlines()
    for i, (policy, layout) in enumerate(PAIRS):
        row = next(line for line in lines if line.startswith(f"| {policy} / {layout} |"))
        for frac in ("1/4", "1/8"):
            r_ppl = int(np.argsort(np.argsort(ppl[frac]))[i]) + 1
            r_kl = int(np.argsort(np.argsort(kl[frac]))[i]) + 1
            assert f"{ppl[frac][i]:.3f} ({kl[frac][i]:.4f}), {r_ppl} / {r_kl} of {len(PAIRS)}" in row
    for frac in ("1/4", "1/8"):
        ref_ppl, ref_kl = ppl[frac][0], kl[frac][0]
        versus = [line for line in lines if line.startswith(f"| {frac} |")]
        assert len(versus) == len(PAIRS)
        assert [float(v.split("|")[3]) for v in versus] == sorted(round(x, 3) for x in ppl[frac])
        for i, (policy, layout) in enumerate(PAIRS[1:], start=1):
            line = next(v for v in versus if f" {policy} / {layout} " in v)
            below = [k for k, x, ref in (("ppl", ppl[frac][i], ref_ppl), ("kl", kl[frac][i], ref_kl)) if x < ref]
            assert line.rstrip(" |").endswith(", ".join(below) or "-")
            assert f"| {ppl[frac][i] / ref_ppl:.3f} | {kl[frac][i] / ref_kl:.2f} |" in line


def test_runs_of_different_texts_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report([("ahakv", "natural auto", "1/4", 10.5, 0.02)])))
    b.write_text(json.dumps(report([("h2o", "natural auto", "1/4", 10.6, 0.03)]) | {"tokens": 2048}))
    done = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--out", str(tmp_path / "f.png")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0 and "do not compare" in done.stderr
