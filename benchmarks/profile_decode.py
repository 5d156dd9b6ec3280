"""Where a budgeted decode step spends its time: cProfile over AhaKV decode steps (KVController.step) after a
prompt twice the budget, in a session opened as the product opens one. Prints the seconds per token and the
top functions by cumulative time (llama_decode is ``Engine._run_batch``; the rest is the controller and policy), and
how many of the steps' graphs llama.cpp reused rather than rebuilt (``llama_perf_context``'s ``n_reused``).

    AHAKV_THREADS=1 python benchmarks/profile_decode.py --budget 512 --steps 320
    AHAKV_THREADS=1 python benchmarks/profile_decode.py --layer-budgets adaptive --steps 160
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import llama_cpp
from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--layer-budgets", default="shared", help="the layout (shared, natural, uniform, ...)")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, 2 * args.budget + args.steps)
    spec = SessionSpec.bounded(args.policy, args.budget, layer_budgets=args.layer_budgets)
    with open_session(model, spec, len(tokens)) as session:
        ctl = session.controller
        ctl.prefill(tokens[: 2 * args.budget])
        before = llama_cpp.llama_perf_context(session.engine.ctx)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for tok in tokens[2 * args.budget :]:
            ctl.step(tok)
        profile.disable()
        print(f"{(time.perf_counter() - start) / args.steps * 1000:.1f} ms per token (under the profiler)")
        e = session.engine
        after = llama_cpp.llama_perf_context(e.ctx)
        print(f"graphs reused: {after.n_reused - before.n_reused} of {after.n_eval - before.n_eval} decode calls")
        print("cells by layer:", [e.n_cells(il) for il in range(e.n_layer)])  # each layer's cache, as allocated
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
