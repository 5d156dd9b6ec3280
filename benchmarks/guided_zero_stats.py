"""How many evictions of a guided read are scored on all-zero statistics (RESULTS.md, "Session ae"): 1,800 tokens of
GPL-3 and a question, AhaKV at 256 cells, read with the question guiding. A sliding group whose cells the question's
decode took re-read the statistics the question's reset had emptied; 7bb5d0e gives 49 of 288 in the adaptive layout,
the fix (a807f0d) 0.

    AHAKV_THREADS=1 python benchmarks/guided_zero_stats.py --layer-budgets adaptive
    PYTHONPATH=../before AHAKV_THREADS=1 python benchmarks/guided_zero_stats.py   # ../before: a checkout of 7bb5d0e
"""

from __future__ import annotations

import argparse

import numpy as np

from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer-budgets", default="adaptive")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1800)
    args = ap.parse_args()
    spec = SessionSpec.bounded(args.policy, args.budget, reading="query", layer_budgets=args.layer_budgets)
    scored, empty = 0, 0
    with open_session(default_model_path(), spec, args.tokens + 400, 64) as s:
        policy_class = s.controller.policy.__class__
        score = policy_class.score

        def counting(policy, obs):  # every group's eviction scores its observation here
            nonlocal scored, empty
            scored += 1
            empty += int(obs.attn is not None and not np.any(obs.attn))
            return score(policy, obs)

        policy_class.score = counting
        try:
            text = open("/usr/share/common-licenses/GPL-3").read()
            question = s.engine.tokenize("\nQuestion: what does the license say about patents?", add_bos=False)
            s.read(s.engine.tokenize(text)[: args.tokens] + question, question)
        finally:
            policy_class.score = score
    print(f"{args.layer_budgets} {args.policy}: {empty} of {scored} scored observations were all zero")


if __name__ == "__main__":
    main()
