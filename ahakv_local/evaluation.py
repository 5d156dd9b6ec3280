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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .controller import Budget, ControllerConfig, KVController, default_evict_every
from .engine import Engine, EngineConfig
from .policies import make_policy

CONTROLLER_KEYS = ("evict_every", "observe_steps")  # config params that go to the controller, not the policy


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


def _log_softmax32(logits: np.ndarray) -> np.ndarray:
    """log_softmax of float32 rows in place (262K-entry rows: no float64 copies; the sums are
    float32-exact to ~1e-6 relative, far below the differences measured)."""
    logits -= logits.max(axis=1, keepdims=True)
    logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return logits


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
    step: int = 1,
) -> _Run:
    unbounded = policy == "full" or budget.mode != "cells"
    n_ctx = n_tokens + n_ubatch + 16 if unbounded else int(budget.value) + 2 * n_ubatch
    engine = Engine(model, EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch))
    kw = dict(params)
    # the product's schedule when stepping token by token; in steps of several tokens, an eviction
    # after each that leaves room for the next, so no step ever holds more than the budget
    every = step if step > 1 else default_evict_every(budget, n_sink, n_recent)
    schedule = {"evict_every": every, "observe_steps": 1}
    schedule |= {k: kw.pop(k) for k in CONTROLLER_KEYS if k in kw}  # the rest configure the policy
    ctl = KVController(engine, make_policy(policy, **kw), ControllerConfig(budget, n_sink, n_recent, **schedule))
    return _Run(label, policy, budget, params, engine, ctl)


def evaluate(
    model: Path,
    tokens: list[int],
    configs: list[tuple[str, str, str | int, dict]],
    prefix: int = 128,
    n_ubatch: int = 64,
    n_sink: int = 4,
    n_recent: int = 32,
    step: int = 1,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, PplResult]:
    """Streaming perplexity, KL from the full cache and top-1 agreement for each (label, policy, budget,
    params), plus the full cache itself under the label "full".

    After the prefix, tokens go in ``step`` at a time (1: token by token through ``KVController.step``;
    more: one decode call per step, every row scored, the cache brought back to the budget after
    each, so it never holds more than budget + step cells)."""
    if not 1 <= step <= n_ubatch:
        raise ValueError(f"step must be between 1 and n_ubatch ({n_ubatch})")
    full = Budget("cells", 10**9)
    runs = [_open(model, len(tokens), "full", full, n_ubatch, n_sink, n_recent, {}, "full", step)]
    runs += [
        _open(model, len(tokens), p, Budget.parse(b), n_ubatch, n_sink, n_recent, kw, label, step)
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
        for start in range(prefix, len(tokens), step):  # then all configurations in lockstep
            chunk = tokens[start : start + step]
            for i, run in enumerate(runs):
                t0 = time.perf_counter()
                if step == 1:
                    rows = run.ctl.step(chunk[0])[None]
                else:
                    rows = run.ctl.prefill(chunk, all_logits=True, chunk=step)
                run.seconds += time.perf_counter() - t0
                run.peak = max(run.peak, run.ctl.live.size)
                # the logits that predicted this chunk: the previous call's last row, then this call's
                logp = _log_softmax32(np.concatenate([last[i][None], rows[:-1]]))
                last[i] = rows[-1]
                run.nll += (-logp[np.arange(len(chunk)), chunk]).astype(np.float64).tolist()
                if i == 0:
                    reference, p_ref = logp, np.exp(logp)
                    # KL(p || q) = sum p log p - sum p log q: the first term once per chunk
                    entropy_term = np.einsum("ij,ij->i", p_ref, reference, dtype=np.float64)
                    top_ref = np.argmax(reference, axis=1)
                else:
                    run.kl += (entropy_term - np.einsum("ij,ij->i", p_ref, logp, dtype=np.float64)).tolist()
                    run.top1 += (np.argmax(logp, axis=1) == top_ref).tolist()
            progress(min(start + step, len(tokens)), len(tokens))
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
