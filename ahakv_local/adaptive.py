"""Adaptive layer budgets (``--layer-budgets adaptive``): each layer's share of its kind's KV bytes, re-decided
as the text goes on from how widely the layer's attention spreads over what it holds.

The seed's per-layer retention: a layer whose attention spreads over most of what it holds loses output with
every position it gives up, one whose attention sits on a few positions loses little. The measure is the
*fill* of a layer: the effective number of positions its heads attend to (exp of the entropy of each head's
attention over the rows observed, summed per position), as a fraction of the positions the layer sees. Every
``every`` positions each layer's share is multiplied by its fill over its kind's mean fill (to the power
``gamma``), so the shares move until the layers of a kind fill what they hold alike; ``budget.allocate`` keeps
them within ``ADAPTIVE_RANGE`` of the mean and the bytes where they were. The controller applies a decision by
evicting from the layers that shrink and resizing the caches (``Engine.resize_caches``: llama.cpp cannot
resize one, so the sequence moves to a context of the new sizes).

Every policy works with it: the fill comes from the model's softmax, which the controller taps for every
evicting policy on its observed steps (``ControllerConfig.track_mass``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .budget import Budget
from .policies import Observation

ADAPT_EVERY = 256  # positions between two decisions (each costs a context of the new sizes: ~20 ms on Gemma 3 270M)
ADAPT_GAMMA = 0.5  # how far one decision moves the shares toward equal fill (LGPL-2.1: 0.5, 1, 2 tried)
FILL_SMOOTHING = 0.3  # weight of the newest observation in a layer's running fill


def fill(obs: Observation) -> float | None:
    """The share of the positions one layer sees (``obs`` of a one-layer group) that its heads effectively attend
    to: exp(entropy) of each head's attention over them, averaged over the heads, over their number. None
    without the model's softmax or with fewer than two positions to spread over."""
    if obs.attn is None:
        return None
    n = int(np.count_nonzero(obs.visible[0]))
    if n < 2:
        return None
    return float(np.exp(obs.head_entropy[0]).mean() / n)


class LayerShares:
    """The running fill of every layer and the shares decided from it (mean 1 over each kind of layer)."""

    def __init__(self, sliding: Sequence[bool], every: int | None = None, gamma: float | None = None):
        self.sliding = np.asarray(sliding, dtype=bool)
        self.every = every or ADAPT_EVERY
        self.gamma = ADAPT_GAMMA if gamma is None else gamma
        self.weights = np.ones(self.sliding.size)
        self.fill = np.full(self.sliding.size, np.nan)  # running fill by layer (nan: not observed yet)
        self.next_at = self.every
        self.decisions = 0

    def observe(self, layer: int, obs: Observation) -> None:
        """Fold one observation of ``layer`` into its running fill."""
        f = fill(obs)
        if f is not None:
            old = self.fill[layer]
            self.fill[layer] = f if np.isnan(old) else (1 - FILL_SMOOTHING) * old + FILL_SMOOTHING * f

    def due(self, n_seen: int) -> bool:
        """Whether to decide now: ``every`` positions after the last decision, once every layer was measured
        (without the model's softmax, ``track_mass`` off, never: the shares stay uniform)."""
        return n_seen >= self.next_at and not np.isnan(self.fill).any()

    def decide(self, n_seen: int) -> np.ndarray:
        """New shares: each layer's times (its fill / its kind's mean fill) ** gamma, mean 1 over each kind.
        ``budget.allocate`` bounds them (``ADAPTIVE_RANGE``) and the caller stores what it applied (``applied``)."""
        w = self.weights.copy()
        for kind in (False, True):
            of_kind = self.sliding == kind
            if of_kind.any():
                f = self.fill[of_kind]
                w[of_kind] *= (f / f.mean()) ** self.gamma
                w[of_kind] /= w[of_kind].mean()
        self.next_at = n_seen + self.every
        self.decisions += 1
        return w

    def applied(self, held: Mapping[int, Budget]) -> None:
        """What each layer holds now (by layer, after ``budget.allocate``'s bounds and rounding): the next decision
        starts from these shares. A kind whose holdings are not cells or ratios (auto, none) keeps its weights."""
        for kind in (False, True):
            mine = {il: b for il, b in held.items() if self.sliding[il] == kind}
            if mine and all(b.mode in ("cells", "ratio") for b in mine.values()):
                mean = sum(b.value for b in mine.values()) / len(mine)
                for il, b in mine.items():
                    self.weights[il] = b.value / mean

    def restart(self, n_seen: int) -> None:
        """A new sequence: forget the fill and the shares measured on the old one (its caches are resized to even
        shares before the next decode: ``KVController.truncate``)."""
        self.weights[:] = 1.0
        self.fill[:] = np.nan
        self.next_at = n_seen + self.every
