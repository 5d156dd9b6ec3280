"""Every architecture ahakv-local claims, on a tiny random-weight fixture (ahakv_local/fixture.py).

Two code paths per architecture: (a) the tap's ATTN statistic against the model's own softmax
``kq_soft_max-<il>`` read through cb_eval (tests/capture.py), and (b) the patched batched eviction against
stock llama.cpp's ``llama_memory_seq_rm`` in a second engine that decoded the same tokens.

Numerics. Both sides of (a) are the same F32 tensor: a single decoded row is read as it is, so the tap equals
it bit for bit; a window of n rows is a sum of n non-negative F32 terms (in-graph per ubatch, then added up
on the host in F32), within (n - 1) * 2^-24 of the exact sum relative to the sum itself, whatever the order
the SIMD width (AVX2, AVX-512) picks. The reference sums in float64. (b) is exact: both engines run the same
graphs on the same inputs, and both removals free the same cells and move the slot-search head alike, so the
following tokens land in the same cells and every logit is bit for bit equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.fixture import ARCHITECTURES, SLIDING, FixtureSpec
from ahakv_local.info import SUPPORTED, check_architecture
from ahakv_local.models import fixture_path
from ahakv_local.native import TapFlag

from capture import Capture
from numerics import sum_rtol

PROMPT = 70  # > the sliding window (24) and > 4 ubatches of 16


def make_engine(path, cap: Capture) -> Engine:
    # the default F16 K/V cache: the softmax and the tap are F32 whatever the cache holds
    return Engine(path, EngineConfig(n_ctx=256, n_batch=256, n_ubatch=16), cb_eval=cap.callback)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_model(request):
    return request.param, fixture_path(FixtureSpec(arch=request.param))


def tokens(engine: Engine, text: str, n: int) -> list[int]:
    toks = engine.tokenize(text)
    assert len(toks) >= n
    return toks[:n]


def captured_column_sums(cap: Capture, il: int, first_row: int) -> np.ndarray:
    """float64 [n_head, n_kv]: the captured softmax rows at batch index >= first_row, summed by cell."""
    parts, row0 = [], 0
    for p in cap.tensors[f"kq_soft_max-{il}"]:
        p = p[0]  # [n_head, n_tokens, n_kv]: n_kv grows (256, 512, ...) as the cache fills
        rows = np.arange(row0, row0 + p.shape[1])
        parts.append(p[:, rows >= first_row, :].astype(np.float64).sum(axis=1))
        row0 += p.shape[1]
    n_kv = max(q.shape[1] for q in parts)
    return sum(np.pad(q, ((0, 0), (0, n_kv - q.shape[1]))) for q in parts)


def test_supported_means_tested_here():
    assert SUPPORTED == set(ARCHITECTURES)  # gemma3 is also tested on the real model (test_tap_gemma.py)
    for arch in ARCHITECTURES:
        assert check_architecture(fixture_path(FixtureSpec(arch=arch))) == arch


@pytest.mark.parametrize("window", [0, 23])  # all rows; a window spanning two ubatches
def test_prompt_tap_equals_model_softmax(arch_model, license_text, window):
    arch, path = arch_model
    cap = Capture(("kq_soft_max-",))
    with make_engine(path, cap) as e:
        assert (e.n_swa > 0) == (arch in SLIDING)
        toks = tokens(e, license_text, PROMPT)
        e.set_tap(TapFlag.ATTN, window)
        e.decode(toks)
        n_rows = window or PROMPT
        assert e.stat_rows == n_rows
        for il in range(e.n_layer):
            expected = captured_column_sums(cap, il, PROMPT - n_rows)  # by cell
            by_cell = e.stat_by_cell("attn", il).astype(np.float64)
            n_kv = expected.shape[1]
            assert np.all(by_cell[:, n_kv:] == 0.0)
            err = np.abs(by_cell[:, :n_kv] - expected)
            assert np.all(err <= sum_rtol(n_rows) * expected), f"{arch} layer {il}: {(err / expected.max()).max():.1e}"
            # a fresh cache holds position p in cell p: the same numbers by position
            attn = e.stat("attn", il)
            np.testing.assert_array_equal(attn.positions, np.arange(PROMPT))
            np.testing.assert_array_equal(attn.values, by_cell[:, :PROMPT].astype(np.float32))
            if arch in SLIDING and e.layer_cache[il] != e.layer_cache[e.base_layer]:
                # the last row of a sliding layer sees only the last n_swa positions
                last = captured_column_sums(cap, il, PROMPT - 1)
                assert np.all(last[:, : PROMPT - e.n_swa] == 0.0) and np.all(last[:, PROMPT - e.n_swa : PROMPT] > 0)


def assert_live(e: Engine, il: int, positions: np.ndarray, live: np.ndarray) -> None:
    """The positions a layer's cache holds: every live one in the full cache; in a sliding-window cache the
    live ones inside the window for sure, and older live ones until llama.cpp reuses their (masked) cells."""
    if e.layer_cache[il] == e.layer_cache[e.base_layer]:
        np.testing.assert_array_equal(positions, live, f"layer {il}")
    else:
        assert np.isin(positions, live).all() and np.isin(live[live >= e.n_past - e.n_swa], positions).all()


def remove_stock(engine: Engine, positions) -> None:
    """Stock llama.cpp removal, one position range at a time (llama_memory_seq_rm)."""
    for p in positions:
        engine._ctx.kv_cache_seq_rm(0, int(p), int(p) + 1)


def test_eviction_equals_stock_removal(arch_model, license_text):
    """Evict through the patch in engine A and through llama_memory_seq_rm in engine B, which decoded the same
    tokens: the live positions of every layer equal the expected set, the next tokens' logits are bit for bit
    equal, an evicted cell gets exactly zero attention, and the tap still equals the model's softmax.

    (Not compared: an engine that decodes only the surviving tokens. llama.cpp refuses gaps in a sequence's
    positions, and above layer 0 the survivors' K/V were computed while the evicted tokens were visible.)"""
    arch, path = arch_model
    rng = np.random.default_rng(7)
    cap_a, cap_b = Capture(("kq_soft_max-",)), Capture(("kq_soft_max-",))
    with make_engine(path, cap_a) as a, make_engine(path, cap_b) as b:
        toks = tokens(a, license_text, PROMPT + 12)
        live = np.arange(60)
        for e in (a, b):
            e.set_tap(TapFlag.ATTN, 1)
            e.decode(toks[:60])
        for start, n_victims in [(60, 20), (66, 8)]:  # the second round also frees cells reused since the first
            victims = np.sort(rng.choice(live[:-1], n_victims, replace=False))  # never the newest
            assert a.evict(victims) == len(victims)
            remove_stock(b, victims)
            live = np.setdiff1d(live, victims)
            for il in range(a.n_layer):
                assert_live(a, il, a.live_positions(il), live)
                np.testing.assert_array_equal(a.cell_positions(il), b.cell_positions(il))
            assert a.n_used() == b.n_used() == live.size
            for t in range(start, start + 6):
                cap_a.clear()
                a.reset_stats()
                logits = [e.decode([toks[t]]) for e in (a, b)]
                np.testing.assert_array_equal(logits[0], logits[1], f"{arch}: logits at position {t}")
                live = np.append(live, t)
                for il in range(a.n_layer):
                    row = cap_a.tensors[f"kq_soft_max-{il}"][-1][0, :, 0, :]  # [n_head, n_kv] of the one row
                    cell_pos = a.cell_positions(il)[: row.shape[1]]
                    assert np.all(row[:, cell_pos < 0] == 0.0), f"{arch} layer {il}: an empty cell got attention"
                    by_cell = a.stat_by_cell("attn", il)
                    np.testing.assert_array_equal(by_cell[:, : row.shape[1]], row)
                    assert_live(a, il, a.stat("attn", il).positions, live)
