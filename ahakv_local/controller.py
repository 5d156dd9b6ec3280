"""Keeps one sequence's KV cache inside its budget.

After every decode call the controller reads the tapped statistics (one native reset + read per
layer), hands them to the policy, and - every ``evict_every`` steps, or after each prefill chunk -
evicts the lowest-scored positions outside the protected ones in one native call. With
``observe_steps`` it reads only the last steps before each eviction; a policy whose score is a sum
over query rows still gets the others, summed by the tap in the graph (cheap) and read as one block:

    protected = the first n_sink positions (attention sinks) + the last n_recent live positions
              + the pinned span (a system prompt) + the newest position (llama.cpp needs it)

Bookkeeping is by position (``live``, ascending); it always equals the engine's cell map.
A long prompt is decoded in chunks of n_ubatch and compressed after each, so it never needs more
than budget + one chunk of cells.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .budget import Budget, cells_for
from .engine import Engine
from .errors import AhakvError
from .native import TapFlag
from .policies import Observation, Policy
from .policies.base import unit_mean


@dataclass(frozen=True)
class Reconstruct:
    """Question-agnostic reading (KVzip, Kim et al. 2025): behind each chunk the model reads ``prompt`` (a
    request to repeat the context) and the chunk again; what that reconstruction attends to is kept. A
    position keeps the best score any pass gave it, so the chunks read earlier are not judged only by how
    much the reconstruction of a later chunk needs them."""

    prompt: tuple[int, ...]


@dataclass
class ControllerConfig:
    budget: Budget
    n_sink: int = 4
    n_recent: int = 32
    # decode steps between evictions: each eviction goes evict_every - 1 cells below the budget, so
    # the cache holds the budget at every step while it grows until the next one
    evict_every: int = 1
    pinned: tuple[int, int] | None = None  # [start, end) positions never evicted (a system prompt)
    track_mass: bool = True  # tap the model's softmax for the retained-mass statistic
    # observe only the last observe_steps decode steps before each eviction (None: every step). The
    # steps between run the plain graph, or - for a policy whose score sums over query rows - the
    # graph plus the model-softmax tap, summed natively and handed over as one block
    observe_steps: int | None = None

    def __post_init__(self) -> None:
        if self.evict_every < 1 or (self.observe_steps is not None and self.observe_steps < 1):
            raise AhakvError("evict_every must be at least 1 and observe_steps at least 1 (or None: every step)")
        if self.n_sink < 0 or self.n_recent < 0:
            raise AhakvError(f"sinks and recent must be at least 0, not {self.n_sink} and {self.n_recent}")
        if self.pinned is not None and not 0 <= self.pinned[0] <= self.pinned[1]:
            raise AhakvError(f"a pinned span is [start, end) with 0 <= start <= end, not {self.pinned}")


@dataclass
class ControllerStats:
    cells_used: int = 0
    budget: int | None = None  # the current target in cells (auto: the last decision)
    tokens_seen: int = 0
    evicted: int = 0
    evictions: int = 0  # native eviction calls
    retained_mass: list[float] = field(default_factory=list)  # per layer, at the last eviction

    @property
    def retention(self) -> float:
        return self.cells_used / self.tokens_seen if self.tokens_seen else 1.0


class KVController:
    """Drives an Engine for one sequence, evicting with ``policy`` to hold ``config.budget``."""

    def __init__(self, engine: Engine, policy: Policy, config: ControllerConfig):
        self.engine, self.policy, self.config = engine, policy, config
        self.check_budget(config.budget, policy)
        if engine.config.flash_attn and self._flags(0) & TapFlag.ATTN:
            raise AhakvError(f"policy {policy.name} reads the model's softmax: turn flash attention off")
        self.live = engine.live_positions().astype(np.int64)
        self.stats = ControllerStats(cells_used=self.live.size, tokens_seen=engine.n_past)
        self.step_count = 0
        self._tap: tuple[TapFlag, int] | None = None
        self._obs: Observation | None = None
        self._pending = 0  # decode steps whose attention the tap has summed but nobody has read yet
        self._best = np.zeros(0)  # Reconstruct: each position's best reconstruction score so far

    # -- decoding ------------------------------------------------------------------------------------

    def prefill(
        self,
        tokens: Sequence[int],
        all_logits: bool = False,
        chunk: int | None = None,
        query: Sequence[int] | Reconstruct | None = None,
        ends_prompt: bool = True,
    ) -> np.ndarray:
        """Decode a prompt in chunks (of n_ubatch by default), compressing after each chunk; return the
        logits of the last token, or of every token with ``all_logits``.

        With ``query`` (the tokens of what the reader will be asked; see ``read_query``) and a policy that
        reads with one, every compression but the last is guided by it: the query is decoded behind the
        chunk, its attention over the cache (all layers, all heads) joins the policy's own score, and its
        cells are removed again before the next chunk, which takes its positions. The last chunk ends the
        prompt (where the question itself is) and is read once, normally (``ends_prompt=False``: these tokens
        are only a part of a prompt, and their last chunk is guided too). With ``Reconstruct`` no question
        is known: every chunk is scored by how much a repetition of it attends to each position."""
        chunk = chunk or self.engine.config.n_ubatch
        use_query = bool(query) and self.policy.reads_with_query
        rows = []
        for i in range(0, len(tokens), chunk):
            piece = tokens[i : i + chunk]
            rows.append(self._decode(piece, self.policy.window, all_logits))
            if isinstance(query, Reconstruct) and use_query:
                again = [*query.prompt, *piece]
                self.evict(self._reconstruction_scores(again) if self._has_room(len(again)) else None)
                continue
            last = ends_prompt and i + chunk >= len(tokens)
            guided = use_query and not last and self._over_budget() and self._has_room(len(query))
            self.evict(self.read_query(query) if guided else None)
        return np.concatenate(rows) if all_logits else rows[-1]

    def _reconstruction_scores(self, query: list[int]) -> np.ndarray:
        """Score this pass, remember each position's best (scaled to mean 1 per pass), return the best."""
        scores = unit_mean(self.read_query(query))
        end = int(self.live[-1]) + 1 if self.live.size else 0
        if self._best.size < end:
            self._best = np.concatenate([self._best, np.zeros(max(end - self._best.size, self._best.size))])
        self._best[self.live] = np.maximum(self._best[self.live], scores)
        return self._best[self.live]

    def read_query(self, query: Sequence[int]) -> np.ndarray:
        """Decode ``query`` behind the live positions, return the policy's query score of each (aligned with
        ``live``), and remove the query again: its cells, its statistics, and its positions, which the next
        tokens reuse. The policy's running state never sees it."""
        e = self.engine
        start = e.n_past
        flags = self.policy.query_flags
        if self.config.track_mass:
            flags |= TapFlag.ATTN
        self._set_tap(flags, 0)  # every row of the query
        if flags & TapFlag.SIDE:
            target = self.config.budget.target(e.n_past) or self.live.size
            e.set_side_scale(self.policy.side_scale(e.n_past, target))
        e.reset_stats()
        try:
            e.decode(list(query))
            seen = np.concatenate([self.live, np.arange(start, e.n_past, dtype=np.int64)])
            stats = e.aligned(seen, flags)
            obs = Observation(
                positions=seen,
                n_seen=e.n_past,
                n_rows=e.stat_rows,
                budget=self.config.budget.target(start) or self.live.size,
                visible=stats.visible,
                attn=stats.values.get(TapFlag.ATTN),
                side=stats.values.get(TapFlag.SIDE),
                verr=stats.values.get(TapFlag.VERR),
                vnorm=stats.values.get(TapFlag.VNORM),
            )
            return self.policy.query_score(obs)[: self.live.size]
        finally:
            e.truncate(start)  # the query's cells go; llama.cpp needs the next token at seq_pos_max + 1
            e.reset_stats()

    def _has_room(self, n: int) -> bool:
        """Whether ``n`` more tokens fit the allocated cells now (a budget raised past the room the session
        was sized with reads that chunk unguided instead of failing)."""
        return self.engine.n_used() + n <= self.engine.n_ctx

    def _over_budget(self) -> bool:
        """Whether an eviction now would remove anything (cell and ratio budgets; auto decides for itself)."""
        target = self.config.budget.target(self.engine.n_past)
        if target is None:
            return self.config.budget.mode == "auto"
        return self.live.size > max(1, target - (self.config.evict_every - 1))

    def step(self, token: int) -> np.ndarray:
        """Decode one generated token; evict every ``evict_every`` positions.

        The schedule follows the position, not a step counter, so the same tokens meet the same
        evictions whatever came before (a rewind, another request): greedy output is reproducible."""
        every, watch = self.config.evict_every, self.config.observe_steps
        phase = self.engine.n_past % every
        observe = watch is None or phase >= every - watch
        logits = self._decode([token], 1, False, observe)
        self.step_count += 1
        if phase == every - 1:
            self.evict()
        return logits

    def check_floor(self, budget: Budget) -> None:
        """Refuse a cell budget that cannot hold the protected positions and the steps between evictions."""
        cfg = self.config
        if budget.mode == "cells" and budget.value < cfg.n_sink + cfg.n_recent + cfg.evict_every:
            room = "newest" if cfg.evict_every == 1 else "one eviction period"
            parts = f"{cfg.n_sink} + {cfg.n_recent} + {cfg.evict_every}"
            raise AhakvError(f"budget {int(budget.value)} is smaller than sinks + recent + {room} ({parts})")

    def check_budget(self, budget: Budget, policy: Policy | None = None) -> None:
        """Every check a budget must pass before it is used with ``policy`` (default: the current one):
        the floor, the allocated cells, and an error model for 'auto'. Raises AhakvError; changes nothing."""
        policy = policy or self.policy
        if policy.evicts and not budget.evicts:
            raise AhakvError(f"policy {policy.name} evicts: give it a budget (the full cache keeps everything)")
        self.check_floor(budget)
        if budget.mode == "auto" and not policy.supports_auto_budget:
            raise AhakvError(f"an auto budget needs a policy with an error model (ahakv), not {policy.name}")
        if policy.evicts and not self.fits(budget):
            raise AhakvError(
                f"budget {int(budget.value)} does not fit the {self.engine.n_ctx} allocated cells with a prompt "
                f"chunk of {self.engine.config.n_ubatch}"
            )

    def set_budget(self, budget: Budget) -> int:
        """Check, apply and enforce a new budget now; returns how many positions were evicted."""
        self.check_budget(budget)
        self.config.budget = budget
        return self.evict()

    def fits(self, budget: Budget) -> bool:
        """Whether the allocated cells hold this budget plus one prompt chunk and the newest token."""
        return budget.mode != "cells" or self.engine.n_ctx >= cells_for(budget, self.engine.config.n_ubatch, 0)

    def set_policy(self, policy: Policy) -> None:
        """Switch policies; the new one learns from the next decode on (its statistics are tapped then).
        A policy the current budget cannot work with (an 'auto' budget without an error model) is refused."""
        self.check_budget(self.config.budget, policy)
        self.policy = policy
        self._tap = None
        self._obs = None
        self._pending = 0

    def resync(self) -> None:
        """Take the live set from the engine after its cache was replaced (a state load): the cells
        moved, the positions did not; what the policy learned no longer matches, so it starts over."""
        self.live = self.engine.live_positions().astype(np.int64)
        self.policy.truncate(0)
        self._obs = None
        self._pending = 0
        self.stats.cells_used = self.live.size
        self.stats.tokens_seen = self.engine.n_past

    def truncate(self, n: int) -> None:
        """Rewind to position n: forget every position >= n (cells, bookkeeping and policy state)."""
        if n < self.engine.n_past:
            self.engine.truncate(n)
        self.engine.n_past = n
        self.live = self.live[self.live < n]
        # from the start: a fresh policy (same settings), so a replay meets exactly the same decisions
        self.policy = self.policy.fresh() if n == 0 else self.policy
        self.policy.truncate(n)
        self._best[n:] = 0.0
        self._obs = None
        self._pending = 0  # the summed rows may include forgotten positions' queries: drop them
        self.stats.tokens_seen = n
        self.stats.cells_used = self.live.size
        if n == 0:
            self.stats.budget = None  # the last decision belonged to the forgotten sequence

    def first_gap(self) -> int | None:
        """The lowest evicted position below n_past, or None if the history is intact."""
        n = self.engine.n_past
        if self.live.size == n:
            return None
        holes = np.flatnonzero(self.live != np.arange(self.live.size))
        return int(holes[0]) if holes.size else int(self.live.size)

    def _flags(self, step: int) -> TapFlag:
        flags = self.policy.tap_flags(step)
        if self.config.track_mass and self.policy.evicts:
            flags |= TapFlag.ATTN
        return flags

    def _decode(self, tokens: list[int], window: int, all_logits: bool, observe: bool = True) -> np.ndarray:
        e = self.engine
        flags = self._flags(self.step_count)
        if not observe:
            # the norms stay current (turning them on again would recompute them all); a summing
            # policy keeps the cheap model-softmax tap, which accumulates until the next observation
            flags &= TapFlag.VNORM | (TapFlag.ATTN if self.policy.accumulates else TapFlag(0))
        elif self._pending:
            self._observe_block()
        self._set_tap(flags, window)
        if flags & TapFlag.SIDE:
            target = self.config.budget.target(e.n_past + len(tokens)) or self.stats.budget or len(tokens)
            e.set_side_scale(self.policy.side_scale(e.n_past + len(tokens), target))
        if observe or (flags & TapFlag.ATTN and not self._pending):  # a new observation or a new block
            e.reset_stats()
        start = e.n_past
        logits = e.decode(tokens, all_logits)
        self.live = np.concatenate([self.live, np.arange(start, e.n_past, dtype=np.int64)])
        if observe:
            self._obs = self._observe(flags)
            if flags:
                self.policy.observe(self._obs)
        elif flags & TapFlag.ATTN:
            self._pending += 1
        self.stats.tokens_seen = e.n_past
        self.stats.cells_used = self.live.size
        return logits

    def _set_tap(self, flags: TapFlag, window: int) -> None:
        if self._tap != (flags, window):
            self.engine.set_tap(flags, window)
            self._tap = (flags, window)

    def _observe_block(self) -> None:
        """Hand the policy the attention the tap summed over the unobserved steps, as one observation."""
        self.policy.observe(self._observe(self._tap[0]))
        self._pending = 0

    def _observe(self, flags: TapFlag) -> Observation:
        """The tapped statistics of every layer, aligned with ``live`` (the engine maps cells to positions)."""
        e = self.engine
        if flags & TapFlag.VERR:
            flags |= TapFlag.VNORM  # the error model divides by the value norms
        stats = e.aligned(self.live, flags)
        target = self.config.budget.target(e.n_past)
        return Observation(
            positions=self.live,
            n_seen=e.n_past,
            n_rows=e.stat_rows,
            budget=target if target is not None else (self.stats.budget or self.live.size),
            visible=stats.visible,
            attn=stats.values.get(TapFlag.ATTN),
            side=stats.values.get(TapFlag.SIDE),
            verr=stats.values.get(TapFlag.VERR),
            vnorm=stats.values.get(TapFlag.VNORM),
        )

    # -- eviction ------------------------------------------------------------------------------------

    def protected(self) -> np.ndarray:
        """bool [n]: positions the controller never evicts."""
        pos, cfg = self.live, self.config
        keep = pos < cfg.n_sink
        keep[max(0, pos.size - cfg.n_recent) :] = True
        if pos.size:
            keep[-1] = True  # the newest position: the next batch starts after it
        if cfg.pinned is not None:
            keep |= (pos >= cfg.pinned[0]) & (pos < cfg.pinned[1])
        return keep

    def evict(self, query_scores: np.ndarray | None = None) -> int:
        """Evict down to the budget now; returns how many positions went. ``query_scores`` (aligned with
        ``live``, from ``read_query``) join the policy's own score (``Policy.with_query``)."""
        if not self.policy.evicts or not self.config.budget.evicts or self._tap is None:
            return 0
        if self._obs is None or self._obs.positions is not self.live:
            # the live set changed since the last decode (an eviction, a new budget): re-read the
            # accumulated statistics for it; the policy has already observed them
            self._obs = self._observe(self._tap[0])
        obs, budget = self._obs, self.config.budget
        if budget.mode == "auto" and (obs.verr is None or obs.vnorm is None):
            return 0  # the error model decides at the next observed step (the budget just became auto)
        n = self.live.size
        candidates = np.flatnonzero(~self.protected())
        scores = self.policy.score(obs)
        if query_scores is not None:
            scores = self.policy.with_query(scores, query_scores)
        scores = scores[candidates]
        order = candidates[np.lexsort((self.live[candidates], scores))]  # lowest score first, then oldest
        if budget.mode == "auto":
            k = self._auto_count(obs, order)
            self.stats.budget = n - k
        else:
            self.stats.budget = budget.target(obs.n_seen)
            keep = max(1, self.stats.budget - (self.config.evict_every - 1))  # room for the steps to come
            k = min(max(0, n - keep), order.size)
        if k == 0:
            return 0
        victims = np.sort(order[:k])
        if obs.attn is not None:
            kept = np.ones(n, dtype=bool)
            kept[victims] = False
            total = np.maximum(obs.attn.sum(axis=2), 1e-12)
            self.stats.retained_mass = (obs.attn[:, :, kept].sum(axis=2) / total).mean(axis=1).tolist()
        self.engine.evict(self.live[victims])
        self.live = np.delete(self.live, victims)
        self.stats.evicted += k
        self.stats.evictions += 1
        self.stats.cells_used = self.live.size
        return k

    def _auto_count(self, obs: Observation, order: np.ndarray) -> int:
        """Auto budget: evict the most low-scored tokens whose predicted relative output change stays
        under the tolerance, keeping between min_ratio and max_ratio of the tokens seen."""
        b, n = self.config.budget, self.live.size
        k_max = min(order.size, max(0, n - math.ceil(b.min_ratio * obs.n_seen)))
        k_min = min(k_max, max(0, n - math.floor(b.max_ratio * obs.n_seen)))
        if k_max == 0:
            return 0
        errors = self.policy.predicted_error(obs, order[:k_max])
        k = int(np.searchsorted(errors, b.error_tol, side="right"))  # errors grow with k
        return max(k_min, min(k, k_max))
