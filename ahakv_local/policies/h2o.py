from dataclasses import dataclass, field

import numpy as np

from ..native import TapFlag
from .base import ByPosition, Observation, Policy, holistic_sum


@dataclass
class H2O(Policy):
    """H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

    Score: attention accumulated over every query since the token arrived (prompt rows included).
    Budget split (``split``): H2O evicts a token a step and holds heavy hitters and recent tokens half and
    half. Evicting every E steps, an eviction leaves E - 1 cells free for the steps to come, so one of
    the halves is short by them between evictions:
    - "eviction" (the default): each eviction keeps the most recent ``recent_ratio`` of the budget and
      the heavy hitters in what is left (at 128 cells evicting every 32: 64 recent, 33 heavy hitters);
    - "peak": each eviction keeps 1 - ``recent_ratio`` of the budget as heavy hitters and the recent
      tokens in what is left, the split H2O holds when the cache is back at the budget (64 and 33).
    On 1,536 tokens of GPL-3 at 128 cells, evicting every 32 steps, "peak" read perplexity 22.97 where
    "eviction" read 21.70 (``benchmarks/h2o_split.py``), so the baseline keeps the stronger one.
    H2O keeps a set per head; llama.cpp's cells are shared, so the per-head sums are averaged over the
    heads and layers that see the token (SpAtten-style)."""

    name = "h2o"
    needs = TapFlag.ATTN
    window = 0  # every prompt row counts
    accumulates = True
    ranges = {"recent_ratio": (0, 1)}
    recent_ratio: float = 0.5
    split: str = "eviction"  # or "peak" (above)
    acc: ByPosition = field(default_factory=ByPosition, init=False)

    def __post_init__(self) -> None:
        if self.split not in ("eviction", "peak"):
            raise ValueError(f"h2o's split is 'eviction' or 'peak', not {self.split!r}")

    def observe(self, obs: Observation) -> None:
        self.acc.add(obs.positions, holistic_sum(obs.attn, obs.visible))

    def truncate(self, n: int) -> None:
        self.acc.truncate(n)

    def score(self, obs: Observation) -> np.ndarray:
        s = self.acc.get(obs.positions).copy()
        if self.split == "peak":  # the heavy hitters' share of the budget; the recent tokens in what the eviction keeps
            n_recent = max(0, obs.budget - obs.room - int((1 - self.recent_ratio) * obs.budget))
        else:
            n_recent = int(self.recent_ratio * obs.budget)
        if n_recent:
            s[-n_recent:] = np.inf
        return s
