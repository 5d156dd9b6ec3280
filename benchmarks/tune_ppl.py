"""Perplexity and KL from the full cache of policy variants on a tuning text (not GPL-3 or MPL-1.1, which the
RESULTS tables read), so that a setting tuned for one task is checked for what it costs in perplexity.

    python benchmarks/tune_ppl.py '{"aha": ["ahakv", {}], "aha-r16": ["ahakv", {"r": 16}]}' \
        --text /usr/share/common-licenses/GFDL-1.3 --tokens 2048 --budget 256 --step 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.evaluation import evaluate
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help="JSON {label: [policy, params]}")
    ap.add_argument("--text", default="/usr/share/common-licenses/GFDL-1.3")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--layer-budgets", default="shared", help="layouts crossed with the variants (comma-separated)")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: every core)")
    ap.add_argument("--reference-dir", default=None, help="keep or read the full cache's rows here")
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, args.tokens)
    layouts = args.layer_budgets.split(",")
    specs = [
        SessionSpec.bounded(
            policy, args.budget, label=label + ("" if len(layouts) == 1 else f" {lb}"), params=params, layer_budgets=lb
        )
        for label, (policy, params) in json.loads(args.variants).items()
        for lb in layouts
    ]
    start = time.time()
    results = evaluate(model, tokens, specs, step=args.step, n_threads=args.threads, reference_dir=args.reference_dir)
    print(f"{Path(args.text).name}, {len(tokens)} tokens, budget {args.budget}, step {args.step}")
    print("| variant | ppl | mean KL | top-1 | KV MiB |\n|---|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r.ppl:.3f} | {r.kl:.4f} | {r.top1:.3f} | {r.kv_bytes / 2**20:.2f} |")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
