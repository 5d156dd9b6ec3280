"""Adaptive layer budgets (``--layer-budgets adaptive``): caches resized while a sequence is read
(``Engine.resize_caches``), each layer's share measured from its attention (``adaptive.LayerShares``) and laid
out within its kind's bytes (``budget.allocate``).

Fixture: the random-weight gemma3 GGUF with six layers (ahakv_local/fixture.py): layers 0, 2 and 4 slide over 24
positions, layers 1, 3 and 5 attend to every position; one cache per layer. References:

* numpy's softmax of the model's own Q and K over each layer's survivors (``check_rows_against_reference``)
  after a resize that renumbers every cell;
* the same engine without a resize, bit for bit, where the resize leaves every live cell where it was (no holes:
  the state is read back into cells 0.. in the order it was written);
* the fill of a layer from its definition on attention patterns whose entropy is known (uniform, one-hot).

Numerics: F32 K/V caches; bounds from F32 = 2^-24 (tests/numerics.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layer_budgets import CHUNK, GEMMA3_270M_BY_LAYER, GEMMA3_LAYERS, run_checked
from test_per_layer_caches import PER_LAYER

from ahakv_local import adaptive
from ahakv_local.adaptive import LayerShares, fill
from ahakv_local.budget import ADAPTIVE_RANGE, Budget, allocate, whole_cells
from ahakv_local.errors import AhakvError
from ahakv_local.native import TapFlag
from ahakv_local.policies import POLICIES, Observation
from ahakv_local.session import SessionSpec, open_session

from capture import Capture
from numerics import norm_rtol
from test_layer_groups import QK_OPS, check_rows_against_reference, make_engine, tokens

EVICTING = sorted(set(POLICIES) - {"full"})


# -- the engine: a context of new sizes keeps the sequence --------------------------------------------------


def test_a_resized_context_attends_to_the_same_survivors(six_layers, license_text):
    """Evictions that differ per layer, then caches of other sizes (some smaller, some larger): every layer keeps
    its live positions, each cache has the cells asked (and the bytes), and each layer's softmax row after the
    move is numpy's over its own survivors; a second resize after more evictions, and decoding refills cells."""
    cap = Capture(("Qcur-", "Kcur-", "kq_soft_max-"), ops=QK_OPS)
    with make_engine(six_layers, cap, layer_groups=PER_LAYER, cache_cells=(64, 48, 72, 56, 80, 64)) as e:
        toks = tokens(e, license_text, 64)
        e.decode(toks[:40])
        evicted = {c: {2 + c, 9 + 2 * c, 28 + c, 37 - c} for c in e.caches}
        for cache, victims in evicted.items():
            e.evict(sorted(victims), cache=cache)
        before = [e.live_positions(il).copy() for il in range(6)]
        one_cell = e.kv_bytes() // sum(e.cache_cells(c) for c in e.caches)
        sizes = (44, 64, 36, 90, 48, 70)  # cache 0 (36 live cells) with room for the 6 tokens before t = 46
        e.resize_caches(sizes)
        assert [e.cache_cells(c) for c in e.caches] == list(sizes) and e.kv_bytes() == sum(sizes) * one_cell
        for il in range(6):  # a sliding layer's state holds only its window (llama.cpp's reader drops the rest)
            want = before[il][before[il] > 39 - e.n_swa] if e.layer_sliding[il] else before[il]
            np.testing.assert_array_equal(e.live_positions(il), want, f"layer {il} lost or gained positions")
        for t in range(40, 52):
            e.decode([toks[t]])
            check_rows_against_reference(e, cap, t, evicted)
            if t == 45:
                for cache, p in ((0, [41, 43]), (2, [42, 44])):
                    e.evict(p, cache=cache)
                    evicted[cache] |= set(p)
                e.resize_caches((72,) * 6)
        e.decode(toks[52:64])
        assert e.n_past == 64


def test_a_resize_without_holes_is_bit_for_bit(six_layers, license_text):
    """No evictions, and a resize before the sliding window is full (the reader drops what a window no longer
    sees): the state goes back into cells 0.. in the order it came out, so every live cell is where it was, and
    the logits of single-token decodes are those of the engine that was not resized, bit for bit, through and past
    the window. (A batch of rows is not: its kernel spans the larger caches' empty cells in other blocks.)"""
    with (
        make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(128,) * 6) as a,
        make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(128,) * 6) as b,
    ):
        toks = tokens(a, license_text, 60)
        np.testing.assert_array_equal(a.decode(toks[:20]), b.decode(toks[:20]))
        a.resize_caches((128, 160, 200, 130, 256, 140))
        for t in range(20, 60):
            np.testing.assert_array_equal(a.decode([toks[t]]), b.decode([toks[t]]), f"logits at position {t}")


