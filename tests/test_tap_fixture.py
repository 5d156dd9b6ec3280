"""The native tap on the tiny GQA llama fixture, against an independent numpy forward pass."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ahakv_local import upstream
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.native import TapFlag

import device
from capture import Capture
from numerics import F32, FORWARD_RTOL
from reference import LlamaReference, reconstruction_scale, reconstruction_term, window_column_sums

ALL = TapFlag.VNORM | TapFlag.ATTN | TapFlag.SIDE | TapFlag.VERR
# Tolerances come from F32 rounding only (F32 = 2^-24, the unit roundoff, numerics.py): the weights are F32 and
# the cache is F32 (make_engine), so llama.cpp and the float64 reference start from the same numbers; FORWARD_RTOL
# (numerics.py) bounds the forward pass, on the CPU and on a device.
pytestmark = pytest.mark.device


def verr_tolerance(e: Engine, tr, rows: slice) -> np.ndarray:
    """[n_head, T]: how far the tap's sum over rows of a_tj ||v_j - o_t|| may be from the reference. The graph takes
    ||v - o||^2 as ||v||^2 - 2 v.o + ||o||^2 in F32; the three terms and their sum are within (hd + 5) F32 of exact,
    relative to (||v|| + ||o||)^2, and a square root turns an error eps of d^2 into at most sqrt(eps) of d
    (however close o is to v, e.g. a query locked on one cell): sqrt((hd + 5) F32) (||v|| + ||o||) per term.
    The reference's own forward error (FORWARD_RTOL) comes on top."""
    scale = reconstruction_scale(tr.p, tr.v, tr.o, rows, e.n_head // e.n_head_kv)  # sum of a (||v|| + ||o||)
    return (np.sqrt((e.head_dim + 5) * F32) + FORWARD_RTOL) * scale + FORWARD_RTOL * scale.max()


def assert_verr(e: Engine, il: int, tr, rows: slice) -> None:
    expected = reconstruction_term(tr.p, tr.v, tr.o, rows, e.n_head // e.n_head_kv)
    err = np.abs(e.stat("verr", il).values - expected)
    tol = verr_tolerance(e, tr, rows)
    assert np.all(err <= tol), f"verr layer {il}: error {(err / tol).max():.2f}x its bound"


@pytest.fixture(scope="module")
def ref(fixture_model):
    return LlamaReference(fixture_model)


def make_engine(path, cb_eval=None, **kw) -> Engine:
    # F32 cache: llama.cpp then computes in F32 like the reference (FORWARD_RTOL)
    config = EngineConfig(
        n_ctx=512, n_batch=256, n_ubatch=16, type_k="f32", type_v="f32", n_gpu_layers=device.N_GPU_LAYERS, **kw
    )
    return Engine(path, config, cb_eval=cb_eval)


def tokens_of(engine: Engine, text: str, n: int) -> list[int]:
    toks = engine.tokenize(text)
    assert len(toks) >= n
    return toks[:n]


def assert_close(actual, expected, rtol: float, what: str):
    # relative to the largest entry: column sums range over orders of magnitude
    scale = max(np.abs(expected).max(), 1e-12)
    err = np.abs(actual - expected).max() / scale
    assert err < rtol, f"{what}: max relative error {err:.2e} >= {rtol:.1e}"


def test_reference_matches_llama_cpp_logits(fixture_model, ref, license_text):
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 40)
        logits = e.decode(toks, all_logits=True)
    ref_logits, _ = ref.forward(toks)
    assert_close(logits, ref_logits, FORWARD_RTOL, "logits")


@pytest.mark.parametrize("window", [0, 23])
def test_prompt_tap_over_several_ubatches(fixture_model, ref, license_text, window):
    n = 70  # > 4 ubatches of 16; a window of 23 spans two of them
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, n)
        e.set_tap(ALL, window)
        e.decode(toks)
        assert e.stat_rows == (window or n)
        _, traces = ref.forward(toks)
        rows = slice(n - (window or n), n)
        for il, tr in enumerate(traces):
            attn = e.stat("attn", il)
            np.testing.assert_array_equal(attn.positions, np.arange(n))
            expected = window_column_sums(tr.p, rows)
            assert_close(attn.values, expected, FORWARD_RTOL, f"attn layer {il}")
            assert_close(e.stat("side", il).values, expected, FORWARD_RTOL, f"side(1) layer {il}")
            assert_close(e.stat("vnorm", il).values, np.linalg.norm(tr.v, axis=-1).T, FORWARD_RTOL, f"vnorm {il}")
            assert_verr(e, il, tr, rows)


