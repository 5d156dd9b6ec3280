"""Layer groups: the full-attention cache and the sliding-window cache of a Gemma 3-style model, each with its
own size (EngineConfig.cache_cells), its own evictions (Engine.evict(..., cache=...)) and its own bytes.

Fixture: the random-weight gemma3 GGUF (ahakv_local/fixture.py): layer 0 slides over n_swa = 24 positions
(the SLIDING cache), layer 1 attends to everything (the BASE cache). The references:

* the model's own softmax row of every layer, read through cb_eval (tests/capture.py), against numpy's softmax of
  the model's own post-RoPE Q and K with the visibility each layer must have after per-cache evictions (its
  window, minus what was evicted from ITS cache): an independent check of what each layer attends to;
* logits bit for bit against stock llama.cpp (llama_memory_seq_rm in a second engine) where the two must agree:
  evicting the same positions from the base and then from the sliding cache is an ordinary eviction;
* the statistics by position against an engine whose sliding-window cache is never reused (swa_full), and, on the
  llama fixture, against the numpy forward of tests/reference.py.

Numerics. All engines here use F32 K/V caches, so llama.cpp computes in F32. The bounds are built from the unit
roundoff F32 = 2^-24 (tests/numerics.py) and the sizes of each computation, never from one machine's results;
each is spelled out where it is used. With AHAKV_TEST_DEVICE (tests/device.py) every engine here runs on that
device, whose matrix products may round their operands to F16 first (numerics.DEVICE_OPERAND); the bit-for-bit
comparisons hold there too (both engines on the same device, the same kernels and shapes).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from ahakv_local import native
from ahakv_local.engine import Cache, Engine, EngineConfig, LayerCache, cache_name
from ahakv_local.errors import AhakvError
from ahakv_local.fixture import ARCH_HPARAMS
from ahakv_local.native import TapFlag

import device
from capture import Capture
from numerics import DEVICE_OPERAND, F32, FORWARD_RTOL, sum_rtol
from reference import LlamaReference

N_SWA = int(ARCH_HPARAMS["sliding_window"])  # 24
N_UBATCH = 16
BASE, SLIDING = LayerCache.BASE, LayerCache.SLIDING
QK_OPS = {"Qcur-": ("ROPE",), "Kcur-": ("ROPE",)}
pytestmark = pytest.mark.device


def make_engine(path, cap: Capture | None = None, **kw) -> Engine:
    config = (
        dict(n_ctx=256, n_batch=256, n_ubatch=N_UBATCH, type_k="f32", type_v="f32", n_gpu_layers=device.N_GPU_LAYERS)
        | kw
    )
    return Engine(path, EngineConfig(**config), cb_eval=cap.callback if cap else None)


def tokens(engine: Engine, text: str, n: int) -> list[int]:
    toks = engine.tokenize(text)
    assert len(toks) >= n
    return toks[:n]


def layer_of(e: Engine, cache: LayerCache) -> int:
    return e.layer_cache.index(cache)


def cell_bytes(e: Engine) -> int:
    """K + V bytes of one cell in one layer: F32 K and V of n_head_kv heads of head_dim."""
    return 2 * e.n_head_kv * e.head_dim * 4


# -- sizes and bytes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cells", "swa_full", "expected"),
    [
        (None, True, (256, 256)),  # llama.cpp: n_ctx padded to 256, swa_full copies it
        (None, False, (256, 256)),  # PAD(min(256, 24 + 16), 256)
        ((300, 40), False, (300, 40)),  # exact, no padding: the SWA cache is its window + one ubatch
        ((100, 17), True, (100, 17)),  # smaller than the window: the caller must evict from it to decode on
        ((257, 0), True, (257, 257)),  # 0 = llama.cpp's rule for that cache: swa_full follows the base size
        ((257, 0), False, (257, 256)),  # PAD(min(257, 40), 256) = 256, within the base size
        ((200, 0), False, (200, 200)),  # the rule's 256 is capped at a base size below it
        ((0, 33), True, (256, 33)),
    ],
)
def test_cache_sizes_are_exact_and_bytes_add_up(gemma3_fixture, cells, swa_full, expected):
    with make_engine(gemma3_fixture, cache_cells=cells, swa_full=swa_full) as e:
        assert e.caches == [BASE, SLIDING]
        for il, cache in enumerate(e.layer_cache):
            assert e.n_cells(il) == expected[int(cache)], f"layer {il} ({cache.name})"
        assert (e.cache_cells(BASE), e.cache_cells(SLIDING)) == expected
        n_layers = {c: e.layer_cache.count(c) for c in (BASE, SLIDING)}
        for cache in (BASE, SLIDING):
            assert e.kv_bytes(cache) == expected[int(cache)] * n_layers[cache] * cell_bytes(e)
        assert e.kv_bytes(BASE) + e.kv_bytes(SLIDING) == e.kv_bytes()


def test_one_cache_model(fixture_model):
    with make_engine(fixture_model, cache_cells=(300, 0)) as e:
        assert e.caches == [BASE]
        assert all(e.n_cells(il) == 300 for il in range(e.n_layer))
        assert e.kv_bytes(BASE) == e.kv_bytes() == 300 * e.n_layer * cell_bytes(e)
        assert e.kv_bytes(SLIDING) == 0 and e.cache_cells(SLIDING) == 0
        e.decode(list(range(3, 40)))
        with pytest.raises(AhakvError, match="no sliding cache"):
            e.evict([3], cache=SLIDING)
        assert e.evict([3, 4], cache=BASE) == 2
        np.testing.assert_array_equal(e.live_positions(), np.setdiff1d(np.arange(37), [3, 4]))
    with pytest.raises(AhakvError, match="no sliding-window cache"):
        make_engine(fixture_model, cache_cells=(300, 40))
    with pytest.raises(ValueError, match="n_ubatch"):
        make_engine(fixture_model, cache_cells=(10, 0))
    with pytest.raises(ValueError, match="cell counts"):
        make_engine(fixture_model, cache_cells=(-1, 0))


def test_next_context_setting_is_consumed_once(gemma3_fixture):
    """llama_ahakv_set_next_cache_cells sizes the next context of this thread only, even when that creation fails."""
    lib = native.lib()
    assert lib.set_next_cache_cells(-1, 0) == -1
    with make_engine(gemma3_fixture) as e:  # the Engine always says its sizes: (0, 0) is llama.cpp's rule
        assert (e.cache_cells(BASE), e.cache_cells(SLIDING)) == (256, 256)
        model = e._model.model
        base, sliding = e.layer_cache.index(BASE), e.layer_cache.index(SLIDING)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.swa_full = 256, 32, 32, False

        def raw_sizes() -> tuple[int, int]:
            ctx = llama_cpp.llama_init_from_model(model, params)
            try:
                return lib.n_cells(ctx, base), lib.n_cells(ctx, sliding)
            finally:
                llama_cpp.llama_free(ctx)

        assert lib.set_next_cache_cells(300, 40) == 0
        assert raw_sizes() == (300, 40)  # the pending setting sizes the next context ...
        assert raw_sizes() == (256, 256)  # ... and only that one
        # a creation llama.cpp refuses (n_batch = n_ubatch = 0) consumes it too
        assert lib.set_next_cache_cells(300, 40) == 0
        bad = llama_cpp.llama_context_default_params()
        bad.n_batch = bad.n_ubatch = 0
        assert not llama_cpp.llama_init_from_model(model, bad)
        assert raw_sizes() == (256, 256)


# -- per-cache eviction -------------------------------------------------------------------------------------


def softmax_row_bound(q, k, p, scale, n_terms):
    """Bound on |p_model - p| for one softmax row of logits scale * q.k, where p is the exact softmax of the
    same (captured) q and k: each logit is a dot product of hd terms (within hd F32 |q||k| of exact, times
    the scale; on a device 2 DEVICE_OPERAND |q||k| more, its operands rounded first), rounded again when Q is
    scaled (F32 |logit| each way); a logit error <= d changes a probability by a factor within exp(+-2d); exp
    adds ~4 F32 and the sum and the division of n_terms terms (n_terms + 2) F32.
    Below 2^-126 (F32's smallest normal number) F32 loses precision down to zero. Shapes: q [n_head, hd],
    k [n, n_head, hd], p [n_head, n]."""
    hd = q.shape[-1]
    qk = np.linalg.norm(q, axis=-1)[:, None] * np.linalg.norm(k, axis=-1).T  # [n_head, n]
    logits = scale * np.einsum("hd,jhd->hj", q, k)
    d = (scale * (hd * F32 + 2 * DEVICE_OPERAND) * qk + 2 * F32 * np.abs(logits)).max(axis=1)
    return (2 * d[:, None] + (n_terms + 6) * F32) * p + 2.0**-126


def check_rows_against_reference(e: Engine, cap: Capture, t: int, evicted: dict[Cache, set[int]]) -> None:
    """The softmax row of query position t in every layer, by position, equals numpy's softmax of the model's
    own Q and K over what that layer must see: its window (sliding layers), minus its cache's evictions (any
    caches: the model's two, or layer groups)."""
    r = e.n_head // e.n_head_kv
    scale = 1.0 / np.sqrt(e.head_dim)  # gemma3: Q * 1/sqrt(head_dim), kq_scale 1
    for il in range(e.n_layer):
        cache = e.layer_cache[il]
        q = cap.tokens(f"Qcur-{il}").astype(np.float64)  # [T, n_head, hd], every token decoded so far
        k = np.repeat(cap.tokens(f"Kcur-{il}"), r, axis=1).astype(np.float64)
        assert q.shape[0] == t + 1
        seen = np.arange(t + 1)
        if e.layer_sliding[il]:
            seen = seen[t - seen < N_SWA]
        seen = np.setdiff1d(seen, sorted(evicted[cache]))
        logits = scale * np.einsum("hd,jhd->hj", q[t], k[seen])
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)

        row = cap.tensors[f"kq_soft_max-{il}"][-1][0, :, 0, :]  # [n_head, n_kv] of the one decoded row
        cell_pos = e.cell_positions(il)[: row.shape[1]]
        by_pos = np.zeros((e.n_head, t + 1))
        held = cell_pos >= 0
        by_pos[:, cell_pos[held]] = row[:, held]
        assert np.all(row[:, ~held] == 0.0), f"layer {il}: an empty cell got attention"
        hidden = np.setdiff1d(np.arange(t + 1), seen)
        name = cache_name(cache)
        assert np.all(by_pos[:, hidden] == 0.0), f"layer {il} ({name}) attends to a position it must not see"
        tol = softmax_row_bound(q[t], k[seen], p, scale, seen.size)
        err = np.abs(by_pos[:, seen] - p)
        assert np.all(err <= tol), f"layer {il} ({name}): error {(err / tol).max():.2f}x its bound"


