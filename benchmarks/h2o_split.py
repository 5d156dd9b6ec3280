"""H2O's budget split under a periodic eviction: the recent tokens' half at each eviction, or the heavy hitters'.

    python benchmarks/h2o_split.py [--text FILE] [--tokens 1536] [--budget 128] [--evict-every 32]
                                   [--out benchmarks/out/h2o_split.json]

H2O evicts a token a step and holds heavy hitters and recent tokens half and half. Evicting every E steps leaves
E - 1 cells free after each eviction, which one half goes without (``policies/h2o.py``: "eviction", the default,
or "peak"). Both run token by token at the same schedule as README's comparison of every policy at 128 cells
(`ahakv-local eval ppl --tokens 1536 --budgets 128 --evict-every 32 --observe-steps 1`), against one full cache.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import command_line, file_tokens, text_name, write_report

from ahakv_local.evaluation import evaluate
from ahakv_local.models import resolve_model
from ahakv_local.session import SessionSpec

SPLITS = ("eviction", "peak")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--evict-every", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "h2o_split.json"))
    args = ap.parse_args()

    model = resolve_model(args.model)
    tokens = file_tokens(model, args.text, args.tokens)
    specs = [
        SessionSpec.bounded(
            "h2o", args.budget, label=split, params={"split": split}, evict_every=args.evict_every, observe_steps=1
        )  # fmt: skip
        for split in SPLITS
    ]
    t0 = time.perf_counter()
    results = evaluate(model, tokens, specs, prefix=128, n_ubatch=64, step=1)
    full = results.pop("full")
    command = command_line()
    # what an eviction keeps (the budget less the room for the steps to come), less the recent half, or the half
    kept = args.budget - (args.evict_every - 1)
    heavy = {"eviction": kept - args.budget // 2, "peak": args.budget // 2}
    lines = [
        f"H2O's split, {model.name}, {len(tokens)} tokens of {text_name(args.text)}, {args.budget} cells, an eviction "
        f"every {args.evict_every} steps, token by token; full cache ppl {full.ppl:.3f}",
        "",
        f"    {command}",
        "",
        "| split | heavy hitters kept | ppl | vs full | KL (nats) | top-1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {split} | {heavy[split]} | {r.ppl:.3f} | {r.ppl / full.ppl - 1:+.1%} | {r.kl:.4f} | {r.top1:.3f} |"
        for split, r in results.items()
    ]
    lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
    rows = {split: {"ppl": r.ppl, "kl": r.kl, "top1": r.top1} for split, r in results.items()}
    report = {"command": command, "date": time.strftime("%Y-%m-%d"), "text": args.text, "tokens": len(tokens),
              "full_ppl": full.ppl, "rows": rows}  # fmt: skip
    write_report(report, Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
