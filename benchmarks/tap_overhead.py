"""Decode speed of Gemma 3 270M at a 2K context with the attention tap off and on, side by side.

Configurations are interleaved round by round (so drift of the machine hits all alike); each round
decodes the same tokens after a rewind to the same 2K context. Prints a Markdown table of median
tokens/s and ratios to the untapped engine and writes benchmarks/out/tap_overhead.json.

    python benchmarks/tap_overhead.py [--model PATH] [--context 2048] [--tokens 32] [--rounds 7] [--period 8] [-ngl N]

-ngl offloads N layers (-1 or 999: all) to the engine's GPU backend (CUDA, Metal, Vulkan). The last two rows
switch statistics on for one step in every ``--period`` and off again, as the controller does around an
observation (the default policy's flags: AhaKV's); each switch costs a graph build, priced in the last column.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import resolve_model
from ahakv_local.native import TapFlag
from ahakv_local.policies import make_policy


@dataclass(frozen=True)
class Tap:
    flags: TapFlag  # every step's statistics
    read: bool = False  # read every layer's ATTN from Python each step (and reset)
    observed: TapFlag | None = None  # the statistics of one step in every --period instead (a switch there and back)


# AhaKV's statistics between observations and on an observed step (controller._before_decode, track_mass on)
OBSERVED = make_policy("ahakv").tap_flags(0) | TapFlag.ATTN
BETWEEN = OBSERVED & (TapFlag.VNORM | TapFlag.ATTN)

CONFIGS = {
    "off": Tap(TapFlag(0)),
    "model softmax (ATTN)": Tap(TapFlag.ATTN),
    "ATTN + read all layers each step": Tap(TapFlag.ATTN, read=True),
    "side pass (SIDE)": Tap(TapFlag.SIDE),
    "reconstruction (ATTN+VNORM+VERR)": Tap(TapFlag.ATTN | TapFlag.VNORM | TapFlag.VERR),
    "AhaKV's observed step": Tap(OBSERVED),
    "off, ATTN on one step in a period": Tap(TapFlag(0), observed=TapFlag.ATTN),
    "AhaKV's between, its observed one step in a period": Tap(BETWEEN, observed=OBSERVED),
}
# the steady configurations a switching one's steps are made of: (between, observed)
STEADY = {
    "off, ATTN on one step in a period": ("off", "model softmax (ATTN)"),
    "AhaKV's between, its observed one step in a period": ("model softmax (ATTN)", "AhaKV's observed step"),
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
    ap.add_argument("--period", type=int, default=8, help="steps per observation of the switching rows")
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
                tap = CONFIGS[name]
                e.set_tap(tap.flags, 1)
                e.decode(follow[:2])  # a flag change rebuilds the graph once: not timed
                e.truncate(args.context)
                t0 = time.perf_counter()
                for i, tok in enumerate(follow):
                    observed = tap.observed is not None and i % args.period == args.period - 1
                    if observed:
                        e.set_tap(tap.observed, 1)
                    e.decode([tok])
                    if observed:
                        e.set_tap(tap.flags, 1)
                    if tap.read:
                        e.stats("attn")
                        e.reset_stats()
                dt = time.perf_counter() - t0
                e.truncate(args.context)
                speeds[name].append(len(follow) / dt)

    base = statistics.median(speeds["off"])
    medians = {name: statistics.median(s) for name, s in speeds.items()}
    rows = []
    for name, s in speeds.items():
        row = {"config": name, "median_tps": medians[name], "ratio_to_off": medians[name] / base, "runs": s}
        if name in STEADY:  # the time beyond its steps' own, per switch (two per observed step)
            between, observed = (1 / medians[n] for n in STEADY[name])
            mixed = (1 - 1 / args.period) * between + observed / args.period
            row["ms_per_switch"] = (1 / medians[name] - mixed) * 1000 * args.period / 2
        rows.append(row)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    result = {
        "command": command,
        "model": str(path),
        "context": args.context,
        "tokens_per_run": args.tokens,
        "rounds": args.rounds,
        "period": args.period,
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
    print(f"observed step (AhaKV): {OBSERVED!r}; between: {BETWEEN!r}; period {args.period} steps\n")
    print("| configuration | median tok/s | ratio to off | cost | ms per switch |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["ratio_to_off"]
        switch = f"{r['ms_per_switch']:.2f}" if "ms_per_switch" in r else ""
        print(f"| {r['config']} | {r['median_tps']:.1f} | {ratio:.3f} | {100 * (1 - ratio):+.1f}% | {switch} |")


if __name__ == "__main__":
    main()
