"""One frontier figure from several runs of benchmarks/layer_budgets.py on the same text and length (their rows
side by side; a layout measured by an earlier run can be renamed, e.g. natural's default before a change).

    python benchmarks/frontier_merge.py benchmarks/out/layer_budgets_gpl3.json:natural=natural-window \\
        benchmarks/out/layer_budgets_gpl3_even.json --policies ahakv --out benchmarks/figures/frontier_gpl3.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import text_name  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.plots import plot_frontier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="JSON reports, each optionally :OLD=NEW,... to rename its layouts")
    ap.add_argument("--policies", default=None, help="only these policies (comma-separated)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, reports = [], []
    for run in args.runs:
        path, _, renames = run.partition(":")
        report = json.loads(Path(path).read_text())
        names = dict(r.split("=") for r in renames.split(",")) if renames else {}
        reports.append(report)
        for r in report["results"]:
            if args.policies is None or r["policy"] in args.policies.split(","):
                rows.append(r | {"layer_budgets": names.get(r["layer_budgets"], r["layer_budgets"])})
    first = reports[0]
    if any((r["text"], r["tokens"], r["trimmed_bytes"]) != (first["text"], first["tokens"], first["trimmed_bytes"])
           for r in reports):  # fmt: skip
        raise SystemExit("the runs read different texts, lengths or trimmed caches: their rows do not compare")
    title = f"{first['model']}, {first['tokens']} tokens of {text_name(first['text'])}"
    print(plot_frontier(rows, first["full_ppl"], first["trimmed_bytes"], Path(args.out), title))


if __name__ == "__main__":
    main()
