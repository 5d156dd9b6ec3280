#!/usr/bin/env bash
# Round 10 on the H200 (benchmarks/gpu_h200.md): where a decode step's time goes after a long prompt, every layer
# offloaded. Called with the model's last piece, after device.sh; model.sh only assembles the model (no tests, no
# model steps), then profile_decode.py after prompts of 2,048, 8,192 and 32,512 tokens.
set -uo pipefail
mkdir -p /tmp/m && mv .m4 /tmp/m/
TESTS=" " MODEL_STEPS=0 RES=/tmp/gpu3 bash benchmarks/gpu_offline/model.sh >/dev/null 2>&1
source "$(dirname "$0")/env.sh" >/dev/null
for run in "ahakv shared" "streaming shared"; do
	set -- $run
	for ctx in 2048 8192 32512; do
		echo "=== profile_decode.py -ngl -1 --policy $1 --layer-budgets $2 --context $ctx"
		timeout 120 $PY benchmarks/profile_decode.py -ngl -1 --text .lic/licenses.txt --policy "$1" --layer-budgets "$2" \
			--context $ctx --steps 256 --sort tottime --top 8 2>&1 | grep -v '^$' | grep -v -e 'Ordered by' -e 'List reduced'
	done
done
