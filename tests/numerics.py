"""The rounding units every numeric tolerance in the suite is derived from.

A tolerance is never "what passed on one machine": it is a bound built from these units and the
sizes of the computation, so it holds on every SIMD path of the CPU backend (AVX2-only AMD,
AVX-512 Intel, NEON) and every summation order a kernel may choose.
"""

from __future__ import annotations

import numpy as np

import device

F32 = 2.0**-24  # unit roundoff of float32
F16 = 2.0**-11  # unit roundoff of float16: the K/V cache, and mul_mat's rounding of its F32 operand to F16

# On a device (AHAKV_TEST_DEVICE, tests/device.py) a matrix product may round its F32 operands before multiplying:
# to F16 (ggml-vulkan's and CUDA's F16 paths, as the CPU does against an F16 weight) or to TF32 (cuBLAS with tensor-op
# math, whose 10-bit mantissa is F16's): up to F16 relative per operand, where the CPU keeps F32.
DEVICE_OPERAND = F16 if device.DEVICE else 0.0
# The fixtures' forward pass against the float64 reference (tests/reference.py), relative to the largest entry. A
# reduction of n terms is within n * F32 of exact, relative to the sum of its terms' magnitudes, in any summation
# order (AVX2's 8-wide or AVX-512's 16-wide FMA lanes alike). The longest path to a logit chains ~16 reductions of at
# most 128 terms (n_ff; attention reads <= 120 positions): 16 * 128 * F32 = 1.2e-4 of the largest entry, worst case
# (measured on AVX2: <= 3e-6; rounding errors add up like a random walk). On a device both operands of a product
# may be rounded (F32 weights and activations through TF32 or F16): 2 DEVICE_OPERAND per reduction, 32 F16 along the
# chain (measured on an H200: <= 8.7e-3, benchmarks/gpu_h200.md).
FORWARD_RTOL = 16 * 2 * DEVICE_OPERAND if device.DEVICE else 16 * 128 * F32


def sum_rtol(n: int) -> float:
    """Relative error bound of a sum of n non-negative F32 terms, in any order: (n - 1) * u."""
    return max(n - 1, 1) * F32


def log_softmax32_atol(n: int, span: float) -> float:
    """Absolute error bound of an entry of a float32 log-softmax of a row of n entries spanning ``span`` nats
    (max - min), against float64 on the same float32 inputs (``evaluation._log_softmax32``): the shift by the
    maximum (span * u), exp (numpy's float32 exp is within 4 ulp = 8u, its input's error carried: span * u), the sum
    (numpy sums 128-term blocks in 8 lanes of 16, then pairwise: (15 + 7 + log2(n / 128)) * u relative), the log of
    the sum (ln n * u) and the last difference ((span + ln n) * u). The per-token error of a perplexity's mean
    log-likelihood, so also the bound of |ln ppl32 - ln ppl64|."""
    pairwise = 15 + 7 + max(0.0, float(np.log2(n / 128)))
    return F32 * (span + 8 + span + pairwise + np.log(n) + span + np.log(n))


def norm_rtol(hd: int) -> float:
    """Relative error of an F32 vector norm over hd entries: the squared sum's bound, halved by the sqrt."""
    return sum_rtol(hd) / 2


def output_rounding(a: np.ndarray, v_norm: np.ndarray) -> np.ndarray:
    """Bound on ||o_model - o_exact|| for o = sum_i a_i v_i computed by mul_mat against an F16 V cache:
    ggml rounds the F32 weights a_i to F16 (relative 2^-11 each), so the error is <= 2^-11 sum_i a_i ||v_i||
    (the F32 accumulation adds ~n * 2^-24, negligible beside it). ``a`` is [..., n]."""
    return F16 * (a * v_norm).sum(axis=-1)


def distance_rounding(v_norm, o_norm, dist, hd: int):
    """Bound on the F32 error of ||v - o|| evaluated as sqrt(||v||^2 - 2 v.o + ||o||^2) (clamped at 0): the
    squared distance d^2 is off by at most D = hd * 2^-24 * (||v|| + ||o||)^2 (cancellation where v ~ o), so
    the distance by at most min(sqrt(D), D / d) (d^2 - D under the root is the worse side). Arguments broadcast."""
    d2_err = hd * F32 * (np.asarray(v_norm) + np.asarray(o_norm)) ** 2
    return np.minimum(np.sqrt(d2_err), d2_err / np.maximum(dist, 1e-30))