@pytest.mark.parametrize("cells", [None, (200, 48)])
def test_base_only_and_swa_only_evictions(gemma3_fixture, license_text, cells):
    """Evict from one cache at a time: each cache's cell map is exactly what was asked, every layer attends to
    exactly its cache's survivors inside its window (against numpy), and decoding goes on, in freed cells."""
    cap = Capture(("Qcur-", "Kcur-", "kq_soft_max-"), ops=QK_OPS)
    with make_engine(gemma3_fixture, cap, cache_cells=cells) as e:
        toks = tokens(e, license_text, 60)
        e.decode(toks[:40])
        base_victims = [2, 9, 20, 30, 33, 37]  # 30, 33, 37: inside the window of the next queries, so the
        swa_victims = [25, 31, 36, 38]  # sliding layer keeps seeing them; 25..38 are inside it too
        assert e.evict(base_victims, cache=BASE) == len(base_victims)
        assert e.evict(swa_victims, cache=SLIDING) == len(swa_victims)
        assert e.evict(swa_victims, cache=SLIDING) == 0  # gone already
        evicted = {BASE: set(base_victims), SLIDING: set(swa_victims)}
        decoded = np.arange(40)
        np.testing.assert_array_equal(e.live_positions(layer_of(e, BASE)), np.setdiff1d(decoded, base_victims))
        in_swa = e.live_positions(layer_of(e, SLIDING))
        np.testing.assert_array_equal(in_swa, np.setdiff1d(decoded, swa_victims))
        assert e.n_used(layer_of(e, BASE)) == 40 - len(base_victims)
        assert e.n_used(layer_of(e, SLIDING)) == 40 - len(swa_victims)

        for t in range(40, 52):  # single tokens: each one's softmax row is checked
            e.decode([toks[t]])
            check_rows_against_reference(e, cap, t, evicted)
            live = np.setdiff1d(np.arange(t + 1), sorted(evicted[BASE]))
            np.testing.assert_array_equal(e.live_positions(layer_of(e, BASE)), live)
            # the sliding cache: every survivor inside the window for sure; older ones until their cells are reused
            swa = e.live_positions(layer_of(e, SLIDING))
            window = np.setdiff1d(np.arange(t - N_SWA + 1, t + 1), sorted(evicted[SLIDING]))
            assert np.isin(window, swa).all() and not np.isin(sorted(evicted[SLIDING]), swa).any()
            if t == 45:  # a second round, newer positions, then a multi-token decode
                assert e.evict([41, 43], cache=SLIDING) == 2 and e.evict([42], cache=BASE) == 1
                evicted[SLIDING] |= {41, 43}
                evicted[BASE] |= {42}
        e.decode(toks[52:60])  # a batch that spans a ubatch boundary: still decodes, freed cells are refilled
        assert e.n_past == 60
        assert e.n_used(layer_of(e, BASE)) == 60 - len(evicted[BASE])


