"""Decode time per token by layout, without a profiler: the median time inside llama_decode
(``Engine._run_batch``) and of a whole controller step, over budgeted AhaKV decode steps after a prompt twice the
budget, each layout in its own process, rounds interleaved (layout order repeated), so that a drift of the
machine's speed falls on every layout alike. ``adaptive-frozen`` is ``adaptive`` with its shares decided during
the prompt and never again (no resize while decoding): what its cache sizes alone cost, apart from its decisions.
``LAYOUT-moved`` is LAYOUT whose sequence moves once, after the prompt, to a new context of the same cache sizes
(what every adaptive resize does): what the move alone costs the decode steps after it.

    AHAKV_THREADS=1 python benchmarks/decode_layouts.py --layouts natural,uniform,adaptive,adaptive-frozen --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np
from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.budget import LAYER_BUDGETS
from ahakv_local.engine import Engine
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def one(layout: str, args: argparse.Namespace) -> tuple[float, float]:
    """(median ms in llama_decode, median ms per controller step) of one layout's decode steps."""
    layout, _, variant = layout.partition("-")
    model = default_model_path()
    tokens = file_tokens(model, args.text, 2 * args.budget + args.steps)
    spec = SessionSpec.bounded("ahakv", args.budget, layer_budgets=layout)
    inside: list[float] = []
    run_batch = Engine._run_batch

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = run_batch(self, *a, **kw)
        inside.append(time.perf_counter() - t0)
        return out

    steps: list[float] = []
    with open_session(model, spec, len(tokens)) as session:
        ctl = session.controller
        ctl.prefill(tokens[: 2 * args.budget])
        if variant == "frozen":
            ctl.shares.next_at = ctl.shares.every = sys.maxsize  # no decision after the prompt
        if variant == "moved":  # the first step moves the sequence to a new context of the same sizes
            ctl._resize_to = session.engine.cache_sizes()
        Engine._run_batch = timed
        try:
            for tok in tokens[2 * args.budget :]:
                t0 = time.perf_counter()
                ctl.step(tok)
                steps.append(time.perf_counter() - t0)
        finally:
            Engine._run_batch = run_batch
    return 1000 * float(np.median(inside)), 1000 * float(np.median(steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layouts", default="natural,uniform,adaptive,adaptive-frozen")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one layout, its two medians printed
    args = ap.parse_args()
    if args.one:
        print(*one(args.one, args))
        return
    layouts = args.layouts.split(",")
    for name in layouts:
        layout, _, variant = name.partition("-")
        if layout not in LAYER_BUDGETS or variant not in ("", "moved") and name != "adaptive-frozen":
            ap.error(f"--layouts: {name!r} is not one of {', '.join(LAYER_BUDGETS)}, LAYOUT-moved or adaptive-frozen")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name in layouts:
            cmd = [sys.executable, __file__, "--one", name, "--text", args.text, "--budget", str(args.budget)]
            out = subprocess.run(cmd + ["--steps", str(args.steps)], capture_output=True, text=True, check=True)
            decode, step = map(float, out.stdout.split()[-2:])
            results[name].append((decode, step))
    print(f"AhaKV at {args.budget} cells, {args.steps} decode steps after {2 * args.budget} tokens of {args.text}, "
          f"{args.rounds} interleaved rounds (ms per token, medians of each run)")  # fmt: skip
    print("\n| layout | llama_decode, by round | step, by round | llama_decode / first layout's |")
    print("|---|---|---|---:|")
    first = np.mean([d for d, _ in results[layouts[0]]])
    for name, runs in results.items():
        decode = " / ".join(f"{d:.2f}" for d, _ in runs)
        step = " / ".join(f"{s:.2f}" for _, s in runs)
        print(f"| {name} | {decode} | {step} | {np.mean([d for d, _ in runs]) / first:.3f} |")


if __name__ == "__main__":
    main()
