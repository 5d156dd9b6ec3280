"""Layer groups: the layers that read one KV cache, with their own live positions, policy and budget.

``shared`` is one group over every layer whose evictions go to every cache at once: the single pool, where
a position is kept or evicted for all layers together. ``natural`` is one group per cache of the model:
Gemma 3's full-attention layers (the base cache) and its sliding-window layers (the sliding cache), each
observed over its own layers only, scored by its own policy instance, held to its own budget
(``budget.allocate``) and evicting from its own cache (``Engine.evict(positions, cache)``), so the old
tokens the full-attention layers keep no longer cost the sliding-window layers the recent ones they see.
``uniform``, ``pyramid`` and ``adaptive`` are one group per layer, each layer with a cache of its own (the engine's
layer groups, patch 0013), observed over that layer alone (``adaptive`` also resizes them: adaptive.py).

A sliding group's layers see only the last ``window`` positions. llama.cpp itself hands the cells of
positions that left the window to new tokens when it needs them, so the group re-reads its live positions
from the engine when a decode may have done that (``LayerGroup.decoded``); and what no layer of the group can
see any more is evicted first, at every eviction, protected or not (a sink or a pinned span outside the window
is invisible to these layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .budget import Allocation, Budget
from .engine import Cache, Engine, LayerCache, cache_name
from .policies import Observation, Policy


@dataclass
class LayerGroup:
    name: str  # "shared", "base" or "sliding" (natural), "layer <il>" (one cache per layer)
    cache: Cache | None  # the cache its evictions go to; None: every cache (the shared pool)
    layers: np.ndarray | None  # the layers it observes; None: every layer
    policy: Policy
    budget: Budget  # what it holds, in cells (ratio, auto or none: decided as the sequence grows)
    _live: np.ndarray  # int64 positions ascending, ``live`` once brought up to date
    window: int = 0  # its layers see the last ``window`` positions (0: every position)
    obs: Observation | None = None  # the last observation, aligned with ``live``
    # a question-agnostic reading's score by position (Reconstruct: each position's best; Surprisal: its own); NaN
    # where that reading scored none
    best: np.ndarray = field(default_factory=lambda: np.zeros(0))
    decided: int | None = None  # the cells of its last eviction target (auto: the error model's decision)
    evicted: int = 0  # positions it evicted
    # a sliding group's positions from here to its engine's n_past are decoded but not yet in ``_live`` (``decoded``)
    _unread: tuple[Engine, int] | None = field(default=None, repr=False)

    @property
    def live(self) -> np.ndarray:
        """int64 positions ascending: the native cell map of its cache."""
        if self._unread is not None:
            self._catch_up()
        return self._live

    @live.setter
    def live(self, positions: np.ndarray) -> None:
        self._live, self._unread = positions, None

    @property
    def map_layer(self) -> int | None:
        """A layer reading its cache (None: the engine's base layer)."""
        return None if self.layers is None else int(self.layers[0])

    def grow_best(self, end: int) -> None:
        """Room in ``best`` for positions below ``end`` (doubling: a long read grows it in few copies)."""
        if self.best.size < end:
            self.best = np.concatenate([self.best, np.full(max(end - self.best.size, self.best.size), np.nan)])

    def read_live(self, engine: Engine) -> np.ndarray:
        return engine.live_positions(self.map_layer).astype(np.int64)

    def decoded(self, engine: Engine, start: int) -> None:
        """Positions ``start`` .. n_past - 1 were just decoded. A sliding cache may have handed them cells of positions
        that left its window; then it holds fewer than live + new, since llama.cpp removes a position only by
        reusing its cell (the count is exact: cells are freed, never added, behind our back), and only then is the
        map read again. That count is one native call per sliding cache, 15 a token on Gemma 3's per-layer layouts,
        for positions nobody reads between observations: a sliding group counts when ``live`` is next read. A
        context shared by several sequences counts their cells together: there the map is read at once."""
        if self.window and engine.shared:
            self.live = self.read_live(engine)
        elif self.window:
            if self._unread is None:
                self._unread = (engine, start)
        else:
            self.live = np.concatenate([self._live, np.arange(start, engine.n_past, dtype=np.int64)])

    def _catch_up(self) -> None:
        (engine, start), self._unread = self._unread, None
        new = np.arange(start, engine.n_past, dtype=np.int64)
        if engine.n_used(self.map_layer) != self._live.size + new.size:
            self._live = self.read_live(engine)
        else:
            self._live = np.concatenate([self._live, new])

    def outside_window(self, n_seen: int) -> np.ndarray:
        """bool [n]: positions none of its layers can see again (they left the sliding window)."""
        if not self.window:
            return np.zeros(self.live.size, dtype=bool)
        return n_seen - 1 - self.live >= self.window

    def protected(self, n_sink: int, n_recent: int, pinned: tuple[int, int] | None) -> np.ndarray:
        """bool [n]: positions never evicted: the first n_sink (attention sinks), the last n_recent live ones,
        the pinned span and the newest (the next batch starts after it); in a sliding group only while its
        layers can see them (``outside_window``)."""
        pos = self.live
        keep = pos < n_sink
        keep[max(0, pos.size - n_recent) :] = True
        if pos.size:
            keep[-1] = True
        if pinned is not None:
            keep |= (pos >= pinned[0]) & (pos < pinned[1])
        return keep

    def has_room(self, engine: Engine, n: int) -> bool:
        """Whether ``n`` more tokens fit its cache's free cells now."""
        return engine.n_used(self.map_layer) + n <= engine.n_cells(self.map_layer)

    def caches(self, engine: Engine) -> list[Cache]:
        return engine.caches if self.cache is None else [self.cache]

    def allocated_bytes(self, engine: Engine) -> int:
        """K+V bytes allocated to its cache (the shared group: every cache)."""
        return sum(engine.kv_bytes(c) for c in self.caches(engine))

    def used_bytes(self, engine: Engine) -> int:
        """K+V bytes of the cells its cache (the shared group: every cache) holds positions in."""
        return sum(engine.kv_bytes_used(c) for c in self.caches(engine))


def make_groups(engine: Engine, policy: Policy, allocation: Allocation) -> list[LayerGroup]:
    """The groups of ``allocation`` on ``engine``: one shared group, or one per cache (base first; per-layer
    layouts: in the engine's cache order), each with its own instance of ``policy`` (the first group gets
    ``policy`` itself)."""
    if len(allocation.groups) == 1:
        live = engine.live_positions().astype(np.int64)
        return [LayerGroup("shared", None, None, policy, allocation.groups[0], live)]
    groups = []
    caches = engine.caches if allocation.layer_groups else [LayerCache.BASE, LayerCache.SLIDING]
    for cache, budget in zip(caches, allocation.groups, strict=True):
        layers = np.flatnonzero([c == cache for c in engine.layer_cache])
        window = engine.n_swa if engine.cache_sliding(cache) else 0
        own = policy if not groups else policy.fresh()
        name = f"layer {layers[0]}" if allocation.layer_groups and layers.size == 1 else cache_name(cache)
        group = LayerGroup(name, cache, layers, own, budget, np.zeros(0, np.int64), window)
        group.live = group.read_live(engine)
        groups.append(group)
    return groups
