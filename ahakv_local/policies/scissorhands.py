from dataclasses import dataclass, field

import numpy as np

from ..native import TapFlag
from .base import Observation, Policy, RecentSum, holistic_sum


@dataclass
class Scissorhands(Policy):
    """Scissorhands (Liu et al., NeurIPS 2023): persistence of importance.

    At every step a token is important to a head when its attention is at least uniform, a >= 1/t
    (t = tokens that head's layer can see). The score is the fraction of the last ``history`` steps
    in which it was important (averaged over heads and layers); the least persistent goes first."""

    name = "scissorhands"
    needs = TapFlag.ATTN
    window = 1  # one query per step, like a decode step
    ranges = {"history": (1, None)}
    history: int = 400
    hits: RecentSum = field(init=False)
    present: RecentSum = field(init=False)

    def __post_init__(self) -> None:
        self.hits = RecentSum(self.history)
        self.present = RecentSum(self.history)

    def observe(self, obs: Observation) -> None:
        t = np.maximum(obs.visible.sum(axis=1), 1)[:, None, None]  # [L, 1, 1]
        important = (obs.attn >= 1.0 / t).astype(np.float64)
        self.hits.push(obs.positions, holistic_sum(important, obs.visible))
        self.present.push(obs.positions, np.ones(obs.n))

    def truncate(self, n: int) -> None:
        self.hits.truncate(n)
        self.present.truncate(n)

    def score(self, obs: Observation) -> np.ndarray:
        seen = self.present.get(obs.positions)
        return np.divide(self.hits.get(obs.positions), seen, out=np.ones(obs.n), where=seen > 0)