@pytest.mark.parametrize(
    "kv",
    [
        dict(type_k="f32", type_v="f32"),  # V transposed (the non-flash path), F32: copied
        dict(type_k="f16", type_v="f16"),  # transposed, F16: through patch 0023's table
        dict(type_k="f16", type_v="f16", flash_attn=True),  # V by cell (flash attention)
    ],
    ids=["f32", "f16", "f16-flash"],
)
def test_the_value_norms_survive_a_resize(six_layers, license_text, kv):
    """The value norms are not in llama.cpp's state: the reader recomputes them from V on the host, in either
    layout of V and any type. They equal the ones the graph wrote from the same stored values, to an F32 norm's
    rounding in another order (norm_rtol(head_dim), each side)."""
    with make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(64,) * 6, **kv) as e:
        toks = tokens(e, license_text, 41)
        e.set_tap(TapFlag.VNORM, 0)
        e.decode(toks[:40])
        for c in e.caches:
            e.evict([3 + c, 17, 30 - c], cache=c)
        before = [e.stat("vnorm", il) for il in range(6)]
        e.resize_caches((50, 40, 60, 45, 70, 38))
        e.set_tap(TapFlag.VNORM, 0)
        e.decode([toks[40]])  # the reader's recomputation happens before the next use
        for il in range(6):
            got = e.stat("vnorm", il)
            old = before[il]
            kept = old.positions > 39 - e.n_swa if e.layer_sliding[il] else old.positions >= 0  # see above
            assert np.array_equal(got.positions[:-1], old.positions[kept]) and got.positions[-1] == 40
            tol = 2 * norm_rtol(e.head_dim) * old.values[:, kept] + 2.0**-126
            assert np.all(np.abs(got.values[:, :-1] - old.values[:, kept]) <= tol), f"layer {il}"


def test_resizes_that_cannot_be_are_refused(six_layers, license_text):
    with make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(64,) * 6) as e:
        toks = tokens(e, license_text, 41)
        logits = e.decode(toks[:40])
        with pytest.raises(AhakvError, match="holds 40 cells: 39 cannot hold them"):
            e.resize_caches((64, 39, 64, 64, 64, 64))
        assert [e.cache_cells(c) for c in e.caches] == [64] * 6  # nothing changed
        assert e.live_positions(0).size == 40 and np.isfinite(logits).all()
        e.decode([toks[40]])
    with make_engine(six_layers, n_seq=2, layer_groups=PER_LAYER, cache_cells=(128,) * 6) as shared:
        with pytest.raises(AhakvError, match="one-sequence context"):
            shared.view(1).resize_caches((128,) * 6)
        spec = SessionSpec.bounded("h2o", "40KiB", layer_budgets="adaptive")
        with pytest.raises(AhakvError, match="not possible on a shared context"):  # before anything is evicted
            spec.controller(shared.view(1))


# -- the shares: measured, decided, laid out ---------------------------------------------------------------


def observation(attn: np.ndarray, visible: np.ndarray) -> Observation:
    n = attn.shape[-1]
    return Observation(np.arange(n), n, 1, n, visible[None, :], attn=attn[None].astype(np.float32))


def test_fill_is_the_effective_share_of_what_a_layer_sees():
    n, seen = 40, np.arange(40) >= 10  # 30 positions visible
    uniform = np.where(seen, 1.0, 0.0) * np.ones((4, n))
    assert fill(observation(uniform, seen)) == pytest.approx(1.0)
    one_hot = np.zeros((4, n))
    one_hot[np.arange(4), [12, 20, 25, 39]] = 2.0
    assert fill(observation(one_hot, seen)) == pytest.approx(1 / 30)
    # two heads uniform over 10 and 15 of the 30: exp(entropy) = 10 and 15
    mixed = np.zeros((2, n))
    mixed[0, 10:20], mixed[1, 25:40] = 0.1, 1 / 15
    assert fill(observation(mixed, seen)) == pytest.approx((10 + 15) / 2 / 30)
    # mass where the layer cannot see (a cell outside its window) is no part of its spread: uniform over the 30 seen
    assert fill(observation(np.ones((4, n)), seen)) == pytest.approx(1.0)
    assert fill(Observation(np.arange(n), n, 1, n, seen[None, :])) is None  # no softmax tapped
    every = np.ones(n, dtype=bool)  # a layer that sees all it holds (no mask to apply)
    assert fill(observation(np.ones((4, n)), every)) == pytest.approx(1.0)
    assert fill(observation(one_hot, every)) == pytest.approx(1 / 40)


