from dataclasses import dataclass

import numpy as np

from .base import Observation, Policy


@dataclass
class Full(Policy):
    """No eviction: the reference every other policy is measured against."""

    name = "full"
    evicts = False

    def score(self, obs: Observation) -> np.ndarray:
        return np.full(obs.n, np.inf)
