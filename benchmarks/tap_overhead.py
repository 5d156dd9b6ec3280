"""Decode speed of Gemma 3 270M at a 2K context with the attention tap off and on, side by side.

Configurations are interleaved round by round (so drift of the machine hits all alike); each round
decodes the same tokens after a rewind to the same 2K context. Prints a Markdown table of median
tokens/s and ratios to the untapped engine and writes benchmarks/out/tap_overhead.json.

    python benchmarks/tap_overhead.py [--model PATH] [--context 2048] [--tokens 32] [--rounds 7] [-ngl N]

-ngl offloads N layers (-1 or 999: all) to the engine's GPU backend (CUDA, Metal, Vulkan).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import resolve_model
from ahakv_local.native import TapFlag

CONFIGS = {
    "off": (TapFlag(0), False),
    "model softmax (ATTN)": (TapFlag.ATTN, False),
    "ATTN + read all layers each step": (TapFlag.ATTN, True),
    "side pass (SIDE)": (TapFlag.SIDE, False),
    "reconstruction (ATTN+VNORM+VERR)": (TapFlag.ATTN | TapFlag.VNORM | TapFlag.VERR, False),
}


def real_text() -> str:
    paths = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
    return "\n".join(Path(p).read_text() for p in paths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers offloaded to the GPU (-1: all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "tap_overhead.json"))
    args = ap.parse_args()

    path = resolve_model(args.model, progress=True)
    with Engine(path, EngineConfig(n_ctx=args.context + 512, n_gpu_layers=args.n_gpu_layers)) as e:
        tokens = e.tokenize(real_text())
        assert len(tokens) >= args.context + args.tokens, "not enough text"
        e.decode(tokens[: args.context])
        follow = tokens[args.context : args.context + args.tokens]
        speeds: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for rnd in range(args.rounds):
            names = list(CONFIGS)
            names = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate the order
            for name in names:
                flags, read = CONFIGS[name]
                e.set_tap(flags, 1)
                e.decode(follow[:2])  # a flag change rebuilds the graph once: not timed
                e.truncate(args.context)
                t0 = time.perf_counter()
                for tok in follow:
                    e.decode([tok])
                    if read:
                        e.stats("attn")
                        e.reset_stats()
                dt = time.perf_counter() - t0
                e.truncate(args.context)
                speeds[name].append(len(follow) / dt)

    base = statistics.median(speeds["off"])
    rows = []
    for name, s in speeds.items():
        med = statistics.median(s)
        rows.append({"config": name, "median_tps": med, "ratio_to_off": med / base, "runs": s})
    command = " ".join([Path(sys.executable).name, *sys.argv])
    result = {
        "command": command,
        "model": str(path),
        "context": args.context,
        "tokens_per_run": args.tokens,
        "rounds": args.rounds,
        "n_gpu_layers": args.n_gpu_layers,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    where = f", {args.n_gpu_layers} layers offloaded" if args.n_gpu_layers else ""
    print(f"# decode speed at {args.context} context, {path.name}, {args.rounds} interleaved rounds{where}")
    print(f"command: `{command}`\n")
    print("| configuration | median tok/s | ratio to off | cost |")
    print("|---|---:|---:|---:|")
    for r in rows:
        ratio = r["ratio_to_off"]
        print(f"| {r['config']} | {r['median_tps']:.1f} | {ratio:.3f} | {100 * (1 - ratio):+.1f}% |")


if __name__ == "__main__":
    main()
