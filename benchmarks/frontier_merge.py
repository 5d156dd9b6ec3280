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
    ap.add_argument(
        "--versus",
        metavar="POLICY/LAYOUT",
        help='also print every row per budget against this one, e.g. "ahakv/adaptive auto" (ppl and KL ratios)',
    )
    ap.add_argument("--matrix", action="store_true", help="also print one row per policy/layout, one column per budget")
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
    if args.matrix:
        print("\n".join(matrix_table(rows)))
    if args.versus:
        print("\n".join(versus_table(rows, args.versus)))


def matrix_table(rows: list[dict]) -> list[str]:
    """One row per policy/layout, one column per budget: ppl (KL) and its rank among the rows of that budget by
    perplexity / by KL (1: the lowest)."""
    fracs = list(dict.fromkeys(r["fraction"] for r in rows))
    rank, n = {}, {frac: sum(r["fraction"] == frac for r in rows) for frac in fracs}
    for frac in fracs:
        at = [r for r in rows if r["fraction"] == frac]
        for key in ("ppl", "kl"):
            for i, r in enumerate(sorted(at, key=lambda r: r[key])):
                rank[(id(r), key)] = i + 1
    lines = ["| policy / layout | " + " | ".join(f"{f}: ppl (KL), rank ppl / KL" for f in fracs) + " |"]
    lines.append("|---|" + "---:|" * len(fracs))
    for pair in dict.fromkeys((r["policy"], r["layer_budgets"]) for r in rows):
        cells = []
        for frac in fracs:
            r = next((r for r in rows if (r["policy"], r["layer_budgets"], r["fraction"]) == (*pair, frac)), None)
            cells.append(
                ""
                if r is None
                else f"{r['ppl']:.3f} ({r['kl']:.4f}), {rank[(id(r), 'ppl')]} / {rank[(id(r), 'kl')]} of {n[frac]}"
            )
        lines.append(f"| {pair[0]} / {pair[1]} | " + " | ".join(cells) + " |")
    return lines


def versus_table(rows: list[dict], versus: str) -> list[str]:
    """Per budget, every row sorted by perplexity beside the ``versus`` row ("policy/layout"): its ppl and KL,
    their ratios to the reference's, and whether it is below the reference in either."""
    policy, _, layout = versus.partition("/")
    lines = [
        "| budget | policy / layout | ppl | KL | ppl / ref | KL / ref | below ref in |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for frac in dict.fromkeys(r["fraction"] for r in rows):
        at = sorted((r for r in rows if r["fraction"] == frac), key=lambda r: r["ppl"])
        ref = next((r for r in at if (r["policy"], r["layer_budgets"]) == (policy, layout)), None)
        if ref is None:
            raise SystemExit(f"no row {versus!r} at {frac}")
        for r in at:
            below = [k for k in ("ppl", "kl") if r is not ref and r[k] < ref[k]]
            name = f"**{r['policy']} / {r['layer_budgets']}**" if r is ref else f"{r['policy']} / {r['layer_budgets']}"
            lines.append(
                f"| {frac} | {name} | {r['ppl']:.3f} | {r['kl']:.4f} | {r['ppl'] / ref['ppl']:.3f} | "
                f"{r['kl'] / ref['kl']:.2f} | {', '.join(below) or '-'} |"
            )
    return lines


if __name__ == "__main__":
    main()
