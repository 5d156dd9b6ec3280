"""Layer budgets on the real model: perplexity and mean KL from the full cache, shared vs natural, at byte
budgets of 1/2, 1/4 and 1/8 of llama.cpp's trimmed cache (swa_full off) at the same length.

    AHAKV_CACHE_DIR=... python benchmarks/layer_budgets.py --text /usr/share/common-licenses/GPL-3 \\
        --tokens 4096 --step 16 --out benchmarks/layer_budgets.json

Nothing is tuned on the text. Results go to a JSON file (rewritten after each run) and a markdown table
next to it, with the command that produced them, and the frontier (perplexity and KL against allocated bytes)
as a PNG beside them. With ``--reference-dir DIR`` the full cache's rows are kept in DIR, and a later run on the
same tokens and step reads them instead of running the full cache again (8.6 GB at 16K tokens on Gemma 3).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# benchmarks/ is the script's directory: sys.path[0]
from common import command_line, file_tokens, text_name, write_report

from ahakv_local import adaptive
from ahakv_local.budget import Budget
from ahakv_local.evaluation import PplResult, evaluate
from ahakv_local.info import read_info
from ahakv_local.models import default_model_path
from ahakv_local.plots import plot_frontier
from ahakv_local.session import SessionSpec

FRACTIONS = (2, 4, 8)


def layouts(spec: str, kv_types: str) -> list[tuple[str, str, float | None, str]]:
    """``--layouts`` x ``--kv-types`` as (label, layer budgets, sliding share, KV type): "natural@0.55" is natural
    groups giving the sliding cache 0.55 of the bytes; "natural:q5_0" is natural in q5_0 only (not crossed with
    --kv-types); a quantized layout's label ends in its type, e.g. " q8_0"."""
    out = []
    for item in spec.split(","):
        item, _, only = item.partition(":")
        lb, _, share = item.partition("@")
        for kv in [only] if only else kv_types.split(","):
            out.append((item + ("" if kv == "f16" else f" {kv}"), lb, float(share) if share else None, kv))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help='a file; "a+b": one after the other')
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--n-ubatch", type=int, default=64)
    ap.add_argument("--policies", default="streaming,h2o,tova,snapkv,ahakv")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="budgets: 1/F of the trimmed cache")
    ap.add_argument("--layouts", default="shared,natural", help="shared, natural, natural@SHARE; LAYOUT:KV_TYPE")
    ap.add_argument("--kv-types", default="f16", help="K and V types crossed with the layouts (f16,q8_0,q5_0,q4_0)")
    floors_help = "each quantized type once without eviction (a run as long as the full cache's)"
    ap.add_argument("--floors", action=argparse.BooleanOptionalAction, default=True, help=floors_help)
    ap.add_argument("--adapt-gamma", type=float, default=None, help="adaptive: adaptive.ADAPT_GAMMA (tuning only)")
    ap.add_argument("--adapt-every", type=int, default=None, help="adaptive: adaptive.ADAPT_EVERY (tuning only)")
    ap.add_argument("--out", default="benchmarks/layer_budgets.json")
    reference_help = "keep the full cache's rows here, or read them if this text's were kept (evaluation.Reference)"
    ap.add_argument("--reference-dir", default=None, help=reference_help)
    args = ap.parse_args()
    if args.adapt_gamma is not None:
        adaptive.ADAPT_GAMMA = args.adapt_gamma
    if args.adapt_every is not None:
        adaptive.ADAPT_EVERY = args.adapt_every
    model = default_model_path()
    tokens = file_tokens(model, args.text, args.tokens)
    trimmed = read_info(model).trimmed_bytes(len(tokens), args.n_ubatch)
    plan = layouts(args.layouts, args.kv_types)
    out = Path(args.out)
    report = {
        "command": command_line(),
        "model": model.name,
        "text": args.text,
        "tokens": len(tokens),
        "step": args.step,
        "n_ubatch": args.n_ubatch,
        "trimmed_bytes": trimmed,
        "results": [],
    }
    specs = {}
    for policy in args.policies.split(","):
        for frac in map(int, args.fractions.split(",")):
            budget = Budget.parse(f"{trimmed // frac}B")
            for label, lb, share, kv in plan:
                spec = SessionSpec.bounded(policy, budget, layer_budgets=lb, sliding_share=share, kv_type=kv,
                                           label=f"{policy}/{label}/{frac}")  # fmt: skip
                specs[spec.label] = (spec, policy, label, frac)
    # each quantized KV type once without eviction: what the quantization alone costs against the f16 full cache
    quantized = dict.fromkeys(kv for *_, kv in plan if kv != "f16") if args.floors else {}
    floors = [SessionSpec(f"full {kv}", kv_type=kv) for kv in quantized]
    t0 = time.perf_counter()

    def record(key: str, r: PplResult) -> None:
        """One run's result into the report, written at once (a long matrix keeps what it measured if stopped)."""
        if key == "full":
            report["full_ppl"] = r.ppl
            return
        if key not in specs:  # a floor
            report[key] = {"ppl": r.ppl, "kl": r.kl, "kv_bytes": r.kv_bytes}
        else:
            spec, policy, label, frac = specs[key]
            report["results"].append(
                {
                    "policy": policy,
                    "layer_budgets": label,
                    "fraction": f"1/{frac}",
                    "budget_bytes": int(spec.budget.value),
                    "ppl": r.ppl,
                    "kl": r.kl,
                    "top1": r.top1,
                    "max_cells": r.max_cells,
                    "kv_bytes": r.kv_bytes,
                    "seconds": r.seconds,
                }
            )
        print(f"{key}: ppl {r.ppl:.3f}, KL {r.kl:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write_report(report, out, table(report))
        plot_frontier(report["results"], report["full_ppl"], trimmed, out.with_suffix(".png"),
                      f"{model.name}, {len(tokens)} tokens of {text_name(args.text)}")  # fmt: skip

    # one full-cache run, the reference of every configuration's KL
    runs = [spec for spec, *_ in specs.values()] + floors
    evaluate(
        model, tokens, runs, n_ubatch=args.n_ubatch, step=args.step, on_result=record, reference_dir=args.reference_dir
    )


def table(report: dict) -> str:
    """One row per policy and budget, ppl (mean KL) per layout."""
    names = list(dict.fromkeys(r["layer_budgets"] for r in report["results"]))
    lines = [
        f"Layer budgets, {report['model']}, {report['tokens']} tokens of {report['text']}, step {report['step']}; "
        f"llama.cpp's trimmed cache: {report['trimmed_bytes'] / 2**20:.2f} MiB; full cache ppl "
        f"{report.get('full_ppl', float('nan')):.3f}"
        + "".join(f"; {k}: ppl {v['ppl']:.3f}, KL {v['kl']:.4f}" for k, v in report.items() if k.startswith("full ")),
        "",
        f"    {report['command']}",
        "",
        "| policy | budget | " + " | ".join(f"{n}: ppl (KL)" for n in names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    rows = {(r["policy"], r["fraction"], r["layer_budgets"]): r for r in report["results"]}
    for policy, frac in dict.fromkeys((r["policy"], r["fraction"]) for r in report["results"]):
        cells = [rows.get((policy, frac, n)) for n in names]
        mib = next(c for c in cells if c)["budget_bytes"] / 2**20
        shown = [f"{c['ppl']:.3f} ({c['kl']:.4f})" if c else "–" for c in cells]
        lines.append(f"| {policy} | {frac} ({mib:.2f} MiB) | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
