"""Build the patched engine for CUDA on a machine without a GPU (and without cuBLAS in its CUDA toolkit), for
benchmarks/gpu_offline/device.sh to run on a GPU machine that cannot compile or reach a network.

    python -m pip download --no-deps --only-binary=:all: "nvidia-cublas>=13,<14" -d CUBLAS_DL
    unzip CUBLAS_DL/nvidia_cublas-*.whl -d CUBLAS_DL/x   # then, in CUBLAS_DL/x/nvidia/cu13/lib:
    ln -s libcublas.so.13 libcublas.so; ln -s libcublasLt.so.13 libcublasLt.so
    CUBLAS=CUBLAS_DL/x/nvidia/cu13 CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=ON" \\
        python benchmarks/gpu_offline/build_elsewhere.py WORK

The same steps as `ahakv-local build --cuda` (the pinned sdist, patches/, the same CMake arguments, so the same
key), plus where cuBLAS is; the wheel lands in WORK/dist, not installed. GGML_NATIVE=OFF: the CPU part runs on any
x86-64 with AVX2 (the GPU machine's CPU is another one); GGML_CUDA_NO_VMM=ON: no link against the driver's
libcuda.so, which a machine without a GPU lacks. On 2 cores: about 20 minutes, 144 CUDA files for sm_90. Then
package the llama_cpp folder of the wheel with each library once (the wheel holds six copies, 257 MB):
engine-cuda.tar.xz, 40 MB (benchmarks/gpu_offline/env.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ahakv_local import build


def main() -> None:
    work = Path(sys.argv[1])
    cublas = Path(os.environ["CUBLAS"])
    bp = build.plan(cuda=True)
    where = (
        f"-DCUDA_cublas_LIBRARY={cublas}/lib/libcublas.so",
        f"-DCUDA_cublasLt_LIBRARY={cublas}/lib/libcublasLt.so",
        f"-DCMAKE_CUDA_FLAGS=-I{cublas}/include",
    )
    print("key", bp.key, " ".join(bp.cmake_args), flush=True)
    tree = build.unpack(build.fetch_sdist(), work / "src")
    build.apply_patches(tree, bp.patches)
    print("wheel", build.build_wheel(tree, work / "build", work / "dist", bp.cmake_args + where), flush=True)


if __name__ == "__main__":
    main()
