"""The budget: how much of a sequence's KV cache to keep, and how many cells that takes.

This module is the one owner of budgets: their grammar (``Budget.parse``), their meaning at a given
length (``Budget.target``), the one spelling of "no eviction" (``NO_EVICTION``), the one rule for how
many KV cells a bounded sequence allocates (``cells_for``) and the default eviction schedule. The
controller enforces a budget (``KVController.set_budget``); nothing else parses or sizes one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .errors import AhakvError


@dataclass(frozen=True)
class Budget:
    """How many cells to keep: a fixed count, a fraction of the tokens seen, ``auto`` (decided by the
    policy's error model), or ``none`` (keep everything: ``NO_EVICTION``)."""

    mode: Literal["cells", "ratio", "auto", "none"]
    value: float = 0.0
    min_ratio: float = 0.10  # auto: never keep less than this fraction of the tokens seen
    max_ratio: float = 0.40  # auto: never keep more
    error_tol: float = 0.05  # auto: evict while the predicted relative output change stays below this

    @classmethod
    def parse(cls, text: str | int | float, **kw) -> Budget:
        """'128' -> 128 cells, '0.25' or '25%' -> a quarter of the tokens seen, 'auto' -> error-driven.
        The one parser of budgets; anything else (0, 0%, 100%, inf, nan, 1.5, -3) is an AhakvError."""
        s = str(text).strip().lower()
        if s == "auto":
            return cls("auto", **kw)
        percent = s.endswith("%")
        try:
            v = float(s[:-1] if percent else s)
        except ValueError:
            raise AhakvError(f"budget must be a cell count, a ratio (0.25 or 25%) or 'auto', not {text!r}") from None
        if percent:
            v /= 100
            if not 0 < v < 1:
                raise AhakvError(f"a budget in percent must be above 0% and below 100%, not {text!r}")
            return cls("ratio", v, **kw)
        if math.isfinite(v) and v >= 1 and v == int(v):
            return cls("cells", int(v), **kw)
        if 0 < v < 1:
            return cls("ratio", v, **kw)
        raise AhakvError(f"budget must be a positive whole number of cells or a ratio in (0, 1), not {text!r}")

    @property
    def evicts(self) -> bool:
        return self.mode != "none"

    def target(self, n_seen: int) -> int | None:
        """Cells to keep after ``n_seen`` tokens; None where the error model decides (auto) or nothing
        is evicted (none)."""
        if self.mode == "cells":
            return int(self.value)
        if self.mode == "ratio":
            return max(1, math.ceil(self.value * n_seen))
        return None

    def compression(self, n_seen: int) -> float:
        """Tokens seen per cell kept (1.0 for the full cache; auto: unknown before it runs, also 1.0)."""
        target = self.target(n_seen)
        return n_seen / target if target else 1.0

    def __str__(self) -> str:
        if self.mode == "cells":
            return f"{int(self.value)} cells"
        if self.mode == "ratio":
            return f"{100 * self.value:g}%"
        return "auto" if self.mode == "auto" else "full cache"


NO_EVICTION = Budget("none")  # the full cache: every position is kept


QUERY_TOKENS = 128  # at most this many tokens of a question guide the reading of a long prompt
REPEAT_TOKENS = 32  # room for the repetition prompt of a question-agnostic (reconstruction) reading


def guide_room(reading: str, chunk: int) -> int:
    """Cells a guided reading needs on top: the question (or a repetition prompt and the chunk again)
    is decoded behind each chunk before the compression."""
    return {"query": QUERY_TOKENS, "reconstruct": REPEAT_TOKENS + chunk}.get(reading, 0)


def cells_for(budget: Budget, chunk: int, longest: int, room: int = 0) -> int:
    """KV cells to allocate for a sequence under ``budget`` that is read ``chunk`` tokens at a time and is
    at most ``longest`` tokens long: a cell budget needs itself, one chunk on top (the cache is compressed
    after each chunk), the newest token and the ``room`` a guided reading decodes behind a chunk
    (``guide_room``); any other budget can need every position (capped by ``longest``: a ratio of the
    whole, or an error model, or no eviction)."""
    if budget.mode == "cells":
        return int(budget.value) + chunk + 1 + room
    return longest + room


def default_evict_every(budget: Budget, n_sink: int = 4, n_recent: int = 32) -> int:
    """The eviction period the product uses: 32 decode steps, observed on the last one (tapping every
    step costs a third of the decode speed; see benchmarks/RESULTS.md), shorter for a budget too
    small to leave that much room; every step for ratio and auto budgets."""
    if budget.mode != "cells":
        return 1
    return max(1, min(32, (int(budget.value) - n_sink - n_recent) // 4))


def parse_schedule(evict_every: int | None, observe_steps: int) -> tuple[int | None, int | None]:
    """The command-line form (--evict-every N or default, --observe-steps N with 0 = every step) checked and
    turned into the controller's (None = the product's default period; None = observe every step)."""
    if (evict_every is not None and evict_every < 1) or observe_steps < 0:
        raise AhakvError("--evict-every must be at least 1 and --observe-steps at least 0")
    return evict_every, observe_steps or None
