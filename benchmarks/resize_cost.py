"""What a resize of the per-layer caches costs a decode (adaptive layer budgets, every 256 positions): the move itself
(state out, a context of the new sizes, state in), the first decode in the new context, and the first observed step
after it, in an AhaKV session of the product's shape after a prompt twice the budget.

Two ways, alternating round by round in one run: ``carried``, the new context made tapped as the old one and planned
with every flag the old one had (patch 0020, what ``Engine.resize_caches`` does), and ``untapped``, the new context
made as before that patch: no tap until the controller sets one, so its first decode reserves the scheduler again
(ATTN on) and its first observed step once more (the side pass and the error term appear).

    AHAKV_THREADS=2 python benchmarks/resize_cost.py --rounds 8
    python benchmarks/resize_cost.py -ngl -1   # every layer offloaded (a GPU build), where a reserve costs ~10 ms

Prints milliseconds (medians over the rounds): the move, llama_decode of the first step and of the first observed
step after it, and a steady step (the median step of the period) for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.models import default_model_path
from ahakv_local.native import TapFlag
from ahakv_local.session import SessionSpec, open_session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8, help="resizes timed in each way")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers offloaded to a GPU (-1: all)")
    args = ap.parse_args()
    model = default_model_path()
    prompt = 2 * args.budget
    spec = SessionSpec.bounded("ahakv", args.budget, layer_budgets="adaptive")
    tokens = file_tokens(model, args.text, prompt + (2 * args.rounds + 2) * 64)  # periods of at most 64 steps
    rows: dict[str, list[tuple[float, float, float, float]]] = {"carried": [], "untapped": []}
    with open_session(model, spec, len(tokens), n_gpu_layers=args.n_gpu_layers) as session:
        ctl, e = session.controller, session.engine
        period = ctl.config.evict_every  # the observed step is the last of each period
        ctl.prefill(tokens[:prompt])
        at = prompt
        for _ in range(period - (at % period)):  # to the start of a period (a pending decision applied)
            ctl.step(tokens[at])
            at += 1
        ctl.shares.next_at = 10**9  # no decision of its own while timed: only the resizes below
        first = e.cache_sizes()
        larger = tuple(n + 16 for n in first)
        for r in range(2 * args.rounds):
            # every move changes the sizes (back and forth), and each way grows and shrinks the caches as often
            way = "carried" if (r % 2 == 0) != (r // 2 % 2 == 1) else "untapped"
            if way == "untapped":  # the engine before patch 0020: a new context starts untapped
                e._tap, e._tap_reserved, ctl._tap = (TapFlag(0), 0), TapFlag(0), None
            sizes = larger if r % 2 == 0 else first
            t0 = time.perf_counter()
            e.resize_caches(sizes)
            move = time.perf_counter() - t0
            with llama_decode_times() as calls:
                for _ in range(period):
                    ctl.step(tokens[at])
                    at += 1
            rows[way].append((move, calls[0], calls[-1], statistics.median(calls)))
    print(f"ms, medians of {args.rounds} resizes each way (budget {args.budget}, AhaKV, adaptive, Gemma 3 270M)")
    print("| way | move | first decode | first observed step | steady step |")
    print("|---|---:|---:|---:|---:|")
    for way, got in rows.items():
        cols = [statistics.median(col) * 1000 for col in zip(*got, strict=True)]
        print(f"| {way} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
