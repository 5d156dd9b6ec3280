#!/usr/bin/env bash
# benchmarks/gpu_check.sh on the Vulkan backend, sized for lavapipe (Mesa's Vulkan device on the CPU, Debian's
# mesa-vulkan-drivers): the same build, device tests, tap overhead and bench speed with every layer offloaded.
#
#   bash benchmarks/vulkan_check.sh [OUT]        (OUT: benchmarks/out/gpu-vulkan)
#
# Needs: apt-get install libvulkan-dev glslc spirv-headers mesa-vulkan-drivers. ggml-vulkan skips CPU devices
# unless they are named, so lavapipe is device 0 of GGML_VK_VISIBLE_DEVICES (set it otherwise for a real GPU).
# lavapipe computes on the CPU: the timings say that the offloaded graph runs, not how fast a GPU would be.
set -uo pipefail
cd "$(dirname "$0")/.."
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
export TAP_ARGS=${TAP_ARGS:---context 1024 --tokens 16 --rounds 3}
export BENCH_ARGS=${BENCH_ARGS:---budget 256 --policies ahakv,streaming --rounds 2 --decode-tokens 32 --long-context 2048}
exec bash benchmarks/gpu_check.sh vulkan "${1:-benchmarks/out/gpu-vulkan}"
