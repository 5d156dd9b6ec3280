"""Why tests/test_rpc.py compares RPC workers with a local run that does not repack weights.

Starts two loopback workers (`ahakv-local rpc-server`), decodes the first N tokens of a text with every layer
on them, and locally with llama.cpp's weight repacking on (its default) and off; prints the largest logit
difference of each pair. Needs an engine built with `ahakv-local build --rpc`.

    python benchmarks/rpc_repack.py [--model PATH] [--tokens 100] [--text FILE]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import numpy as np

from ahakv_local import rpc
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.models import resolve_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    args = ap.parse_args()
    model = resolve_model(args.model)
    text = open(args.text, encoding="utf-8").read()
    ports = [free_port(), free_port()]
    cmd = [sys.executable, "-m", "ahakv_local", "rpc-server", "-t", "1", "--port"]
    workers = [subprocess.Popen([*cmd, str(p)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for p in ports]
    servers = tuple(f"127.0.0.1:{p}" for p in ports)
    try:
        for ep in servers:
            for _ in range(300):
                try:
                    rpc.check_worker(ep, timeout=2)
                    break
                except AhakvError:
                    time.sleep(0.2)

        def logits(**kw) -> np.ndarray:
            n = args.tokens
            with Engine(model, EngineConfig(n_ctx=max(256, n), n_batch=n, n_ubatch=n, **kw)) as e:
                return e.decode(e.tokenize(text)[:n], all_logits=True)

        remote, plain, packed = logits(rpc_servers=servers), logits(repack_weights=False), logits()
    finally:
        for w in workers:
            w.terminate()
            w.wait()
    print(f"{model.name}, {args.tokens} tokens, max |logit difference|:")
    print(f"  RPC workers vs local, repacking off: {np.abs(remote - plain).max():.4g}")
    print(f"  RPC workers vs local, repacking on:  {np.abs(remote - packed).max():.4g}")
    print(f"  local repacking off vs on:           {np.abs(plain - packed).max():.4g}")


if __name__ == "__main__":
    main()
