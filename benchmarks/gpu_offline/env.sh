# The device check (benchmarks/gpu_check.sh) on a lent GPU machine that can reach no network and may not compile:
# what ran on an H200 on 2026-12-04 (benchmarks/gpu_h200.md). Sourced by device.sh and model.sh, which run from the
# repository root with, beside it (each call carries at most 64 MiB):
#   $DATA (default .dev)   GPL-3 and engine-cuda.tar.xz: the llama_cpp package that `ahakv-local build --cuda` built
#                          elsewhere with CMAKE_ARGS below (its wheel holds each library six times, 257 MB; the
#                          package with the libraries once, as symbolic links, is 40 MB as tar.xz)
#   .whl/                  wheels of gguf and diskcache (the machine's python3 has the rest)
#   .lic/licenses.txt      /usr/share/common-licenses/* in one file (model.sh's bench speed reads it)
# and, for model.sh, the default model's GGUF in five pieces under /tmp/m (split -n 5 -d -a 1 into .m0-.m4, one call
# each: mkdir -p /tmp/m && mv .mK /tmp/m/).
export PYTHONUNBUFFERED=1
export DATA=${DATA:-.dev}
export DEV=${DEV:-cuda} PY=${PY:-python3}
export AHAKV_CACHE_DIR=${AHAKV_CACHE_DIR:-/tmp/ahakv-cache}
export CMAKE_ARGS=${CMAKE_ARGS:-"-DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=ON"}
[ -d /tmp/site/gguf ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
[ -f /usr/share/common-licenses/GPL-3 ] || { mkdir -p /usr/share/common-licenses && cp $DATA/GPL-3 /usr/share/common-licenses/; }
for so in libcublas.so.13 libcudart.so.13; do  # the engine was linked against CUDA 13's runtime and cuBLAS
	lib=$(find /usr/local /opt /usr/lib -name "$so" 2>/dev/null | head -1)
	[ -n "$lib" ] && export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	echo "$so: ${lib:-none}"
done
