"""Where the time of `serve --parallel N` goes, on benchmarks/serve_parallel.py's workload, in-process (no HTTP).

The scheduler loop of the parallel server (``ParallelRunner._loop`` without its threads) and the one-at-a-time
server's ``Llama.create_completion`` run the same requests (GPL-3 excerpts of 150 words, greedy, ``max_tokens``);
llama_decode is timed by wrapping it, the rest is split by cProfile. Prints the split of each.

    python benchmarks/profile_parallel.py [MODEL] [--parallel 4] [--requests 8] [--max-tokens 64] [--budget 128]
                                          [--threads 1] [--serial] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()


class DecodeTimer:
    """Wraps llama_cpp.llama_decode (the package's and the module's binding): seconds, calls and tokens."""

    def __init__(self) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        self.seconds, self.calls, self.tokens = 0.0, 0, 0
        self._orig = low.llama_decode

        def timed(ctx, batch):
            t0 = time.perf_counter()
            rc = self._orig(ctx, batch)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.tokens += batch.n_tokens
            return rc

        llama_cpp.llama_decode = low.llama_decode = timed


def prompts(n: int) -> list[str]:
    words = TEXT.split()
    return [" ".join(words[200 * i : 200 * i + 150]) for i in range(n)]


def run_parallel(a) -> None:
    from ahakv_local.cli import load_pool
    from ahakv_local.parallel import Generation, Sampling

    pool = load_pool(
        a.model or None, a.parallel, None, a.budget, "ahakv", 4, 32, None, None, 1, a.threads, 0, None, reading="plain"
    )
    e = pool.engine
    done = []
    gens = [
        Generation(e.tokenize(p, add_bos=True, special=True), Sampling(a.max_tokens, temperature=0),
                   lambda t, f: done.append(f) if f else None)
        for p in prompts(a.requests)
    ]  # fmt: skip
    timer = DecodeTimer()
    prof = cProfile.Profile()
    t0, cpu = time.perf_counter(), time.process_time()
    prof.enable()
    waiting = list(gens)
    while waiting or pool.active:
        admit = []
        while waiting and len(admit) < len(pool.free()):
            admit.append(waiting.pop(0))
        if hasattr(pool, "start_many"):
            pool.start_many(admit)
        else:
            for g in admit:
                pool.start(g)
        pool.step()
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    report("parallel", wall, cpu, timer, sum(len(g.tokens) for g in gens), prof, a.top)


def run_serial(a) -> None:
    from ahakv_local.cli import load_llama

    model = a.model or None
    llm = load_llama(model, None, a.budget, "ahakv", 4, 32, None, None, 1, a.threads, 0, None, reading="plain")
    timer = DecodeTimer()
    prof = cProfile.Profile()
    n = 0
    t0, cpu = time.perf_counter(), time.process_time()
    prof.enable()
    for p in prompts(a.requests):
        out = llm.create_completion(p, max_tokens=a.max_tokens, temperature=0)
        n += out["usage"]["completion_tokens"]
    prof.disable()
    report("one at a time", time.perf_counter() - t0, time.process_time() - cpu, timer, n, prof, a.top)


def report(label: str, wall: float, cpu: float, timer: DecodeTimer, n: int, prof: cProfile.Profile, top: int) -> None:
    print(f"## {label}: {wall:.2f} s wall, {cpu:.2f} s CPU, {n} completion tokens, {n / wall:.1f} t/s")
    print(f"llama_decode {timer.seconds:.2f} s ({100 * timer.seconds / wall:.0f}%) in {timer.calls} calls, "
          f"{timer.tokens} tokens; the rest {wall - timer.seconds:.2f} s")  # fmt: skip
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(r"engine.py.*\((decode|decode_batch)\)")  # prompts / steps
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", default="128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serial", action="store_true", help="profile the one-at-a-time server's path instead")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    (run_serial if a.serial else run_parallel)(a)


if __name__ == "__main__":
    main()
