"""Layer groups beyond the model's two caches (patch 0013): one KV cache per group of layers, up to one per
layer (``EngineConfig.layer_groups``), each with its own cells, slots, mask and cell -> position map.

Fixture: the random-weight gemma3 GGUF with six layers (ahakv_local/fixture.py, sliding-window pattern 2):
layers 0, 2 and 4 slide over n_swa = 24 positions, layers 1, 3 and 5 attend to every position. References:

* llama.cpp's own two caches in a second engine: with as many cells in every cache and the same evictions
  everywhere, every logit is bit for bit the same (the same cells, masks and kernels, layer by layer);
* numpy's softmax of the model's own Q and K (``check_rows_against_reference``) for every layer after
  evictions that differ from layer to layer;
* the model's own softmax rows, read through cb_eval and added up by position in float64, for the tap's
  statistics after per-layer evictions and the reuse of freed cells.

Numerics: F32 K/V caches, so llama.cpp computes in F32; bounds from F32 = 2^-24 (tests/numerics.py). With
AHAKV_TEST_DEVICE every engine here runs on that device (make_engine of tests/test_layer_groups.py).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from ahakv_local import native
from ahakv_local.budget import per_layer_groups
from ahakv_local.engine import LayerCache
from ahakv_local.errors import AhakvError
from ahakv_local.native import TapFlag

from capture import Capture
from numerics import sum_rtol
from test_layer_groups import QK_OPS, cell_bytes, check_rows_against_reference, make_engine, tokens

SLIDES = [True, False, True, False, True, False]  # the six-layer fixture, pattern 2
PER_LAYER = per_layer_groups(SLIDES)  # (1, 0, 2, 3, 4, 5)
pytestmark = pytest.mark.device


def test_per_layer_numbering():
    """Cache 0 is the first full-attention layer's, cache 1 the first sliding one's, the rest in layer order
    (known answers: the fixture, and Gemma 3's pattern of five sliding layers then one full)."""
    assert PER_LAYER == (1, 0, 2, 3, 4, 5)
    gemma3 = [il % 6 != 5 for il in range(18)]
    expected = (1, 2, 3, 4, 5, 0) + tuple(range(6, 18))
    assert per_layer_groups(gemma3) == expected


def test_each_layer_gets_its_own_cache_of_its_own_size(six_layers):
    cells = (100, 110, 120, 130, 140, 150)  # by cache
    with make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=cells) as e:
        assert e.layer_sliding == SLIDES
        assert list(e.layer_cache) == list(PER_LAYER) and e.caches == list(range(6))
        assert e.layer_cache[1] is LayerCache.BASE and e.layer_cache[0] is LayerCache.SLIDING
        assert native.lib().n_caches(e.ctx) == 6
        for il in range(6):
            assert e.n_cells(il) == cells[PER_LAYER[il]]
            assert e.cache_sliding(PER_LAYER[il]) == SLIDES[il]
            assert e.kv_bytes(PER_LAYER[il]) == cells[PER_LAYER[il]] * cell_bytes(e)  # one layer per cache
        assert sum(e.kv_bytes(c) for c in e.caches) == e.kv_bytes()
        e.decode(list(range(3, 60)))  # decodes, every cache filled alike
        assert [e.n_used(il) for il in range(6)] == [57] * 6


def test_groups_of_several_layers(six_layers):
    """Groups need not be single layers: full layers 1+3 share a cache, 5 has its own; sliding 0+2+4 share one."""
    groups = (1, 0, 1, 0, 1, 2)
    with make_engine(six_layers, layer_groups=groups, cache_cells=(64, 48, 80)) as e:
        assert [e.n_cells(il) for il in range(6)] == [48, 64, 48, 64, 48, 80]
        assert e.kv_bytes(0) == 2 * 64 * cell_bytes(e) and e.kv_bytes(1) == 3 * 48 * cell_bytes(e)
        e.decode(list(range(3, 40)))
        assert e.evict([4, 9], cache=0) == 2
        np.testing.assert_array_equal(e.live_positions(3), np.setdiff1d(np.arange(37), [4, 9]))
        np.testing.assert_array_equal(e.live_positions(5), np.arange(37))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ((1, 0, 2, 3, 4), "5 entries for 6 layers"),
        ((1, 0, 1, 0, 1, 3), "every cache from 0"),
        ((1, 0, 1, 1, 1, 0), "mixes full-attention and sliding-window"),
        ((0, 1, 2, 3, 4, 5), "cache 0 must hold full-attention layers"),
    ],
)
def test_bad_groups_are_one_line(six_layers, groups, message):
    with pytest.raises(AhakvError, match=message):
        make_engine(six_layers, layer_groups=groups)


def test_groups_need_a_sliding_window_model(fixture_model):
    with pytest.raises(AhakvError, match="no sliding-window cache: layer groups need one"):
        make_engine(fixture_model, layer_groups=(0, 1))
    with pytest.raises(ValueError, match="one per layer group"):
        make_engine(fixture_model, layer_groups=(0, 1), cache_cells=(64, 64, 64))


