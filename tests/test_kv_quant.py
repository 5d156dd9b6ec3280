"""KV quantization composes with the tap and eviction: q8_0 (q5_0, q4_0) K and V with flash attention on (Gemma 3
270M).

Patch 0009 gives ATTN under flash attention (the side pass at scale 1), patch 0010 VERR and the value norms for a
quantized V. The references are numpy on the run's own Q, K and V (llama.cpp's graph read through cb_eval,
tests/capture.py) in F32/F64; every tolerance is the type's quantization step, bounded from those values:
q8_0 stores round(x / d) per block of 32 with d = max|x| / 127 kept in F16, so each value is off by at most
d (1/2 + 127 * 2^-11) (the rounding, and the F16 rounding of d times the integer); q5_0 and q4_0 (d = max / 16,
max / 8) by at most d (1 + 16 * 2^-11), d (1 + 8 * 2^-11) (their clamp at the top costs up to one step).

With a quantized cache llama.cpp rotates what it stores (llama-kv-cache.cpp, attn_rot_k/attn_rot_v): Q and K by
an orthonormal Walsh-Hadamard matrix over the largest power of two >= 64 dividing the head size, V over blocks
of 64, and the attention output back. Dot products and norms do not change; the quantization steps are those
of the rotated values, so the references rotate too (in F32, as the graph does: off by sum_rtol(n) of the
block's |x|_1 / sqrt(n) per value).
"""

from __future__ import annotations

import numpy as np
import pytest

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.info import read_info
from ahakv_local.native import TapFlag

from capture import Capture
from numerics import F16, distance_rounding, norm_rtol, sum_rtol

PROMPT = 300
ALL = TapFlag.VNORM | TapFlag.ATTN | TapFlag.SIDE | TapFlag.VERR
QKV_OPS = {"Qcur-": ("ROPE",), "Kcur-": ("ROPE",), "Vcur-": ("RESHAPE",)}
BLOCK = 32


# ggml's reference quantizers (ggml-quants.c, quantize_row_*_ref) of the quantized KV types offered: a block of 32
# shares d = (signed or absolute) max / LEVELS, stored in F16; q4_0 and q5_0 map the block's max to -LEVELS and
# clamp the top to LEVELS - 1, so the value opposite the max may lose a whole step
LEVELS = {"q8_0": 127, "q5_0": 16, "q4_0": 8}


def q_step(x: np.ndarray, kv_type: str) -> np.ndarray:
    """Per-value bound on |dequant(quant(x)) - x| over blocks of 32 along the last axis (same shape as x): half a
    step for q8_0's rounding (a whole one for q4_0/q5_0's clamp) plus the F16 rounding of d times the integer."""
    levels = LEVELS[kv_type]
    blocks = np.abs(x).reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.max(axis=-1, keepdims=True) / levels
    rounding = 0.5 if kv_type == "q8_0" else 1.0
    return np.broadcast_to(d * (rounding + levels * F16) * (1 + 1e-6), blocks.shape).reshape(x.shape)


def hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard: Sylvester's construction, scaled to be orthonormal (symmetric: H @ H = I)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(H x over blocks of n along the last axis, a per-value bound on the graph's F32 rounding of it)."""
    blocks = x.reshape(*x.shape[:-1], -1, n)
    out = (blocks.astype(np.float32) @ hadamard(n).astype(np.float32)).astype(np.float64)
    err = np.broadcast_to(sum_rtol(n) * np.abs(blocks).sum(axis=-1, keepdims=True) / np.sqrt(n), blocks.shape)
    return out.reshape(x.shape), err.reshape(x.shape)


def q_round(x: np.ndarray, kv_type: str) -> np.ndarray:
    """ggml's reference quantizer of ``kv_type`` then dequantize, in float64."""
    levels = LEVELS[kv_type]
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    if kv_type == "q8_0":  # d = max|x| / 127, round half away from zero
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(levels)
        q = np.where(d > 0, blocks / np.where(d > 0, d, 1), 0)
        q = np.sign(q) * np.floor(np.abs(q) + 0.5)
    else:  # d = -(the signed max) / levels, q = min(2 levels - 1, floor(x / d + levels + 0.5)) - levels
        i = np.abs(blocks).argmax(axis=-1)[..., None]
        d = np.take_along_axis(blocks, i, axis=-1) / np.float32(-levels)
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = np.minimum(2 * levels - 1, np.floor(blocks * inv + np.float32(levels + 0.5))) - levels
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


