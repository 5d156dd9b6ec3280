#!/usr/bin/env bash
# Round 7 on the H200 (benchmarks/gpu_h200.md): the CUDA graph key with the node count (now patch 0019) against
# upstream's first-node key, side by side in one call. The engine (device.sh, ENGINE_TAR) carried patch 0019's line
# with a switch for that run only, in ggml_cuda_graph_get_key: `if (getenv("AHAKV_CUDA_GRAPH_KEY_FIRST_NODE"))
# return cgraph->nodes[0];` (read once, static). Called with the model's last piece (.m4).
set -uo pipefail
mkdir -p /tmp/m && mv .m4 /tmp/m/
export TAP_ARGS="--context 2048 --tokens 64 --rounds 5 --period 8"
export BENCH_ARGS="--text .lic/licenses.txt --policies ahakv,h2o,streaming --layer-budgets shared,natural --rounds 3"
run() { # run NAME [VAR=value ...]: model.sh's steps into /tmp/NAME, its archive renamed
	local name=$1
	shift
	env "$@" RES=/tmp/$name bash benchmarks/gpu_offline/model.sh
	[ -n "${OUT:-}" ] && mv "$OUT/gpu2.tgz" "$OUT/$name.tgz"
}
run first_node AHAKV_CUDA_GRAPH_KEY_FIRST_NODE=1 TESTS=" "
run node_count TESTS="tests/test_tap_gemma.py tests/test_policies_gemma.py"
run first_node_again AHAKV_CUDA_GRAPH_KEY_FIRST_NODE=1 TESTS=" " BENCH_ARGS="--text .lic/licenses.txt --policies ahakv --layer-budgets shared --rounds 3"
run node_count_again TESTS=" " BENCH_ARGS="--text .lic/licenses.txt --policies ahakv --layer-budgets shared --rounds 3"
