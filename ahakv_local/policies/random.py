from dataclasses import dataclass, field

import numpy as np

from .base import Observation, Policy


@dataclass
class Random(Policy):
    """Uniformly random victims: the floor any attention-guided policy must beat."""

    name = "random"
    ranges = {"seed": (0, None)}
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def score(self, obs: Observation) -> np.ndarray:
        return self.rng.random(obs.n)