def test_evict_cache_error_codes(gemma3_fixture):
    lib = native.lib()
    with make_engine(gemma3_fixture) as e:
        e.decode(list(range(3, 40)))

        def evict(cache, positions, seq=0):
            arr = np.asarray(positions, dtype=np.int32)
            return lib.evict_cache(e.ctx, cache, seq, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), arr.size)

        for cache in (0, 1):  # the newest position is refused in either cache: the next batch starts after it
            assert evict(cache, [2, e.n_past - 1]) == native.EvictError.NEWEST_POSITION
            assert evict(cache, [5, 4]) == native.EvictError.NOT_SORTED
            assert evict(cache, [2], seq=7) == native.EvictError.BAD_ARGUMENT
            assert evict(cache, []) == 0
        assert evict(2, [2]) == native.EvictError.BAD_ARGUMENT
        assert evict(-1, [2]) == native.EvictError.BAD_ARGUMENT
        assert e.n_used(0) == e.n_used(1) == 37  # every refusal removed nothing
        with pytest.raises(AhakvError, match="newest"):
            e.evict([e.n_past - 1], cache=SLIDING)
        with pytest.raises(ValueError):
            e.evict([2], cache=LayerCache.NONE)


def test_per_cache_evictions_compose_to_stock_removal(gemma3_fixture, license_text):
    """Evicting positions from the base cache and then from the sliding cache is an ordinary eviction: every
    logit bit for bit equal to stock llama_memory_seq_rm in a second engine (same graphs, same cells freed, the
    slot-search heads moved alike, so the next tokens land in the same cells)."""
    rng = np.random.default_rng(3)
    with make_engine(gemma3_fixture) as a, make_engine(gemma3_fixture) as b:
        toks = tokens(a, license_text, 80)
        for e in (a, b):
            e.decode(toks[:50])
        victims = np.sort(rng.choice(np.arange(49), 15, replace=False))
        assert a.evict(victims, cache=BASE) == 15
        a.evict(victims, cache=SLIDING)
        for p in victims:
            b._ctx.kv_cache_seq_rm(0, int(p), int(p) + 1)
        for il in range(a.n_layer):
            np.testing.assert_array_equal(a.cell_positions(il), b.cell_positions(il))
        for t in range(50, 62):
            np.testing.assert_array_equal(a.decode([toks[t]]), b.decode([toks[t]]), f"logits at position {t}")
        np.testing.assert_array_equal(a.decode(toks[62:80], all_logits=True), b.decode(toks[62:80], all_logits=True))