def test_shares_follow_the_fill_within_each_kind(monkeypatch):
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 100)
    sliding = [True, False, True, False, True, False]
    shares = LayerShares(sliding, gamma=1.0)
    assert not shares.due(500)  # nothing measured yet
    fills = [0.2, 0.1, 0.4, 0.3, 0.6, 0.2]
    for il, f in enumerate(fills):
        shares.fill[il] = f
    assert not shares.due(99) and shares.due(100)
    w = shares.decide(130)
    assert shares.next_at == 230
    # within each kind: proportional to the fill, mean 1 (sliding 0.2/0.4/0.6, full 0.1/0.3/0.2)
    np.testing.assert_allclose(w[[0, 2, 4]], [0.5, 1.0, 1.5])
    np.testing.assert_allclose(w[[1, 3, 5]], [0.5, 1.5, 1.0])
    shares.applied({il: Budget("cells", 100 * w[il]) for il in range(6)})
    np.testing.assert_allclose(shares.weights, w)
    shares.applied({0: Budget("cells", 50), 2: Budget("cells", 100), 4: Budget("cells", 150)} | {
        il: Budget("auto") for il in (1, 3, 5)})  # fmt: skip
    np.testing.assert_allclose(shares.weights, [0.5, w[1], 1.0, w[3], 1.5, w[5]])  # auto: weights kept
    shares.fill[:] = [0.3, 0.2, 0.3, 0.2, 0.3, 0.2]  # every layer of a kind fills alike: the shares stay
    np.testing.assert_allclose(shares.decide(230), w)
    shares.restart(300)
    assert np.isnan(shares.fill).all() and shares.next_at == 400
    half = LayerShares(sliding, gamma=0.5)  # half the step: the square root of the fill ratios
    half.fill[:] = fills
    w = half.decide(100)
    root = np.sqrt([0.2, 0.4, 0.6])
    np.testing.assert_allclose(w[[0, 2, 4]], root / root.mean())


@pytest.mark.parametrize("text", ["16MiB", "5MiB", "1024"])
def test_adaptive_layouts_on_gemma3_270m(text):
    """Without weights adaptive is uniform; with weights each kind's holdings follow them within
    ADAPTIVE_RANGE of the kind's mean (and the window, and the floor), never above natural's bytes."""
    chunk, every, keep = 64, 32, 36
    budget = Budget.parse(text)
    uniform = allocate(budget, GEMMA3_270M_BY_LAYER, "uniform", chunk, 4096, 0, every, None, keep)
    natural = allocate(budget, GEMMA3_270M_BY_LAYER, "natural", chunk, 4096, 0, every, None, keep)
    unweighted = allocate(budget, GEMMA3_270M_BY_LAYER, "adaptive", chunk, 4096, 0, every, None, keep)
    assert unweighted.groups == uniform.groups and unweighted.cache_cells == uniform.cache_cells
    weights = [3.0 if il % 4 == 0 else 1.0 for il in range(18)]  # far outside the range: clamped
    a = allocate(budget, GEMMA3_270M_BY_LAYER, "adaptive", chunk, 4096, 0, every, None, keep, weights)
    assert sum(a.cache_cells) * 1024 <= GEMMA3_270M_BY_LAYER.bytes(natural.cache_cells)
    by_layer = [int(a.groups[a.layer_groups[il]].value) for il in range(18)]
    for kind in (False, True):
        mean = natural.groups[int(kind)].value
        held = [h for h, s in zip(by_layer, GEMMA3_LAYERS, strict=True) if s == kind]
        heavy = [h for il, h in enumerate(by_layer) if GEMMA3_LAYERS[il] == kind and il % 4 == 0]
        light = [h for il, h in enumerate(by_layer) if GEMMA3_LAYERS[il] == kind and il % 4 != 0]
        floor = min(keep + 1, 512 if kind else 10**9) + every - 1
        cap = 512 + every - 1 if kind else 10**9
        assert min(held) >= max(floor, (1 - ADAPTIVE_RANGE) * mean) - 1
        assert max(held) <= min(cap, (1 + ADAPTIVE_RANGE) * mean)
        if heavy and light and min(heavy) < cap:
            assert min(heavy) > max(light), "a layer weighted up must hold more"


