#!/usr/bin/env bash
# Call A on the lent GPU machine (no network, no compilers needed): the engine built elsewhere by `ahakv-local build
# --cuda` with the same flags (its llama_cpp package, libraries deduplicated, as $DATA/engine-cuda.tar.xz: the wheel
# holds each library six times), marked as that build's so `build --cuda` finds it up to date, then
# benchmarks/gpu_check.sh on the fixtures (the default model is absent) and benchmarks/device_error.py.
set -uo pipefail
t0=$SECONDS
source "$(dirname "$0")/env.sh"
RES=${RES:-/tmp/gpu}
tar xJf "${ENGINE_TAR:-$DATA/engine-cuda.tar.xz}" -C /tmp/site || exit 1
$PY - <<PY || exit 1
import json
from ahakv_local import build
pkg, bp = build.installed_package(), build.plan($DEV=True)
marker = {"key": bp.key, "cmake_args": bp.cmake_args, "patches": [p.name for p in bp.patches]}
(pkg / build.MARKER).write_text(json.dumps(marker | {"library_sha256": build.library_digest(pkg)}))
print("engine", pkg, "key", bp.key)
PY
echo "setup $((SECONDS - t0)) s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 330 env TESTS="${TESTS:-tests/test_native.py tests/test_tap_fixture.py tests/test_controller.py tests/test_layer_groups.py tests/test_per_layer_caches.py}" \
	PYTHON=$PY MODEL_STEPS=0 PYTEST_K="not 270m" bash benchmarks/gpu_check.sh "$DEV" "$RES"
for fa in "" --flash-attn; do  # DEVICE_ERROR=0: not this time
	[ "${DEVICE_ERROR:-1}" = 0 ] && break
	echo "== device_error.py $fa" >>"$RES/device_error.txt"
	AHAKV_TEST_DEVICE=$DEV timeout 120 $PY benchmarks/device_error.py $fa >>"$RES/device_error.txt" 2>&1
done
cat "$RES/device_error.txt" 2>/dev/null
grep -h -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$RES"/test_*.txt | tail -n 40
[ -n "${OUT:-}" ] && tar czf "$OUT/gpu.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
echo "total $((SECONDS - t0)) s"
