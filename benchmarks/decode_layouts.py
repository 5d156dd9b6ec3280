"""Decode time per token by layout, without a profiler: the median time inside llama_decode
(``Engine._run_batch``) and of a whole controller step, over budgeted AhaKV decode steps after a prompt twice the
budget, each layout in its own process, rounds interleaved (layout order repeated), so that a drift of the
machine's speed falls on every layout alike. ``adaptive-frozen`` is ``adaptive`` with its shares decided during
the prompt and never again (no resize while decoding): what its cache sizes alone cost, apart from its decisions.
``LAYOUT-moved`` is LAYOUT whose sequence moves once, after the prompt, to a new context of the same cache sizes
(what every adaptive resize does): what the move alone costs the decode steps after it.

``--nodes N`` times every graph node instead (llama.cpp's cb_eval asks for each node, so the scheduler computes
one at a time: the sums exceed a plain decode, compare layouts, not absolutes) and prints the N costliest
node names, summed over layers, in ms per token for each layout; ``--per-layer NAME`` adds one node's time
per layer beside the layer's cache cells.

    AHAKV_THREADS=1 python benchmarks/decode_layouts.py --layouts natural,uniform,adaptive,adaptive-frozen --rounds 3
    AHAKV_THREADS=1 python benchmarks/decode_layouts.py --layouts natural,adaptive-frozen --nodes 8 --per-layer kqv
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import time
from collections import defaultdict

import llama_cpp
import numpy as np
from common import file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local import upstream
from ahakv_local.budget import LAYER_BUDGETS
from ahakv_local.engine import Engine
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


class NodeTimer:
    """A cb_eval that asks the scheduler for every node and sums the time each one takes, by node name."""

    def __init__(self):
        ggml = upstream.ggml_cdll()
        self.name, self.op = ggml.ggml_get_name, ggml.ggml_op_desc
        self.name.argtypes = self.op.argtypes = [ctypes.c_void_p]
        self.name.restype = self.op.restype = ctypes.c_char_p
        self.on, self.t_asked = False, 0.0
        self.seconds: dict[str, float] = defaultdict(float)
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)  # kept alive by self

    def _callback(self, tensor, ask, _user_data) -> bool:
        if ask:  # yes to every node: the scheduler computes it alone, then calls back with ask false
            self.t_asked = time.perf_counter()
        elif self.on:
            node = f"{self.name(tensor).decode()} ({self.op(tensor).decode()})"
            self.seconds[node] += time.perf_counter() - self.t_asked
        return True


def one(layout: str, args: argparse.Namespace) -> tuple[float, float] | dict:
    """(median ms in llama_decode, median ms per controller step) of one layout's decode steps; with --nodes,
    the ms per token of every node name and each layer's cache cells."""
    layout, _, variant = layout.partition("-")
    model = default_model_path()
    tokens = file_tokens(model, args.text, 2 * args.budget + args.steps)
    spec = SessionSpec.bounded("ahakv", args.budget, layer_budgets=layout)
    steps: list[float] = []
    timer, init = NodeTimer() if args.nodes else None, Engine.__init__
    if timer:
        Engine.__init__ = lambda self, path, config: init(self, path, config, timer.callback)
    with open_session(model, spec, len(tokens)) as session:
        ctl = session.controller
        ctl.prefill(tokens[: 2 * args.budget])
        if variant == "frozen":
            ctl.shares.next_at = ctl.shares.every = sys.maxsize  # no decision after the prompt
        if variant == "moved":  # the first step moves the sequence to a new context of the same sizes
            ctl.schedule_resize(session.engine.cache_sizes())
        if timer:
            timer.on = True
        try:
            with llama_decode_times() as inside:
                for tok in tokens[2 * args.budget :]:
                    t0 = time.perf_counter()
                    ctl.step(tok)
                    steps.append(time.perf_counter() - t0)
        finally:
            Engine.__init__ = init
        cells = [session.engine.cache_cells(c) for c in session.engine.layer_cache]  # by layer
    if timer:
        return {"cells": cells, "ms": {k: 1000 * v / args.steps for k, v in timer.seconds.items()}}
    return 1000 * float(np.median(inside)), 1000 * float(np.median(steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layouts", default="natural,uniform,adaptive,adaptive-frozen")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=0, help="time every graph node; print the N costliest")
    ap.add_argument("--per-layer", help="with --nodes: one node name's time per layer (e.g. kqv)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one layout, its two medians printed
    args = ap.parse_args()
    if args.one:
        result = one(args.one, args)
        print(json.dumps(result) if args.nodes else " ".join(map(str, result)))
        return
    layouts = args.layouts.split(",")
    for name in layouts:
        layout, _, variant = name.partition("-")
        if layout not in LAYER_BUDGETS or variant not in ("", "moved") and name != "adaptive-frozen":
            ap.error(f"--layouts: {name!r} is not one of {', '.join(LAYER_BUDGETS)}, LAYOUT-moved or adaptive-frozen")
    results: dict[str, list] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name in layouts:
            cmd = [sys.executable, __file__, "--one", name, "--text", args.text, "--budget", str(args.budget)]
            cmd += ["--steps", str(args.steps), "--nodes", str(args.nodes)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
            results[name].append(json.loads(out) if args.nodes else tuple(map(float, out.split())))
    if args.nodes:
        print_nodes(results, args)
        return
    print(f"AhaKV at {args.budget} cells, {args.steps} decode steps after {2 * args.budget} tokens of {args.text}, "
          f"{args.rounds} interleaved rounds (ms per token, medians of each run)")  # fmt: skip
    print("\n| layout | llama_decode, by round | step, by round | llama_decode / first layout's |")
    print("|---|---|---|---:|")
    first = np.mean([d for d, _ in results[layouts[0]]])
    for name, runs in results.items():
        decode = " / ".join(f"{d:.2f}" for d, _ in runs)
        step = " / ".join(f"{s:.2f}" for _, s in runs)
        print(f"| {name} | {decode} | {step} | {np.mean([d for d, _ in runs]) / first:.3f} |")


def print_nodes(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """The costliest node names (layer numbers summed) and, for --per-layer, one name layer by layer."""
    by_name: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        summed: dict[str, float] = defaultdict(float)
        for run in runs:
            for node, ms in run["ms"].items():
                summed[re.sub(r"-\d+ ", " ", re.sub(r"^node_\d+", "node_*", node))] += ms / len(runs)
        by_name[name] = summed
    first = by_name[next(iter(results))]
    print(f"Every graph node timed (cb_eval), AhaKV at {args.budget} cells, {args.steps} decode steps, "
          f"{args.rounds} rounds: ms per token, means")  # fmt: skip
    print("\n| node (op) | " + " | ".join(results) + " |\n|---|" + "---:|" * len(results))
    for node in sorted(first, key=first.get, reverse=True)[: args.nodes]:
        print(f"| {node} | " + " | ".join(f"{by_name[n].get(node, 0):.3f}" for n in results) + " |")
    print("| all nodes | " + " | ".join(f"{sum(by_name[n].values()):.2f}" for n in results) + " |")
    if args.per_layer:
        print(f"\n{args.per_layer} by layer, ms per token (cache cells):\n")
        print("| layer | " + " | ".join(results) + " |\n|---|" + "---:|" * len(results))
        for il in range(len(next(iter(results.values()))[0]["cells"])):
            row = []
            for runs in results.values():
                ms = sum(v for run in runs for k, v in run["ms"].items() if k.startswith(f"{args.per_layer}-{il} ("))
                row.append(f"{ms / len(runs):.3f} ({runs[0]['cells'][il]})")
            print(f"| {il} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