@pytest.fixture(scope="module")
def tokens(gemma_model, license_text):
    with Engine(gemma_model, EngineConfig(n_ctx=256)) as e:
        return e.tokenize(license_text)[: PROMPT + 2]


def run(model, tokens, kv_type: str, flash_attn: bool, cap: Capture | None = None) -> Engine:
    """Decode the prompt, then one token with every statistic on over that one row; the engine stays open."""
    config = EngineConfig(
        n_ctx=1024, n_batch=512, n_ubatch=128, flash_attn=flash_attn, type_k=kv_type, type_v=kv_type
    )  # fmt: skip
    e = Engine(model, config, cb_eval=cap.callback if cap else None)
    e.set_tap(ALL, 1)
    e.set_side_scale(1.0)
    e.decode(tokens[:PROMPT])
    e.reset_stats()
    e.decode([tokens[PROMPT]])
    return e


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_attn_under_flash_attention_is_the_side_pass_at_scale_1(gemma_model, tokens, kv_type):
    """Patch 0009: one node for both, so equal to the bit; a softmax row, summing to 1 over the visible cells."""
    with run(gemma_model, tokens, kv_type, flash_attn=True) as e:
        n = PROMPT + 1
        for il in range(e.n_layer):
            attn, side = e.stat("attn", il).values, e.stat("side", il).values
            np.testing.assert_array_equal(attn, side)
            assert attn.shape == (e.n_head, n) and (attn > 0).all()
            np.testing.assert_allclose(attn.sum(axis=1), 1.0, rtol=sum_rtol(n))


