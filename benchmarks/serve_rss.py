"""The one-at-a-time server's resident memory over many requests: `ahakv-local serve` on the default model, then
``--requests`` completions of ~600 tokens of GPL-3 each (a different stretch each time, 8 tokens greedy), every other
one with its own kv_budget; VmRSS, threads and open files of the server process every ``--every`` requests.
Compare two checkouts run after run (``PYTHONPATH=../before``: the server runs what this script imports).

    AHAKV_THREADS=2 python benchmarks/serve_rss.py --requests 120
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ahakv_local.models import default_model_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, body: dict) -> int:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status


def figures(pid: int) -> tuple[int, int, int]:
    """(VmRSS in MiB, threads, open files) of process ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) // 1024, int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--budget", default="256")
    args = ap.parse_args()
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ahakv_local", "serve", str(default_model_path()), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--budget", args.budget], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:  # until /health answers (the model loads in a few seconds)
            try:
                urllib.request.urlopen(base + "/health", timeout=2).close()
                break
            except (OSError, urllib.error.URLError):
                if proc.poll() is not None:
                    sys.exit("the server exited")
                time.sleep(0.5)
        print(f"requests  RSS MiB  threads  open files   ({' '.join(cmd[1:])} --budget {args.budget})")
        print(f"{0:8d}  {figures(proc.pid)[0]:7d}  {figures(proc.pid)[1]:7d}  {figures(proc.pid)[2]:10d}")
        t0 = time.perf_counter()
        for i in range(args.requests):
            start = (i * 997) % 20000
            body = {"prompt": text[start : start + 2500], "max_tokens": 8, "temperature": 0}
            if i % 2:
                body["kv_budget"] = min(128, int(args.budget))  # its own budget, within the server's (--budget 64)
            post(base, body)
            if (i + 1) % args.every == 0:
                rss, threads, files = figures(proc.pid)
                print(f"{i + 1:8d}  {rss:7d}  {threads:7d}  {files:10d}", flush=True)
        print(f"{args.requests} requests in {time.perf_counter() - t0:.0f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
