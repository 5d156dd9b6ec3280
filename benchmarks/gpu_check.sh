#!/usr/bin/env bash
# The device check (issue 13): build the engine for this machine's GPU backend, run the engine and policy tests
# on it (AHAKV_TEST_DEVICE, tests/device.py: every layer offloaded), the tap overhead and `bench speed` with every
# layer offloaded, and print one summary table (benchmarks/gpu_summary.py) naming the machine.
#
#   bash benchmarks/gpu_check.sh [cuda|metal|vulkan] [OUT]     default: metal on macOS, else cuda;
#                                                            OUT: benchmarks/out/gpu-<device>
#
# Each step's full output is kept under OUT; a failing step is recorded and the next one still runs. The lighter
# settings a slow device needs (benchmarks/vulkan_check.sh) come through the environment:
#   TESTS       test files (default: the tap-vs-reference, eviction, controller, layer-group and policy tests)
#   PYTEST_K    a pytest -k expression (e.g. "not 270m and not gemma" where the default model is absent)
#   MODEL_STEPS 0: skip the tap overhead and `bench speed`, which read the default model (default 1)
#   TAP_ARGS    arguments of benchmarks/tap_overhead.py  (default: --context 2048 --tokens 32 --rounds 5)
#   BENCH_ARGS  arguments of `ahakv-local bench speed`   (default: --policies ahakv,h2o,streaming --rounds 3)
#   BUILD_ARGS  extra arguments of `ahakv-local build`   (e.g. --cmake-args "-DCMAKE_CUDA_ARCHITECTURES=90")
#   PYTHON      the interpreter with ahakv-local installed (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."

default_device=cuda
[ "$(uname)" = Darwin ] && default_device=metal
DEVICE=${1:-$default_device}
case "$DEVICE" in cuda | metal | vulkan) ;; *) echo "error: device must be cuda, metal or vulkan, not '$DEVICE'" >&2; exit 2 ;; esac
OUT=${2:-benchmarks/out/gpu-$DEVICE}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TESTS=${TESTS:-tests/test_native.py tests/test_tap_fixture.py tests/test_tap_gemma.py tests/test_controller.py tests/test_layer_groups.py tests/test_per_layer_caches.py tests/test_policies_gemma.py}
TAP_ARGS=${TAP_ARGS:---context 2048 --tokens 32 --rounds 5}
BENCH_ARGS=${BENCH_ARGS:---policies ahakv,h2o,streaming --rounds 3}
mkdir -p "$OUT"
: >"$OUT/steps.tsv" # step, exit code, seconds

step() { # step NAME LOGFILE COMMAND...: run, keep the output, record the exit code and the time
	local name=$1 log=$2 t0=$SECONDS rc
	shift 2
	echo "== $name: $*" >&2
	"$@" >"$log" 2>&1
	rc=$?
	printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/steps.tsv"
	tail -n 3 "$log" >&2
}

{ # the machine, named
	echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
	echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1) ($(nproc 2>/dev/null) cores)"
	[ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null &&
		echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n1)"
	[ "$DEVICE" = metal ] && echo "gpu: $(system_profiler SPDisplaysDataType 2>/dev/null | sed -n 's/^ *Chipset Model: *//p' | head -n1)"
	if [ "$DEVICE" = vulkan ]; then
		command -v dpkg-query >/dev/null && echo "mesa: $(dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null)"
		echo "vulkan headers: $(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\)/1.3.\1/p' /usr/include/vulkan/vulkan_core.h 2>/dev/null)"
		echo "GGML_VK_VISIBLE_DEVICES: ${GGML_VK_VISIBLE_DEVICES:-unset}"
	fi
	echo "os: $(uname -srm)"
} >"$OUT/machine.txt"

step build "$OUT/build.txt" "$PY" -m ahakv_local build "--$DEVICE" ${BUILD_ARGS:-}
AHAKV_TEST_DEVICE=$DEVICE "$PY" -c 'import sys; sys.path.insert(0, "tests"); import device; print("engine device:", device.description())' \
	>>"$OUT/machine.txt" 2>/dev/null
for t in $TESTS; do
	name=$(basename "$t" .py)
	step "$name" "$OUT/$name.txt" env AHAKV_TEST_DEVICE="$DEVICE" "$PY" -m pytest "$t" -q -rfEs -p no:cacheprovider \
		--junitxml="$OUT/$name.xml" ${PYTEST_K:+-k "$PYTEST_K"}
done
if [ "${MODEL_STEPS:-1}" != 0 ]; then
	# shellcheck disable=SC2086  # the argument strings are split on purpose
	step tap_overhead "$OUT/tap_overhead.md" "$PY" benchmarks/tap_overhead.py -ngl -1 $TAP_ARGS --out "$OUT/tap_overhead.json"
	# shellcheck disable=SC2086
	step bench_speed "$OUT/bench_speed.txt" "$PY" -m ahakv_local bench speed -ngl -1 $BENCH_ARGS --out "$OUT/bench"
fi
"$PY" benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
