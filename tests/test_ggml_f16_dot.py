"""The F16 dot product of the CPU backend (ggml_vec_dot_f16, patch 0016) against numpy.

Without flash attention llama.cpp multiplies the attention weights by a transposed V cache: one F16 dot
product per dimension, as long as the layer's cache has cells. Patch 0016 sends the whole vectors left after
the kernel's unrolled loop through the vector unit; these lengths are the ones it changes: every length up to
three times the widest unrolled step (64 elements with AVX-512, 32 with AVX2), and cache sizes of the
adaptive layout. The matrix product runs in ggml itself (``ggml_mul_mat`` of an F16 matrix by one F32
column, the decode shape), so every SIMD path the library was built for is what is tested.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

import engine_libs
import numpy as np
import pytest

from capture import GgmlTensor
from numerics import F16, F32

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
# the rounding unit of the kernel's accumulator: F32 lanes on every x86 path (AVX-512 FP16 included); ARM builds
# with FP16 vector arithmetic sum in F16 lanes (simd-mappings.h, GGML_F16x8_FMA), which patch 0016 leaves alone
ACCUMULATOR = F16 if platform.machine().lower() in ("aarch64", "arm64") else F32
# the lengths at which a skipped or doubled element (>= 0.25 with the positive terms below, each <= 1) lies outside
# the bound k * u * sum |terms| <= k^2 * u: every one on x86 (0.062 at k = 1023); on ARM's F16 lanes up to k = 22 only,
# where a longer row's bound would pass the error the test is for
LENGTHS = [k for k in (*range(1, 200), 363, 412, 577, 591, 600, 608, 775, 1023) if k * k * ACCUMULATOR < 0.25]


class InitParams(ctypes.Structure):  # struct ggml_init_params (ggml.h)
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@cache
def _libs():
    base = engine_libs.load("ggml-base", mode=ctypes.RTLD_GLOBAL)
    cpu = engine_libs.load("ggml-cpu", mode=ctypes.RTLD_GLOBAL)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.argtypes, base.ggml_init.restype = [InitParams], p
    base.ggml_free.argtypes, base.ggml_free.restype = [p], None
    base.ggml_new_tensor_2d.argtypes, base.ggml_new_tensor_2d.restype = [p, ctypes.c_int, i64, i64], p
    base.ggml_mul_mat.argtypes, base.ggml_mul_mat.restype = [p, p, p], p
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes, base.ggml_build_forward_expand.restype = [p, p], None
    compute = cpu.ggml_graph_compute_with_ctx
    compute.argtypes, compute.restype = [p, p, ctypes.c_int], ctypes.c_int
    return base, cpu


def _array(tensor: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of a ggml tensor's data (numpy axes reversed from ggml's ne)."""
    data = ctypes.cast(tensor, ctypes.POINTER(GgmlTensor)).contents.data
    element = ctypes.c_uint16 if dtype == np.float16 else ctypes.c_float
    flat = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(element)), (int(np.prod(shape)),))
    return flat.view(dtype).reshape(shape)


def ggml_f16_matvec(a: np.ndarray, b: np.ndarray, threads: int = 1) -> np.ndarray:
    """ggml_mul_mat(a as F16 [rows, k], b as F32 [k]) computed by the CPU backend: rows dot products."""
    base, cpu = _libs()
    rows, k = a.shape
    ctx = base.ggml_init(InitParams(64 * 1024 * 1024, None, False))
    try:
        ta = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F16, k, rows)
        tb = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 1)
        _array(ta, np.float16, (rows, k))[:] = a
        _array(tb, np.float32, (1, k))[:] = b
        out = base.ggml_mul_mat(ctx, ta, tb)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
        return _array(out, np.float32, (1, rows))[0].copy()
    finally:
        base.ggml_free(ctx)


@pytest.mark.parametrize("signed", [False, True], ids=["positive", "signed"])
def test_f16_dot_every_length(signed: bool):
    """Each row's dot product equals numpy's within the F32 bound of its sum. ggml rounds the F32 column to
    F16 first (mul_mat's vec_dot_type), so the reference rounds it too; F16 x F16 products are exact in F32,
    and a sum of k terms in any order and any lane split is off by at most k * u * sum |terms|, u the
    accumulator's unit (2^-24 on x86; the final rounding of the double to F32 included). With positive terms
    of at least 0.25 a skipped or doubled element is off by at least 0.25, outside the bound at every length
    tested (``LENGTHS``; on x86 at most 0.035, at k = 1023)."""
    rng = np.random.default_rng(16)
    for k in LENGTHS:
        low = -1.0 if signed else 0.5
        a = rng.uniform(low, 1.0, size=(8, k)).astype(np.float16)
        b = rng.uniform(low, 1.0, size=k).astype(np.float32)
        terms = a.astype(np.float64) * b.astype(np.float16).astype(np.float64)
        want = terms.sum(axis=1)
        got = ggml_f16_matvec(a, b)
        bound = k * ACCUMULATOR * np.abs(terms).sum(axis=1)
        assert np.all(np.abs(got - want) <= bound), (k, np.max(np.abs(got - want) - bound))
