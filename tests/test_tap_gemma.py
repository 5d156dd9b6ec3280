"""The native tap on Gemma 3 270M Q4_K_M (two caches: SWA and full; MQA, one KV head).

The second code path is llama.cpp's own graph read through cb_eval (tests/capture.py): the
model's softmax ``kq_soft_max-<il>``, its head outputs ``kqv-<il>``, and ``Qcur``/``Kcur``/``Vcur``
from which numpy recomputes what the flash-attention path never materializes.
"""

from __future__ import annotations

import numpy as np
import pytest

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.native import TapFlag

import device
from capture import Capture
from numerics import DEVICE_OPERAND, F32, distance_rounding, norm_rtol, sum_rtol

N_UBATCH = 128
PROMPT = 300  # three ubatches: 128 + 128 + 44
ALL = TapFlag.VNORM | TapFlag.ATTN | TapFlag.SIDE | TapFlag.VERR
# llama.cpp names several nodes Qcur-<il> (before and after RoPE): keep the ones written to the cache
QKV_OPS = {"Qcur-": ("ROPE",), "Kcur-": ("ROPE",), "Vcur-": ("RESHAPE",)}
# on AHAKV_TEST_DEVICE every layer is offloaded; the bounds are the CPU's (derived from F32/F16 rounding of the
# very tensors the run produced), plus a device's own operand rounding where its kernels may round otherwise
# (numerics.DEVICE_OPERAND): a device that rounds worse still fails them, and says by how much
pytestmark = pytest.mark.device


def assert_close(actual, expected, rtol, what):
    scale = max(np.abs(expected).max(), 1e-12)
    err = np.abs(actual - expected).max() / scale
    assert err < rtol, f"{what}: max relative error {err:.2e} >= {rtol:.0e}"


def make_engine(path, cap: Capture, flash_attn=False, kv_type: str = "f16") -> Engine:
    config = EngineConfig(
        n_ctx=1024, n_batch=512, n_ubatch=N_UBATCH, flash_attn=flash_attn, n_gpu_layers=device.N_GPU_LAYERS,
        type_k=kv_type, type_v=kv_type,
    )  # fmt: skip
    return Engine(path, config, cb_eval=cap.callback)


def as_cached(x: np.ndarray, kv_type: str) -> np.ndarray:
    """``x`` (F32) as an F16 or BF16 cache holds it, in float64: ggml rounds F32 to BF16 to the nearest, ties to
    even (its top 16 bits)."""
    if kv_type == "f16":
        return x.astype(np.float16).astype(np.float64)
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def softmax_column_sums(cap: Capture, il: int, first_row: int, n_pos: int) -> np.ndarray:
    """Sum of the captured kq_soft_max rows at batch index >= first_row, by cell (= position in a
    fresh cache): [n_head, n_pos]."""
    total, row0 = 0.0, 0
    for p in cap.tensors[f"kq_soft_max-{il}"]:
        p = p[0]  # [n_head, n_tokens, n_kv]: n_kv grows (256, 512, ...) as the cache fills
        rows = np.arange(row0, row0 + p.shape[1])
        part = np.zeros((p.shape[0], n_pos))
        n = min(n_pos, p.shape[2])
        part[:, :n] = p[:, rows >= first_row, :n].sum(axis=1)
        total = total + part
        row0 += p.shape[1]
    return total


@pytest.fixture(scope="module")
def prompt_tokens(gemma_model, license_text):
    cap = Capture(())
    with make_engine(gemma_model, cap) as e:
        toks = e.tokenize(license_text)
    assert len(toks) > PROMPT + 10
    return toks


