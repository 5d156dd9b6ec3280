"""How to split a byte budget between Gemma 3's two caches under ``natural`` layer budgets: perplexity and mean
KL from the full cache at 1/4 and 1/8 of llama.cpp's trimmed cache, for several shares of the bytes given to
the sliding-window cache (15 layers, 15 KiB a cell) against the full-attention cache (3 layers, 3 KiB a cell).
The default (share None, "even") splits the bytes evenly between the groups' held cells (budget.allocate); before
it, the default gave the sliding cache its window when the bytes allowed, else as many cells as the other
(share 15/18 = 0.83): a share below that buys five full-attention cells for each sliding one.

    AHAKV_CACHE_DIR=... python benchmarks/group_split.py --text /usr/share/common-licenses/LGPL-2.1 \\
        --tokens 4096 --step 16 --shares 0.4,0.55,0.7 --out benchmarks/out/group_split.json

Run on a tuning text (not GPL-3 or MPL-1.1, which the reports read). JSON + a markdown table with the command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import command_line, file_tokens, write_report  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.budget import Budget
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.evaluation import evaluate
from ahakv_local.info import read_info
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/LGPL-2.1")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--n-ubatch", type=int, default=64)
    ap.add_argument("--fractions", default="4,8")
    ap.add_argument("--shares", default="0.4,0.55,0.7")
    ap.add_argument("--policies", default="ahakv")
    ap.add_argument("--out", default="benchmarks/out/group_split.json")
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, args.tokens)
    with Engine(model, EngineConfig(n_ctx=256)) as e:
        layout = e.cache_layout()
    trimmed = read_info(model).trimmed_bytes(len(tokens), args.n_ubatch)
    report = {"command": command_line(), "model": model.name,
              "text": args.text, "tokens": len(tokens), "trimmed_bytes": trimmed, "rows": []}  # fmt: skip
    out = Path(args.out)
    for frac in map(int, args.fractions.split(",")):
        budget = Budget.parse(f"{trimmed // frac}B")
        specs = []
        for policy in args.policies.split(","):
            for share in [None, *map(float, args.shares.split(","))]:
                label = f"{policy}/{frac}/{share or 'even'}"
                spec = SessionSpec.bounded(policy, budget, layer_budgets="natural", sliding_share=share,
                                           evict_every=args.step, label=label)  # fmt: skip
                # a group must hold its sinks, recent tokens and one eviction period (the controller's floor)
                floor = spec.n_sink + spec.n_recent + args.step
                try:  # (a budget whose layout cannot hold a chunk is refused as it is laid out: skipped too)
                    held = min(g.value for g in spec.allocation(layout, args.n_ubatch, len(tokens)).groups)
                except AhakvError as exc:
                    print(f"skipped {spec.label}: {exc}", flush=True)
                    continue
                if held < floor:
                    print(f"skipped {spec.label}: a group would hold fewer than {floor} cells", flush=True)
                else:
                    specs.append(spec)
        results = evaluate(model, tokens, specs, n_ubatch=args.n_ubatch, step=args.step)
        report["full_ppl"] = results["full"].ppl
        for spec in specs:
            r = results[spec.label]
            policy, _, share = spec.label.split("/")
            report["rows"].append({"policy": policy, "fraction": f"1/{frac}", "share": share,
                                   "kv_bytes": r.kv_bytes, "ppl": r.ppl, "kl": r.kl, "top1": r.top1})  # fmt: skip
        write(report, out, args)


def write(report: dict, out: Path, args: argparse.Namespace) -> None:
    lines = [f"Byte split between the caches, {report['model']}, {report['tokens']} tokens of {args.text}, "
             f"step {args.step}; trimmed cache {report['trimmed_bytes'] / 2**20:.2f} MiB; "
             f"full cache ppl {report['full_ppl']:.3f}",
             "", f"    {report['command']}", "",
             "| policy | budget | sliding share | KV MiB | ppl | mean KL | top-1 |",
             "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['policy']} | {r['fraction']} | {r['share']} | {r['kv_bytes'] / 2**20:.2f} | "
                     f"{r['ppl']:.3f} | {r['kl']:.4f} | {r['top1']:.3f} |")  # fmt: skip
    write_report(report, out, "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