def test_decode_tap_single_token(fixture_model, ref, license_text):
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 45)
        e.set_tap(ALL, 1)
        e.decode(toks[:40])
        for t in range(40, 45):
            e.reset_stats()
            e.decode([toks[t]])
            assert e.stat_rows == 1
        _, traces = ref.forward(toks)
        for il, tr in enumerate(traces):
            attn = e.stat("attn", il)
            assert_close(attn.values, tr.p[:, 44, :], FORWARD_RTOL, f"decode attn layer {il}")
            # one softmax row of 45 F32 terms: exp within 4 F32, the sum and the division within (45 + 2) F32
            assert np.allclose(attn.values.sum(axis=1), 1.0, rtol=0, atol=(45 + 6) * F32)
            assert_verr(e, il, tr, slice(44, 45))


def test_tap_switched_off_and_on(fixture_model, ref, license_text):
    """The controller taps a few steps per eviction period: switching must not reuse a stale graph, and
    tokens decoded with the norms off get theirs when the norms come back on."""
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 50)
        e.set_tap(ALL, 1)
        e.decode(toks[:40])
        e.set_tap(TapFlag(0), 1)  # plain graph: no statistics, no norms written
        for t in range(40, 47):
            e.decode([toks[t]])
        e.set_tap(ALL, 1)
        for t in range(47, 50):
            e.reset_stats()
            logits = e.decode([toks[t]])
        ref_logits, traces = ref.forward(toks)
        assert_close(logits, ref_logits[49], FORWARD_RTOL, "logits")
        for il, tr in enumerate(traces):
            assert_close(e.stat("attn", il).values, tr.p[:, 49, :], FORWARD_RTOL, f"attn layer {il}")
            assert_close(e.stat("vnorm", il).values, np.linalg.norm(tr.v, axis=-1).T, FORWARD_RTOL, f"vnorm {il}")
            assert_verr(e, il, tr, slice(49, 50))


@pytest.mark.parametrize(
    "off, on",
    [(TapFlag.VNORM, TapFlag.VNORM | TapFlag.ATTN), (TapFlag(0), TapFlag.ATTN), (TapFlag(0), ALL)],
    ids=["vnorm-then-attn", "nothing-then-attn", "nothing-then-all"],
)
def test_switching_the_softmax_on_reads_every_layers_own(fixture_model, ref, license_text, off, on):
    """A one-row ATTN tap adds no graph node: it marks each layer's softmax an output. Switching only ATTN on
    used to allocate the new graph with the allocator's plan of the old one, where the layers' softmaxes share
    memory, so every layer read the last one's (layer 0 returned layer 1's rows exactly; patch 0015).
    Scissorhands and TOVA switch exactly so on each observed decode step. The buffers are reserved for ``on``
    by the prompt first, so no reserve hides the switch."""
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 43)
        e.set_tap(on, 1)
        e.decode(toks[:40])
        e.set_tap(off, 1)
        e.decode([toks[40]])
        e.decode([toks[41]])
        e.set_tap(on, 1)
        e.reset_stats()
        e.decode([toks[42]])
        _, traces = ref.forward(toks)
        for il, tr in enumerate(traces):
            assert_close(e.stat("attn", il).values, tr.p[:, 42, :], FORWARD_RTOL, f"attn layer {il}")


