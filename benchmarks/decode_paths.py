"""Single-token vs batched decode of the same tokens, full cache, no tap, no eviction.

Shows how far llama.cpp's two matmul paths (one row vs a batch) are apart on a model, which bounds how
closely a token-by-token streamed perplexity can match a one-pass perplexity.

    python benchmarks/decode_paths.py [--model PATH] [--tokens 300] [--prefix 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.evaluation import log_softmax
from ahakv_local.models import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--prefix", type=int, default=64)
    args = ap.parse_args()
    model = resolve_model(args.model)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    with Engine(model, EngineConfig(n_ctx=512, n_batch=512, n_ubatch=512)) as e:
        tokens = e.tokenize(text)[: args.tokens]
        batched = e.decode(tokens, all_logits=True)
    with Engine(model, EngineConfig(n_ctx=512, n_batch=64, n_ubatch=64)) as e:
        rows = list(e.decode(tokens[: args.prefix], all_logits=True)) + [e.decode([t]) for t in tokens[args.prefix :]]
    stepped = np.array(rows)

    def ppl(logits: np.ndarray) -> float:
        return float(np.exp(np.mean([-log_softmax(r)[t] for r, t in zip(logits[:-1], tokens[1:], strict=True)])))

    tail = slice(args.prefix, None)
    rel = np.abs(stepped[tail] - batched[tail]).max(axis=1) / np.abs(batched[tail]).max(axis=1)
    print(f"command: `{' '.join([Path(sys.executable).name, *sys.argv])}`")
    print(f"{model.name}: max relative logit difference {rel.max():.3g} (median {np.median(rel):.3g})")
    print(
        f"perplexity one pass {ppl(batched):.4f}, token by token after {args.prefix} {ppl(stepped):.4f} "
        f"({100 * (ppl(stepped) / ppl(batched) - 1):+.2f}%)"
    )


if __name__ == "__main__":
    main()
