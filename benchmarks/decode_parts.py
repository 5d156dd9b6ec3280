"""Where a budgeted decode step's time goes outside llama_decode, part by part: wall-clock timers around the
controller's own methods (no profiler: its overhead would swamp parts of a few microseconds) over AhaKV decode steps
after a prompt twice the budget, in a session opened as the product opens one. Prints each part's milliseconds per
token; the parts nest (``before`` holds the summed block's observation and the resize, ``evict`` the fills), so they
do not add up. Then the steps by kind: a steady step (no eviction, no resize), an eviction step (the observed step,
its two observations and the evictions) and a resize step (a new context of the adaptive shares' sizes), each kind's
median and what the eviction and resize steps add to a token over the steady median.

Several layouts (``--layer-budgets natural,adaptive``) run in one process, ``--rounds`` times in turn from the same
prompt, so their figures are side by side; or compare two checkouts (``PYTHONPATH=../before``) on a quiet machine.

    AHAKV_THREADS=2 python benchmarks/decode_parts.py --layer-budgets natural,adaptive --steps 256 --rounds 4
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import Counter
from contextlib import ExitStack

from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local import adaptive, controller, engine, groups
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session

PARTS = [  # (class, method, label): what each timer wraps
    (engine.Engine, "_run_batch", "llama_decode"),
    (controller.KVController, "_before_decode", "before a decode"),
    (controller.KVController, "_observe_block", "  the summed block, observed"),
    (controller.KVController, "_resize", "  resizes"),
    (controller.KVController, "_after_decode", "after a decode"),
    (controller.KVController, "_observe", "  statistics read (every call)"),
    (engine.Engine, "aligned", "  statistics aligned (every call)"),
    (groups.LayerGroup, "decoded", "  each group's new positions"),
    (controller.KVController, "_count", "  the statistics' count"),
    (controller.KVController, "evict", "evictions"),
    (adaptive.LayerShares, "observe", "  fills (adaptive)"),
]


def timed(seconds: Counter, label: str, f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--layer-budgets", default="adaptive", help="one layout or several, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="each layout this many times, in turn")
    args = ap.parse_args()
    seconds: Counter = Counter()
    for cls, name, label in PARTS:
        setattr(cls, name, timed(seconds, label, getattr(cls, name)))
    model = default_model_path()
    n_prompt = 2 * args.budget
    tokens = file_tokens(model, args.text, n_prompt + args.steps)
    layouts = args.layer_budgets.split(",")
    parts = {lb: Counter() for lb in layouts}
    steps: dict[str, list[tuple[str, float]]] = {lb: [] for lb in layouts}  # (kind, seconds) of every step
    with ExitStack() as stack:
        sessions = {
            lb: stack.enter_context(
                open_session(model, SessionSpec.bounded(args.policy, args.budget, layer_budgets=lb), len(tokens))
            )
            for lb in layouts
        }
        for _ in range(args.rounds):
            for lb, session in sessions.items():
                session.reset()
                ctl = session.controller
                ctl.prefill(tokens[:n_prompt])
                seconds.clear()
                for tok in tokens[n_prompt:]:
                    before = seconds["  resizes"], seconds["evictions"]
                    t0 = time.perf_counter()
                    ctl.step(tok)
                    took = time.perf_counter() - t0
                    seconds["total"] += took
                    kind = "resize" if seconds["  resizes"] > before[0] else "steady"
                    kind = "eviction" if seconds["evictions"] > before[1] else kind
                    steps[lb].append((kind, took))
                parts[lb].update(seconds)
    n = args.steps * args.rounds
    per_token = lambda s: s / n * 1000  # noqa: E731
    for lb in layouts:
        total, p = per_token(parts[lb]["total"]), parts[lb]
        outside = total - per_token(p["llama_decode"])
        print(f"{lb} {args.policy}: {total:.3f} ms a token, {outside:.3f} outside llama_decode")
        for _, _, label in PARTS:
            print(f"  {label:34s} {per_token(p[label]):.3f} ms")
        steady = statistics.median(t for k, t in steps[lb] if k == "steady")
        for kind in ("steady", "eviction", "resize"):
            took = [t for k, t in steps[lb] if k == kind]
            if not took:
                continue
            median = statistics.median(took) * 1000
            line = f"  {kind} steps: {len(took) / args.rounds:g} a round, median {median:.2f} ms"
            if kind != "steady":
                line += f", {per_token(sum(t - steady for t in took)):+.3f} ms a token over the steady median"
            print(line)


if __name__ == "__main__":
    main()
