"""Where a budgeted decode step's time goes outside llama_decode, part by part: wall-clock timers around the
controller's own methods (no profiler: its overhead would swamp parts of a few microseconds) over AhaKV decode steps
after a prompt twice the budget, in a session opened as the product opens one. Prints each part's milliseconds per
token; the parts nest (``before`` holds the summed block's observation and the resize, ``evict`` the fills), so they
do not add up. Compare layouts, or two checkouts (``PYTHONPATH=../before``), run after run on a quiet machine.

    AHAKV_THREADS=2 python benchmarks/decode_parts.py --layer-budgets adaptive
    AHAKV_THREADS=2 python benchmarks/decode_parts.py --layer-budgets natural
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import Counter

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
    ap.add_argument("--layer-budgets", default="adaptive")
    args = ap.parse_args()
    seconds: Counter = Counter()
    for cls, name, label in PARTS:
        setattr(cls, name, timed(seconds, label, getattr(cls, name)))
    model = default_model_path()
    n_prompt = 2 * args.budget
    tokens = file_tokens(model, args.text, n_prompt + args.steps)
    spec = SessionSpec.bounded(args.policy, args.budget, layer_budgets=args.layer_budgets)
    with open_session(model, spec, len(tokens)) as session:
        ctl = session.controller
        ctl.prefill(tokens[:n_prompt])
        seconds.clear()
        t0 = time.perf_counter()
        for tok in tokens[n_prompt:]:
            ctl.step(tok)
        total = time.perf_counter() - t0
    per_token = lambda s: s / args.steps * 1000  # noqa: E731
    outside = per_token(total - seconds["llama_decode"])
    print(f"{args.layer_budgets} {args.policy}: {per_token(total):.3f} ms a token, {outside:.3f} outside llama_decode")
    for _, _, label in PARTS:
        print(f"  {label:34s} {per_token(seconds[label]):.3f} ms")


if __name__ == "__main__":
    main()
