"""``ahakv_local.Llama``: llama-cpp-python's ``Llama`` with a bounded KV cache.

Without ``kv_budget`` it *is* llama_cpp.Llama (same code path, same errors). With one:

- the KV buffer holds ``budget + n_batch + 1`` cells (llama.cpp pads to 256), however
  long the text: positions run up to the model's trained context, far past the cells, so
  ``n_ctx()`` reports the trained context and completions are bounded by it;
- ``eval`` decodes through the eviction controller (prompt in n_ubatch chunks, compressed after
  each; then one token at a time, evicting every ``kv_evict_every`` steps - 32 by default - after
  observing the last ``kv_observe_steps``), keeping the cache at the budget at every step;
- prefix reuse stays honest: a prompt that extends the whole cached sequence continues it; any other
  is read from the start with a fresh policy (the cache may have holes, and the policy's statistics
  cannot be rewound), so the same request always gets the same answer. With
  ``kv_reuse_compressed=True`` (what the chat uses) the compressed history is reused on purpose;
- the token-keyed state cache (``set_cache``) is refused: it would hand back lossy states as exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import llama_cpp
import numpy as np

from .controller import Budget, ControllerConfig, ControllerStats, KVController, default_evict_every
from .engine import Engine
from .errors import AhakvError
from .policies import make_policy


@dataclass
class KVStats:
    cells_used: int
    budget: int | None
    tokens_seen: int
    evicted: int
    retention_ratio: float
    kv_cells: int
    kv_bytes: int
    prompt_tokens: int
    prompt_tps: float
    generated_tokens: int
    generation_tps: float

    def as_dict(self) -> dict:
        return asdict(self)


class Llama(llama_cpp.Llama):
    def __init__(
        self,
        model_path: str,
        *,
        kv_budget: int | float | str | None = None,
        kv_policy: str = "ahakv",
        kv_sinks: int = 4,
        kv_recent: int = 32,
        kv_error_tol: float = 0.05,
        kv_min_ratio: float = 0.10,
        kv_max_ratio: float = 0.40,
        kv_evict_every: int | None = None,
        kv_observe_steps: int | None = 1,
        kv_pinned: tuple[int, int] | None = None,
        kv_reuse_compressed: bool = False,
        n_ctx: int = 512,
        n_batch: int = 512,
        **kwargs,
    ):
        self._kv: KVController | None = None
        self._timing = {"prompt_tokens": 0, "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0}
        if kv_budget is None:
            super().__init__(model_path, n_ctx=n_ctx, n_batch=n_batch, **kwargs)
            self._kv_engine = Engine.attach(self)
            return

        budget = Budget.parse(kv_budget, min_ratio=kv_min_ratio, max_ratio=kv_max_ratio, error_tol=kv_error_tol)
        policy = make_policy(kv_policy)  # an unknown name fails before the model loads
        if kwargs.get("logits_all"):
            raise AhakvError("logits_all keeps a row of logits per position; it cannot be combined with kv_budget")
        n_batch = min(n_batch, n_ctx) if budget.mode != "cells" else n_batch
        if kv_evict_every is None:
            kv_evict_every = default_evict_every(budget, kv_sinks, kv_recent)
        # cells: the budget plus one prompt chunk; ratio/auto: the caller's n_ctx bounds the cells
        cells = int(budget.value) + n_batch + 1 if budget.mode == "cells" else n_ctx
        super().__init__(model_path, n_ctx=cells, n_batch=n_batch, **kwargs)

        engine = Engine.attach(self)
        self._kv_engine = engine
        config = ControllerConfig(
            budget, kv_sinks, kv_recent, kv_evict_every, kv_pinned, observe_steps=kv_observe_steps
        )
        self._kv = KVController(engine, policy, config)
        self._kv_reuse_compressed = kv_reuse_compressed
        # positions, not cells, bound a sequence now: re-size llama-cpp-python's per-position arrays
        self._n_ctx = engine.n_ctx_train
        self.input_ids = np.zeros(self._n_ctx, dtype=np.intc)

    # -- what changes with a budget ---------------------------------------------------------------

    @property
    def kv_controller(self) -> KVController | None:
        return self._kv

    def n_ctx(self) -> int:
        """Without a budget: the context size. With one: the model's trained context, the bound on
        positions (the KV cells stay at the budget; see ``kv_stats``)."""
        return self._n_ctx if self._kv is not None else super().n_ctx()

    def set_cache(self, cache) -> None:
        if self._kv is not None and cache is not None:
            raise ValueError(
                "a token-keyed state cache would return compressed states as exact ones: not available with kv_budget"
            )
        super().set_cache(cache)

    def eval(self, tokens: Sequence[int]):
        if self._kv is None:
            t0 = time.perf_counter()
            super().eval(tokens)
            self._count(len(tokens), time.perf_counter() - t0)
            return
        if self.n_tokens + len(tokens) > self._n_ctx:
            raise ValueError(
                f"Requested tokens ({self.n_tokens + len(tokens)}) exceed the model's trained "
                f"context of {self._n_ctx} positions"
            )
        kv = self._kv
        kv.truncate(self.n_tokens)  # positions >= n_tokens are being replaced
        tokens = list(tokens)
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i : i + self.n_batch]
            t0 = time.perf_counter()
            if len(chunk) == 1:
                kv.step(chunk[0])
            else:
                kv.prefill(chunk)
            self._count(len(chunk), time.perf_counter() - t0)
            self.input_ids[self.n_tokens : self.n_tokens + len(chunk)] = chunk
            self.n_tokens += len(chunk)
            self._requires_eval = False

    def generate(self, tokens: Sequence[int], *args, **kwargs):
        if self._kv is not None and not self._kv_reuse_compressed and self._needs_rewind(tokens):
            # llama-cpp-python would rewind to the longest matching prefix and reuse it as if intact. The
            # cached values may have holes, and the policy's statistics include queries that a rewind
            # removes and cannot be taken back: read the prompt from the start with a fresh policy, so
            # the same request meets the same evictions and gets the same answer
            self.n_tokens = 0
            self._requires_eval = True
        return super().generate(tokens, *args, **kwargs)

    def _needs_rewind(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` fails to extend the whole cached sequence (llama-cpp-python would rewind)."""
        n = self.n_tokens
        return n > 0 and (len(tokens) <= n or list(self._input_ids[:n]) != list(tokens[:n]))

    def reset(self):
        super().reset()
        if self._kv is not None:
            self._kv.truncate(0)

    def load_state(self, state) -> None:
        super().load_state(state)
        if self._kv is not None:
            self._kv_engine.n_past = self.n_tokens
            self._kv.resync()

    # -- resources --------------------------------------------------------------------------------

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # frees the context and the model now, not at garbage collection

    # -- statistics -------------------------------------------------------------------------------

    def _count(self, n: int, seconds: float) -> None:
        kind = "gen" if n == 1 else "prompt"
        self._timing[f"{kind}_tokens"] += n
        self._timing[f"{kind}_s"] += seconds

    def reset_timings(self) -> None:
        self._timing = dict.fromkeys(self._timing, 0)

    def kv_stats(self) -> KVStats:
        """Cells used and budget, tokens seen, evicted, retention, KV buffer, prompt and generation speed."""
        t, engine = self._timing, self._kv_engine
        stats = self._kv.stats if self._kv is not None else ControllerStats(self.n_tokens, None, self.n_tokens)
        return KVStats(
            cells_used=stats.cells_used,
            budget=stats.budget,
            tokens_seen=self.n_tokens,
            evicted=stats.evicted,
            retention_ratio=stats.cells_used / self.n_tokens if self.n_tokens else 1.0,
            kv_cells=engine.n_cells(),
            kv_bytes=engine.kv_bytes(),
            prompt_tokens=t["prompt_tokens"],
            prompt_tps=t["prompt_tokens"] / t["prompt_s"] if t["prompt_s"] else 0.0,
            generated_tokens=t["gen_tokens"],
            generation_tps=t["gen_tokens"] / t["gen_s"] if t["gen_s"] else 0.0,
        )