@pytest.mark.parametrize(
    "between, reserves",
    [(TapFlag.VNORM | TapFlag.ATTN, 0), (TapFlag.VNORM, 1)],
    ids=["attn-kept-on", "attn-switched-on"],
)
def test_a_resized_context_keeps_the_tap_and_reserves_nothing_more(
    fixture_model, ref, license_text, capsys, between, reserves
):
    """A resize (adaptive layer budgets) moves the sequence to a new context. It is made tapped as the old one and
    planned with every flag the old one had (patch 0020): the observed step's switch to every statistic afterwards
    reserves nothing, and only switching ATTN on reserves, as in any context (patch 0015). Each layer's one-row
    statistics in the new context are its own (the hazard of 0015: a plan where the layers' softmaxes share
    memory). llama.cpp logs each reserve ("sched_reserve: reserving ..."), counted here."""
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 44)
        e.set_tap(ALL, 1)
        e.decode(toks[:40])
        e.set_tap(between, 1)
        e.decode([toks[40]])
        e.resize_caches((100, 0))
        upstream.set_verbose(True)
        try:
            capsys.readouterr()
            e.set_tap(between, 1)  # the controller sets its tap again after a resize: nothing changes
            e.decode([toks[41]])
            e.set_tap(ALL, 1)
            e.reset_stats()
            e.decode([toks[42]])
            e.set_tap(between, 1)
            e.decode([toks[43]])
            log = capsys.readouterr().err
        finally:
            upstream.set_verbose(False)
        assert e.n_cells() == 100 and log.count("reserving ...") == reserves, log
        _, traces = ref.forward(toks)
        for il, tr in enumerate(traces):
            if between & TapFlag.ATTN:  # summed since the reset: rows 42 and 43
                assert_close(e.stat("attn", il).values, tr.p[:, 42:44, :].sum(axis=1), FORWARD_RTOL, f"attn {il}")
            else:
                assert_close(e.stat("attn", il).values, tr.p[:, 42, :], FORWARD_RTOL, f"attn layer {il}")
            assert_verr(e, il, tr, slice(42, 43))


@pytest.mark.parametrize("flash_attn", [False, True])
def test_side_pass_scale(fixture_model, license_text, flash_attn):
    """softmax(s * logits) from the model's own Q and K (read through cb_eval); s is a graph input,
    so it changes between decodes without a rebuild. With flash attention on, the side pass is the
    only source of probabilities; its Q/K differ from the F32 reference forward by FA's rounding, so
    the reference here is recomputed from the Q and K this very run produced."""
    cap = Capture(("Qcur-", "Kcur-"), ops={"Qcur-": ("ROPE",), "Kcur-": ("ROPE",)})
    with make_engine(fixture_model, flash_attn=flash_attn, cb_eval=cap.callback) as e:
        toks = tokens_of(e, license_text, 45)
        e.set_tap(TapFlag.SIDE, 8)
        e.decode(toks[:42])
        r = e.n_head // e.n_head_kv
        for step, scale in enumerate([1.0, 2.5, 0.5]):
            e.set_side_scale(scale)
            e.reset_stats()
            t = 42 + step
            e.decode([toks[t]])
            for il in range(e.n_layer):
                q, k = cap.tokens(f"Qcur-{il}"), cap.tokens(f"Kcur-{il}")
                assert q.shape[0] == k.shape[0] == t + 1
                kh = np.repeat(k, r, axis=1).astype(np.float64)  # [T, n_head, hd]
                qt = q[t].astype(np.float64)  # [n_head, hd]
                logits = scale * np.einsum("hd,jhd->hj", qt, kh) / np.sqrt(e.head_dim)
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                # F32 rounding of the side pass on the very Q and K the reference uses: each logit is a dot product
                # of hd terms (within hd F32 of |q||k|, times scale/sqrt(hd)), then rounded when scaled twice
                # (2 F32 |s|); logit errors <= d change each probability by a factor within exp(+-2d); the softmax
                # adds exp's ~4 F32 and the sum and division of t + 1 terms. Below 2^-126 (F32's smallest normal
                # number) F32 loses precision down to zero.
                qk = np.linalg.norm(qt, axis=-1)[:, None] * np.linalg.norm(kh, axis=-1).T  # [n_head, T]
                d = (scale / np.sqrt(e.head_dim) * e.head_dim * F32 * qk + 2 * F32 * np.abs(logits)).max(axis=1)
                tol = (2 * d[:, None] + (t + 1 + 6) * F32) * p + 2.0**-126
                err = np.abs(e.stat("side", il).values - p)
                assert np.all(err <= tol), f"side scale {scale} layer {il}: error {(err / tol).max():.2f}x its bound"


