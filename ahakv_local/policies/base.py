"""What a policy sees and what it must answer.

llama.cpp shares KV cells between all layers and heads, so eviction is per token: every policy
reduces its per-layer, per-head evidence to one keep-score per live position (higher = keep;
``+inf`` = this policy insists on keeping it). The controller protects sinks, the recent window,
pinned spans and the newest token on top of that, and evicts the lowest scores.

A layer that cannot see a position (Gemma 3's sliding-window layers only see the last 512
positions) gives it zero attention by construction, not by judgement: ``holistic_sum`` averages
over the layers that *can* see each position, so old tokens are judged by the full-attention
layers alone instead of being dragged down by the sliding-window layers' zeros.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from ..native import TapFlag


@dataclass
class Observation:
    """Statistics of the query rows of the last decode call, aligned with the live positions."""

    positions: np.ndarray  # int64 [n] live positions, ascending
    n_seen: int  # tokens decoded so far (the newest position + 1)
    n_rows: int  # query rows the statistics sum over
    budget: int  # the controller's current target, in cells
    visible: np.ndarray  # bool [L, n]: layer l can see position j
    attn: np.ndarray | None = None  # float32 [L, H, n]: the model's softmax mass
    side: np.ndarray | None = None  # float32 [L, H, n]: side-pass mass at the policy's scale
    verr: np.ndarray | None = None  # float32 [L, H, n]: sum of a * ||v - o||
    vnorm: np.ndarray | None = None  # float32 [L, H_kv, n]: ||v||
    words: np.ndarray | None = None  # int64 [n]: the first position of each position's word (words.py; guided reads)
    # cells an eviction leaves free below ``budget`` for the steps until the next one (evict_every - 1): it keeps
    # budget - room, and the cache is back at the budget when the next eviction comes
    room: int = 0

    @property
    def n(self) -> int:
        return self.positions.size

    def subset(self, keep: np.ndarray) -> Observation:
        """The same statistics on the positions ``keep`` (bool [n]) selects."""

        def cut(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[..., keep]

        return dataclasses.replace(
            self,
            positions=self.positions[keep],
            visible=self.visible[:, keep],
            attn=cut(self.attn),
            side=cut(self.side),
            verr=cut(self.verr),
            vnorm=cut(self.vnorm),
            words=cut(self.words),
        )

    @cached_property
    def head_entropy(self) -> np.ndarray:
        """float64 [L, H]: the entropy of each head's ``attn`` over the positions its layer sees (the mass of each
        head normalized to 1). AhaKV's head focus and the adaptive layers' fill both read it from one observation:
        computed once."""
        a = self.attn if self.visible.all() else np.where(self.visible[:, None, :], self.attn, 0.0)
        a = a.astype(np.float64)
        p = a / np.maximum(a.sum(axis=2, keepdims=True), 1e-12)
        return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=2)


def holistic_sum(x: np.ndarray, visible: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """[L, H, n] -> [n]: the weighted mean over the layers and heads that can see each position."""
    w = np.ones(x.shape[:2]) if weights is None else weights
    num = np.einsum("lh,lhn->n", w, x if visible.all() else np.where(visible[:, None, :], x, 0.0))
    den = np.einsum("lh,ln->n", w, visible.astype(np.float64))
    return np.divide(num, den, out=np.zeros_like(num, dtype=np.float64), where=den > 0)


def kv_to_query_heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """[L, H_kv, n] -> [L, H, n]: query head h reads KV head h // (H / H_kv), like llama.cpp's GQA."""
    return np.repeat(x, n_head // x.shape[1], axis=1)


class ByPosition:
    """A float array indexed by absolute position that grows as positions do."""

    def __init__(self) -> None:
        self.data = np.zeros(1024)
        self.end = 0  # one past the highest position ever written: truncate zeroes up to here only

    def _fit(self, max_pos: int) -> None:
        if max_pos >= self.data.size:
            grown = np.zeros(max(2 * self.data.size, max_pos + 1))
            grown[: self.data.size] = self.data
            self.data = grown

    def add(self, positions: np.ndarray, values: np.ndarray) -> None:
        if positions.size:
            self._fit(int(positions[-1]))
            self.data[positions] += values
            self.end = max(self.end, int(positions[-1]) + 1)

    def get(self, positions: np.ndarray) -> np.ndarray:
        if positions.size:
            self._fit(int(positions[-1]))
        return self.data[positions]

    def truncate(self, n: int) -> None:
        """Forget positions >= n (they will be decoded again, with other tokens). The drop-in calls this
        on every decode: zeroing only what was written keeps it O(rewound), not O(array)."""
        if n < self.end:
            self.data[n : self.end] = 0.0
            self.end = n


class RecentSum:
    """The sum of the per-row contributions of the last ``r`` query rows, by position (AhaKV's recent
    accumulation, SnapKV's observation window, Scissorhands' history window): every token older than
    r rows is judged on exactly r of them. A push may carry several rows at once (a prompt chunk, or
    decode steps the tap accumulated natively); pushes are kept whole."""

    def __init__(self, r: int) -> None:
        self.r = r
        self.total = ByPosition()
        self.steps: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.rows = 0

    def push(self, positions: np.ndarray, values: np.ndarray, rows: int = 1) -> None:
        self.total.add(positions, values)
        self.steps.append((positions, values, rows))
        self.rows += rows
        while len(self.steps) > 1 and self.rows - self.steps[0][2] >= self.r:
            old_pos, old_val, old_rows = self.steps.pop(0)
            self.total.add(old_pos, -old_val)
            self.rows -= old_rows

    def get(self, positions: np.ndarray) -> np.ndarray:
        return self.total.get(positions)

    def truncate(self, n: int) -> None:
        self.total.truncate(n)
        self.steps = [(p[p < n], v[p < n], rows) for p, v, rows in self.steps]


class Policy:
    """The contract between a policy and the controller; each policy is a small dataclass in its own module.

    What the controller asks of a policy:
    - ``name``: its registry name; ``score(obs)``: one keep-score per live position (higher = keep);
    - ``needs`` / ``tap_flags(step)``: the statistics to tap; ``window``: query rows per prefill chunk
      to tap (0 = all; decode steps are always one row); ``side_scale``: the side pass's logit scale;
    - ``accumulates``: the score is a sum over query rows, so the model's softmax of several decode
      steps may be summed in the graph and observed at once (see ControllerConfig.observe_steps);
    - ``evicts``: False for a policy that never evicts (the full cache);
    - ``supports_auto_budget``: it has ``predicted_error`` (the error model behind the 'auto' budget);
    - ``reads_with_query``: it can be guided by a question while a long prompt is read (``query_flags`` to
      tap over the question's rows, ``query_score(obs)`` from them, ``with_query`` to join its own score);
    - ``reading(guided)``: whether a prompt is being read under guidance now (False again after it);
      ``whole_words``: its guided scores give every token of a word the word's best (``Observation.words``);
    - ``observe(obs)``: update running state after a decode call;
    - ``fresh()``: a new policy with the same settings and no state (a sequence read from the start);
      ``truncate(n)``: forget positions >= n (a rewind). A policy with state says how, explicitly.
    """

    name: ClassVar[str]
    # each numeric setting's (least, most) values, None for no bound: ``make_policy`` refuses others by name
    ranges: ClassVar[dict[str, tuple[float | None, float | None]]] = {}
    needs: ClassVar[TapFlag] = TapFlag(0)
    window: ClassVar[int] = 1
    accumulates: ClassVar[bool] = False
    evicts: ClassVar[bool] = True
    supports_auto_budget: ClassVar[bool] = False
    reads_with_query: ClassVar[bool] = False
    query_flags: ClassVar[TapFlag] = TapFlag.ATTN
    # with a question, the policy's own score still counts: this share of it, both scaled to mean 1
    own_share: ClassVar[float] = 0.5
    # while a guided prompt is read, every token of a word is kept or evicted with its word (words.py)
    whole_words: bool = False

    def tap_flags(self, step: int) -> TapFlag:
        """The statistics for the decode call of this step (a policy may skip costly ones)."""
        return self.needs

    def side_scale(self, n_seen: int, budget: int) -> float:
        return 1.0

    def observe(self, obs: Observation) -> None:
        """Called after every decode call with its statistics (update running state)."""

    def score(self, obs: Observation) -> np.ndarray:
        raise NotImplementedError

    def query_score(self, obs: Observation) -> np.ndarray:
        """Keep-score from a question's rows (FINCH, SnapKV with the question as the window): the mean
        attention of its rows over every layer and head that can see each position. Must not change state."""
        return holistic_sum(obs.attn, obs.visible) / max(obs.n_rows, 1)

    def with_query(self, own: np.ndarray, query: np.ndarray) -> np.ndarray:
        """The score to evict by when a question guides the reading: the question's attention, plus
        ``own_share`` of the policy's own score, each scaled to mean 1 (their units differ)."""
        return unit_mean(query) + self.own_share * unit_mean(own)

    def reading(self, guided: bool) -> None:
        """Told by the controller when it starts reading a prompt whether a question or a reconstruction guides
        it, and told False when the read ends (``KVController.prefill``). Stateless: nothing."""

    def predicted_error(self, obs: Observation, order: np.ndarray) -> np.ndarray:
        """Predicted relative output change of evicting order[:k], for every k (auto budget only)."""
        raise NotImplementedError(f"{self.name} has no error model")

    def fresh(self) -> Policy:
        """The same policy and settings, without state."""
        return dataclasses.replace(self)  # type: ignore[type-var]

    def truncate(self, n: int) -> None:
        """Forget what was learned about positions >= n: the sequence is rewound there. Stateless: nothing."""


def unit_mean(x: np.ndarray) -> np.ndarray:
    """x divided by the mean of its finite entries (+inf, a policy insisting on a token, stays +inf)."""
    finite = x[np.isfinite(x)]
    mean = float(finite.mean()) if finite.size else 0.0
    return x / mean if mean > 0 else np.where(np.isfinite(x), 0.0, x)


def avg_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """1-D average pooling along the last axis, same length (edges average over what exists)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    n, pad = x.shape[-1], kernel // 2
    c = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
    lo = np.clip(np.arange(n) - pad, 0, n)
    hi = np.clip(np.arange(n) + pad + 1, 0, n)
    return (c[..., hi] - c[..., lo]) / (hi - lo)