@pytest.mark.parametrize("seed", range(4))
def test_a_kind_holds_its_cell_budget_exactly_on_average(seed):
    """Shares of a cell budget are rounded to whole cells that add up to the kind's cells (largest remainders up):
    the full-attention layers hold 1,024 on average, what ``kv_stats`` reports as the budget; each layer within one
    cell of its share (a numpy reference of the shares: ``spread`` inside ADAPTIVE_RANGE, no cap binding here)."""
    rng = np.random.default_rng(seed)
    chunk, every, keep = 64, 32, 36
    weights = rng.uniform(0.6, 1.4, 18)
    a = allocate(Budget.parse("1024"), GEMMA3_270M_BY_LAYER, "adaptive", chunk, 0, 0, every, None, keep, weights)
    full = np.flatnonzero(~np.asarray(GEMMA3_LAYERS))
    held = np.array([a.groups[a.layer_groups[il]].value for il in full])
    share = 1024 * weights[full] / weights[full].mean()
    assert held.sum() == 3 * 1024 and np.all(np.abs(held - share) < 1)
    assert whole_cells([2.5, 2.5, 1.0]) in ([3, 2, 1], [2, 3, 1]) and whole_cells([0.4, 0.4, 0.4]) == [1, 0, 0]
    assert whole_cells([3.7, 1.2]) == [3, 1]  # 4.9 cells: 4 whole ones, none rounded up


def test_no_full_attention_layer_holds_more_than_the_longest_sequence():
    """A full-attention layer weighted above the longest sequence would keep cells it can never fill while the
    others evict: it holds the longest sequence and the others share what it could not use (the kind's cells
    kept where they fit); where even the mean exceeds the sequence, every full-attention layer holds all of it,
    as natural's one cache does (nothing evicted)."""
    chunk, every, keep = 64, 32, 36
    budget = Budget.parse("1024")  # natural: 1024 cells in each full-attention layer
    full = [il for il, s in enumerate(GEMMA3_LAYERS) if not s]
    weights = [1.0] * 18
    weights[full[0]] = 1.5  # one layer asks for 1.5x the mean, inside ADAPTIVE_RANGE
    for longest, want in ((1100 - every + 1, None), (800, 800 + every - 1)):  # a cap leaves one eviction period
        a = allocate(budget, GEMMA3_270M_BY_LAYER, "adaptive", chunk, longest, 0, every, None, keep, weights)
        held = [int(a.groups[a.layer_groups[il]].value) for il in full]
        assert max(held) <= longest + every - 1
        if want is None:
            # the rest went to the others
            assert held[0] == longest + every - 1 and sum(held) >= 3 * 1024 - len(held), held
        else:
            assert held == [want] * 3
    a = allocate(budget, GEMMA3_270M_BY_LAYER, "adaptive", chunk, 0, 0, every, None, keep, weights)
    assert int(a.groups[a.layer_groups[full[0]]].value) > 1100  # longest unknown (0): no cap
    # the sliding layers all at their cap (window + one period): one weighted down has no one to give to, keeps it
    weights[0] = 0.5
    a = allocate(budget, GEMMA3_270M_BY_LAYER, "adaptive", chunk, 4096, 0, every, None, keep, weights)
    assert {int(a.groups[a.layer_groups[il]].value) for il, s in enumerate(GEMMA3_LAYERS) if s} == {512 + every - 1}


# -- the controller -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", EVICTING)
def test_every_layer_holds_its_adaptive_budget(six_layers, license_text, policy, monkeypatch):
    """Decisions every 32 positions: every layer's group holds its (changing) budget at every step, its live
    positions are its cache's map after each resize, no protected position is evicted (run_checked), the caches
    end within the byte budget, and the shares moved."""
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 32)
    budget = "40KiB"
    spec = SessionSpec.bounded(
        policy, budget, n_sink=4, n_recent=8, evict_every=4, pinned=(30, 36), layer_budgets="adaptive"
    )
    got = run_checked(six_layers, license_text, spec, prompt=200, steps=50)
    assert got["kv_bytes"] <= Budget.parse(budget).value
    assert {f"layer {il}" for il in range(6)} <= set(got)
    # the shares moved, for every policy (the layers' fill is read from the model's softmax, whatever the policy taps:
    # with it tapped only for policies that read attention, streaming and random stayed even, uniform in all but name)
    assert got["decisions"] >= 5 and not np.allclose(got["weights"], 1.0), got["weights"]


