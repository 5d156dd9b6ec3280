"""A budgeted decode step's time by its phase in the eviction period, inside and outside llama_decode: which steps
of a layout cost more than the plain engine's, and where. Medians over the periods of ``--steps`` decode steps after
a prompt twice the budget, in a session opened as the product opens one; the plain engine (llama.cpp's trimmed
cache, no tap) decodes the same tokens after the first ``budget`` of the prompt, for reference.

    AHAKV_THREADS=2 python benchmarks/decode_phases.py --layer-budgets natural,adaptive

Prints, per layout: an ordinary step (neither the period's first nor its observed last), the first step (where a
resize of the adaptive layout's caches lands), and the observed step (statistics read, the eviction), each as ms
inside and outside llama_decode, and the mean outside per token over all steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session


def timed_steps(step, tokens: list[int]) -> list[tuple[float, float]]:
    """(seconds inside llama_decode, seconds outside) of ``step(token)`` for each token."""
    out = []
    with llama_decode_times() as calls:
        for tok in tokens:
            before = len(calls)
            t0 = time.perf_counter()
            step(tok)
            total = time.perf_counter() - t0
            inside = sum(calls[before:])
            out.append((inside, total - inside))
    return out


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--layer-budgets", default="natural,adaptive", help="comma-separated layouts")
    args = ap.parse_args()
    model = default_model_path()
    n_prompt = 2 * args.budget
    tokens = file_tokens(model, args.text, n_prompt + args.steps)
    steps = tokens[n_prompt:]

    config = EngineConfig(n_ctx=args.budget + args.steps + 64, n_batch=64, n_ubatch=64, swa_full=False)
    with Engine(model, config) as plain:
        for i in range(0, args.budget, 64):
            plain.decode(tokens[i : i + 64])
        times = timed_steps(lambda tok: plain.decode([tok]), steps)
    print(f"plain engine, trimmed cache: inside {ms([t[0] for t in times])} ms, outside {ms([t[1] for t in times])}")

    for layout in args.layer_budgets.split(","):
        spec = SessionSpec.bounded(args.policy, args.budget, layer_budgets=layout)
        with open_session(model, spec, len(tokens)) as session:
            ctl = session.controller
            ctl.prefill(tokens[:n_prompt])
            every = ctl.config.evict_every
            phases = [(n_prompt + i) % every for i in range(len(steps))]
            times = timed_steps(ctl.step, steps)
        by_kind: dict[str, list[tuple[float, float]]] = {"ordinary": [], "first": [], "observed": []}
        for phase, t in zip(phases, times, strict=True):
            kind = "first" if phase == 0 else "observed" if phase == every - 1 else "ordinary"
            by_kind[kind].append(t)
        mean_outside = sum(t[1] for t in times) / len(times) * 1000
        print(f"{layout} {args.policy} (period {every}): mean outside {mean_outside:.3f} ms a token")
        for kind, got in by_kind.items():
            print(f"  {kind:9s} step: inside {ms([t[0] for t in got])} ms, outside {ms([t[1] for t in got])}")


if __name__ == "__main__":
    main()
