"""Throughput of `ahakv-local serve --parallel N` against the one-at-a-time server, on the same 8 concurrent requests.

Both servers run at once, each as its own process (Gemma 3 270M by default, a cell budget, AhaKV); 8 completion
requests (GPL-3 excerpts, greedy, ``max_tokens`` each, ``ignore`` of end tokens is not available, so the prompts are
text the model continues) are sent at once to one server, then to the other, ``--rounds`` times, the order
alternating each round, so that a change in the machine's load meets both alike. Reported per server: wall time of
a round, completion tokens/s over all requests, mean and max per-request latency, the server process's CPU seconds
per round (user + system: with one thread, the work itself, which the load of a shared machine stretches far less
than wall time), and the ratios parallel / one-at-a-time. Prints a markdown table and the command that made it.

    python benchmarks/serve_parallel.py [MODEL] [--parallel 4] [--requests 8] [--max-tokens 64] [--budget 128]
                                        [--threads 1] [--rounds 2]

``--engine POLICY`` measures one layer down instead, in one process: ``--parallel`` sequences of one context
after a 150-token prompt each, ``--max-tokens`` decode steps of all of them in one llama_decode each
(``step_batch``) against the same steps taken one sequence at a time (``KVController.step``), interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()


def prompts(n: int) -> list[str]:
    """The workload's n prompts: GPL-3 excerpts of 150 words, 200 words apart."""
    words = TEXT.split()
    return [" ".join(words[200 * i : 200 * i + 150]) for i in range(n)]


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's options (profile_parallel.py measures the same one)."""
    ap.add_argument("model", nargs="?", default="")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", default="128")
    # one thread: llama.cpp's threads spin at every graph node's barrier, which on 2 cores shared with other work
    # costs more than the batch saves (measured: AhaKV batched 0.66x of single steps with 2 threads at load 9-11,
    # 1.43x with 1 thread)
    ap.add_argument("--threads", type=int, default=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ahakv_local", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    if model:
        cmd.insert(4, model)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server exited: {proc.stderr.read().decode()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return proc, base
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start")


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.load(r)


def one_round(base: str, n: int, max_tokens: int) -> tuple[float, int, list[float]]:
    """(wall seconds, completion tokens, per-request latencies) of n requests sent at once."""
    texts = prompts(n)
    out: list = [None] * n

    def send(i: int) -> None:
        t0 = time.perf_counter()
        body = post(base, {"prompt": texts[i], "max_tokens": max_tokens, "temperature": 0})
        out[i] = (time.perf_counter() - t0, body["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(k for _, k in out), [s for s, _ in out]


def engine_run(a) -> None:
    import numpy as np

    from ahakv_local.controller import step_batch
    from ahakv_local.engine import Engine, EngineConfig
    from ahakv_local.models import resolve_model
    from ahakv_local.parallel import SequencePool
    from ahakv_local.session import SessionSpec

    spec = SessionSpec.bounded(a.engine, a.budget)
    cells = SequencePool.context_cells(spec.budget, a.parallel, 64, 0)
    config = EngineConfig(n_ctx=cells, n_batch=64, n_ubatch=64, n_seq=a.parallel, n_threads=a.threads)
    with Engine(resolve_model(a.model or None), config) as e:
        pool = SequencePool(e, spec)
        ctls = pool.controllers
        words = TEXT.split()
        times = {"batched": 0.0, "one at a time": 0.0}
        for _ in range(a.rounds):
            for mode in times:
                tokens = []
                for i, c in enumerate(ctls):
                    c.truncate(0)
                    logits = c.prefill(e.tokenize(" ".join(words[200 * i : 200 * i + 110]))[:150])
                    tokens.append(int(np.argmax(logits)))
                t0 = time.perf_counter()
                for _ in range(a.max_tokens):
                    if mode == "batched":
                        rows = step_batch(ctls, tokens)
                    else:
                        rows = [c.step(t) for c, t in zip(ctls, tokens, strict=True)]
                    tokens = [int(np.argmax(r)) for r in rows]
                times[mode] += time.perf_counter() - t0
    n = a.rounds * a.max_tokens * a.parallel
    print(f"`python benchmarks/serve_parallel.py {' '.join(sys.argv[1:])}` on {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f} at the end\n")  # fmt: skip
    print("| decode | tokens/s |\n|---|---|")
    for mode, t in times.items():
        print(f"| {mode} | {n / t:.1f} |")
    print(f"\nratio: {times['one at a time'] / times['batched']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine", metavar="POLICY", help="measure step_batch against single steps in-process")
    a = ap.parse_args()
    if a.engine:
        engine_run(a)
        return
    common = ["--budget", a.budget, "--threads", str(a.threads), "--reading", "plain"]
    labels = ("one at a time", f"--parallel {a.parallel}")
    servers = {}
    try:
        for label, extra in zip(labels, ([], ["--parallel", str(a.parallel)]), strict=True):
            servers[label] = start(a.model, common + extra)
        for _, base in servers.values():
            one_round(base, 2, 4)  # warm up
        runs: dict[str, list] = {label: [] for label in labels}
        for r in range(a.rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                proc, base = servers[label]
                cpu = cpu_seconds(proc.pid)
                wall, tokens, lat = one_round(base, a.requests, a.max_tokens)
                runs[label].append((wall, tokens, lat, cpu_seconds(proc.pid) - cpu))
                print(f"round {r} {label}: {wall:.1f} s, {tokens} tokens, load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    rows = {}
    for label, rounds in runs.items():
        wall = sum(r[0] for r in rounds)
        tokens = sum(r[1] for r in rounds)
        lat = [x for r in rounds for x in r[2]]
        cpu = sum(r[3] for r in rounds)
        n = a.rounds
        rows[label] = (wall / n, tokens / wall, sum(lat) / len(lat), max(lat), cpu / n, tokens // n)
    (_, serial), (_, par) = rows.items()
    print(f"`python benchmarks/serve_parallel.py {' '.join(sys.argv[1:])}` on {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f} at the end\n")  # fmt: skip
    print("| server | round wall s | completion tokens/s | mean latency s | max latency s | CPU s per round | "
          "tokens per round |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for label, (wall, tps, mean, worst, cpu, n) in rows.items():
        print(f"| {label} | {wall:.1f} | {tps:.1f} | {mean:.1f} | {worst:.1f} | {cpu:.1f} | {n} |")
    print(f"\nthroughput ratio: {par[1] / serial[1]:.2f}x (by CPU seconds: {serial[4] / par[4]:.2f}x); "
          f"mean latency ratio: {par[2] / serial[2]:.2f}x")  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
