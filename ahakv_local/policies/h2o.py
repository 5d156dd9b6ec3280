from dataclasses import dataclass, field

import numpy as np

from ..native import TapFlag
from .base import ByPosition, Observation, Policy, holistic_sum


@dataclass
class H2O(Policy):
    """H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

    Score: attention accumulated over every query since the token arrived (prompt rows included).
    Budget split: the most recent ``recent_ratio`` of the budget is kept as the local window, the
    rest goes to the heavy hitters. H2O keeps a set per head; llama.cpp's cells are shared, so the
    per-head sums are averaged over the heads and layers that see the token (SpAtten-style)."""

    name = "h2o"
    needs = TapFlag.ATTN
    window = 0  # every prompt row counts
    accumulates = True
    recent_ratio: float = 0.5
    acc: ByPosition = field(default_factory=ByPosition, init=False)

    def observe(self, obs: Observation) -> None:
        self.acc.add(obs.positions, holistic_sum(obs.attn, obs.visible))

    def truncate(self, n: int) -> None:
        self.acc.truncate(n)

    def score(self, obs: Observation) -> np.ndarray:
        s = self.acc.get(obs.positions).copy()
        n_recent = int(self.recent_ratio * obs.budget)
        if n_recent:
            s[-n_recent:] = np.inf
        return s