def test_eviction_zero_attention_and_cell_map(fixture_model, ref, license_text):
    rng = np.random.default_rng(0)
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 120)
        e.set_tap(TapFlag.ATTN, 1)
        e.decode(toks[:100])
        evicted = np.sort(rng.choice(np.arange(1, 99), size=30, replace=False))
        assert e.evict(evicted) == 30
        live = np.setdiff1d(np.arange(100), evicted)
        for il in range(e.n_layer):
            np.testing.assert_array_equal(e.live_positions(il), live)
        assert e.n_used() == live.size

        e.reset_stats()
        e.decode([toks[100]])
        live = np.append(live, 100)
        for il in range(e.n_layer):
            cell_pos = e.cell_positions(il)
            by_cell = e.stat_by_cell("attn", il)
            assert np.all(by_cell[:, cell_pos < 0] == 0.0), "an evicted or empty cell got attention"
            np.testing.assert_array_equal(e.stat("attn", il).positions, live)
        assert e.n_used() == live.size

        # the new token's attention equals the reference with the evicted positions masked for that row
        visible = np.tril(np.ones((101, 101), dtype=bool))
        visible[100, evicted] = False
        _, traces = ref.forward(toks[:101], visible=visible)
        for il, tr in enumerate(traces):
            assert_close(e.stat("attn", il).values, tr.p[:, 100, live], FORWARD_RTOL, f"post-eviction layer {il}")

        # decoding goes on, and the freed cells are reused
        e.decode(toks[101:120])
        assert e.n_used() == live.size + 19


def test_newest_position_is_never_evicted(fixture_model, license_text):
    from ahakv_local.errors import AhakvError

    with make_engine(fixture_model) as e:
        e.decode(tokens_of(e, license_text, 10))
        with pytest.raises(AhakvError, match="newest"):
            e.evict([3, 9])
        assert e.n_used() == 10  # refused as a whole: nothing was removed


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_eviction_sequence_keeps_cells_and_attention_consistent(fixture_model, license_text, data):
    """Random rounds of decode + evict: the cell maps always equal the expected live set, evicted cells get
    exactly zero attention, and the used-cell count equals the live count."""
    with make_engine(fixture_model) as e:
        toks = tokens_of(e, license_text, 200)
        e.set_tap(TapFlag.ATTN, 1)
        live = np.array([], dtype=np.int64)
        for _ in range(data.draw(st.integers(1, 4), label="rounds")):
            n = data.draw(st.integers(1, 30), label="tokens")
            start = e.n_past
            e.reset_stats()
            e.decode(toks[start : start + n])
            live = np.append(live, np.arange(start, start + n))
            for layer in e.stats("attn"):
                np.testing.assert_array_equal(layer.positions, live)
            by_cell = e.stat_by_cell("attn", 0)
            assert np.all(by_cell[:, e.cell_positions(0) < 0] == 0.0)
            candidates = live[:-1]  # never the newest
            if candidates.size:
                victims = data.draw(st.lists(st.sampled_from(candidates.tolist()), unique=True, max_size=20))
                assert e.evict(victims) == len(victims)
                live = np.setdiff1d(live, victims)
            assert e.n_used() == live.size
            np.testing.assert_array_equal(e.live_positions(), live)