# -- statistics of reused cells -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_ctx", "cells", "n_prompt"),
    [
        (512, None, 300),  # llama.cpp's own rule with swa_full off: 256 SWA cells, reused as a ring past 256
        (256, (0, 48), 70),  # a sliding cache of window + ubatch + 8 cells, reused from the 4th ubatch on
    ],
)
def test_statistics_restart_when_the_sliding_window_reuses_a_cell(gemma3_fixture, license_text, n_ctx, cells, n_prompt):
    """A prompt longer than the sliding cache, tapped over all its rows in one call: the ring reuses cells of
    positions that fell out of the window. Each position's attention mass must be its own - equal to an engine
    whose sliding cache holds every position - not its own plus the previous occupant's of its cell."""
    cap = Capture(("Qcur-", "Kcur-"), ops=QK_OPS)
    ring = make_engine(gemma3_fixture, n_ctx=n_ctx, n_batch=512, swa_full=False, cache_cells=cells)
    full = make_engine(gemma3_fixture, cap, n_ctx=n_ctx, n_batch=512, swa_full=True)
    with ring, full:
        toks = tokens(ring, license_text, n_prompt)
        il = layer_of(ring, SLIDING)
        assert ring.n_cells(il) < n_prompt <= full.n_cells(il)  # the ring reuses cells, the full cache never
        for e in (ring, full):
            e.set_tap(TapFlag.ATTN, 0)
            e.decode(toks)
            assert e.stat_rows == n_prompt
        got, want = ring.stat("attn", il), full.stat("attn", il)
        assert got.positions.size == ring.n_used(il)
        expected = want.values[:, np.searchsorted(want.positions, got.positions)]

        # Each engine's column sum differs from the exact one by at most (2d + (N_SWA + 6) F32) times itself per
        # row (softmax_row_bound: a row sees at most N_SWA positions) plus (n_prompt - 1) F32 for the sum over rows:
        # the two engines place positions in different cells, so their sums run in different orders.
        q = cap.tokens(f"Qcur-{il}").astype(np.float64)
        k = cap.tokens(f"Kcur-{il}").astype(np.float64)
        scale = 1.0 / np.sqrt(full.head_dim)
        qk = np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
        d = scale * (full.head_dim * F32 + 2 * DEVICE_OPERAND) * qk + 2 * F32 * scale * qk
        rel = 2 * d + (N_SWA + 6) * F32 + sum_rtol(n_prompt)
        tol = 2 * rel * expected + n_prompt * 2.0**-126
        err = np.abs(got.values - expected)
        assert np.all(err <= tol), f"error up to {err.max():.3g} ({(err / tol).max():.1f}x its bound)"


