"""A digest of what a budgeted decode decides: every group's live positions and the logits after each step, hashed.
Two engines or two checkouts that print the same digest evicted the same positions at every step and computed the
same logits to the last bit (a refactor of the controller's bookkeeping should leave it unchanged).

    AHAKV_THREADS=2 python benchmarks/decode_digest.py --layer-budgets adaptive --policy ahakv
    PYTHONPATH=../before AHAKV_THREADS=2 python benchmarks/decode_digest.py   # ../before: a second checkout

llama.cpp's CPU kernels give the same bits for the same thread count; compare runs with equal AHAKV_THREADS.
"""

from __future__ import annotations

import argparse
import hashlib

from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--layer-budgets", default="adaptive")
    ap.add_argument("--budget", type=int, default=384)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, args.prompt + args.steps)
    spec = SessionSpec.bounded(args.policy, args.budget, layer_budgets=args.layer_budgets)
    digest = hashlib.sha256()
    with open_session(model, spec, len(tokens)) as session:
        ctl = session.controller
        ctl.prefill(tokens[: args.prompt])
        for tok in tokens[args.prompt :]:
            logits = ctl.step(tok)
            for g in ctl.groups:
                digest.update(g.live.tobytes())
            digest.update(logits.tobytes())
        sizes = session.engine.cache_sizes()
    cells = ", ".join(map(str, sizes))
    print(f"{args.layer_budgets} {args.policy}: {digest.hexdigest()[:16]} (caches at the end: {cells})")


if __name__ == "__main__":
    main()