@pytest.mark.parametrize("window", [0, 150])
def test_prompt_tap_equals_model_softmax(gemma_model, prompt_tokens, window):
    cap = Capture(("kq_soft_max-", "Vcur-"), ops=QKV_OPS)
    with make_engine(gemma_model, cap) as e:
        e.set_tap(ALL, window)
        e.decode(prompt_tokens[:PROMPT])
        assert e.stat_rows == (window or PROMPT)
        first = PROMPT - (window or PROMPT)
        for il in range(e.n_layer):
            expected = softmax_column_sums(cap, il, first, PROMPT)
            attn = e.stat("attn", il)
            np.testing.assert_array_equal(attn.positions, np.arange(PROMPT))
            # the same F32 probabilities summed over the window rows in another order
            rows = window or PROMPT
            assert_close(attn.values, expected, sum_rtol(rows), f"attn layer {il}")
            # the side pass at scale 1 re-normalizes the same logits with its own max, exp and row sum: each
            # probability within 4 F32 more than the model's, so the column sums within 4 times their bound
            assert_close(e.stat("side", il).values, expected, 4 * sum_rtol(rows), f"side at scale 1, layer {il}")
            # ||v|| of the values as the F16 cache holds them, an F32 norm over the head size
            v16 = cap.tokens(f"Vcur-{il}").astype(np.float16).astype(np.float64)  # [T, n_head_kv, hd]
            ref = np.linalg.norm(v16, axis=-1).T
            assert_close(e.stat("vnorm", il).values, ref, norm_rtol(v16.shape[-1]), f"vnorm {il}")


# 100: the KV window (256 cells) equals the head size. A BF16 cache: its transposed V converted to F32 in one copy
# (patch 0026; it was copied in BF16, then converted)
@pytest.mark.parametrize("prompt, kv_type", [(100, "f16"), (PROMPT, "f16"), (100, "bf16")])
def test_decode_tap_and_reconstruction_term(gemma_model, prompt_tokens, prompt, kv_type):
    cap = Capture(("kq_soft_max-", "kqv-", "Vcur-"), ops=QKV_OPS)
    with make_engine(gemma_model, cap, kv_type=kv_type) as e:
        e.set_tap(ALL, 1)
        e.decode(prompt_tokens[:prompt])
        for t in range(prompt, prompt + 3):
            e.reset_stats()
            e.decode([prompt_tokens[t]])
        n = prompt + 3
        r = e.n_head // e.n_head_kv
        for il in range(e.n_layer):
            p = cap.tensors[f"kq_soft_max-{il}"][-1][0, :, 0, :n]  # [n_head, n]: the last query row
            # one row: the tap copies the model's F32 probabilities (exactly, up to one addition to zero)
            assert_close(e.stat("attn", il).values, p, F32, f"decode attn layer {il}")
            # a * ||v - o|| from the values of v as the cache holds them and the model's own head outputs o
            o = cap.tensors[f"kqv-{il}"][-1][0, :, 0, :].astype(np.float64)  # [n_head, hd]
            v = as_cached(cap.tokens(f"Vcur-{il}"), kv_type)  # [n, n_head_kv, hd]
            assert v.shape[0] == n
            v_rep = np.repeat(v, r, axis=1)  # [n, n_head, hd]
            dist = np.linalg.norm(v_rep - o[None], axis=-1).T  # [n_head, n]
            # elementwise: the F32 cancellation of ||v||^2 - 2 v.o + ||o||^2 (tests/numerics.py)
            bound = p * distance_rounding(
                np.linalg.norm(v_rep, axis=-1).T, np.linalg.norm(o, axis=1)[:, None], dist, o.shape[1]
            )
            err = np.abs(e.stat("verr", il).values - p * dist)
            assert (err <= bound + sum_rtol(2) * p * dist).all(), f"verr layer {il}: {(err / bound).max():.2f}"


