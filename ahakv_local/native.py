"""ctypes bindings of the ``llama_ahakv_*`` C API that patches/ adds to libllama.

The functions live in the same libllama that llama-cpp-python loads, so we bind them on
``llama_cpp.llama_cpp._lib``. Every per-layer result is indexed by KV *cell*; engine.py turns
cells into positions.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from functools import cache

from . import upstream
from .errors import EngineNotPatched

# must equal LLAMA_AHAKV_ABI_VERSION of the patch series in patches/
ABI_VERSION = 7

# ggml's GGML_MAX_N_THREADS: more threads than it crashed llama.cpp (-t 100000: a segfault, in a worker bad_alloc)
MAX_THREADS = 512

BUILD_HINT = "run `ahakv-local build` (add --cuda or --metal for a GPU build) to install the patched engine"


class TapFlag(enum.IntFlag):
    """Statistics the patched graph can compute (LLAMA_AHAKV_* in llama.h)."""

    VNORM = 1 << 0  # ||v|| per KV head and cell, written once with V
    ATTN = 1 << 1  # the model's own softmax summed over the window rows (flash attention off)
    SIDE = 1 << 2  # a side-pass softmax of the logits times a caller scale (any attention path)
    VERR = 1 << 3  # reconstruction term a*||v - o|| summed over the window rows (float V caches)


class EvictError(enum.IntEnum):
    BAD_ARGUMENT = -1
    NOT_SORTED = -2
    NEWEST_POSITION = -3
    NO_KV_CACHE = -4


_c = ctypes
_ctx = _c.c_void_p
# an array's data: a numpy array's address (``engine.address``), or a ctypes array. Not ndarray.ctypes.data_as: it
# casts, and every ctypes.cast leaves a reference cycle for the collector (one per call)
_f32p = _i32p = _c.c_void_p

_SIGNATURES: dict[str, tuple[list, object]] = {
    "llama_ahakv_abi_version": ([], _c.c_int32),
    "llama_ahakv_layer_cache": ([_ctx, _c.c_int32], _c.c_int32),
    "llama_ahakv_n_cells": ([_ctx, _c.c_int32], _c.c_int32),
    "llama_ahakv_n_used": ([_ctx, _c.c_int32], _c.c_int32),
    "llama_ahakv_cell_pos": ([_ctx, _c.c_int32, _c.c_int32, _i32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_evict": ([_ctx, _c.c_int32, _i32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_kv_bytes": ([_ctx], _c.c_uint64),
    "llama_ahakv_evict_cache": ([_ctx, _c.c_int32, _c.c_int32, _i32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_kv_bytes_cache": ([_ctx, _c.c_int32], _c.c_uint64),
    "llama_ahakv_set_next_cache_cells": ([_c.c_int32, _c.c_int32], _c.c_int32),
    "llama_ahakv_set_next_layer_groups": ([_i32p, _c.c_int32, _i32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_n_caches": ([_ctx], _c.c_int32),
    "llama_ahakv_layer_is_swa": ([_c.c_void_p, _c.c_int32], _c.c_int32),
    "llama_ahakv_set_tap": ([_ctx, _c.c_uint32, _c.c_int32], None),
    "llama_ahakv_set_next_tap": ([_c.c_uint32, _c.c_int32], None),
    "llama_ahakv_set_log_level": ([_c.c_int32], None),
    "llama_ahakv_set_side_scale": ([_ctx, _c.c_float], None),
    "llama_ahakv_reset": ([_ctx], None),
    "llama_ahakv_n_rows": ([_ctx], _c.c_int64),
    "llama_ahakv_set_side_scale_seq": ([_ctx, _c.c_int32, _c.c_float], None),
    "llama_ahakv_reset_seq": ([_ctx, _c.c_int32], None),
    "llama_ahakv_n_rows_seq": ([_ctx, _c.c_int32], _c.c_int64),
    "llama_ahakv_get_attn": ([_ctx, _c.c_int32, _f32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_get_side": ([_ctx, _c.c_int32, _f32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_get_verr": ([_ctx, _c.c_int32, _f32p, _c.c_int32], _c.c_int32),
    "llama_ahakv_get_vnorm": ([_ctx, _c.c_int32, _f32p, _c.c_int32], _c.c_int32),
}


@dataclass(frozen=True)
class NativeLib:
    """The bound functions, as attributes named without the ``llama_ahakv_`` prefix."""

    cdll: ctypes.CDLL

    def __getattr__(self, name: str):
        return getattr(self.cdll, "llama_ahakv_" + name)


@cache
def lib() -> NativeLib:
    """Bind the API once; refuse an unpatched or mismatched engine with a message that says what to do."""
    try:
        cdll = upstream.cdll()
    except Exception as exc:  # ImportError, OSError (no library), AttributeError (a library without llama_*)
        raise EngineNotPatched(f"llama-cpp-python is not installed or does not load ({exc}); {BUILD_HINT}") from exc
    upstream.check_version()
    if not hasattr(cdll, "llama_ahakv_abi_version"):
        raise EngineNotPatched(f"the installed llama-cpp-python is not patched for ahakv-local; {BUILD_HINT}")
    for name, (argtypes, restype) in _SIGNATURES.items():
        if not hasattr(cdll, name):
            raise EngineNotPatched(f"the patched engine lacks {name}; {BUILD_HINT}")
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = argtypes, restype

    found = cdll.llama_ahakv_abi_version()
    if found != ABI_VERSION:
        raise EngineNotPatched(f"the engine has ahakv ABI {found}, this ahakv-local needs {ABI_VERSION}; {BUILD_HINT}")
    upstream.use_ggml_log_levels()  # every command binds here first: its plain llama_cpp.Llama baselines too
    return NativeLib(cdll)
