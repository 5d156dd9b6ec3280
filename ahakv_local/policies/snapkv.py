from dataclasses import dataclass, field

import numpy as np

from ..native import TapFlag
from .base import Observation, Policy, RecentSum, avg_pool, holistic_sum


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., NeurIPS 2024): attention of the last ``w`` queries (the observation
    window), average-pooled along positions with kernel ``k`` so that neighbours of important
    tokens survive too. Built for prompt compression; in decode the window slides over the last
    w generated queries."""

    name = "snapkv"
    needs = TapFlag.ATTN
    window = 32
    accumulates = True
    reads_with_query = True  # SnapKV's own setting: the question is the observation window
    ranges = {"w": (1, None), "kernel": (1, None)}
    w: int = 32
    kernel: int = 7
    recent: RecentSum = field(init=False)

    def __post_init__(self) -> None:
        self.recent = RecentSum(self.w)

    def observe(self, obs: Observation) -> None:
        self.recent.push(obs.positions, holistic_sum(obs.attn, obs.visible), obs.n_rows)

    def truncate(self, n: int) -> None:
        self.recent.truncate(n)

    def score(self, obs: Observation) -> np.ndarray:
        return avg_pool(self.recent.get(obs.positions), self.kernel)

    def query_score(self, obs: Observation) -> np.ndarray:
        return avg_pool(super().query_score(obs), self.kernel)