@pytest.mark.parametrize("flash_attn", [False, True])
def test_side_pass_from_q_and_k(gemma_model, prompt_tokens, flash_attn):
    """Recompute softmax(s * q.k) in numpy from the run's own Q and K, rounded to F16 like ggml's
    mul_mat does against the F16 K cache. With flash attention on this is the only reference."""
    cap = Capture(("Qcur-", "Kcur-"), ops=QKV_OPS)
    with make_engine(gemma_model, cap, flash_attn=flash_attn) as e:
        e.set_tap(TapFlag.SIDE, 4)
        e.decode(prompt_tokens[:PROMPT])
        q_scale = 1.0 / np.sqrt(e.head_dim)  # Gemma 3 pre-scales Q by 1/sqrt(256)
        for step, scale in enumerate([1.0, 1.7]):
            e.set_side_scale(scale)
            e.reset_stats()
            e.decode([prompt_tokens[PROMPT + step]])
            n = PROMPT + step + 1
            for il in range(e.n_layer):
                q = cap.tokens(f"Qcur-{il}")  # the window is this decode's single row
                k = cap.tokens(f"Kcur-{il}")
                assert k.shape[0] == n
                qs = (q[-1:] * np.float32(q_scale)).astype(np.float16).astype(np.float64)  # [1, n_head, hd]
                kk = k.astype(np.float16).astype(np.float64)[:, 0, :]  # one KV head
                logits = scale * np.einsum("thd,jd->htj", qs, kk)[:, 0, :]
                prob = np.exp(logits - logits.max(axis=1, keepdims=True))
                prob /= prob.sum(axis=1, keepdims=True)
                # the F16 x F16 products are exact in F32; their sum over hd is off by <= hd * 2^-24 of
                # sum_d |q_d k_d|, which moves p_j by <= 2 p_j max_j |dlogit_j|; n * 2^-24 for the normalization.
                # A device's kernel may keep q in F32 instead (CUDA's, for one row): DEVICE_OPERAND of the same sum
                rtol = sum_rtol(kk.shape[1]) + DEVICE_OPERAND
                dlogit = rtol * scale * np.einsum("thd,jd->htj", np.abs(qs), np.abs(kk))[:, 0, :]
                bound = prob * (2 * dlogit.max(axis=1, keepdims=True) + sum_rtol(n))
                err = np.abs(e.stat("side", il).values - prob)
                worst = (err / (bound + 1e-12)).max()
                assert (err <= bound + 1e-12).all(), f"side s={scale} fa={flash_attn} layer {il}: {worst:.2f}x bound"


