"""What a sliding cache re-using its cells does to the logits, with nothing evicted that a layer could still see.

    python benchmarks/window_reuse.py [--text FILE] [--lengths 576,578,600,800,1000,1500] [--layouts natural,adaptive]

The prompt's first N tokens are read in 64-token chunks by plain llama-cpp-python (the full cache, and llama.cpp's
trimmed sliding cache, ``swa_full=False``) and by the drop-in with a budget above N in each per-layer layout (no
question, so only what left Gemma 3's 512-token window goes), and the last row's logits are compared with the full
cache's: the largest absolute difference and the KL. The trimmed cache holds 768 cells (window + one batch, in
llama.cpp's multiples of 256) and starts re-using them past 768 positions; a per-layer layout's sliding caches hold
window + one chunk + the newest token (577 cells) and start past 577. A re-used cell puts a position elsewhere in the
attention's sums, which then round otherwise (``cache_size_floor.py``): both leave the full cache's logits by the
same amounts from there on, so a greedy answer may part from plain llama.cpp's after a few dozen tokens although
``--stats`` says nothing was evicted.
"""

from __future__ import annotations

import argparse

import llama_cpp
import numpy as np
from common import file_tokens

from ahakv_local import Llama
from ahakv_local.models import default_model_path

CHUNK = 64


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float64)


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of two rows of logits, in nats."""
    lp = p_logits - np.logaddexp.reduce(p_logits)
    lq = q_logits - np.logaddexp.reduce(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--lengths", default="576,578,600,800,1000,1500")
    ap.add_argument("--layouts", default="natural,adaptive")
    args = ap.parse_args()
    model = str(default_model_path())
    lengths = [int(n) for n in args.lengths.split(",")]
    n_ctx = 2048
    common = dict(n_ctx=n_ctx, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=1, verbose=False)
    runs = {
        "full": llama_cpp.Llama(model, **common),
        "trimmed": llama_cpp.Llama(model, swa_full=False, **common),
    }
    for layout in args.layouts.split(","):
        runs[layout] = Llama(model, kv_budget=n_ctx - CHUNK - 1, kv_layer_budgets=layout, kv_query=False, **common)
    tokens = file_tokens(default_model_path(), args.text, max(lengths))
    print("| tokens | " + " | ".join(f"{name}: max abs diff, KL" for name in list(runs)[1:]) + " |")
    print("|---:|" + "---:|" * (len(runs) - 1))
    for n in lengths:
        rows = {}
        for name, llm in runs.items():
            llm.reset()
            llm.eval(tokens[:n])
            rows[name] = last_logits(llm)
        full = rows.pop("full")
        cells = " | ".join(f"{np.abs(row - full).max():.3f}, {kl(full, row):.1e}" for row in rows.values())
        print(f"| {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
