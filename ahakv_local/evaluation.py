"""Streaming evaluation with a bounded cache (the StreamingLLM protocol, positions kept).

The first ``prefix`` tokens go through the controller's chunked prefill (their NLL is scored from the
chunk's logits); every later token is decoded alone, scored from the previous step's logits, and
the cache is brought back to the budget after every step.

``evaluate`` runs a full-cache reference and every (policy, budget) run in lockstep, one token at a
time, so each step's next-token distribution is compared with the full cache's exactly (KL divergence
and top-1 agreement) without storing vocabulary-sized rows.
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
    kl: float = 0.0  # mean KL(full || this) per scored token, nats
    top1: float = 1.0  # fraction of steps whose argmax equals the full cache's


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, target: int) -> float:
    return float(-log_softmax(logits)[target])


@dataclass
class _Run:
    """One configuration being evaluated: its engine, controller and running sums."""

    label: str
    policy: str
    budget: Budget
    params: dict
    engine: Engine
    ctl: KVController
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    peak: int = 0
    seconds: float = 0.0

    def result(self, n_tokens: int) -> PplResult:
        return PplResult(
            self.policy,
            str(self.budget),
            n_tokens,
            float(np.exp(np.mean(self.nll))),
            self.peak,
            self.seconds,
            self.params,
            float(np.mean(self.kl)) if self.kl else 0.0,
            float(np.mean(self.top1)) if self.top1 else 1.0,
        )


def _open(
    model: Path,
    n_tokens: int,
    policy: str,
    budget: Budget,
    n_ubatch: int,
    n_sink: int,
    n_recent: int,
    params: dict,
    label: str,
) -> _Run:
    unbounded = policy == "full" or budget.mode != "cells"
    n_ctx = n_tokens + n_ubatch + 16 if unbounded else int(budget.value) + 2 * n_ubatch
    engine = Engine(model, EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch))
    ctl = KVController(engine, make_policy(policy, **params), ControllerConfig(budget, n_sink, n_recent))
    return _Run(label, policy, budget, params, engine, ctl)


def evaluate(
    model: Path,
    tokens: list[int],
    configs: list[tuple[str, str, str | int, dict]],
    prefix: int = 128,
    n_ubatch: int = 64,
    n_sink: int = 4,
    n_recent: int = 32,
) -> dict[str, PplResult]:
    """Streaming perplexity, KL from the full cache and top-1 agreement for each (label, policy, budget,
    params), plus the full cache itself under the label "full"."""
    runs = [_open(model, len(tokens), "full", Budget("cells", 10**9), n_ubatch, n_sink, n_recent, {}, "full")]
    runs += [
        _open(model, len(tokens), p, Budget.parse(b), n_ubatch, n_sink, n_recent, kw, label)
        for label, p, b, kw in configs
    ]
    try:
        last: list[np.ndarray] = []
        for run in runs:  # the prefix, in chunks
            t0 = time.perf_counter()
            rows = run.ctl.prefill(tokens[:prefix], all_logits=True)
            run.seconds += time.perf_counter() - t0
            run.nll += [token_nll(row, t) for row, t in zip(rows[:-1], tokens[1:prefix], strict=True)]
            run.peak = run.ctl.live.size
            last.append(rows[-1])
        for tok in tokens[prefix:]:  # then one token at a time, all configurations in lockstep
            reference = log_softmax(last[0])
            for i, run in enumerate(runs):
                logp = reference if i == 0 else log_softmax(last[i])
                run.nll.append(float(-logp[tok]))
                if i:
                    p = np.exp(reference)
                    run.kl.append(float(np.sum(p * (reference - logp))))
                    run.top1.append(bool(np.argmax(logp) == np.argmax(reference)))
                t0 = time.perf_counter()
                last[i] = run.ctl.step(tok)
                run.seconds += time.perf_counter() - t0
                run.peak = max(run.peak, run.ctl.live.size)
        return {run.label: run.result(len(tokens)) for run in runs}
    finally:
        for run in runs:
            run.engine.close()


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
    """One configuration alone (no reference run): perplexity and the peak cell count."""
    b = Budget.parse(budget)
    run = _open(model, len(tokens), policy, b, n_ubatch, n_sink, n_recent, policy_params, policy)
    try:
        t0 = time.perf_counter()
        rows = run.ctl.prefill(tokens[:prefix], all_logits=True)
        run.nll += [token_nll(row, t) for row, t in zip(rows[:-1], tokens[1:prefix], strict=True)]
        logits, run.peak = rows[-1], run.ctl.live.size
        for tok in tokens[prefix:]:
            run.nll.append(token_nll(logits, tok))
            logits = run.ctl.step(tok)
            run.peak = max(run.peak, run.ctl.live.size)
        run.seconds = time.perf_counter() - t0
        return run.result(len(tokens))
    finally:
        run.engine.close()
