"""A second code path for the tests: copy named graph tensors through llama.cpp's cb_eval.

This is the slow path the patched tap replaces (one Python callback per graph node). The tests use
it to read the model's own ``kq_soft_max-<il>``, ``Qcur``/``Kcur``/``Vcur`` and head outputs.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict

import engine_libs
import llama_cpp.llama_cpp as ll
import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64


class GgmlTensor(ctypes.Structure):
    # mirrors struct ggml_tensor (vendor/llama.cpp/ggml/include/ggml.h)
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_base = engine_libs.load("ggml-base", mode=ctypes.RTLD_GLOBAL)
_base.ggml_nbytes.argtypes = [ctypes.c_void_p]
_base.ggml_nbytes.restype = ctypes.c_size_t
_base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
_base.ggml_is_contiguous.restype = ctypes.c_bool
_base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
_base.ggml_backend_tensor_get.restype = None
_base.ggml_op_name.argtypes = [ctypes.c_int]
_base.ggml_op_name.restype = ctypes.c_char_p

GGML_TYPE_F32 = 0


class Capture:
    """Collects every F32 tensor whose name starts with one of ``prefixes``, per ubatch, in order.

    A model may name several nodes alike (llama.cpp calls ``cb(Qcur, "Qcur", il)`` before and after
    RoPE); ``ops`` keeps, per prefix, only nodes made by one of the given ggml ops (e.g. ROPE).
    """

    def __init__(self, prefixes: tuple[str, ...], ops: dict[str, tuple[str, ...]] | None = None):
        self.prefixes = tuple(p.encode() for p in prefixes)
        self.ops = {k.encode(): tuple(o.encode() for o in v) for k, v in (ops or {}).items()}
        self.enabled = True
        self.tensors: dict[str, list[np.ndarray]] = defaultdict(list)
        self.callback = ll.ggml_backend_sched_eval_callback(self._callback)  # keep a reference

    def clear(self) -> None:
        self.tensors.clear()

    def _callback(self, t_ptr, ask, _user_data):
        t = ctypes.cast(t_ptr, ctypes.POINTER(GgmlTensor)).contents
        wanted = self.enabled and t.name.startswith(self.prefixes) and t.type == GGML_TYPE_F32
        if wanted:
            prefix = next(p for p in self.prefixes if t.name.startswith(p))
            rest = t.name[len(prefix) :]
            wanted = rest.isdigit() and (prefix not in self.ops or _base.ggml_op_name(t.op) in self.ops[prefix])
        if ask:
            return wanted
        if wanted and _base.ggml_is_contiguous(t_ptr):
            arr = np.empty(tuple(t.ne)[::-1], dtype=np.float32)  # numpy axes: (ne3, ne2, ne1, ne0)
            _base.ggml_backend_tensor_get(t_ptr, arr.ctypes.data, 0, _base.ggml_nbytes(t_ptr))
            self.tensors[t.name.decode()].append(arr)
        return True  # False would skip the rest of the split

    def tokens(self, name: str) -> np.ndarray:
        """Per-token tensors like Qcur-<il> ([hd, n_head, n_tokens] per ubatch) stacked in decode
        order: [n_tokens_total, n_head, hd]."""
        return np.concatenate([a.reshape(-1, *a.shape[-2:]) for a in self.tensors[name]], axis=0)
