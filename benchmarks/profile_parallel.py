"""Where the time of `serve --parallel N` goes, on benchmarks/serve_parallel.py's workload, in-process (no HTTP).

The scheduler loop of the parallel server (``ParallelRunner._loop`` without its threads) and the one-at-a-time
server's ``Llama.create_completion`` run the same requests (GPL-3 excerpts of 150 words, greedy, ``max_tokens``);
llama_decode is timed by wrapping it, the rest is split by cProfile, both in CPU seconds of the process (with one
engine thread: the work itself, which the load of a shared machine stretches far less than wall time). Prints the
split of each.

    python benchmarks/profile_parallel.py [MODEL] [--parallel 4] [--requests 8] [--max-tokens 64] [--budget 128]
                                          [--threads 1] [--serial] [--top 25]

``--kernels``: CPU milliseconds of the decode calls the two servers are made of (one token; four tokens with one
row of logits and with four; a 64-token prompt chunk), median of 7, which bound what batching can save.
``--prompts``: the first ``--parallel`` prompts read into the pool's slots one after another (as the server does)
against all of them in one llama_decode per chunk round (a measurement prototype built from the controller's
own steps, ``prefill_together``), CPU seconds, three rounds interleaved, with n_ubatch 64 and one chunk per
sequence.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from serve_parallel import TEXT, add_workload_args, prompts  # benchmarks/ is the script's directory: sys.path[0]


class DecodeTimer:
    """Wraps llama_cpp.llama_decode (the package's and the module's binding): CPU seconds, calls and tokens."""

    def __init__(self) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        self.seconds, self.calls, self.tokens = 0.0, 0, 0
        self._orig = low.llama_decode

        def timed(ctx, batch):
            t0 = time.process_time()
            rc = self._orig(ctx, batch)
            self.seconds += time.process_time() - t0
            self.calls += 1
            self.tokens += batch.n_tokens
            return rc

        llama_cpp.llama_decode = low.llama_decode = timed


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
    prof = cProfile.Profile(time.process_time)
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
    # the CLI's defaults (ctx_size 0: the trained context, as a budget lays its caches out; error_tol the auto budget's)
    llm = load_llama(
        model, ctx_size=0, budget=a.budget, policy="ahakv", sinks=4, recent=32, error_tol=0.05, evict_every=None,
        observe_steps=1, threads=a.threads, n_gpu_layers=0, batch_size=None, reading="plain",
    )  # fmt: skip
    timer = DecodeTimer()
    prof = cProfile.Profile(time.process_time)
    n = 0
    t0, cpu = time.perf_counter(), time.process_time()
    prof.enable()
    for p in prompts(a.requests):
        out = llm.create_completion(p, max_tokens=a.max_tokens, temperature=0)
        n += out["usage"]["completion_tokens"]
    prof.disable()
    report("one at a time", time.perf_counter() - t0, time.process_time() - cpu, timer, n, prof, a.top)


def kernels(a) -> None:
    import numpy as np

    from ahakv_local.engine import Engine, EngineConfig
    from ahakv_local.models import resolve_model

    config = EngineConfig(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=a.threads)
    with Engine(resolve_model(a.model or None), config) as e:
        tokens = e.tokenize(TEXT)
        e.decode(tokens[:128])
        calls = {
            "1 token": (1, False),
            "4 tokens, 1 row of logits": (4, False),
            "4 tokens, 4 rows of logits": (4, True),
            "64-token prompt chunk, 1 row": (64, False),
        }
        for label, (n, rows) in calls.items():
            times = []
            for _ in range(7):
                t0 = time.process_time()
                e.decode(tokens[200 : 200 + n], rows)
                times.append(time.process_time() - t0)
                e.truncate(128)
            print(f"| {label} | {1000 * float(np.median(times)):.1f} |")


def prefill_together(controllers, prompts, chunk: int) -> None:
    """Each controller's ``prefill`` (unguided), all sequences' k-th chunks in one llama_decode."""
    from ahakv_local.native import TapFlag

    e, done = controllers[0].engine, [0] * len(prompts)
    while idx := [i for i, p in enumerate(prompts) if done[i] < len(p)]:
        pieces = {i: prompts[i][done[i] : done[i] + chunk] for i in idx}
        plan = {i: (controllers[i]._before_decode(len(pieces[i]), True), controllers[i].engine.n_past) for i in idx}
        union, window = TapFlag(0), controllers[idx[0]].policy.window
        for flags, _ in plan.values():
            union |= flags
        e.set_tap(union, window)
        rows = []
        for i in idx:
            v = controllers[i].engine
            rows += [(t, v.n_past + j, v.seq, j == len(pieces[i]) - 1) for j, t in enumerate(pieces[i])]
        e._fill(rows)
        e._run_batch()
        for i in idx:
            c = controllers[i]
            c.engine.n_past += len(pieces[i])
            done[i] += len(pieces[i])
            c._tap = (plan[i][0], window)
            c._after_decode(plan[i][1], plan[i][0], True)
            c.evict()


def prompts_run(a) -> None:
    from ahakv_local.engine import Engine, EngineConfig
    from ahakv_local.models import resolve_model
    from ahakv_local.parallel import SequencePool
    from ahakv_local.session import SessionSpec

    spec = SessionSpec.bounded("ahakv", a.budget, reading="plain")
    cells = SequencePool.context_cells(spec.budget, a.parallel, 64, 0) + (a.parallel - 1) * 64  # a chunk each
    config = EngineConfig(n_ctx=cells, n_batch=64 * a.parallel, n_ubatch=64, n_seq=a.parallel, n_threads=a.threads)
    with Engine(resolve_model(a.model or None), config) as e:
        ctls = SequencePool(e, spec).controllers
        texts = [e.tokenize(p) for p in prompts(a.parallel)]
        times: dict[str, list[float]] = {"one after another": [], "together": []}
        for _ in range(3):
            for mode, t in times.items():
                for c in ctls:
                    c.truncate(0)
                t0 = time.process_time()
                if mode == "together":
                    prefill_together(ctls, texts, 64)
                else:
                    for c, p in zip(ctls, texts, strict=True):
                        c.prefill(p, chunk=64)
                t.append(time.process_time() - t0)
        for mode, t in times.items():
            print(f"| {mode} | {' / '.join(f'{x:.2f}' for x in t)} |")


def report(label: str, wall: float, cpu: float, timer: DecodeTimer, n: int, prof: cProfile.Profile, top: int) -> None:
    print(f"## {label}: {wall:.2f} s wall, {cpu:.2f} s CPU, {n} completion tokens, {n / wall:.1f} t/s")
    print(f"llama_decode {timer.seconds:.2f} CPU s ({100 * timer.seconds / cpu:.0f}%) in {timer.calls} calls, "
          f"{timer.tokens} tokens; the rest {cpu - timer.seconds:.2f} CPU s")  # fmt: skip
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(r"engine.py.*\((decode|decode_batch)\)")  # prompts / steps
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--serial", action="store_true", help="profile the one-at-a-time server's path instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kernels", action="store_true", help="CPU ms of the decode calls the servers are made of")
    ap.add_argument("--prompts", action="store_true", help="prompts read one after another vs together")
    a = ap.parse_args()
    if a.kernels:
        kernels(a)
    elif a.prompts:
        prompts_run(a)
    else:
        (run_serial if a.serial else run_parallel)(a)


if __name__ == "__main__":
    main()