def test_engine_refuses_groups_it_cannot_build_and_consumes_them(six_layers):
    """The native rules, without the Python checks: a bad argument is -1; groups llama.cpp cannot build fail
    the context's creation; either way the setting is gone for the next context."""
    lib = native.lib()

    def arr(values):
        return (ctypes.c_int32 * len(values))(*values)

    assert lib.set_next_layer_groups(None, 6, arr([0, 0]), 2) == -1
    assert lib.set_next_layer_groups(arr(PER_LAYER), 6, arr([0] * 6), 0) == -1
    assert lib.set_next_layer_groups(arr(PER_LAYER), 6, arr([0, -1, 0, 0, 0, 0]), 6) == -1
    with make_engine(six_layers) as e:
        model = e._model.model
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 256, 32, 32

        def n_caches() -> int:
            ctx = llama_cpp.llama_init_from_model(model, params)
            try:
                return lib.n_caches(ctx) if ctx else -1
            finally:
                if ctx:
                    llama_cpp.llama_free(ctx)

        assert lib.set_next_layer_groups(arr(PER_LAYER), 6, arr([64] * 6), 6) == 0
        assert n_caches() == 6  # the pending groups build the next context ...
        assert n_caches() == 2  # ... and only that one
        assert lib.set_next_layer_groups(arr([1, 0, 1, 1, 1, 0]), 6, arr([0, 0]), 2) == 0  # layer 3 is full
        assert n_caches() == -1  # refused by llama.cpp
        assert n_caches() == 2  # and consumed


def test_same_as_two_caches_bit_for_bit(six_layers, license_text):
    """Six caches of 256 cells with the same evictions everywhere against llama.cpp's two caches of 256 cells:
    the same cells hold the same positions in every layer, so every logit is identical."""
    groups = make_engine(six_layers, layer_groups=PER_LAYER, cache_cells=(256,) * 6)
    two = make_engine(six_layers, cache_cells=(256, 256))
    rng = np.random.default_rng(5)
    with groups as a, two as b:
        toks = tokens(a, license_text, 90)
        np.testing.assert_array_equal(a.decode(toks[:50], all_logits=True), b.decode(toks[:50], all_logits=True))
        victims = np.sort(rng.choice(np.arange(49), 15, replace=False))
        for cache in a.caches:
            assert a.evict(victims, cache=cache) == 15
        b.evict(victims)
        for il in range(6):
            np.testing.assert_array_equal(a.cell_positions(il), b.cell_positions(il))
        for t in range(50, 60):
            np.testing.assert_array_equal(a.decode([toks[t]]), b.decode([toks[t]]), f"logits at position {t}")
        np.testing.assert_array_equal(a.decode(toks[60:90], all_logits=True), b.decode(toks[60:90], all_logits=True))


def test_each_layer_attends_to_its_own_survivors(six_layers, license_text):
    """Different evictions in every layer's cache: each layer's cell map is what was asked, and each layer's
    softmax row is numpy's over its own survivors inside its window; decoding refills freed cells."""
    cap = Capture(("Qcur-", "Kcur-", "kq_soft_max-"), ops=QK_OPS)
    with make_engine(six_layers, cap, layer_groups=PER_LAYER, cache_cells=(64, 48, 72, 56, 80, 64)) as e:
        toks = tokens(e, license_text, 56)
        e.decode(toks[:40])
        # per cache: old positions (outside the window of the coming queries) and recent ones (inside it)
        evicted = {c: {2 + c, 9 + 2 * c, 28 + c, 37 - c} for c in e.caches}
        for cache, victims in evicted.items():
            assert e.evict(sorted(victims), cache=cache) == 4
        for il in range(6):
            live = np.setdiff1d(np.arange(40), sorted(evicted[e.layer_cache[il]]))
            np.testing.assert_array_equal(e.live_positions(il), live)
        for t in range(40, 52):
            e.decode([toks[t]])
            check_rows_against_reference(e, cap, t, evicted)
            if t == 45:  # a second round, on newer positions, in two caches only
                for cache, p in ((3, [41, 43]), (4, [42])):
                    e.evict(p, cache=cache)
                    evicted[cache] |= set(p)
        e.decode(toks[52:56])
        assert e.n_past == 56


def test_tap_statistics_follow_each_layers_cells(six_layers, license_text):
    """The tap's attention mass by position, per layer, after per-layer evictions and decodes that write new
    tokens into freed cells, equals the model's own softmax rows added up by position on the host: each
    position's mass is its own, none of an evicted occupant's. Bound: a sum of at most n_rows non-negative F32
    terms in another order, sum_rtol(n_rows) relative for each side."""
    cap = Capture(("kq_soft_max-",))
    with make_engine(six_layers, cap, layer_groups=PER_LAYER, cache_cells=(80, 48, 64, 96, 72, 88)) as e:
        toks = tokens(e, license_text, 70)
        e.decode(toks[:40])
        e.set_tap(TapFlag.ATTN, 0)
        e.reset_stats()
        mass = np.zeros((6, e.n_head, 70))
        for t in range(40, 70):
            if t in (44, 55):  # evict in every cache, differently: the next tokens reuse those cells
                for c in e.caches:
                    e.evict([1 + c, 20 + 2 * c, 38 - c] if t == 44 else [12 + c, 41 + c], cache=c)
            e.decode([toks[t]])
            for il in range(6):
                row = cap.tensors[f"kq_soft_max-{il}"][-1][0, :, 0, :].astype(np.float64)  # [n_head, n_kv]
                cell_pos = e.cell_positions(il)[: row.shape[1]]
                held = cell_pos >= 0
                mass[il][:, cell_pos[held]] += row[:, held]
        n_rows = 30
        assert e.stat_rows == n_rows
        for il in range(6):
            got = e.stat("attn", il)
            np.testing.assert_array_equal(got.positions, e.live_positions(il))
            want = mass[il][:, got.positions]
            tol = 2 * sum_rtol(n_rows) * want + 2.0**-126
            assert np.all(np.abs(got.values - want) <= tol), f"layer {il}"
