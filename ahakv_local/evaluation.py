"""Streaming perplexity with a bounded cache (the StreamingLLM protocol, positions kept).

The first ``prefix`` tokens go through the controller's chunked prefill (their NLL is scored from the
chunk's logits); every later token is decoded alone, scored from the previous step's logits, and
the cache is brought back to the budget after every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .controller import Budget, ControllerConfig, KVController
from .engine import Engine, EngineConfig
from .policies import make_policy


@dataclass
class PplResult:
    policy: str
    budget: str
    tokens: int
    ppl: float
    max_cells: int
    seconds: float
    params: dict = field(default_factory=dict)


def token_nll(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64) - logits.max()
    return float(np.log(np.exp(z).sum()) - z[target])


def streaming_perplexity(
    model: Path,
    tokens: list[int],
    policy: str,
    budget: str | int,
    prefix: int = 128,
    n_ubatch: int = 64,
    n_sink: int = 4,
    n_recent: int = 32,
    **policy_params,
) -> PplResult:
    b = Budget.parse(budget)
    n_ctx = len(tokens) + n_ubatch + 16 if policy == "full" or b.mode != "cells" else int(b.value) + 2 * n_ubatch
    config = EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch)
    t0 = time.perf_counter()
    with Engine(model, config) as engine:
        ctl = KVController(engine, make_policy(policy, **policy_params), ControllerConfig(b, n_sink, n_recent))
        rows = ctl.prefill(tokens[:prefix], all_logits=True)
        nll = [token_nll(row, t) for row, t in zip(rows[:-1], tokens[1:prefix], strict=True)]
        logits, peak = rows[-1], ctl.live.size
        for tok in tokens[prefix:]:
            nll.append(token_nll(logits, tok))
            logits = ctl.step(tok)
            peak = max(peak, ctl.live.size)
    return PplResult(
        policy, str(b), len(tokens), float(np.exp(np.mean(nll))), peak, time.perf_counter() - t0, policy_params
    )
