"""The numerics floor of a budgeted row: perplexity and KL from the full cache when nothing is evicted, by cache size.

    python benchmarks/cache_size_floor.py [--text FILE] [--tokens 300] [--prefix 128] [--step 16]
                                          [--budgets 315-346] [--layer-budgets shared]
                                          [--out benchmarks/out/cache_size_floor.json]

A session holds a budget of B cells in caches of exactly B + one chunk + the newest token (``budget.cells_for``);
llama.cpp sizes its own in multiples of 256, and its attention runs over the used cells rounded up to 256, at most
the cache's size: a full cache of its own over a multiple of 256, a session's cache over all its cells once it
is past the last multiple of 256 below its size (always, once it evicts). Each budget here keeps the whole text
(300 tokens: the sessions' caches run over all their cells, the full cache over 512), so every row keeps every
position, as the full cache does, and differs from it only by the number of cells its attention runs over. On
the CPU that number sets where the f16 dot product of the attention weights with V (and the softmax's sum)
leaves its vector loop, so the sums round otherwise, and Gemma 3's Q4_K activations carry the difference on.
The KL of these rows is the floor under every budgeted row's KL at that cache size: differences between
configurations below it are not the policies'.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import command_line, file_tokens, text_name, write_report

from ahakv_local.budget import Budget, cells_for
from ahakv_local.evaluation import evaluate
from ahakv_local.models import resolve_model
from ahakv_local.session import SessionSpec

CHUNK = 64  # evaluate's n_ubatch


def budgets_of(text: str) -> list[int]:
    """'512-560' (every budget from 512 to 560) or '512,520,544'."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--budgets", default="315-346")
    ap.add_argument("--layer-budgets", default="shared")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "cache_size_floor.json"))
    args = ap.parse_args()

    model = resolve_model(args.model)
    tokens = file_tokens(model, args.text, args.tokens)
    budgets = budgets_of(args.budgets)
    # an eviction every step keeps the budget less the step's room (evaluation.spec_for_step): the whole text
    if min(budgets) < len(tokens) + args.step - 1:
        ap.error(f"every budget must keep the whole text ({len(tokens)} tokens) and a step's room: nothing is evicted")
    specs = [SessionSpec.bounded("streaming", b, label=str(b), layer_budgets=args.layer_budgets) for b in budgets]
    t0 = time.perf_counter()
    results = evaluate(model, tokens, specs, prefix=args.prefix, n_ubatch=CHUNK, step=args.step)
    full = results.pop("full")
    rows = []
    for label, r in results.items():
        cells = cells_for(Budget.parse(label), CHUNK, 0)
        rows.append(
            {
                "budget": int(label),
                "cells": cells,
                "ppl": r.ppl,
                "ppl_ratio": r.ppl / full.ppl,
                "kl": r.kl,
                "top1": r.top1,
                "kv_bytes": r.kv_bytes,
                "max_cells": r.max_cells,
            }  # fmt: skip
        )
    assert all(row["max_cells"] == len(tokens) for row in rows), "a row evicted: not the floor"
    command = command_line()
    lines = [
        f"Cache size and the numerics floor, {model.name}, {len(tokens)} tokens of {text_name(args.text)}, prefix "
        f"{args.prefix}, step {args.step}, layout {args.layer_budgets}; nothing evicted; full cache (llama.cpp's own "
        f"cells) ppl {full.ppl:.4f}",
        "",
        f"    {command}",
        "",
        "| budget | cells | cells mod 16 | ppl vs full | KL (nats) | top-1 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    # the cells of a shared pool's cache; the per-layer layouts give each layer its own share of the bytes
    shared = args.layer_budgets == "shared"
    lines += [
        f"| {r['budget']} | {r['cells'] if shared else 'by layer'} | {r['cells'] % 16 if shared else ''} | "
        f"{r['ppl_ratio']:.4f} | {r['kl']:.5f} | {r['top1']:.3f} |"
        for r in rows
    ]
    kls = sorted(r["kl"] for r in rows)
    lines += [
        "",
        f"KL over {len(rows)} cache sizes: median {kls[len(kls) // 2]:.5f}, max {kls[-1]:.5f}; ppl vs full "
        f"{min(r['ppl_ratio'] for r in rows):.4f}-{max(r['ppl_ratio'] for r in rows):.4f} "
        f"({time.perf_counter() - t0:.0f} s)",
    ]
    report = {"command": command, "date": time.strftime("%Y-%m-%d"), "text": args.text, "tokens": len(tokens),
              "full_ppl": full.ppl, "rows": rows}  # fmt: skip
    write_report(report, Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