@pytest.mark.parametrize("kv_type", ["q8_0", "q5_0", "q4_0"])
def test_quantized_statistics_against_numpy(gemma_model, tokens, kv_type):
    cap = Capture(("Qcur-", "Kcur-", "Vcur-"), ops=QKV_OPS)
    n = PROMPT + 1
    with run(gemma_model, tokens, kv_type, flash_attn=True, cap=cap) as e:
        hd = e.head_dim
        assert e.n_head_kv == 1  # MQA: every query head reads KV head 0
        q_scale = 1.0 / np.sqrt(hd)  # Gemma 3 pre-scales Q by 1/sqrt(256)
        rounded_through_type = []
        for il in range(e.n_layer):
            q = cap.tokens(f"Qcur-{il}")[-1].astype(np.float64) * q_scale  # [n_head, hd]: the decoded row
            k = cap.tokens(f"Kcur-{il}")[:, 0, :].astype(np.float64)  # [n, hd]: one KV head
            v = cap.tokens(f"Vcur-{il}")[:, 0, :].astype(np.float64)  # [n, hd]
            assert k.shape[0] == v.shape[0] == n

            # ATTN: mul_mat quantizes q to q8_0 (the dot type of all three); each logit q.k = Hq.Hk is off by at most
            # sum_d |q_d| ek_d + eq_d (|k_d| + ek_d) in the rotated values, and a softmax whose logits move by
            # <= delta moves each probability by at most p (e^(2 delta) - 1); the F32 dot adds sum_rtol(hd)
            # of sum |q||k|
            logits = q @ k.T
            (q, rq), (k, rk) = rotate(q, hd), rotate(k, hd)  # hd = 256: a power of two
            eq, ek = q_step(q, "q8_0") + rq, q_step(k, kv_type) + rk
            f32_delta = sum_rtol(hd) * (np.abs(q) + eq) @ (np.abs(k) + ek).T  # [n_head, n]
            delta = np.abs(q) @ ek.T + eq @ (np.abs(k) + ek).T + f32_delta
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            bound = p * np.expm1(2 * delta.max(axis=1, keepdims=True)) + sum_rtol(n) * p
            a = e.stat("attn", il).values.astype(np.float64)
            assert (np.abs(a - p) <= bound).all(), f"attn layer {il}: {(np.abs(a - p) / bound).max():.2f} x bound"

            # VNORM (patch 0010): the norm of the values as the quantized cache holds them
            vnorm = e.stat("vnorm", il).values[0].astype(np.float64)
            exact = np.linalg.norm(v, axis=1)
            v, rv = rotate(v, 64)
            ev = np.linalg.norm(q_step(v, kv_type) + rv, axis=1)  # ||v_q - Hv|| <= this
            assert (np.abs(vnorm - exact) <= ev + norm_rtol(hd) * exact).all(), f"vnorm layer {il}"
            ref = np.linalg.norm(q_round(v, kv_type), axis=1)
            rounded_through_type.append(np.abs(vnorm - ref) <= 2 * norm_rtol(hd) * ref)

            # VERR (patch 0010; before, zeros): a_j ||v_j - o|| with o = sum_i a_i v_i as the flash kernel
            # forms it from the dequantized V: against F32 v, each distance is off by <= ev_j + sum_i a_i ev_i,
            # plus the kernel's own softmax (its F32 dots may sum in another order than the tap's: weights off by
            # a factor e^(2 f32_delta)) and F32 sums (4 sum_rtol(n) of sum a ||v||), and the graph's cancellation
            # in ||v||^2 - 2 v.o + ||o||^2 (tests/numerics.py)
            verr = e.stat("verr", il).values.astype(np.float64)  # [n_head, n]
            for h in range(e.n_head):
                ah = a[h]
                o = ah @ v
                dist = np.linalg.norm(v - o, axis=1)
                kernel = np.expm1(2 * f32_delta[h].max()) + 4 * sum_rtol(n)
                slack = ev + ah @ ev + kernel * (ah @ (exact + ev))
                slack += distance_rounding(exact + ev, np.linalg.norm(o) + ah @ ev, dist, hd)
                err = np.abs(verr[h] - ah * dist)
                bound = ah * slack + sum_rtol(2) * ah * dist
                assert (err <= bound).all(), f"verr layer {il} head {h}: {(err / bound).max():.2f} x bound"
            assert (verr > 0).mean() > 0.99
        # the norms are those of the rounded values, not of the F32 ones (one value in a row may round the other
        # way in ggml's SIMD quantizer at a tie: allow a few rows)
        assert np.mean(rounded_through_type) > 0.95, np.mean(rounded_through_type)


def test_llama_with_q8_0_evicts_and_reads_every_statistic(gemma_model, license_text):
    """A budgeted AhaKV run on a q8_0 cache: half the bytes of f16 per cell (272 of 512 for a 256-wide head),
    the live positions are the engine's cell map at every step, and the value statistics are not zeros."""
    from ahakv_local import Llama

    with Llama(str(gemma_model), kv_budget=96, kv_policy="ahakv", kv_type="q8_0", n_batch=64, verbose=False) as llm:
        e = llm.kv_engine
        assert e.config.flash_attn and (e.config.type_k, e.config.type_v) == ("q8_0", "q8_0")
        info = read_info(gemma_model)
        per_cell = info.cell_bytes(info.n_layer, "q8_0", "q8_0")
        assert e.kv_bytes() == e.n_cells() * per_cell == e.n_cells() * info.kv_bytes_per_token() * 34 // 64
        tokens = e.tokenize(license_text)[:400]
        ctl = llm.kv_controller
        ctl.prefill(tokens[:300])
        for t in tokens[300:400]:
            ctl.step(t)
            for g in ctl.groups:  # the product's layout, adaptive: one cache per layer
                np.testing.assert_array_equal(g.live, g.read_live(e))
                assert g.live.size <= g.budget.target(e.n_past)
        assert ctl.stats.evicted == 400 - ctl.stats.cells_used >= 400 - 96
        e.set_tap(TapFlag.VERR | TapFlag.ATTN, 1)  # one more token, read by hand: VERR of the compressed cache
        e.reset_stats()
        e.decode([tokens[0]])
        assert all(e.stat("verr", il).values.max() > 0 for il in range(e.n_layer))


