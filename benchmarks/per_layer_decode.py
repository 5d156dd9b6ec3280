"""One KV cache per layer (patch 0013) against llama.cpp's two caches, engine only: the logits of a prompt and of
single-token decodes must be bit for bit the same when every layer's cache has the size its two-cache twin has,
and the time per token is printed for equal sizes (f16) and for a byte budget's mixed sizes (q5_0, flash
attention), tap off and on; then what one resize of the per-layer caches costs (``Engine.resize_caches``, what
``--layer-budgets adaptive`` does at each decision) after the prompt.

    AHAKV_THREADS=2 python benchmarks/per_layer_decode.py --text /usr/share/common-licenses/GPL-3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ahakv_local.budget import per_layer_groups
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.native import TapFlag


def run(model, config: EngineConfig, tokens: list[int], prompt: int, steps: int, tap: bool):
    """(prompt seconds, seconds per decoded token, the last logits) of one engine."""
    with Engine(model, config) as e:
        t0 = time.perf_counter()
        for a in range(0, prompt, config.n_ubatch):
            logits = e.decode(tokens[a : min(a + config.n_ubatch, prompt)])
        t_prompt = time.perf_counter() - t0
        if tap:
            e.set_tap(TapFlag.ATTN | TapFlag.VERR, 0)
        t0 = time.perf_counter()
        for t in tokens[prompt : prompt + steps]:
            logits = e.decode([t])
        return t_prompt, (time.perf_counter() - t0) / steps, logits


def resize_cost(model, config: EngineConfig, tokens: list[int], prompt: int, rounds: int = 10) -> str:
    """The median wall time of ``rounds`` resizes of a per-layer engine holding ``prompt`` tokens, between its own
    sizes and sizes moved by a sixth up or down per layer (never below what a cache uses), and the state bytes
    moved."""
    with Engine(model, config) as e:
        for a in range(0, prompt, config.n_ubatch):
            e.decode(tokens[a : min(a + config.n_ubatch, prompt)])
        first = config.cache_cells
        used = [e.n_used(e.layer_cache.index(c)) for c in e.caches]
        moved = tuple(max(used[i], n + (n // 6 if i % 2 else -(n // 6))) for i, n in enumerate(first))
        times = []
        for r in range(rounds):
            t0 = time.perf_counter()
            e.resize_caches(moved if r % 2 == 0 else first)
            times.append(time.perf_counter() - t0)
        import llama_cpp

        state = llama_cpp.llama_state_seq_get_size(e.ctx, 0)
        return f"{1000 * float(np.median(times)):.1f} ms (median of {rounds}; {state / 2**20:.2f} MiB of state)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    model = default_model_path()
    with Engine(model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64)) as e:
        sliding = e.layer_sliding
        tokens = e.tokenize(open(args.text).read())[: args.prompt + args.steps]
    groups = per_layer_groups(sliding)
    kinds = [sliding[groups.index(c)] for c in range(len(sliding))]  # by cache: whether it slides

    equal = dict(n_ctx=1024, n_batch=512, n_ubatch=512)
    mixed = dict(n_ctx=2048, n_batch=64, n_ubatch=64, type_k="q5_0", type_v="q5_0", flash_attn=True, swa_full=False)
    setups = {
        "equal sizes, f16": (equal, (1024, 1024), (1024,) * len(sliding)),
        "mixed sizes, q5_0": (mixed, (1100, 700), tuple(700 if s else 1100 for s in kinds)),
    }
    print("| setup | tap | two caches: prompt s, ms/token | per-layer: prompt s, ms/token | logits equal |")
    print("|---|---|---|---|---|")
    for name, (kw, two, per_layer) in setups.items():
        for tap in (False, True):
            a = run(model, EngineConfig(**kw, cache_cells=two), tokens, args.prompt, args.steps, tap)
            b = run(model, EngineConfig(**kw, cache_cells=per_layer, layer_groups=groups), tokens, args.prompt,
                    args.steps, tap)  # fmt: skip
            same = "yes" if np.array_equal(a[2], b[2]) else "no"
            times = f"{a[0]:.2f}, {1000 * a[1]:.1f} | {b[0]:.2f}, {1000 * b[1]:.1f}"
            print(f"| {name} | {'on' if tap else 'off'} | {times} | {same} |", flush=True)
    mixed_sizes = setups["mixed sizes, q5_0"][2]
    config = EngineConfig(**mixed, cache_cells=mixed_sizes, layer_groups=groups)
    held = min(args.prompt, 600)
    cost = resize_cost(model, config, tokens, held)
    print(f"\none resize of the per-layer caches holding {held} tokens (q5_0): {cost}")


if __name__ == "__main__":
    main()
