"""Where a budgeted prompt's time goes: reading a text through ``KVController.prefill`` with each statistic of the
attention tap turned off in turn (AhaKV's ablations), against llama.cpp's trimmed cache reading it untapped, side by
side (interleaved rounds, medians). Splits each reading into the time inside llama_decode (the graph, with the tap's
nodes) and outside it (the controller and the policy, Python).

    AHAKV_THREADS=2 python benchmarks/prompt_tap_cost.py --rounds 3
    python benchmarks/prompt_tap_cost.py --layer-budgets adaptive --tokens 4096

Every chunk of ``n_ubatch`` prompt tokens is tapped on its last rows (AhaKV: 32) and compressed after it. AhaKV asks
for the model's softmax (ATTN), the side pass at its sharpened scale (SIDE, dropped by ``-sg_softmax``) and the
reconstruction term (VERR with the value norms, dropped by ``-error_model``); TOVA taps ATTN on one row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from common import command_line, file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.bench import interleave
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.policies.ahakv import ABLATIONS
from ahakv_local.session import SessionSpec, open_session

NO_SIDE, NO_ERROR = ABLATIONS["ahakv -sg_softmax"], ABLATIONS["ahakv -error_model"]
VARIANTS: dict[str, tuple[str, dict]] = {
    "tova": ("tova", {}),
    "ahakv": ("ahakv", {}),
    "ahakv -sg_softmax": ("ahakv", NO_SIDE),
    "ahakv -error_model": ("ahakv", NO_ERROR),
    "ahakv -sg_softmax -error_model": ("ahakv", NO_SIDE | NO_ERROR),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=512, help="cells of the budgeted sessions")
    ap.add_argument("--batch", type=int, default=64, help="n_batch = n_ubatch of every engine (the chunk)")
    ap.add_argument("--layer-budgets", default="shared")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, args.tokens)
    n = len(tokens)

    trimmed = Engine(model, EngineConfig(n_ctx=n + args.batch, n_batch=args.batch, n_ubatch=args.batch, swa_full=False))
    sessions = {
        label: open_session(
            model,
            SessionSpec.bounded(policy, args.budget, params=params, layer_budgets=args.layer_budgets),
            n + args.batch,
            args.batch,
        )
        for label, (policy, params) in VARIANTS.items()
    }

    def timed(read: Callable[[], None]) -> Callable[[], tuple[float, float]]:
        """``read`` as a run of ``bench.interleave``: (its seconds, those inside llama_decode)."""

        def run() -> tuple[float, float]:
            with llama_decode_times() as calls:
                t0 = time.perf_counter()
                read()
                return time.perf_counter() - t0, sum(calls)

        return run

    def read_trimmed() -> None:
        trimmed.truncate(0)
        for i in range(0, n, args.batch):
            trimmed.decode(tokens[i : i + args.batch])

    def read_budgeted(label: str) -> Callable[[], None]:
        def read() -> None:
            sessions[label].reset()
            sessions[label].controller.prefill(tokens)

        return read

    runs = {"trimmed (untapped)": timed(read_trimmed)} | {label: timed(read_budgeted(label)) for label in sessions}
    try:
        times = interleave(runs, args.rounds, lambda _: None)
    finally:
        trimmed.close()
        for s in sessions.values():
            s.close()

    base = statistics.median(t for t, _ in times["trimmed (untapped)"])
    print(f"{command_line()}\n")
    print(f"{n} tokens of {args.text}, chunks of {args.batch}, budget {args.budget} cells ({args.layer_budgets}), ")
    print(f"medians of {args.rounds} interleaved rounds\n")
    print("| reading | prompt tok/s | x trimmed | in llama_decode s | outside s |")
    print("|---|---:|---:|---:|---:|")
    for label, rows in times.items():
        total = statistics.median(t for t, _ in rows)
        inside = statistics.median(d for _, d in rows)
        print(f"| {label} | {n / total:.0f} | {base / total:.3f}x | {inside:.2f} | {total - inside:.2f} |")


if __name__ == "__main__":
    main()
