"""Streaming perplexity per policy and budget on real text (Gemma 3 270M by default), plus AhaKV ablations.

    python benchmarks/streaming_ppl.py [--model PATH] [--text FILE] [--tokens 1536] [--budgets 64,128]
                                       [--policies all] [--ablations] [--out benchmarks/out/streaming_ppl.json]

Every policy gets the same sinks (4) and recent window (32); positions are kept, not re-packed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.evaluation import streaming_perplexity
from ahakv_local.models import resolve_model
from ahakv_local.policies import POLICIES
from ahakv_local.policies.ahakv import ABLATIONS
from ahakv_local.session import SessionSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--ablations", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "streaming_ppl.json"))
    args = ap.parse_args()

    model = resolve_model(args.model)
    tokens = file_tokens(model, args.text, args.tokens)
    names = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    runs = [(n, n, {}) for n in names if n != "full"]
    if args.ablations:
        runs += [(label, "ahakv", params) for label, params in ABLATIONS.items()]

    full = streaming_perplexity(model, tokens, SessionSpec(), prefix=args.prefix)
    results = {"full": asdict(full) | {"budget": str(full.budget)}}
    print(f"full cache: ppl {full.ppl:.3f} over {len(tokens)} tokens of {args.text}", flush=True)
    table: dict[str, dict[str, float]] = {}
    for budget in args.budgets.split(","):
        for label, policy, params in runs:
            spec = SessionSpec.bounded(policy, budget, label=label, params=params)
            r = streaming_perplexity(model, tokens, spec, prefix=args.prefix)
            results[f"{label} @ {budget}"] = asdict(r) | {"budget": str(r.budget)}
            table.setdefault(label, {})[budget] = r.ppl
            print(
                f"{label:32s} budget {budget:>5s}: ppl {r.ppl:8.3f} (max cells {r.max_cells}, {r.seconds:.0f} s)",
                flush=True,
            )

    command = " ".join([Path(sys.executable).name, *sys.argv])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": command,
                "date": time.strftime("%Y-%m-%d"),
                "text": args.text,
                "tokens": len(tokens),
                "model": str(model),
                "results": results,
            },
            indent=1,
        )
    )
    budgets = args.budgets.split(",")
    print(f"\ncommand: `{command}`\n")
    print("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("|---|" + "---:|" * len(budgets))
    print("| full cache | " + " | ".join(f"{full.ppl:.3f}" for _ in budgets) + " |")
    for label, row in table.items():
        cells = [f"{row[b]:.3f} ({100 * (row[b] / full.ppl - 1):+.1f}%)" for b in budgets]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
