"""Where a budgeted decode step spends its time: cProfile over AhaKV decode steps (KVController.step) after a
prompt twice the budget (or ``--context`` tokens), in a session opened as the product opens one. Prints the seconds
per token and the top functions by cumulative time (llama_decode is ``Engine._run_batch``; the rest is the controller
and policy), and how many of the steps' graphs llama.cpp reused rather than rebuilt (``llama_perf_context``'s
``n_reused``).

    AHAKV_THREADS=1 python benchmarks/profile_decode.py --budget 512 --steps 320
    AHAKV_THREADS=1 python benchmarks/profile_decode.py --layer-budgets adaptive --steps 160
    python benchmarks/profile_decode.py -ngl -1 --sort tottime   # every layer offloaded (a GPU build)
    python benchmarks/profile_decode.py --context 32768 --steps 128  # the steps after a long prompt

The steps run twice from the same prompt: once timed without the profiler (the seconds per token inside llama_decode
and outside it, the controller's own share), once under it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import llama_cpp
from common import file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--context", type=int, default=0, help="prompt tokens before the steps (default: twice the budget)")
    ap.add_argument("--layer-budgets", default="shared", help="the layout (shared, natural, uniform, ...)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers offloaded to a GPU (-1: all)")
    ap.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime"))
    args = ap.parse_args()
    model = default_model_path()
    n_prompt = args.context or 2 * args.budget
    tokens = file_tokens(model, args.text, n_prompt + args.steps)
    spec = SessionSpec.bounded(args.policy, args.budget, layer_budgets=args.layer_budgets)
    with open_session(model, spec, len(tokens), n_gpu_layers=args.n_gpu_layers) as session:
        ctl, e = session.controller, session.engine
        steps = tokens[n_prompt:]
        ctl.prefill(tokens[:n_prompt])
        with llama_decode_times() as calls:
            start = time.perf_counter()
            for tok in steps:
                ctl.step(tok)
            total = (time.perf_counter() - start) / len(steps) * 1000
        inside = sum(calls) / len(steps) * 1000
        print(f"{total:.3f} ms per token: {inside:.3f} in llama_decode, {total - inside:.3f} outside (no profiler)")

        session.reset()
        ctl = session.controller
        ctl.prefill(tokens[:n_prompt])
        before = llama_cpp.llama_perf_context(e.ctx)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for tok in steps:
            ctl.step(tok)
        profile.disable()
        print(f"{(time.perf_counter() - start) / len(steps) * 1000:.1f} ms per token (under the profiler)")
        after = llama_cpp.llama_perf_context(e.ctx)
        print(f"graphs reused: {after.n_reused - before.n_reused} of {after.n_eval - before.n_eval} decode calls")
        print("cells by layer:", [e.n_cells(il) for il in range(e.n_layer)])  # each layer's cache, as allocated
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
