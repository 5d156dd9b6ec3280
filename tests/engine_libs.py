"""The installed engine's shared libraries by name, on every platform the README names: llama-cpp-python's loader
(``llama_cpp._ctypes_extensions.load_shared_library``) looks for ``lib<name>.so`` on Linux and ``lib<name>.so`` or
``lib<name>.dylib`` on macOS, where CMake writes ``.dylib``. The tests named ``.so`` files: on macOS every file
importing ``capture`` failed at collection, and the documented Metal device run could not start."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import llama_cpp

LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
SUFFIXES = (".so", ".dylib") if sys.platform == "darwin" else (".so",)


def library_path(name: str) -> Path:
    """The path of ``lib<name>`` in the installed engine (the first suffix present)."""
    for suffix in SUFFIXES:
        path = LIB_DIR / f"lib{name}{suffix}"
        if path.exists():
            return path
    raise FileNotFoundError(f"no lib{name}{' or '.join(SUFFIXES)} in {LIB_DIR}")


def load(name: str, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    return ctypes.CDLL(str(library_path(name)), mode=mode)