def test_statistics_restart_when_an_evicted_cell_is_reused(fixture_model, license_text):
    """Tap a prompt, evict, decode on without a reset: the new tokens land in the freed cells, and each live
    position's accumulated mass is exactly its column sum over every tapped row (tests/reference.py, with the
    evicted positions masked for the rows after the eviction) - none of the evicted positions' mass."""
    ref = LlamaReference(fixture_model)
    with make_engine(fixture_model) as e:
        toks = tokens(e, license_text, 75)
        e.set_tap(TapFlag.ATTN, 0)
        e.decode(toks[:60])
        victims = np.arange(5, 45, 2)  # 20 positions, all of them holding mass from 60 rows
        assert e.evict(victims) == victims.size
        e.decode(toks[60:75])
        assert e.stat_rows == 75
        live = np.setdiff1d(np.arange(75), victims)
        stat = e.stat("attn", 0)
        np.testing.assert_array_equal(stat.positions, live)
        reused = e.cell_positions(0)[victims]  # position p sat in cell p: 15 of the 20 freed cells took new tokens
        assert np.count_nonzero(reused >= 60) == 15 and np.all((reused >= 60) | (reused == -1))

        visible = np.tril(np.ones((75, 75), dtype=bool))
        visible[60:, victims] = False
        _, traces = ref.forward(toks, visible=visible)
        for il, tr in enumerate(traces):
            expected = tr.p.sum(axis=1)[:, live]  # [n_head, n_live]: every row's mass on each live position
            got = e.stat("attn", il).values
            # FORWARD_RTOL relative to the largest entry (numerics.py), plus the sum over 75 rows
            tol = (FORWARD_RTOL + sum_rtol(75)) * np.abs(expected).max()
            err = np.abs(got - expected)
            assert np.all(err <= tol), f"layer {il}: error {err.max():.3g} > {tol:.3g}"


