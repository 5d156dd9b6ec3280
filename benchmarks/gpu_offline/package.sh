#!/usr/bin/env bash
# The llama_cpp package of an engine wheel with each library once (the others as symbolic links to it), as tar.xz:
#   bash benchmarks/gpu_offline/package.sh WORK/dist/llama_cpp_python-*.whl .dev/engine-cuda.tar.xz
set -euo pipefail
wheel=$(realpath "$1") out=$(realpath "$2")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
unzip -q "$wheel" 'llama_cpp/*'
cd llama_cpp/lib
for f in *.so.*.*.*; do # libX.so.0.25.3: libX.so and libX.so.0 are copies of it in the wheel
	base=${f%%.so.*}.so
	for link in "$base" "$base.0"; do
		if [ -f "$link" ] && cmp -s "$f" "$link"; then ln -sf "$f" "$link"; fi
	done
done
cd "$tmp"
tar cJf "$out" llama_cpp
ls -l "$out"
