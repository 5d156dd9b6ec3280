"""The ``auto`` budget (the seed's adaptive 10-40% retention, decided by AhaKV's predicted output error) beside
fixed budgets holding the same mean cells, per text: what it keeps and what that costs.

    AHAKV_CACHE_DIR=... python benchmarks/auto_budget.py --texts /usr/share/common-licenses/GPL-3,\\
        /usr/share/common-licenses/MPL-1.1 --tokens 4096 --step 16 --out benchmarks/out/auto_budget.json

Per text: AhaKV with ``auto`` first (its mean cells held after each step and their mean share of the tokens
seen), then every policy at a fixed cell budget that holds the same mean cells, so both hold the same mean KV
bytes in use. (auto cannot know its cells ahead, so its engine allocates the full cache: the table says so.) Nothing
is tuned on the texts (auto's 10%/40%/0.05 bounds are Budget's defaults). A JSON report and a markdown table
with the command go to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import command_line, file_tokens, write_report  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.budget import Budget
from ahakv_local.evaluation import PplResult, evaluate
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec


def row(text: str, label: str, r: PplResult) -> dict:
    return {
        "text": text,
        "label": label,
        "ppl": r.ppl,
        "kl": r.kl,
        "top1": r.top1,
        "mean_cells": r.mean_cells,
        "mean_share": r.mean_share,
        "max_cells": r.max_cells,
        "kv_bytes": r.kv_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="/usr/share/common-licenses/GPL-3,/usr/share/common-licenses/MPL-1.1")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--policies", default="ahakv,snapkv,h2o,streaming")
    ap.add_argument("--out", default="benchmarks/out/auto_budget.json")
    args = ap.parse_args()
    model = default_model_path()
    out = Path(args.out)
    report = {"command": command_line(), "model": model.name,
              "tokens": args.tokens, "step": args.step, "rows": []}  # fmt: skip
    for text in args.texts.split(","):
        tokens = file_tokens(model, text, args.tokens)
        auto = evaluate(model, tokens, [SessionSpec.bounded("ahakv", "auto", label="auto")], step=args.step)
        report["rows"] += [row(text, "full", auto["full"]), row(text, "ahakv auto", auto["auto"])]
        # an eviction every `step` tokens goes step - 1 cells below a cell budget (room for the next step),
        # so this budget holds auto's mean cells after each step, as auto's mean is measured
        cells = round(auto["auto"].mean_cells) + args.step - 1
        specs = [SessionSpec.bounded(p, Budget("cells", cells), label=f"{p}@{cells}") for p in args.policies.split(",")]
        fixed = evaluate(model, tokens, specs, step=args.step)
        report["rows"] += [row(text, s.label, fixed[s.label]) for s in specs]
        write_report(report, out, table(report))
        print(table(report), flush=True)


def table(report: dict) -> str:
    lines = [
        f"auto vs fixed budgets at the same mean cells, {report['model']}, {report['tokens']} tokens, "
        f"step {report['step']}",
        "",
        f"    {report['command']}",
        "",
        "| text | configuration | mean cells | mean kept share | ppl | mean KL | top-1 | KV MiB allocated |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        kl = "–" if r["label"] == "full" else f"{r['kl']:.4f}"
        lines.append(
            f"| {Path(r['text']).name} | {r['label']} | {r['mean_cells']:.0f} | {r['mean_share']:.3f} | "
            f"{r['ppl']:.3f} | {kl} | {r['top1']:.3f} | {r['kv_bytes'] / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