def test_an_adaptive_session_resizes_as_it_reads(six_layers, license_text, monkeypatch):
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 48)
    spec = SessionSpec.bounded("ahakv", "40KiB", n_recent=8, evict_every=4, layer_budgets="adaptive")
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        first = [e.cache_cells(k) for k in e.caches]
        toks = e.tokenize(license_text)[:260]
        c.prefill(toks[:200])
        for t in toks[200:]:
            c.step(t)
        assert c.shares.decisions == 260 // 48
        assert [e.cache_cells(k) for k in e.caches] != first, "the caches never changed size"
        assert e.kv_bytes() <= 40 * 1024
        for g in c.groups:
            np.testing.assert_array_equal(g.live, g.read_live(e))
        for kind in (False, True):  # within a kind, at most (1 + range) / (1 - range) apart (+ a cell of rounding)
            held = [g.budget.value for g in c.groups if e.layer_sliding[g.layers[0]] == kind]
            assert max(held) <= (1 + ADAPTIVE_RANGE) / (1 - ADAPTIVE_RANGE) * min(held) + 1


def test_a_new_sequence_starts_from_even_shares(six_layers, license_text, monkeypatch):
    """After a rewind to the start (a server's next request, chat's /reset) the layers hold even shares again and
    the caches get their first sizes back, so a sequence meets the same decisions whatever came before it: the same
    text read twice leaves every layer the same positions, its statistics alike."""
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 48)
    spec = SessionSpec.bounded("h2o", "40KiB", n_recent=8, evict_every=4, layer_budgets="adaptive")
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        first, even = e.cache_sizes(), [g.budget for g in c.groups]
        toks = e.tokenize(license_text)[:260]

        def read() -> tuple[list[np.ndarray], tuple[int, ...], int]:
            before = c.stats.evicted  # counted from the start of the session (tokens_seen: until a rewind)
            c.prefill(toks[:200])
            for t in toks[200:]:
                c.step(t)
            return [g.live.copy() for g in c.groups], e.cache_sizes(), c.stats.evicted - before

        once = read()
        assert once[1] != first, "the caches never changed size"
        s.reset()
        assert np.all(c.shares.weights == 1.0) and [g.budget for g in c.groups] == even
        twice = read()
        for a, b in zip(once[0], twice[0], strict=True):
            np.testing.assert_array_equal(a, b)
        assert twice[1:] == once[1:] and once[2] > 0


def test_a_restart_replaces_a_decision_not_yet_applied(six_layers, license_text):
    """A decision resizes the caches just before the next decode; a new sequence started before that decode
    restores even shares and the first sizes, so the decision is not applied stale (budgets even, caches not)."""
    spec = SessionSpec.bounded("h2o", "40KiB", n_recent=8, evict_every=4, layer_budgets="adaptive")
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        first, toks = e.cache_sizes(), e.tokenize(license_text)[:CHUNK]
        c.prefill(toks)
        weights = [1.3 if il == 1 else 0.7 if il == 3 else 1.0 for il in range(6)]  # layers 1, 3, 5: full attention
        c._hold(c.allocation(c.config.budget, weights))  # as a decision does
        assert c._resize_to not in (None, first)
        s.reset()
        c.prefill(toks)
        assert e.cache_sizes() == first
        for g in c.groups:
            assert g.live.size <= g.budget.target(e.n_past)
            np.testing.assert_array_equal(g.live, g.read_live(e))