# -- Gemma 3 270M -------------------------------------------------------------------------------------------


def test_gemma3_270m_layer_groups(gemma_model, license_text):
    """The real model (18 layers: 15 sliding over 512 positions, 3 full; one KV head of 256): sizes set per
    group are exact (the sliding group gets its window + one ubatch, the full group its budget), bytes per
    cache add up, and after base-only and sliding-only evictions each cache's cell map is exactly what was asked,
    no layer attends to a position evicted from its cache, and decoding goes on."""
    cap = Capture(("kq_soft_max-",))
    n_ubatch = 128
    cells = (700, 512 + n_ubatch)
    config = EngineConfig(
        n_ctx=1024,
        n_batch=512,
        n_ubatch=n_ubatch,
        swa_full=False,
        cache_cells=cells,
        n_gpu_layers=device.N_GPU_LAYERS,
    )
    with Engine(gemma_model, config, cb_eval=cap.callback) as e:
        assert e.n_swa == 512 and e.layer_cache.count(SLIDING) == 15 and e.layer_cache.count(BASE) == 3
        for il, cache in enumerate(e.layer_cache):
            assert e.n_cells(il) == cells[int(cache)]
        per_cell = 2 * e.n_head_kv * e.head_dim * 2  # F16 K and V
        assert e.kv_bytes(BASE) == 700 * 3 * per_cell
        assert e.kv_bytes(SLIDING) == 640 * 15 * per_cell
        assert e.kv_bytes(BASE) + e.kv_bytes(SLIDING) == e.kv_bytes()

        toks = tokens(e, license_text, 220)
        e.decode(toks[:200])
        base_victims, swa_victims = np.arange(10, 40), np.arange(150, 170)
        assert e.evict(base_victims, cache=BASE) == 30
        assert e.evict(swa_victims, cache=SLIDING) == 20
        base, swa = layer_of(e, BASE), layer_of(e, SLIDING)
        np.testing.assert_array_equal(e.live_positions(base), np.setdiff1d(np.arange(200), base_victims))
        np.testing.assert_array_equal(e.live_positions(swa), np.setdiff1d(np.arange(200), swa_victims))
        cap.clear()
        for t in range(200, 205):
            logits = e.decode([toks[t]])
            assert np.all(np.isfinite(logits))
            for il in range(e.n_layer):
                row = cap.tensors[f"kq_soft_max-{il}"][-1][0, :, 0, :]
                pos = e.cell_positions(il)[: row.shape[1]]
                hidden = base_victims if e.layer_cache[il] is BASE else swa_victims
                assert np.all(row[:, np.isin(pos, hidden) | (pos < 0)] == 0.0), f"layer {il}"
        live = np.setdiff1d(np.arange(205), base_victims)
        np.testing.assert_array_equal(e.live_positions(base), live)
        assert e.n_used(base) == live.size and e.n_used(swa) == 205 - 20