def test_kv_type_refusals(fixture_model, gemma_model):
    from ahakv_local import Llama

    # the fixture's heads are 16 wide: no whole q8_0 block (llama.cpp would abort)
    with pytest.raises(AhakvError, match="16 values cannot be stored as q8_0"):
        Engine(fixture_model, EngineConfig(n_ctx=256, flash_attn=True, type_k="q8_0", type_v="q8_0"))
    with pytest.raises(AhakvError, match="16 values cannot be stored as q8_0"):
        Llama(str(fixture_model), kv_budget=64, kv_type="q8_0", verbose=False)
    with pytest.raises(AhakvError, match="needs flash attention"):
        Llama(str(gemma_model), kv_type="q8_0", flash_attn=False, verbose=False)
    with pytest.raises(AhakvError, match="KV type must be one of f16, q8_0, q5_0, q4_0"):
        Llama(str(gemma_model), kv_type="q4_1", verbose=False)


def test_upstream_type_k_and_type_v_beside_kv_type_and_a_byte_budget(gemma_model):
    """kv_type set K and V over the type_k/type_v given, without a word; a byte budget was laid out in f16's bytes
    whatever type_k/type_v said (a q8_0 pair refused as not fitting its cells, an f32 pair allocated twice the
    bytes); a type kv_type does not offer was named by its number ("3")."""
    from ahakv_local import Llama

    with pytest.raises(ValueError, match="give kv_type or type_k/type_v, not both"):
        Llama(str(gemma_model), kv_type="q8_0", type_k=2, type_v=2, verbose=False)
    with pytest.raises(ValueError, match="a budget in bytes counts K and V of kv_type"):
        Llama(str(gemma_model), kv_budget="2MiB", type_k=0, type_v=0, verbose=False)
    with pytest.raises(ValueError, match="a budget in bytes counts K and V of kv_type"):  # V is upstream's f16
        Llama(str(gemma_model), kv_budget="2MiB", type_k=8, flash_attn=True, verbose=False)
    with Llama(str(gemma_model), kv_budget="8MiB", type_k=1, n_ctx=4096, n_batch=64, verbose=False) as f16:
        assert f16.kv_stats().kv_type == "f16"  # upstream's default named: taken
    kw = dict(kv_budget="2MiB", n_ctx=4096, n_batch=64, verbose=False)
    with Llama(str(gemma_model), type_k=8, type_v=8, flash_attn=True, **kw) as pair:
        with Llama(str(gemma_model), kv_type="q8_0", **kw) as named:  # the same caches: q8_0 bytes
            assert pair.kv_engine.cache_sizes() == named.kv_engine.cache_sizes()
            assert pair.kv_stats().kv_type == "q8_0" and pair.kv_stats().kv_bytes <= 2 * 2**20
    with Llama(str(gemma_model), kv_budget=256, type_k=3, type_v=3, flash_attn=True, n_ctx=1024, verbose=False) as q:
        assert q.kv_stats().kv_type == "q4_1"


