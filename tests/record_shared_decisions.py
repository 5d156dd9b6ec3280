"""Records what the single-pool controller (before layer groups) evicts on the fixtures, for every policy:
tests/data/shared_decisions.json, which tests/test_layer_budgets.py replays with ``layer_budgets="shared"``.
Run once, at the commit before layer groups: python tests/record_shared_decisions.py. With --robust it lists how many of
each run's evictions stand whatever rounding another machine adds (``robust_decisions``), as the replay compares
them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ahakv_local.budget import Budget
from ahakv_local.controller import ControllerConfig, KVController
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.fixture import FixtureSpec
from ahakv_local.models import fixture_path
from ahakv_local.policies import POLICIES, make_policy

from numerics import FORWARD_RTOL

OUT = Path(__file__).parent / "data" / "shared_decisions.json"
TEXT = "/usr/share/common-licenses/GPL-3"
PROMPT, STEPS, CHUNK = 150, 60, 16
QUESTION = " Which license is this?"
# the settings the recorded decisions were made with, where a policy's defaults have changed since (AhaKV's guided
# pooling went from 7 to 11 on 2026-12-02, and a word's tokens take its best score since; both act only in a guided
# read, so the plain recordings never saw them)
RECORDED_WITH = {"ahakv": {"query_kernel": 7, "read_kernel": 7, "whole_words": False}}


def run(path, policy: str, query: bool) -> dict:
    with Engine(path, EngineConfig(n_ctx=512, n_batch=64, n_ubatch=CHUNK)) as e:
        toks = e.tokenize(open(TEXT, encoding="utf-8").read())[: PROMPT + STEPS]
        q = e.tokenize(QUESTION, add_bos=False) if query else None
        cfg = ControllerConfig(Budget.parse(48), n_sink=4, n_recent=8, evict_every=4, observe_steps=None)
        c = KVController(e, make_policy(policy, **RECORDED_WITH.get(policy, {})), cfg)
        victims = []
        real = e.evict

        def spy(positions, cache=None):
            victims.append([e.n_past, *map(int, positions)])
            return real(positions, cache)

        e.evict = spy
        c.prefill(toks[:PROMPT], query=q)
        for t in toks[PROMPT:]:
            c.step(t)
        return {"victims": victims, "live": c.live.tolist()}


def robust_decisions(path, policy: str, query: bool, victims: list, seeds=(1, 2, 3)) -> int:
    """How many of a run's first evictions (``victims``) stand whatever rounding another machine's kernels add: the run
    again with every statistic the controller reads moved at random by up to the forward bound (FORWARD_RTOL of the
    largest entry: another SIMD path's sums may differ that much), once per seed; the first eviction any of them
    changes and every one after it (the caches differ from there) may differ on another machine."""
    real = Engine.aligned
    robust = len(victims)
    for seed in seeds:
        rng = np.random.default_rng(seed)

        def moved(self, *args, rng=rng, **kw):
            out = real(self, *args, **kw)
            for values in out.values.values():
                values += (rng.uniform(-1, 1, values.shape) * FORWARD_RTOL * np.abs(values).max()).astype(values.dtype)
            return out

        Engine.aligned = moved
        try:
            got = run(path, policy, query)["victims"]
        finally:
            Engine.aligned = real
        robust = min(robust, next((i for i, (a, b) in enumerate(zip(victims, got, strict=False)) if a != b), len(got)))
    return robust


def robust_table() -> None:
    """Each recorded run's evictions, and how many of them stand on this machine (``robust_decisions``)."""
    for key, want in sorted(json.loads(OUT.read_text()).items()):
        arch, policy, *query = key.split("/")
        path = fixture_path(FixtureSpec(arch=arch))
        got = run(path, policy, bool(query))["victims"]
        print(f"{key:22s} {len(want['victims'])} evictions, {robust_decisions(path, policy, bool(query), got)} stand")


def main() -> None:
    out = {}
    for arch in ("llama", "gemma3"):
        path = fixture_path(FixtureSpec(arch=arch))
        for name in sorted(set(POLICIES) - {"full"}):
            out[f"{arch}/{name}"] = run(path, name, False)
            if make_policy(name).reads_with_query:
                out[f"{arch}/{name}/query"] = run(path, name, True)
    OUT.write_text(json.dumps(out))
    print(f"wrote {OUT}: {len(out)} runs")


if __name__ == "__main__":
    import sys

    robust_table() if "--robust" in sys.argv[1:] else main()
