"""Tune a policy's guided reading on filler texts the reports do not use (GFDL-1.3, LGPL-2.1, MPL-1.1: the
RESULTS tables read GPL-3), so that what is tuned here is judged there on text it never saw.

    python benchmarks/tune_guided.py '{"aha": ["ahakv", {}], "aha-r1": ["ahakv", {"read_kernel": 1}],
        "snap": ["snapkv", {}]}' --compressions 4 --tasks single

At 16K these texts are too short: `--length 16384 --texts LGPL-2.1,MPL-1.1,GPL-2,MPL-2.0` shares no text with
`eval longdoc`'s 16K filler (GPL-3, Apache-2.0, Artistic, BSD, CC0-1.0, GFDL-1.2).

prints, per variant and compression, the mean score and one digit per item (1 = solved).
"""

from __future__ import annotations

import argparse
import json
import time

from common import license_texts  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local import budget
from ahakv_local.longdoc import run_longdoc
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec

TUNING_TEXTS = ("GFDL-1.3", "LGPL-2.1", "MPL-1.1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help="JSON {label: [policy, params]}")
    ap.add_argument("--compressions", default="4")
    ap.add_argument("--tasks", default="single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--seed", type=int, default=None, help="default 1; 0 with --report-filler")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: every core)")
    ap.add_argument("--answers", action="store_true", help="print the answer of every item not solved")
    ap.add_argument("--full", action="store_true", help="run the full cache too (what a variant can at most keep)")
    ap.add_argument("--texts", default=",".join(TUNING_TEXTS), help="filler license texts (16K needs more)")
    ap.add_argument("--layer-budgets", default="shared", help="shared, natural, uniform, pyramid or adaptive")
    ap.add_argument("--sinks", type=int, default=4, help="first positions never evicted (SessionSpec.n_sink)")
    ap.add_argument(
        "--adaptive-range", type=float, default=None, help="adaptive: budget.ADAPTIVE_RANGE for this run (an ablation)"
    )
    ap.add_argument(
        "--report-filler", action="store_true", help="eval longdoc's filler (the reports' text): to ablate, not to tune"
    )
    args = ap.parse_args()
    if args.adaptive_range is not None:  # read by budget.allocate at every decision
        budget.ADAPTIVE_RANGE = args.adaptive_range
    variants = json.loads(args.variants)
    factors = [float(c) for c in args.compressions.split(",")]
    texts = license_texts(args.texts)
    texts = None if args.report_filler else texts

    def rule(n: int) -> list[SessionSpec]:
        return [SessionSpec()] * args.full + [
            SessionSpec.bounded(
                policy,
                int(n / c),
                label=f"{label}@{c:g}x",
                reading="query",
                params=params,
                layer_budgets=args.layer_budgets,
                n_sink=args.sinks,
            )
            for c in factors
            for label, (policy, params) in variants.items()
        ]

    start = time.time()
    depths = [float(d) for d in args.depths.split(",")]
    trials = run_longdoc(
        default_model_path(),
        rule,
        args.tasks.split(","),
        [args.length],
        depths,
        filler_texts=texts,
        seed=args.seed if args.seed is not None else (0 if args.report_filler else 1),
        n_threads=args.threads,
    )
    scores: dict[str, list[float]] = {}
    for t in trials:
        scores.setdefault(t.label, []).append(t.score)
        if args.answers and t.score < 1:
            print(f"{t.label} {t.task} depth {t.depth:g}: {t.answer!r} for {t.expected}")
    for label, s in scores.items():
        print(f"{label:40s} {sum(s) / len(s):.2f}  {''.join('1' if x == 1 else '0' for x in s)}")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