def test_generate_with_kv_type(gemma_model, fixture_model):
    import subprocess
    import sys

    def ahakv(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ahakv_local", "generate", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    proc = ahakv(str(gemma_model), "-p", "The GNU General Public License is", "-n", "8", "--budget", "64",
                 "--kv-type", "q8_0", "--stats")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = read_info(gemma_model)
    cells = int(proc.stderr.split(" allocated")[0].rsplit("(", 1)[1])
    mib = cells * info.cell_bytes(info.n_layer, "q8_0", "q8_0") / 2**20
    assert f"{mib:.1f} MiB KV" in proc.stderr
    proc = ahakv(str(fixture_model), "-p", "x", "--kv-type", "q8_0")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("cannot be stored as q8_0 (blocks of 32)")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_q8_0_session_spends_a_byte_budget_on_more_cells(gemma_model, license_text):
    """``SessionSpec(kv_type="q8_0")``: ``open_session`` opens q8_0 K and V (flash attention on), lays the byte
    budget out with q8_0's cell bytes (272 of 512 per layer: ~1.88x the cells of f16 under the same bytes) and
    allocates no more than the budget; ``evaluate`` compares it with the f16 full cache. Its mean KL from that
    cache is below the f16 run's at the same bytes (more positions kept; q8_0's own rounding moves the logits far
    less than evicting does: the known answer of the frontier in RESULTS.md, here at 1/4 of the positions)."""
    from ahakv_local.evaluation import evaluate, text_tokens
    from ahakv_local.session import SessionSpec, open_session

    tokens = text_tokens(gemma_model, license_text)[:480]
    info = read_info(gemma_model)
    budget = f"{120 * info.cell_bytes(info.n_layer)}B"  # 120 f16 cells of every layer
    specs = [SessionSpec.bounded("ahakv", budget, kv_type=t, label=t) for t in ("f16", "q8_0")]
    held = {}
    for spec in specs:
        with open_session(gemma_model, spec, len(tokens)) as s:
            e = s.engine
            assert (e.config.type_k, e.config.flash_attn) == (spec.kv_type, spec.kv_type == "q8_0")
            assert sum(e.kv_bytes(c) for c in e.caches) <= spec.budget.value
            held[spec.kv_type] = s.controller.groups[0].budget.target(len(tokens))
            # the known answer: whole cells of every layer in the bytes, less a chunk of 64 and the newest token
            per_cell = info.cell_bytes(info.n_layer, spec.kv_type, spec.kv_type)
            assert held[spec.kv_type] == spec.budget.value // per_cell - 65
    assert (held["f16"], held["q8_0"]) == (120 - 65, 120 * 64 // 34 - 65)  # 55 and 160: the same bytes, 64/34 the cells
    results = evaluate(gemma_model, tokens, specs, step=16)
    assert results["q8_0"].max_cells > results["f16"].max_cells
    assert 0 < results["q8_0"].kl < results["f16"].kl
    with pytest.raises(AhakvError, match="KV type must be one of f16, q8_0, q5_0, q4_0"):
        SessionSpec.bounded("ahakv", budget, kv_type="q4_1")


@pytest.mark.parametrize("layer_budgets", ["shared", "natural"])
def test_llama_lays_a_byte_budget_out_in_q8_0_cells(gemma_model, layer_budgets):
    """The drop-in with ``kv_budget`` in bytes and ``kv_type="q8_0"``: the caches hold the budget in q8_0 bytes."""
    from ahakv_local import Llama

    with Llama(str(gemma_model), kv_budget="2MiB", kv_type="q8_0", kv_layer_budgets=layer_budgets, n_ctx=4096,
               n_batch=64, verbose=False) as llm:  # fmt: skip
        e = llm.kv_engine
        assert e.config.type_v == "q8_0" and sum(e.kv_bytes(c) for c in e.caches) <= 2 * 2**20
        info = read_info(gemma_model)
        for c in e.caches:  # every cache's buffers are q8_0 cells of its own layers
            n_layers = sum(1 for x in e.layer_cache if x == c)
            assert e.kv_bytes(c) == e.cache_cells(c) * info.cell_bytes(n_layers, "q8_0", "q8_0")


def test_eval_ppl_with_kv_type(gemma_model, license_text, tmp_path):
    """``eval ppl --kv-type q8_0``: the budgeted runs hold q8_0 cells (their KV bytes a whole number of q8_0 cells of
    every layer), compared with the f16 full cache. The second code path: the same configuration built here as a
    ``SessionSpec`` (the command's defaults: 4 sinks, 32 recent, the default period, one observed step) and run
    through ``evaluate`` in this process gives the command's perplexity and KL to the bit (one engine thread in
    both, so the same kernels in the same order), which the command only gets if --kv-type reached the session."""
    import json
    import subprocess
    import sys

    from ahakv_local.evaluation import evaluate, text_tokens
    from ahakv_local.session import SessionSpec

    cmd = [sys.executable, "-m", "ahakv_local", "eval", "ppl", str(gemma_model), "--tokens", "256", "--budgets", "96",
           "--policies", "ahakv", "--step", "16", "--kv-type", "q8_0", "-t", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = next(r for r in json.loads((tmp_path / "results.json").read_text())["results"] if r["label"] == "ahakv@96")
    info = read_info(gemma_model)
    per_cell = info.cell_bytes(info.n_layer, "q8_0", "q8_0")  # shared: every cache holds the same cells
    assert run["kv_bytes"] % per_cell == 0 and run["kv_bytes"] // per_cell >= 96

    specs = [SessionSpec.bounded("ahakv", 96, label=t, n_sink=4, n_recent=32, kv_type=t) for t in ("q8_0", "f16")]
    tokens = text_tokens(gemma_model, license_text)[:256]  # the command's default text, GPL-3
    here = evaluate(gemma_model, tokens, specs, prefix=128, step=16, n_threads=1)
    q8 = here["q8_0"]
    assert (run["ppl"], run["kl"], run["top1"], run["kv_bytes"]) == (q8.ppl, q8.kl, q8.top1, q8.kv_bytes)
    assert here["f16"].kl != q8.kl  # and the command's figure is not f16's: q8_0's rounding moves the logits


def test_a_full_cache_row_in_a_quantized_type_holds_that_type(gemma_model, license_text):
    """A full row of another K/V type is that type's floor (benchmarks/layer_budgets.py's "full q8_0"). Since every full
    row went to llama.cpp's own caches, those were made in f16 whatever the spec said: the floor read the f16 full
    cache's perplexity and KL 0. Its caches hold q8_0 cells now: the bytes of llama.cpp's own padded cache in q8_0
    (``ModelInfo.cell_bytes``), and its rows differ from the f16 reference's."""
    from ahakv_local.evaluation import evaluate, text_tokens
    from ahakv_local.session import SessionSpec

    tokens = text_tokens(gemma_model, license_text)[:200]
    got = evaluate(gemma_model, tokens, [SessionSpec("full q8_0", kv_type="q8_0")], prefix=128, n_threads=1)
    info = read_info(gemma_model)
    cells = -(-len(tokens) // 256) * 256  # llama.cpp's own cache: the text's tokens, padded
    assert got["full"].kv_bytes == cells * info.cell_bytes(info.n_layer, "f16", "f16")
    assert got["full q8_0"].kv_bytes == cells * info.cell_bytes(info.n_layer, "q8_0", "q8_0")
    assert got["full q8_0"].kl > 0 and got["full q8_0"].ppl != got["full"].ppl


def trimmed_kv_bytes(model, n_ctx: int, n_ubatch: int) -> int:
    """What llama.cpp itself allocates for ``n_ctx`` positions with the sliding cache trimmed (swa_full off), read
    from the engine's buffers: the reference for ``ModelInfo.trimmed_bytes``, which reads the GGUF header."""
    with Engine(model, EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, swa_full=False)) as e:
        return sum(e.kv_bytes(c) for c in e.caches)


def test_auto_kv_type_spends_a_byte_budget_by_its_share_of_the_trimmed_cache(gemma_model, fixture_model):
    """kv_type "auto" (``SessionSpec.on_model``, ``budget.kv_type_for``): a byte budget holding llama.cpp's whole
    trimmed cache stays f16, one below it is q8_0, one below a fifth of it q5_0 (the crossings measured in
    benchmarks/RESULTS.md); cell and ratio budgets stay f16; a model whose heads hold no whole q8_0 block stays f16.
    ``open_session`` opens the type decided, flash attention on, within the budget."""
    from ahakv_local.session import SessionSpec, open_session

    n_ctx, chunk = 4096, 64
    trimmed = trimmed_kv_bytes(gemma_model, n_ctx, chunk)
    assert read_info(gemma_model).trimmed_bytes(n_ctx, chunk) == trimmed

    def decided(budget: str, model=gemma_model) -> str:
        spec = SessionSpec.bounded("ahakv", budget, kv_type="auto", layer_budgets="natural")
        return spec.on_model(model, chunk, n_ctx).kv_type

    assert decided(f"{trimmed}B") == "f16"
    fifth = -(-trimmed // 5)  # the least budget of a fifth of it or more
    assert decided(f"{trimmed - 1}B") == decided(f"{trimmed // 2}B") == decided(f"{fifth}B") == "q8_0"
    assert decided(f"{fifth - 1}B") == decided(f"{trimmed // 8}B") == "q5_0"
    assert decided("256") == decided("25%") == "f16"
    assert decided("64KiB", fixture_model) == "f16"  # 16-wide heads: no q5_0 block of 32
    for fraction, kv_type in ((2, "q8_0"), (8, "q5_0")):
        spec = SessionSpec.bounded("ahakv", f"{trimmed // fraction}B", kv_type="auto", layer_budgets="natural")
        with open_session(gemma_model, spec, n_ctx, chunk) as s:
            e = s.engine
            assert (e.config.type_k, e.config.type_v, e.config.flash_attn) == (kv_type, kv_type, True)
            assert s.spec.kv_type == kv_type
            allocated = sum(e.kv_bytes(c) for c in e.caches)  # the bytes spent, less than a cell left over
            assert trimmed // fraction - max(e.cell_bytes(c) for c in e.caches) < allocated <= trimmed // fraction


def test_the_drop_in_and_generate_decide_auto_kv_type(gemma_model):
    """``Llama(kv_type="auto")`` decides for its n_ctx positions (q5_0 at an eighth of the trimmed cache; f16 without
    a budget, or with flash attention turned off); ``generate`` does so by default and says which in --stats."""
    import subprocess
    import sys

    from ahakv_local import Llama

    n_ctx, chunk = 4096, 64
    trimmed = trimmed_kv_bytes(gemma_model, n_ctx, chunk)
    kw = dict(kv_type="auto", kv_layer_budgets="natural", n_ctx=n_ctx, n_batch=chunk, verbose=False)
    with Llama(str(gemma_model), kv_budget=f"{trimmed // 8}B", **kw) as llm:
        assert llm.kv_stats().kv_type == llm.kv_engine.config.type_v == "q5_0"
    with (
        pytest.warns(UserWarning, match="^kv_layer_budgets applies to a bounded KV cache"),
        Llama(str(gemma_model), **kw) as llm,
    ):  # (the layout does nothing without a budget; the K/V type does)
        assert llm.kv_stats().kv_type == "f16"
    with Llama(str(gemma_model), kv_budget=f"{trimmed // 2}B", flash_attn=False, **kw) as llm:
        assert llm.kv_stats().kv_type == "f16" and not llm.kv_engine.config.flash_attn

    def stats_line(*args: str) -> str:
        cmd = [sys.executable, "-m", "ahakv_local", "generate", str(gemma_model), "-p", "The GNU General Public",
               "-n", "4", "--ctx-size", str(n_ctx), "--budget", f"{trimmed // 2}B", "--layer-budgets", "natural",
               "--stats", *args]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "MiB KV, q8_0, natural)" in stats_line()
    assert "MiB KV, f16, natural)" in stats_line("--kv-type", "f16")