def test_flash_attention_verr_over_a_window_of_rows(gemma_model, prompt_tokens):
    """VERR under flash attention over AhaKV's 32-row window, as a prompt is read: V stays F16 in the cache, and v.o
    is one F32 product of its converted values (patch 0026; before, a product of the F16 V with o's hi and lo
    halves, which CUDA's cuBLAS and an ARM CPU with FP16 arithmetic summed in F16). Numpy from the run's own Q, K and
    V and the flash kernel's head outputs: the sum over the window rows t of a_tj ||v_j - o_t||."""
    n, window = 100, 32  # one ubatch; the window's rows see 69..100 positions (every sliding layer: all of them)
    cap = Capture(("Qcur-", "Kcur-", "Vcur-", "kqv_out-"), ops=QKV_OPS)
    with make_engine(gemma_model, cap, flash_attn=True) as e:
        e.set_tap(ALL, window)
        e.set_side_scale(1.0)
        e.decode(prompt_tokens[:n])
        assert e.stat_rows == window
        hd, n_head = e.head_dim, e.n_head
        rows = np.arange(n - window, n)
        seen = np.arange(n)[None, :] <= rows[:, None]  # [window, n]: causal
        for il in range(e.n_layer):
            # a: the side pass at scale 1 (patch 0009), its q rounded to F16 against the F16 K as the CPU's mul_mat
            # does; the products exact in F32, their sum over hd within sum_rtol(hd) of sum |q||k| (a device may keep
            # q in F32: DEVICE_OPERAND), which moves p_j by <= 2 p_j max |dlogit|, and n F32 for the normalization
            q = cap.tokens(f"Qcur-{il}")[rows] * np.float32(1.0 / np.sqrt(hd))  # Gemma 3 pre-scales Q by 1/16
            q = q.astype(np.float16).astype(np.float64)  # [window, n_head, hd]
            k = cap.tokens(f"Kcur-{il}")[:, 0, :].astype(np.float16).astype(np.float64)  # [n, hd]: one KV head
            v = cap.tokens(f"Vcur-{il}")[:, 0, :].astype(np.float16).astype(np.float64)
            logits = np.where(seen[:, None, :], np.einsum("thd,jd->thj", q, k), -np.inf)
            p = np.exp(logits - logits.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)  # [window, n_head, n]
            dlogit = (sum_rtol(hd) + DEVICE_OPERAND) * np.einsum("thd,jd->thj", np.abs(q), np.abs(k))
            dlogit = np.where(seen[:, None, :], dlogit, 0.0).max(axis=2, keepdims=True)
            p_err = p * (2 * dlogit + sum_rtol(n))
            # o_t as the flash kernel gave it to the tap (the same node the model reads on), d_tj = ||v_j - o_t||
            o = np.concatenate([a.reshape(-1, n_head, hd) for a in cap.tensors[f"kqv_out-{il}"]])
            o = o[rows].astype(np.float64)  # [window, n_head, hd]
            dist = np.linalg.norm(v[None, None, :, :] - o[:, :, None, :], axis=-1)  # [window, n_head, n]
            # the graph's F32 cancellation in ||v||^2 - 2 v.o + ||o||^2 (tests/numerics.py); a device's product may
            # round its F32 operands (TF32 in cuBLAS): DEVICE_OPERAND of each |v_d o_d| twice more in d^2
            d_err = distance_rounding(np.linalg.norm(v, axis=1), np.linalg.norm(o, axis=2)[..., None], dist, hd)
            d2_dev = 2 * DEVICE_OPERAND * np.einsum("jd,thd->thj", np.abs(v), np.abs(o))
            d_err = d_err + np.minimum(np.sqrt(d2_dev), d2_dev / np.maximum(dist, 1e-30))
            expected = (p * dist).sum(axis=0)  # [n_head, n]
            bound = (p_err * dist + (p + p_err) * d_err).sum(axis=0) + (sum_rtol(window) + sum_rtol(2)) * expected
            err = np.abs(e.stat("verr", il).values - expected)
            assert (err <= bound + 1e-12).all(), f"verr layer {il}: {(err / (bound + 1e-12)).max():.2f}x bound"


def test_eviction_on_both_caches(gemma_model, prompt_tokens):
    rng = np.random.default_rng(1)
    cap = Capture(())
    with make_engine(gemma_model, cap) as e:
        assert set(e.layer_cache) == {0, 1}  # Gemma 3: full and sliding-window layers
        e.set_tap(TapFlag.ATTN, 1)
        e.decode(prompt_tokens[:200])
        evicted = np.sort(rng.choice(np.arange(1, 199), size=60, replace=False))
        assert e.evict(evicted) == 60
        e.reset_stats()
        e.decode([prompt_tokens[200]])
        live = np.append(np.setdiff1d(np.arange(200), evicted), 200)
        for il in range(e.n_layer):
            cell_pos = e.cell_positions(il)
            np.testing.assert_array_equal(np.sort(cell_pos[cell_pos >= 0]), live)
            by_cell = e.stat_by_cell("attn", il)
            assert np.all(by_cell[:, cell_pos < 0] == 0.0)
            # one softmax row over the live cells and the new one, in F32: exp within 4 F32, the sum and the division
            # within (n + 2) F32 (as in test_tap_fixture)
            assert np.allclose(by_cell.sum(axis=1), 1.0, rtol=0, atol=(live.size + 6) * F32)
        for layer in (0, 5):  # one SWA layer, one full layer
            assert e.n_used(layer) == live.size
        e.decode(prompt_tokens[201:220])
        assert e.n_used(5) == live.size + 19
