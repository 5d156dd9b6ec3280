from dataclasses import dataclass

import numpy as np

from ..native import TapFlag
from .base import Observation, Policy, holistic_sum


@dataclass
class TOVA(Policy):
    """TOVA, Token Omission Via Attention (Oren et al., 2024): keep what the current query attends
    to, averaged over heads; no accumulation, no recent window of its own. TOVA decides per layer;
    with shared cells the layer averages are averaged too."""

    name = "tova"
    needs = TapFlag.ATTN
    window = 1
    reads_with_query = True

    def score(self, obs: Observation) -> np.ndarray:
        return holistic_sum(obs.attn, obs.visible)