def test_a_guided_reading_keeps_the_shares_and_decoding_adapts_after_it(six_layers, license_text, monkeypatch):
    """While a question guides the reading the layers keep their even split (no decision, no resize: the layers of
    a kind rank the question's positions alike and keep the same ones only if they hold as many); once the prompt
    is read, decoding decides as usual, from the fill measured during the read."""
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 48)
    spec = SessionSpec.bounded("ahakv", "40KiB", n_recent=8, evict_every=4, layer_budgets="adaptive", reading="query")
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        first = [e.cache_cells(k) for k in e.caches]
        toks, question = e.tokenize(license_text)[:260], e.tokenize(" Which license?", add_bos=False)
        guided = []
        real = c.read_query
        c.read_query = lambda q: guided.append(len(q)) or real(q)
        s.read(toks[:200], question)
        assert guided, "the question never guided the reading"
        assert c.shares.decisions == 0 and [e.cache_cells(k) for k in e.caches] == first
        assert len({g.budget.value for g in c.groups if not e.layer_sliding[g.layers[0]]}) == 1  # even
        for t in toks[200:]:
            c.step(t)
        assert c.shares.decisions >= 1
        for g in c.groups:
            np.testing.assert_array_equal(g.live, g.read_live(e))


def test_the_drop_in_resizes_its_own_context(six_layers, license_text, monkeypatch):
    """The drop-in's context belongs to llama_cpp.Llama: a resize hands it the new one, and generation goes on
    through upstream's own calls (sampling reads the new context's logits)."""
    from ahakv_local import Llama

    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 48)
    with Llama(
        str(six_layers), kv_budget="40KiB", kv_policy="h2o", kv_recent=8, kv_layer_budgets="adaptive",
        n_ctx=400, n_batch=CHUNK, n_ubatch=CHUNK, verbose=False,
    ) as llm:  # fmt: skip
        e, c = llm.kv_engine, llm.kv_controller
        prompt = llm.detokenize(e.tokenize(license_text)[1:180]).decode(errors="replace")
        out = llm.create_completion(prompt, max_tokens=40, temperature=0.0)
        assert out["usage"]["completion_tokens"] > 0
        assert c.shares.decisions >= 3 and llm._ctx.ctx == e.ctx
        assert e.kv_bytes() <= 40 * 1024
        for g in c.groups:
            np.testing.assert_array_equal(g.live, g.read_live(e))


def test_a_saved_state_loads_into_the_caches_it_was_made_in(six_layers, license_text, monkeypatch):
    """A state saved after the shares moved loads into a fresh drop-in (even shares): llama.cpp loads a cache's
    cells only into one as large, so the caches take the saved sizes first; the same positions come back in every
    layer, and a state whose caches exceed this budget is refused in one line with nothing changed."""
    from ahakv_local import Llama

    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 10**6)  # the shares set below stay while the text is read
    kw = dict(kv_budget="160KiB", kv_policy="h2o", kv_recent=8, kv_layer_budgets="adaptive", n_ctx=2048,
              n_batch=CHUNK, n_ubatch=CHUNK, verbose=False)  # fmt: skip
    with Llama(str(six_layers), **kw) as llm:
        c, e = llm.kv_controller, llm.kv_engine
        weights = [1.5 if il == 1 else 0.5 if il == 3 else 1.0 for il in range(6)]  # layers 1, 3, 5: full attention
        toks = e.tokenize(license_text)[:700]
        llm.eval(toks[:CHUNK])  # a new sequence starts from even shares; then they move, as a decision moves them
        c._hold(c.allocation(c.config.budget, weights))
        llm.eval(toks[CHUNK:])
        sizes = e.cache_sizes()
        assert max(sizes) > min(n for n, k in zip(sizes, map(e.cache_sliding, e.caches), strict=True) if not k) + 64
        state = llm.save_state()
        live = {g.name: g.live.copy() for g in c.groups}
    with Llama(str(six_layers), **kw) as fresh:
        assert fresh.kv_engine.cache_sizes() != sizes
        fresh.load_state(state)
        assert fresh.kv_engine.cache_sizes() == sizes
        for g in fresh.kv_controller.groups:
            np.testing.assert_array_equal(g.live, live[g.name])
            np.testing.assert_array_equal(g.live, g.read_live(fresh.kv_engine))
        state.kv_cache_cells = tuple(n + 200 for n in sizes)  # more bytes than this budget holds
        with pytest.raises(ValueError, match="saved in caches of other sizes"):
            fresh.load_state(state)
        assert fresh.kv_engine.cache_sizes() == sizes and fresh.n_tokens == 700


