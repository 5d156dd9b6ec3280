"""The same greedy request, again and again, through one drop-in: how many different answers it gets (one, if the
answer does not depend on the requests before it), per layout and policy. A new sequence's KV cells used to start
where the last sequence's lowest cell was, so the same prompt met its cells in another order and near-equal
evictions flipped (benchmarks/RESULTS.md, session ah).

    AHAKV_THREADS=1 python benchmarks/repeat_requests.py --layouts shared,natural --policies h2o,ahakv --repeats 5
"""

from __future__ import annotations

import argparse

from ahakv_local import Llama
from ahakv_local.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--chars", type=int, default=3000, help="the prompt: the text's first CHARS characters")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--layouts", default="shared,natural")
    ap.add_argument("--policies", default="h2o,ahakv")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    prompt = open(args.text, encoding="utf-8").read()[: args.chars]
    print("| layout | policy | different answers in", args.repeats, "requests |")
    print("|---|---|---:|")
    for layout in args.layouts.split(","):
        for policy in args.policies.split(","):
            with Llama(str(default_model_path()), kv_budget=args.budget, kv_policy=policy, kv_layer_budgets=layout,
                       n_ctx=2048, verbose=False) as llm:  # fmt: skip
                answers = [
                    llm.create_completion(prompt, max_tokens=args.max_tokens, temperature=0)["choices"][0]["text"]
                    for _ in range(args.repeats)
                ]
            print(f"| {layout} | {policy} | {len(set(answers))} |")


if __name__ == "__main__":
    main()
