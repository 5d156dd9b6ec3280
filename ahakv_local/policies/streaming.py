from dataclasses import dataclass

import numpy as np

from .base import Observation, Policy


@dataclass
class Streaming(Policy):
    """StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a rolling window of recent tokens.

    The sinks are the controller's protected first tokens; the rest is ranked by recency, so the
    oldest non-sink token goes first. Positions are kept, not re-packed (see the README)."""

    name = "streaming"

    def score(self, obs: Observation) -> np.ndarray:
        return obs.positions.astype(np.float64)