def test_statistics_of_other_layers_align_with_one_layers_positions(six_layers, license_text):
    """Statistics of several per-layer caches aligned with one layer's positions (other caches hold other
    positions): each layer's statistics land on the positions both hold (by position, as that layer's own ``stat``
    gives them), and what the one layer does not hold is left out, not put on a neighbour."""
    with make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(64,) * 6) as e:
        toks = tokens(e, license_text, 41)
        e.decode(toks[:40])
        for c in e.caches:
            e.evict([2 + 3 * c, 11 + c, 20 - c], cache=c)
        e.set_tap(TapFlag.ATTN, 0)
        e.reset_stats()
        e.decode([toks[40]])
        full = [1, 3, 5]
        live = e.live_positions(3).astype(np.int64)
        got = e.aligned(live, TapFlag.ATTN, full)
        for row, il in enumerate(full):
            own = e.stat("attn", il)
            both = np.isin(live, own.positions)
            np.testing.assert_array_equal(got.visible[row], both)
            np.testing.assert_array_equal(
                got.values[TapFlag.ATTN][row][:, both], own.values[:, np.isin(own.positions, live)]
            )
            assert not got.values[TapFlag.ATTN][row][:, ~both].any()


def test_a_sliding_layers_statistics_align_with_the_positions_its_window_sees(six_layers, license_text):
    """A sliding layer's cache still holds positions that left its window (llama.cpp reuses their cells only when it
    needs them): aligned with everything the cache holds, the statistics are that layer's own by position inside the
    window (``stat``) and zero, not visible, outside it."""
    with make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(64,) * 6) as e:
        toks = tokens(e, license_text, 41)
        e.decode(toks[:40])
        e.evict([30, 33], cache=e.layer_cache[0])  # holes inside the window too
        e.set_tap(TapFlag.ATTN | TapFlag.VNORM, 0)
        e.reset_stats()
        e.decode([toks[40]])
        assert e.layer_sliding[0] and 0 < e.n_swa < 40
        live = e.live_positions(0).astype(np.int64)
        seen = e.n_past - 1 - live < e.n_swa
        assert seen.any() and not seen.all()  # some of what the cache holds is outside the window
        got = e.aligned(live, TapFlag.ATTN | TapFlag.VNORM, [0])
        np.testing.assert_array_equal(got.visible[0], seen)
        for flag, kind in ((TapFlag.ATTN, "attn"), (TapFlag.VNORM, "vnorm")):
            own = e.stat(kind, 0)
            inside = np.isin(own.positions, live[seen])
            np.testing.assert_array_equal(got.values[flag][0][:, seen], own.values[:, inside])
            assert not got.values[flag][0][:, ~seen].any()


@pytest.mark.parametrize("layout", ["pyramid", "adaptive"])
def test_the_side_pass_is_sharpened_for_the_budget_whatever_one_layer_holds(six_layers, license_text, layout,
                                                                            monkeypatch):  # fmt: skip
    """AhaKV's side pass is sharpened by lambda(n) = sqrt(2 ln(n / k) / d), k the budget (README, the paper); one
    scale serves every layer of a sequence. In the per-layer layouts k was the first group's target, one full-attention
    layer's share: under pyramid its 1 + slope times the budget, under adaptive whatever its last re-split gave it. The
    reference is the formula at the cell budget itself, which the full-attention layers hold on average."""
    monkeypatch.setattr(adaptive, "ADAPT_EVERY", 48)
    budget = 48
    spec = SessionSpec.bounded("ahakv", budget, n_recent=8, evict_every=4, layer_budgets=layout)
    with open_session(six_layers, spec, longest=400, n_ubatch=CHUNK) as s:
        c, e = s.controller, s.engine
        scales: list[tuple[int, float]] = []
        real = e.set_side_scale
        monkeypatch.setattr(e, "set_side_scale", lambda x: scales.append((e.n_past, x)) or real(x))
        toks = e.tokenize(license_text)[:300]
        c.prefill(toks[:200])
        for t in toks[200:]:
            c.step(t)
        full = [g.budget.value for g in c.groups if not g.window]
        assert len(set(full)) > 1  # the full-attention layers hold different shares: the case in question
        if layout == "adaptive":
            assert c.shares.decisions >= 2
        decoded = [(n, x) for n, x in scales if n >= 200]
        assert len(decoded) >= 25
        for n, x in decoded:  # (n_past before the one-token decode: the scale is for n + 1 positions seen)
            # (the value handed to the engine, a float64 from math.log/sqrt against numpy's: a few ulps apart at most)
            assert x == pytest.approx(max(1.0, np.sqrt(2 * np.log((n + 1) / budget))), rel=1e-12)
