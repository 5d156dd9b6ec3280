"""Which ggml device the engine tests run on: the CPU, or the one AHAKV_TEST_DEVICE names.

``AHAKV_TEST_DEVICE=vulkan`` (or ``cuda``, ``metal``) offloads every layer of the models that the
modules marked ``device`` load (``n_gpu_layers``), so the tap-vs-reference and eviction tests run on
that backend's kernels and buffers. When the installed engine has no such device, conftest skips those
tests with the reason (``device_missing``). Unset, everything runs on the CPU as before.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

DEVICE = os.environ.get("AHAKV_TEST_DEVICE", "").strip().lower()
# ggml's registry names: ggml_backend_reg_name of each backend (Metal registers as "MTL")
REGISTRY_NAMES = {"vulkan": ("vulkan",), "cuda": ("cuda",), "metal": ("metal", "mtl")}
N_GPU_LAYERS = -1 if DEVICE else 0  # -1: every layer, the output layer included (llama.cpp)


@cache
def _ggml() -> ctypes.CDLL:
    import engine_libs
    import llama_cpp  # noqa: F401  (loads the engine and registers its backends first)

    lib = engine_libs.load("ggml")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    return lib


def devices() -> list[tuple[str, str]]:
    """(registry name, description) of every device the installed engine sees, the CPU included."""
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)).decode()
        out.append((reg, lib.ggml_backend_dev_description(dev).decode()))
    return out


def device_missing() -> str | None:
    """Why the tests cannot run on AHAKV_TEST_DEVICE (None: they can, or it is unset)."""
    if not DEVICE:
        return None
    found = devices()
    if any(reg.lower() in REGISTRY_NAMES[DEVICE] for reg, _ in found):
        return None
    seen = ", ".join(f"{reg} ({desc})" for reg, desc in found)
    hint = {
        "vulkan": "build --vulkan; lavapipe, Mesa's CPU device, is used only with GGML_VK_VISIBLE_DEVICES=0",
        "cuda": "build --cuda on a machine with an NVIDIA GPU",
        "metal": "build --metal on Apple silicon",
    }[DEVICE]
    return f"AHAKV_TEST_DEVICE={DEVICE}: the installed engine has no {DEVICE} device (it sees {seen}; {hint})"


def description() -> str:
    """The device the tests run on, for reports."""
    names = REGISTRY_NAMES.get(DEVICE, ())
    return "; ".join(f"{reg}: {desc}" for reg, desc in devices() if reg.lower() in names) or "CPU"
