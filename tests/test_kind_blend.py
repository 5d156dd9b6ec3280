"""One cache per layer, scored with its kind (``groups.blend_with_kind``): a layer's eviction score blends its own
percentile rank with the mean rank its kind's layers give each position (0 where a layer already evicted it).

References: a plain-Python loop over the definition (sorted(), dicts) for the blend itself; on the six-layer
gemma3 fixture (layers 0, 2, 4 slide over 24 positions, 1, 3, 5 attend to every position) the known answer of
a mix of 1: every layer of a kind holds the same positions at every step, since its score no longer depends on
the layer, while a mix of 0 lets them part.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layer_budgets import CHUNK
from test_per_layer_caches import SLIDES

from ahakv_local import groups
from ahakv_local.budget import Budget
from ahakv_local.fixture import FixtureSpec
from ahakv_local.groups import LayerGroup, blend_with_kind, percentile_ranks
from ahakv_local.models import fixture_path
from ahakv_local.session import SessionSpec, open_session


def layer(live: list[int], window: int) -> LayerGroup:
    return LayerGroup("layer", None, None, None, Budget.parse("8"), np.asarray(live, dtype=np.int64), window)


def reference_blend(lives: list[list[int]], windows: list[int], scores: list[list[float]], mix: float) -> list:
    """The definition, one position at a time."""
    ranks = []
    for live, s in zip(lives, scores, strict=True):
        order = sorted(range(len(live)), key=lambda j: (s[j], live[j]))
        ranks.append({live[j]: r / max(len(live) - 1, 1) for r, j in enumerate(order)})
    out = []
    for live, window, s, rank in zip(lives, windows, scores, ranks, strict=True):
        kin = [r for r, w in zip(ranks, windows, strict=True) if bool(w) == bool(window)]
        row = []
        for j, p in enumerate(live):
            kind = sum(r.get(p, 0.0) for r in kin) / len(kin)
            row.append(np.inf if s[j] == np.inf else (1 - mix) * rank[p] + mix * kind)
        out.append(row)
    return out


@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])  # 0: the policy's own scores, as they are
def test_blend_is_the_definition(mix):
    rng = np.random.default_rng(7)
    lives, windows, scores = [], [], []
    for il in range(6):
        live = sorted(rng.choice(40, size=int(rng.integers(5, 30)), replace=False).tolist())
        s = rng.integers(0, 5, size=len(live)).astype(float).tolist()  # ties: broken by position
        if il == 3:
            s[0] = np.inf
        lives.append(live)
        windows.append(24 if il % 2 == 0 else 0)
        scores.append(s)
    got = blend_with_kind([layer(v, w) for v, w in zip(lives, windows, strict=True)],
                          [np.asarray(s) for s in scores], mix)  # fmt: skip
    wanted = scores if mix == 0 else reference_blend(lives, windows, scores, mix)
    for g, want in zip(got, wanted, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-15, atol=1e-15)  # a few float64 operations on values <= 1


def test_ranks_order_like_the_eviction():
    """Lowest score first, older first among equals: the controller's lexsort order, as ranks in [0, 1]."""
    got = percentile_ranks(np.array([2.0, 1.0, 1.0, 0.0]), np.array([3, 5, 7, 9]))
    np.testing.assert_array_equal(got, [1.0, 1 / 3, 2 / 3, 0.0])
    assert percentile_ranks(np.array([4.0]), np.array([2])).tolist() == [0.0]


@pytest.fixture(scope="module")
def six_layers():
    return fixture_path(FixtureSpec(arch="gemma3", n_layer=6))


def live_by_kind(six_layers, text: str, policy: str, mix: float, monkeypatch) -> dict[bool, list[np.ndarray]]:
    monkeypatch.setattr(groups, "KIND_MIX", mix)
    spec = SessionSpec.bounded(policy, "40", n_sink=2, n_recent=4, evict_every=4, layer_budgets="uniform")
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        toks = e.tokenize(text)[:200]
        c.prefill(toks[:160])
        for t in toks[160:]:
            c.step(t)
        return {kind: [g.live for g in c.groups if SLIDES[g.layers[0]] == kind] for kind in (False, True)}


@pytest.mark.parametrize("policy", ["ahakv", "h2o", "tova"])
def test_a_full_mix_keeps_a_kinds_layers_together(six_layers, license_text, policy, monkeypatch):
    together = live_by_kind(six_layers, license_text, policy, 1.0, monkeypatch)
    apart = live_by_kind(six_layers, license_text, policy, 0.0, monkeypatch)
    for kind in (False, True):
        first, *rest = together[kind]
        for other in rest:
            np.testing.assert_array_equal(other, first)
    # the full-attention layers, each scored alone, keep different positions: the blend is what binds them
    assert any(not np.array_equal(a, apart[False][0]) for a in apart[False][1:])
