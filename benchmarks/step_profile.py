"""Where a budgeted decode step's CPU time goes, by kind of step and by library: a sampling profile (Linux ``perf``,
user time of every thread) of ``--steps`` AhaKV decode steps after a prompt twice the budget, each sample put in the
step it fell in (steady, eviction, resize: as ``decode_parts.py`` sorts them) and in a part of the program by the
library it ran in (ggml's kernels, OpenMP's waiting, llama.cpp, Python and numpy, the C library). Prints CPU ms per
step of each kind and part for each layout, then the llama.cpp functions whose time differs most between the first
two layouts in steady steps (named where the engine's unstripped build is still in the build cache).

Needs ``perf`` with user-space sampling allowed (``kernel.perf_event_paranoid`` <= 2). CPU time, not wall time: the
OpenMP worker waits while the main thread runs Python and llama.cpp's bookkeeping, so those show up twice.

    AHAKV_THREADS=2 python benchmarks/step_profile.py --layer-budgets natural,adaptive --steps 256 --rounds 4
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local import controller
from ahakv_local.models import default_model_path
from ahakv_local.paths import cache_dir
from ahakv_local.session import SessionSpec, open_session

PARTS = {  # part of the program -> substrings of the library file names that belong to it
    "ggml kernels": ("libggml",),
    "OpenMP (waiting)": ("libgomp",),
    "llama.cpp": ("libllama",),
    "Python and numpy": ("libpython", "cpython-", "libffi"),
}
OTHER = "C library and other"
KINDS = ("steady", "eviction", "resize")


def decode(layout: str, steps: int, budget: int, policy: str, log: Path) -> None:
    """The profiled child: prefill twice the budget, then ``steps`` steps, logging (start, end, kind) of each."""
    calls = Counter()
    for name in ("evict", "_resize"):
        method = getattr(controller.KVController, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(controller.KVController, name, counted)
    model = default_model_path()
    tokens = file_tokens(model, "/usr/share/common-licenses/GPL-3", 2 * budget + steps)
    spec = SessionSpec.bounded(policy, budget, layer_budgets=layout)
    rows = []
    with open_session(model, spec, len(tokens)) as s:
        s.controller.prefill(tokens[: 2 * budget])
        for token in tokens[2 * budget :]:
            before = dict(calls)
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            s.controller.step(token)
            t1 = time.clock_gettime(time.CLOCK_MONOTONIC)
            kind = "resize" if calls["_resize"] > before.get("_resize", 0) else "steady"
            rows.append((t0, t1, "eviction" if calls["evict"] > before.get("evict", 0) else kind))
    log.write_text(json.dumps(rows))


def build_id(path: Path) -> str | None:
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    return m.group(1) if m else None


def symbol_dir(tmp: Path) -> Path | None:
    """A ``perf --symfs`` folder holding the unstripped libllama of the installed engine's build (the wheel's copy is
    stripped of its local symbols), found in the build cache by its build id; None where it is not there."""
    import llama_cpp  # the engine the children load

    lib = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    want = build_id(lib)
    for candidate in sorted((cache_dir() / "work").glob("*/build/bin/libllama.so.*")):
        if not candidate.is_symlink() and want and build_id(candidate) == want:
            target = tmp / str(lib.resolve()).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(candidate, target)
            return tmp
    return None


def profile(layout: str, args: argparse.Namespace, tmp: Path, symfs: Path | None) -> tuple[dict, Counter, Counter]:
    """One profiled process: (samples by kind and part, steps of each kind, llama.cpp samples by function in steady
    steps)."""
    data, log = tmp / f"{layout}.data", tmp / f"{layout}.json"
    child = [sys.executable, __file__, "--child", layout, "--steps", str(args.steps), "--budget", str(args.budget)]
    child += ["--policy", args.policy, "--log", str(log)]
    perf = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock:u", "-F", str(args.freq), "-o", str(data)]
    subprocess.run(perf + ["--", *child], check=True)
    steps = json.loads(log.read_text())
    starts = [s[0] for s in steps]
    script = ["perf", "script", "-i", str(data), "-F", "time,ip,sym,dso"] + (["--symfs", str(symfs)] if symfs else [])
    out = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    samples = {k: Counter() for k in KINDS}
    llama = Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+):\s+\S+\s+(.*?)\s+\((\S+)\)\s*$", line)
        if not m:
            continue
        t, sym, dso = float(m.group(1)), m.group(2), m.group(3).rsplit("/", 1)[-1]
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > steps[i][1]:
            continue  # the prompt, loading, or between two steps
        kind = steps[i][2]
        part = next((p for p, keys in PARTS.items() if any(k in dso for k in keys)), OTHER)
        samples[kind][part] += 1
        if kind == "steady" and part == "llama.cpp":
            llama[sym] += 1
    return samples, Counter(s[2] for s in steps), llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer-budgets", default="natural,adaptive", help="layouts, comma-separated")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--rounds", type=int, default=2, help="each layout this many times, the order turned each round")
    ap.add_argument("--freq", type=int, default=4000, help="samples a second of each thread")
    ap.add_argument("--top", type=int, default=10, help="llama.cpp functions listed")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        decode(args.child, args.steps, args.budget, args.policy, Path(args.log))
        return
    if shutil.which("perf") is None:
        sys.exit("step_profile.py needs Linux perf (linux-perf / linux-tools)")
    layouts = args.layer_budgets.split(",")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        symfs = symbol_dir(tmp / "symfs")
        totals = {lb: ({k: Counter() for k in KINDS}, Counter(), Counter()) for lb in layouts}
        for r in range(args.rounds):  # a second process ran ~10% slower in ggml's kernels than the first: alternate
            for lb in layouts if r % 2 == 0 else layouts[::-1]:
                samples, n, llama = profile(lb, args, tmp, symfs)
                for k in KINDS:
                    totals[lb][0][k].update(samples[k])
                totals[lb][1].update(n)
                totals[lb][2].update(llama)
    ms = 1000 / args.freq  # one sample: this many ms of CPU
    results = {}
    for lb, (samples, n, llama) in totals.items():
        per_step = {k: {p: c * ms / n[k] for p, c in samples[k].items()} for k in KINDS if n[k]}
        results[lb] = per_step, n, Counter({s: c * ms / n["steady"] for s, c in llama.items()})
    print(f"{args.policy}, {args.budget} cells, {args.steps} steps after {2 * args.budget} prompt tokens, "
          f"{args.rounds} rounds, AHAKV_THREADS={os.environ.get('AHAKV_THREADS', 'all')}; "
          "CPU ms per step (all threads)")  # fmt: skip
    parts = [*PARTS, OTHER]
    print("| layout | kind of step | steps a round | " + " | ".join(parts) + " | all |")
    print("|---|---|---:|" + "---:|" * (len(parts) + 1))
    for lb, (per_step, n, _) in results.items():
        for kind, by_part in per_step.items():
            cells = " | ".join(f"{by_part.get(p, 0.0):.3f}" for p in parts)
            print(f"| {lb} | {kind} | {n[kind] / args.rounds:g} | {cells} | {sum(by_part.values()):.3f} |")
    if len(layouts) >= 2:
        (a, (_, _, fa)), (b, (_, _, fb)) = list(results.items())[:2]
        named = "" if symfs else " (the unstripped build is not in the cache: local functions unnamed)"
        print(f"\nllama.cpp in a steady step, CPU ms: {b} - {a}, the largest differences{named}")
        for sym in sorted(set(fa) | set(fb), key=lambda s: fb[s] - fa[s], reverse=True)[: args.top]:
            print(f"  {fb[sym] - fa[sym]:+.4f}  {fa[sym]:.4f} -> {fb[sym]:.4f}  {sym}")


if __name__ == "__main__":
    main()
