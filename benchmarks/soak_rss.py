"""Soak: the process's RSS over a 100,000-token budgeted generation through the drop-in ``ahakv_local.Llama``.

Gemma 3 270M's trained context is 32K positions and positions never shift, so this uses the tiny
random-weight fixture with a 131,072-position trained context: ``Llama(path, kv_budget=256, n_batch=64)``,
a 512-token prompt (GPL-3), then greedy ``Llama.generate`` (the drop-in's decode path: ``eval`` ->
``KVController.step``). Not ``create_completion``: llama-cpp-python re-detokenizes every completion token
at every step there, quadratic in the output length (measured here: 2K tokens 4.5 s, 16K 246 s, so ~2.7 h
for 100K), and it stops at this random model's greedy end-of-sequence (after 433 tokens). Every --every
tokens: VmRSS, the cells in use and the bytes of numpy arrays the policy holds. Writes results.json,
results.csv, results.md (these two with the command that made them) and rss.png under --out.

    python benchmarks/soak_rss.py [--tokens 100000] [--budget 256] [--policy ahakv] [--out benchmarks/out/soak]
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ahakv_local import Llama
from ahakv_local.fixture import FixtureSpec
from ahakv_local.models import fixture_path


def vm(key: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def array_bytes(obj: object, depth: int = 0) -> int:
    """Bytes of the numpy arrays reachable from obj's attributes, lists and tuples (policy state)."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if depth > 4:
        return 0
    if isinstance(obj, list | tuple):
        return sum(array_bytes(x, depth + 1) for x in obj)
    return sum(array_bytes(v, depth + 1) for v in getattr(obj, "__dict__", {}).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="tokens to generate")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (GPL-3)")
    ap.add_argument("--every", type=int, default=1000, help="tokens between samples")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "soak"))
    args = ap.parse_args()
    command = " ".join(["python", *sys.argv])

    path = fixture_path(FixtureSpec(n_ctx_train=131072))
    llm = Llama(str(path), kv_budget=args.budget, kv_policy=args.policy, n_batch=64, verbose=False)
    prompt = llm.tokenize(Path("/usr/share/common-licenses/GPL-3").read_bytes())[: args.prompt]
    if len(prompt) + args.tokens > llm.n_ctx():
        sys.exit(f"{len(prompt)} + {args.tokens} tokens exceed the trained context {llm.n_ctx()}")
    ctl = llm.kv_controller
    samples: list[dict] = []
    lo, hi = sys.maxsize, 0  # the cells in use between samples (they swing with every eviction)
    t0 = time.perf_counter()
    for n, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):
        lo, hi = min(lo, ctl.stats.cells_used), max(hi, ctl.stats.cells_used)
        if n % args.every == 0 or n == 1:
            samples.append(
                {
                    "generated": n,
                    "seconds": round(time.perf_counter() - t0, 3),
                    "rss_mib": vm("VmRSS") / 2**20,
                    "cells_used": ctl.stats.cells_used,
                    "cells_min": lo,
                    "cells_max": hi,
                    "kv_cells": llm.kv_stats().kv_cells,
                    "policy_array_bytes": array_bytes(ctl.policy),
                }
            )
            lo, hi = sys.maxsize, 0
        if n == args.tokens:
            break
    seconds = time.perf_counter() - t0
    peak = vm("VmHWM") / 2**20
    llm.close()

    at = {s["generated"]: s for s in samples}
    first, ten_k, last = samples[0], at.get(10_000, samples[len(samples) // 10]), samples[-1]
    summary = {
        "tokens_per_s": args.tokens / seconds,
        "seconds": seconds,
        "rss_mib_at_1": first["rss_mib"],
        "rss_mib_at_10k": ten_k["rss_mib"],
        "rss_mib_at_end": last["rss_mib"],
        "rss_growth_10k_to_end_mib": last["rss_mib"] - ten_k["rss_mib"],
        "policy_array_bytes_10k_to_end": last["policy_array_bytes"] - ten_k["policy_array_bytes"],
        "peak_rss_mib": peak,
        "max_cells_used": max(s["cells_max"] for s in samples),
    }
    config = {
        "command": command,
        "model": f"fixture n_ctx_train=131072 ({path.name})",
        "budget": args.budget,
        "policy": args.policy,
        "prompt_tokens": len(prompt),
        "generated": args.tokens,
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()} {platform.release()}",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config, "summary": summary, "samples": samples}, indent=1))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0]))
        w.writeheader()
        w.writerows(samples)
    rows = [s for s in samples if s["generated"] % 10_000 == 0 or s is first]
    md = [
        f"# Soak: RSS over {args.tokens:,} generated tokens",
        "",
        f"`{command}`",
        "",
        f"{args.policy}, budget {args.budget} cells, {len(prompt)}-token prompt; {summary['tokens_per_s']:.0f} tok/s; "
        f"RSS {ten_k['rss_mib']:.1f} MiB at {ten_k['generated']:,} tokens, {last['rss_mib']:.1f} MiB at "
        f"{last['generated']:,} ({summary['rss_growth_10k_to_end_mib']:+.1f} MiB); peak {peak:.1f} MiB.",
        "",
        "| generated | seconds | RSS (MiB) | cells used (min-max) | KV cells | policy arrays (KiB) |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {s['generated']:,} | {s['seconds']:.0f} | {s['rss_mib']:.1f} | {s['cells_min']}-{s['cells_max']} "
            f"| {s['kv_cells']} "
            f"| {s['policy_array_bytes'] / 1024:.0f} |"
            for s in rows
        ),
    ]
    (out / "results.md").write_text("\n".join(md) + "\n")
    growth = f"RSS {summary['rss_growth_10k_to_end_mib']:+.1f} MiB from {ten_k['generated']:,} to {last['generated']:,}"
    plot(samples, out / "rss.png", f"{args.policy} @ {args.budget} cells, fixture (131K trained context): {growth}")
    print("\n".join(md))


def plot(samples: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["generated"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s["rss_mib"] for s in samples], color="tab:blue", label="RSS")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    lo = min(s["rss_mib"] for s in samples)
    ax.set_ylim(lo - 8, max(s["rss_mib"] for s in samples) + 8)
    cells = ax.twinx()
    lo, hi = [s["cells_min"] for s in samples], [s["cells_max"] for s in samples]
    cells.fill_between(x, lo, hi, color="tab:orange", alpha=0.3, linewidth=0)
    cells.set_ylabel("cells used (min-max per sample interval)", color="tab:orange")
    cells.set_ylim(0, max(hi) * 1.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
