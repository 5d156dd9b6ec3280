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

The layers are split into groups (groups.py, ``ControllerConfig.layer_budgets``): ``shared``, one group
evicting from every cache at once, ``natural``, one per cache (a sliding-window model's full-attention
and sliding-window layers), or one per layer (``uniform``, ``pyramid``: the engine's layer groups), each with
its own live positions, policy instance and budget (``budget.allocate``). ``live`` is the first group's: the
(first) full-attention layers' (or every layer's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .adaptive import LayerShares
from .budget import (
    LONGEST_PERIOD,
    PER_LAYER,
    QUERY_TOKENS,
    Allocation,
    Budget,
    CacheLayout,
    LayerBudgets,
    allocate,
    cells_for,
    check_held_past_trained,
    check_trained_context,
    default_evict_every,
    holding_of,
)
from .engine import Engine, decode_batch
from .errors import AhakvError
from .groups import LayerGroup, make_groups
from .native import TapFlag
from .policies import KINDS, Observation, Policy
from .policies.base import avg_pool, unit_mean
from .words import WordMap, max_by_word, not_space


@dataclass(frozen=True)
class Reconstruct:
    """Question-agnostic reading (KVzip, Kim et al. 2025): behind each chunk the model reads ``prompt`` (a
    request to repeat the context) and the chunk again; what that reconstruction attends to is kept. A
    position keeps the best score any pass gave it, so the chunks read earlier are not judged only by how
    much the reconstruction of a later chunk needs them."""

    prompt: tuple[int, ...]


@dataclass(frozen=True)
class Surprisal:
    """Question-agnostic reading by self-information (as Selective Context, Li et al. 2023, prunes a prompt): each
    token's surprisal -log p(token | what precedes it) is read from the logits of the chunk that holds it, and
    every compression keeps the positions whose phrase carries the most, the surprisal averaged over ``kernel``
    neighbours (a pass key's digits are no more surprising than filler, ~2.3 nats each; the sentence that
    introduces them is). It costs the logits of every prompt row, no second pass. Kernel chosen on single pass keys
    in LGPL-2.1/GFDL-1.3/Apache-2.0 filler (``benchmarks/reconstruct_diag.py --reading surprisal``, RESULTS.md).
    The logits of all 64 rows of a chunk cost the prompt about 2.5x its time on Gemma 3 270M (262,144 tokens)."""

    kernel: int = 15


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
    # how the budget is laid out on the layers: one pool for every layer, or one group per cache
    layer_budgets: LayerBudgets = "shared"
    room: int = 0  # cells the session allocated for a guided reading on top (a byte budget leaves them free)
    sliding_share: float | None = None  # natural, a byte budget: the sliding cache's share (budget.allocate)
    longest: int = 0  # the longest sequence the caches were sized for (budget.allocate's ``longest``; 0: unknown)
    # how far positions may run where that is past ``longest`` (the drop-in: to the trained context, whatever n_ctx
    # cells a ratio budget's caches were laid out in); 0: ``longest``
    positions: int = 0
    # evict_every is the product's default for the budget (budget.default_evict_every): a new budget (chat's /budget,
    # a server request's) takes its own, or a smaller budget was refused for the period of the one before
    period_follows_budget: bool = False

    def __post_init__(self) -> None:
        check_schedule(self.evict_every, self.observe_steps)
        check_protected(self.n_sink, self.n_recent, self.pinned)


def check_protected(n_sink: int, n_recent: int, pinned: tuple[int, int] | None) -> None:
    """Sinks and recent tokens of at least 0, and a pinned span [start, end) with 0 <= start <= end."""
    if n_sink < 0 or n_recent < 0:
        raise AhakvError(f"sinks and recent must be at least 0, not {n_sink} and {n_recent}")
    if pinned is not None and not 0 <= pinned[0] <= pinned[1]:
        raise AhakvError(f"a pinned span is [start, end) with 0 <= start <= end, not {pinned}")


def check_schedule(evict_every: int | None, observe_steps: int | None) -> None:
    """An eviction period of at least one step (None: the product's default, where a caller has one) and at least one
    observed step (None: every step)."""
    if (evict_every is not None and evict_every < 1) or (observe_steps is not None and observe_steps < 1):
        raise AhakvError("evict_every must be at least 1 and observe_steps at least 1 (or None: every step)")


@dataclass
class ControllerStats:
    # cells_used, budget and evicted count the first group, or the mean of the full-attention layers of a per-layer
    # layout (``KVController._count``); each group's own are ``LayerGroup.live``, ``decided`` and ``evicted``
    cells_used: int = 0
    # the current target in cells, or where that is more what is never evicted and the steps until the next eviction
    # (cells and ratios: the cells used never exceed it); auto: what the last decision kept
    budget: int | None = None
    tokens_seen: int = 0
    evicted: int = 0  # positions evicted (tokens_seen = cells_used + evicted until a rewind)
    evictions: int = 0  # native eviction calls
    guide_tokens: int = 0  # tokens decoded to guide a reading (questions, repetitions), then removed
    retained_mass: list[float] = field(default_factory=list)  # per layer, at the last eviction
    # the most cells_used since the sequence started: counted after each decode, before an eviction takes the cache
    # back (a prompt's chunk or the steps between evictions on top of what an eviction keeps)
    peak_cells: int = 0

    @property
    def retention(self) -> float:
        return self.cells_used / self.tokens_seen if self.tokens_seen else 1.0


def protected_floor(cfg: ControllerConfig) -> tuple[int, str, str]:
    """The positions no eviction may take (sinks, a pinned span past them, the recent ones), and how a refusal names
    them with the steps between evictions: (count, "sinks + recent + newest", "4 + 32 + 1")."""
    pinned = 0 if cfg.pinned is None else max(0, cfg.pinned[1] - max(cfg.pinned[0], cfg.n_sink))  # past the sinks
    period = "newest" if cfg.evict_every == 1 else "one eviction period"
    protected = f"sinks + {'pinned + ' if pinned else ''}recent + {period}"
    parts = f"{cfg.n_sink} + {f'{pinned} + ' if pinned else ''}{cfg.n_recent} + {cfg.evict_every}"
    return cfg.n_sink + pinned + cfg.n_recent, protected, parts


def check_floor(cfg: ControllerConfig, layout: CacheLayout, allocation: Allocation, budget: Budget) -> None:
    """Refuse a budget whose ``allocation`` leaves a group too few cells for the protected positions (sinks, a pinned
    span such as chat's system prompt, the recent ones) and the steps between evictions (a sliding group: for those
    inside its window). A controller checks its own (``KVController.check_floor``), a spec one before any engine
    opens (``SessionSpec.check_floor_on``)."""
    keep, protected, parts = protected_floor(cfg)
    for i, held in enumerate(allocation.groups):
        window = layout.window if allocation.group_slides(i) else 0
        need = min(keep + 1, window or np.inf) + cfg.evict_every - 1
        if held.mode != "cells" or held.value >= need:
            continue
        if budget.mode == "cells" and not window:
            raise AhakvError(f"budget {int(budget.value)} is smaller than {protected} ({parts})")
        # (the shared pool, or a model of one kind of layer: one group over every layer)
        where = "sliding-window layers (inside their window)" if window else "full-attention layers"
        where = where if len(allocation.groups) > 1 else "layers"
        raise AhakvError(
            f"budget {budget} keeps {int(held.value)} cells of the {where}: fewer than {protected} ({parts})"
        )


def check_policy(policy: Policy, budget: Budget, cells: int, reach: int) -> None:
    """Refuse ``policy`` under ``budget`` in caches whose smallest full-attention one holds ``cells``, for positions up
    to ``reach``: an evicting policy without a budget, one that keeps every token in caches that cannot, an auto
    budget without an error model (``KVController.check_budget``; ``info``, before any engine opens)."""
    if policy.evicts and not budget.evicts:
        raise AhakvError(f"policy {policy.name} evicts: give it a budget (the full cache keeps everything)")
    if not policy.evicts and cells < reach:
        # every later decode would fail with "the KV cache is full" once the sequence passed the cells
        raise AhakvError(
            f"policy {policy.name} keeps every token: these caches hold {cells} cells, not the "
            f"{reach} positions the context reaches (open it without a budget for the full cache)"
        )
    if not policy.evicts and budget.evicts:  # (a ratio's caches reach every position: accepted, never held, 351/106)
        raise AhakvError(f"policy {policy.name} keeps every token: a budget needs a policy that evicts")
    if budget.mode == "auto" and not policy.supports_auto_budget:
        raise AhakvError(f"an auto budget needs a policy with an error model (ahakv), not {policy.name}")


def fit_to_cells(budget: Budget, cells: int, chunk: int, cfg: ControllerConfig, reach: int) -> Budget:
    """``budget`` as caches of ``cells`` (the smallest a full-attention layer reads), read ``chunk`` tokens at a time,
    can hold it for positions up to ``reach``: a ratio of the tokens seen or ``auto`` (which keeps at least
    ``min_ratio`` of them), set on caches sized for a cell budget (chat's ``/budget 50%``, a server request's
    ``kv_budget``) or for fewer positions than a sequence may reach (the drop-in's n_ctx cells, positions to the
    trained context), is capped at the cells they hold between evictions. Uncapped it grew with the conversation,
    or the document, until the cache was full, and every message (the rest of the document) after that failed.
    Refused where what no eviction takes and a chunk do not fit at all (``KVController.fitted``; ``info``)."""
    if budget.mode not in ("ratio", "auto"):
        return budget
    if cells >= cells_for(replace(budget, cap=None), chunk, reach, cfg.room):
        return budget  # caches sized for every position the ratio can keep
    held = int(holding_of(cells, chunk, cfg.room).value)
    if held < 1:  # (a cap below one cell read "auto (at most -1 cells)" in the refusal that followed)
        guided = " and a guided reading's room" if cfg.room else ""
        raise AhakvError(
            f"budget {budget} keeps nothing in caches of {cells} cells: they hold only one prompt chunk of "
            f"{chunk}, the newest token{guided}: give the context more cells"
        )
    keep, protected, parts = protected_floor(cfg)
    if cells < keep + max(chunk, cfg.evict_every):
        # what no eviction takes and a prompt chunk (or the steps between evictions) overflow the caches: every read
        # of a long text failed with "the KV cache is full" (-c 30 with a 25% budget)
        raise AhakvError(
            f"budget {budget} cannot be held in caches of {cells} cells: {protected} ({parts}) and a prompt chunk "
            f"of {chunk} do not fit: give the context more cells"
        )
    return replace(budget, cap=held if budget.cap is None else min(budget.cap, held))


class KVController:
    """Drives an Engine for one sequence, evicting with ``policy`` to hold ``config.budget``."""

    def __init__(self, engine: Engine, policy: Policy, config: ControllerConfig):
        self.engine, self.config = engine, config
        self.shares: LayerShares | None = None  # adaptive layer budgets: each layer's share, re-decided
        self._resize_to: tuple[int, ...] | None = None  # the cache sizes of a decision not yet applied
        if config.layer_budgets == "adaptive":
            if not engine.resizable:
                raise AhakvError("layer budgets 'adaptive' resize the caches: not possible on a shared context")
            self.shares = LayerShares(engine.layer_sliding)
        self.opened_bytes = engine.kv_bytes()  # what a new cell budget may be laid out in (``_lays_out``)
        config.budget = self.fitted(config.budget)
        self._check_budget(config.budget, policy)  # with the period the session chose for it
        # the budget whose layout the caches have: a smaller cell budget is held inside them (adaptive: until the
        # next re-split), so a chat saved then names this one, which opens caches of these sizes (saved_chat.py)
        self.laid_out = config.budget
        self.groups: list[LayerGroup] = make_groups(engine, policy, self.allocation(config.budget))
        for g in self.groups:  # an engine evicted from before (tokens_seen = cells_used + evicted)
            g.evicted = engine.n_past - g.live.size
        self.stats = ControllerStats(tokens_seen=engine.n_past)
        self._count()
        self.step_count = 0
        self._tap: tuple[TapFlag, int] | None = None
        self._pending = 0  # decode steps whose attention the tap has summed but nobody has read yet
        piece = lambda token: engine.detokenize([token])  # noqa: E731
        self.words = WordMap(piece)
        self.spans = WordMap(piece, joins=not_space)  # runs of text between spaces, for reconstruction
        self._guided = False  # a prompt is being read under guidance (Observation.words are given then only)
        self._surprisal_row: np.ndarray | None = None  # the last row of a surprisal read's piece (``prefill``)
        self._scored_by: type[Reconstruct | Surprisal] | None = None  # the reading whose scores ``best`` holds

    @property
    def live(self) -> np.ndarray:
        """The live positions of the first group: the full-attention layers' (shared: every layer's)."""
        return self.groups[0].live

    @property
    def counted(self) -> list[LayerGroup]:
        """The groups the statistics count: the first; in a per-layer layout every full-attention layer's, whose
        mean they report (each layer holds its own share of the budget: one layer's count would read as the budget
        broken where a layer holds more than the mean, or as half of it where it holds less)."""
        full = [g for g in self.groups if not g.window] if self.config.layer_budgets in PER_LAYER else []
        return full or self.groups[:1]

    @property
    def reach(self) -> int:
        """How far positions may run: the longest sequence the caches were laid out for, or further (``positions``)."""
        return max(self.config.longest, self.config.positions)

    def allocated_cells(self) -> int:
        """The cells of the cache a counted group evicts from (their mean): what the budget is held in."""
        e = self.engine
        return _mean([e.n_cells(g.map_layer) for g in self.counted])

    def restart_stats(self) -> None:
        """Count from zero (a server's sequence slot between requests): the statistics and each group's evictions."""
        for g in self.groups:
            g.evicted = 0
        self.stats = ControllerStats(tokens_seen=self.engine.n_past)
        self._count()

    def _count(self) -> None:
        """The statistics' cells used, budget and evictions, over the counted groups."""
        counted = self.counted
        self.stats.cells_used = _mean([g.live.size for g in counted])
        self.stats.peak_cells = max(self.stats.peak_cells, self.stats.cells_used)
        self.stats.evicted = _mean([g.evicted for g in counted])
        # what each holds: its last eviction target, or before one (nothing read yet, or stopped mid-read) its budget's
        n = self.engine.n_past  # (a ratio of no tokens holds none: its target's floor of one cell showed "budget 1")
        held = [(g.budget.target(n) if n or g.budget.mode != "ratio" else 0) for g in counted]
        targets = [t if g.decided is None else g.decided for g, t in zip(counted, held, strict=True)]
        self.stats.budget = None if None in targets else _mean(targets)  # auto: none until an eviction decides one

    @property
    def policy(self) -> Policy:
        """The first group's policy (every group has an instance with the same settings)."""
        return self.groups[0].policy

    def group(self, name: str) -> LayerGroup:
        """A group by name: "shared", "base" and "sliding" (natural), or "layer <il>" (one cache per layer)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no {name} group: this controller has {', '.join(g.name for g in self.groups)}")

    def group_bytes(self) -> dict[str, tuple[int, int]]:
        """Each group's (allocated, used) K+V bytes, by name: its cache's (the shared group: every cache's)."""
        return {g.name: (g.allocated_bytes(self.engine), g.used_bytes(self.engine)) for g in self.groups}

    def kind_bytes(self) -> dict[str, tuple[int, int, int]]:
        """(allocated, used) K+V bytes and the caches of each kind of group: "shared" (every cache), or "full" and
        "sliding" (natural: one cache each; a per-layer layout: every layer's of that kind, summed)."""
        out: dict[str, tuple[int, int, int]] = {}
        for g in self.groups:
            kind = "shared" if g.cache is None else "sliding" if g.window else "full"
            a, u, n = out.get(kind, (0, 0, 0))
            out[kind] = (a + g.allocated_bytes(self.engine), u + g.used_bytes(self.engine), n + 1)
        return out

    def allocation(
        self, budget: Budget, layer_weights: Sequence[float] | None = None, every: int | None = None
    ) -> Allocation:
        """``budget`` laid out on this engine's layer groups (``budget.allocate``; a byte budget counts every
        layer's K+V bytes and may be refused as too small); adaptive: with the layers' current shares, or
        ``layer_weights``; with the eviction period ``every`` (default: the one in force)."""
        every = every or self.config.evict_every
        e = self.engine
        if layer_weights is None and self.shares is not None:
            layer_weights = self.shares.weights
        return allocate(
            budget,
            e.cache_layout(),
            self.config.layer_budgets,
            e.config.n_ubatch,
            self.config.longest,
            self.config.room,
            every,
            self.config.sliding_share,
            self.config.n_sink + self.config.n_recent,
            layer_weights,
            min((n for c, n in zip(e.caches, self._sizes(), strict=True) if e.cache_sliding(c)), default=0),
        )

    def _sizes(self) -> tuple[int, ...]:
        """The cells of each cache as the next decode will have them (an adaptive decision, or a byte budget's layout
        ``set_budget`` is checking, may be pending)."""
        if self._resize_to is None:
            return self.engine.cache_sizes()
        return tuple(self._resize_to[c] for c in self.engine.caches)  # (a decision names every cache the config has)

    # -- decoding ------------------------------------------------------------------------------------

    def prefill(
        self,
        tokens: Sequence[int],
        all_logits: bool = False,
        chunk: int | None = None,
        query: Sequence[int] | Reconstruct | Surprisal | None = None,
        ends_prompt: bool = True,
    ) -> np.ndarray:
        """Decode a prompt in chunks (of n_ubatch by default), compressing after each chunk; return the
        logits of the last token, or of every token with ``all_logits``.

        With ``query`` (the tokens of what the reader will be asked; see ``read_query``) and a policy that
        reads with one, every compression but the last is guided by it: the query (its last QUERY_TOKENS tokens)
        is decoded behind a span of the prompt (the chunk and what the query leaves of the room behind it), its
        attention over the cache (all layers, all heads) joins the policy's own score, and its cells are removed
        again before the next span, which takes its positions. The last span ends the prompt (where the question
        itself is) and is read once, normally (``ends_prompt=False``: these tokens are only a part of a prompt,
        and their last span is guided too). With ``Reconstruct`` no question
        is known: every chunk is scored by how much a repetition of it attends to each position. With
        ``Surprisal`` (any policy) every chunk is compressed by the surprisal of each position's phrase alone."""
        if not len(tokens):  # (an IndexError, deep in the chunking; len: a numpy array's truth value is ambiguous)
            raise ValueError("prefill needs at least one token")
        chunk = self._chunk(chunk)
        by_surprisal = isinstance(query, Surprisal)
        use_query = by_surprisal or (bool(query) and self.policy.reads_with_query)
        asked = self._asks(query)
        span = self.read_span(query, chunk)
        if asked:
            query = list(query)[-QUERY_TOKENS:]
        self._reading(use_query)
        if by_surprisal or (isinstance(query, Reconstruct) and use_query):
            self._score_by(type(query))
        # surprisal: the row that predicts this piece's first token, where it goes on a prompt read in pieces (the
        # drop-in's n_batch, the parallel server's): each piece's first token took its chunk's mean, so the same
        # prompt was compressed otherwise as its pieces were cut
        rows, before, i = [], self._surprisal_row if by_surprisal else None, 0
        self._surprisal_row = None
        try:
            while i < len(tokens):
                # a span is decoded a chunk at a time, and only its last chunk observed: the guided policies score
                # a prompt by the last rows before a compression (AhaKV's and SnapKV's recent sums keep 32, TOVA
                # one), and an observed chunk costs more: the side pass and the error term over every cell
                # (benchmarks/guided_read_cost.py, a short question: 2.8 against 2.0 ms a token on 2 cores).
                # A span that would leave its question no room (a budget raised past the cells) is one chunk
                n = span if span > chunk and self._has_room(span + len(query)) else chunk
                piece = tokens[i : i + n]
                i += len(piece)
                if by_surprisal:
                    logits = self._decode(piece, self.policy.window, True)
                    before = self._evict_by_surprisal(piece, logits, before, query)
                    rows.append(logits if all_logits else logits[-1])
                    continue
                for j in range(0, len(piece), chunk):
                    observe = j + chunk >= len(piece)
                    rows.append(self._decode(piece[j : j + chunk], self.policy.window, all_logits, observe))
                if isinstance(query, Reconstruct) and use_query:
                    again = [*query.prompt, *piece]
                    self.evict(self._reconstruction_scores(again) if self._has_room(len(again)) else None)
                    continue
                last = ends_prompt and i >= len(tokens)
                guided = asked and not last and self._over_budget()
                tail = self._fitting_tail(query) if guided else []
                self.evict(self.read_query(tail) if tail else None)
        finally:
            self._reading(False)
        if by_surprisal and not ends_prompt:
            self._surprisal_row = before
        return np.concatenate(rows) if all_logits else rows[-1]

    def _chunk(self, chunk: int | None) -> int:
        """A prompt chunk's tokens: ``chunk``, or the ubatch (None); one the engine cannot decode in one call is a
        ValueError (a chunk of -1 read nothing and looped for good; one past the ubatch was cut in several calls, and
        the cache filled in the second with the first's positions unknown to the policy)."""
        n_ubatch = self.engine.config.n_ubatch
        if chunk is None:
            return n_ubatch
        if not KINDS["int"](chunk) or not 0 < chunk <= n_ubatch:
            raise ValueError(f"a prompt chunk is 1 to {n_ubatch} tokens (the engine's n_ubatch), not {chunk!r}")
        return int(chunk)

    def _asks(self, query: Sequence[int] | Reconstruct | Surprisal | None) -> bool:
        """Whether ``prefill`` reads with ``query`` as a question (not question-agnostically, not plainly)."""
        return bool(query) and not isinstance(query, Reconstruct | Surprisal) and self.policy.reads_with_query

    def read_span(self, query: Sequence[int] | Reconstruct | Surprisal | None, chunk: int | None = None) -> int:
        """Prompt tokens ``prefill`` reads between two compressions: a chunk (of n_ubatch by default) or, guided by a
        question, a span: the chunk and what the question's last QUERY_TOKENS tokens leave of the room behind it (at
        chunks of 64: 24 question tokens for 104 of the prompt at most, ``budget.QUERY_TOKENS``). A caller feeding a
        prompt in pieces feeds spans (the compressions follow the pieces)."""
        chunk = self._chunk(chunk)
        if not self._asks(query):
            return chunk
        return chunk + max(0, self.config.room - min(len(query), QUERY_TOKENS))

    def prompt_pieces(
        self, tokens: Sequence[int], query: Sequence[int] | Reconstruct | Surprisal | None, n_batch: int
    ) -> Iterator[tuple[Sequence[int], bool]]:
        """A prompt in the pieces a caller reads one at a time (``read_piece``; to stop or time between them), each
        with whether it ends the prompt: ``n_batch`` tokens, or a guided reading's span where that is longer (the
        compressions follow the pieces, ``read_span``)."""
        n = max(n_batch, self.read_span(query))
        for i in range(0, len(tokens), n):
            yield tokens[i : i + n], i + n >= len(tokens)

    def read_piece(
        self, piece: Sequence[int], query: Sequence[int] | Reconstruct | Surprisal | None, ends_prompt: bool
    ) -> np.ndarray:
        """Read one of ``prompt_pieces``: a single token is a decode step (evicting on the step schedule), more are
        ``prefill``'s; the logits of its last token."""
        if len(piece) == 1:
            self._surprisal_row = None  # (the step decodes the position the row predicted)
            return self.step(piece[0])
        return self.prefill(piece, query=query, ends_prompt=ends_prompt)

    def _reading(self, guided: bool) -> None:
        """Tell every group's policy whether a prompt is being read under guidance (``Policy.reading``)."""
        self._guided = guided
        for g in self.groups:
            g.policy.reading(guided)

    def _score_by(self, reading: type[Reconstruct | Surprisal]) -> None:
        """``best`` holds one reading's scores: a read of the other kind starts it over. Reconstruction scores (a
        pass's attention scaled to mean 1, each position's best) and surprisal (nats) were mixed in one array, and
        a sequence extended under the other reading (a server request, a drop-in call with another ``kv_query``)
        ranked the positions read before by the other scale (reconstruction's ~1 against surprisal's ~3-10 nats:
        under surprisal the earlier read went first, under reconstruction it stayed)."""
        if self._scored_by is not reading:
            for g in self.groups:
                g.best[:] = np.nan
            self._scored_by = reading

    def _evict_by_surprisal(
        self, piece: Sequence[int], logits: np.ndarray, before: np.ndarray | None, rule: Surprisal
    ) -> np.ndarray:
        """Remember the surprisal of the chunk just decoded (``logits``: one row per token; ``before``: the row
        that predicted its first token, None at the start of a read: the chunk's mean stands in) by position in
        every group, evict by it averaged as ``rule`` says (``Surprisal``); return the chunk's last row."""
        rows = np.vstack([before, logits[:-1]]) if before is not None else logits[:-1]
        top = rows.max(axis=1)  # F32, as the logits come: float64 would cost 10x the time for nothing the ranking needs
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        predicted = np.asarray(piece[len(piece) - len(rows) :])
        surprisal = log_z - rows[np.arange(len(rows)), predicted]
        if len(surprisal) < len(piece):  # the first token of the read: nothing predicted it
            surprisal = np.concatenate([[surprisal.mean() if surprisal.size else 0.0], surprisal])
        n = self.engine.n_past
        for g in self.groups:
            g.grow_best(n)
            g.best[n - len(piece) : n] = surprisal
        # by position: the same for every group. A position no surprisal read scored (a conversation's earlier turns,
        # an answer's tokens, a prompt read otherwise) stands at the mean of those scored, neither first to go nor kept
        # whatever happens: at 0 it was the least surprising of all, and chat's /read of a document evicted the
        # conversation before any of the document
        scored = self.groups[0].best[:n]
        unscored = np.isnan(scored)
        if unscored.any():
            scored = np.where(unscored, scored[~unscored].mean(), scored)
        pooled = avg_pool(scored, rule.kernel)
        self.evict([pooled[g.live] for g in self.groups], alone=True)
        return logits[-1]

    def _reconstruction_scores(self, query: list[int]) -> list[np.ndarray]:
        """Score this pass, remember each position's best (scaled to mean 1 per pass) in every group, return
        the best of each group's live positions (a policy with ``whole_words``: each span's best, a span being a run
        of text between spaces, ``WordMap(joins=not_space)``)."""
        out = []
        for g, scores in zip(self.groups, self.read_query(query), strict=True):
            scores = unit_mean(scores)
            g.grow_best(int(g.live[-1]) + 1 if g.live.size else 0)
            g.best[g.live] = np.fmax(g.best[g.live], scores)  # (fmax: a position no pass scored yet is NaN)
            best = g.best[g.live]
            # a word read across two chunks got a best from each pass: its tokens share one best all the same, and so
            # do the characters that touch it (a number with its full stop: read back without it, the model added a
            # digit; on the tuning texts 11 of 15 keys against 7 of 15 for words alone, RESULTS.md)
            out.append(max_by_word(self.spans.words(g.live), best) if g.policy.whole_words else best)
        return out

    def read_query(self, query: Sequence[int]) -> list[np.ndarray]:
        """Decode ``query`` behind the live positions, return each group's policy's query score of its live
        positions (one array per group, aligned with its ``live``), and remove the query again: its cells,
        its statistics, and its positions, which the next tokens reuse. No policy's running state sees it."""
        e = self.engine
        start = e.n_past
        flags = self.policy.query_flags
        if self.config.track_mass:
            flags |= TapFlag.ATTN
        if self._resize_to is not None:
            self._resize()
        self._set_tap(flags, 0)  # every row of the query
        if flags & TapFlag.SIDE:
            e.set_side_scale(self.policy.side_scale(e.n_past, self._side_budget(e.n_past) or self.live.size))
        e.reset_stats()
        try:
            e.decode(list(query))
            self.stats.guide_tokens += len(query)
            scores = []
            for g in self.groups:
                seen = np.concatenate([g.live, np.arange(start, e.n_past, dtype=np.int64)])
                obs = self._observation(g, seen, flags, g.budget.target(start) or g.live.size)
                scores.append(g.policy.query_score(obs)[: g.live.size])
            scores = pooled_by_kind(self.groups, scores)  # one group per layer: a kind's layers rank alike
        finally:
            e.truncate(start)  # the query's cells go; llama.cpp needs the next token at seq_pos_max + 1
            e.reset_stats()
        for i, g in enumerate(self.groups):
            if g.window:  # llama.cpp may have given the query cells of positions that left the window
                now = g.read_live(e)
                if now.size != g.live.size:
                    kept = np.isin(g.live, now)
                    scores[i] = scores[i][kept]
                    # the span's observation stays the group's evidence, on the positions left: the statistics were
                    # reset with the question's, so _evict would re-read zeros (the policy's own score and adaptive's
                    # fill of these layers then came from nothing)
                    if g.obs is not None and g.obs.positions is g.live:
                        g.obs = g.obs.subset(kept)
                        g.live = g.obs.positions
                    else:
                        g.live = now
        return scores

    def _fitting_tail(self, query: Sequence[int], least: int = 8) -> list[int]:
        """The longest tail of the question (halving) that fits the free cells; [] if under ``least`` tokens
        would (the chunk is then compressed unguided, never failing for want of cells)."""
        n = len(query)
        if self._has_room(n):
            return list(query)
        while n >= least and not self._has_room(n):
            n //= 2
        return list(query[-n:]) if n >= least else []

    def _has_room(self, n: int) -> bool:
        """Whether ``n`` more tokens fit the allocated cells of every group now (a budget raised past the room
        the session was sized with reads that chunk unguided instead of failing)."""
        return all(g.has_room(self.engine, n) for g in self.groups)

    def _over_budget(self) -> bool:
        """Whether an eviction now would remove anything (cell and ratio budgets; auto decides for itself)."""
        n_seen = self.engine.n_past
        for g in self.groups:
            target = g.budget.target(n_seen)
            if target is None:
                if g.budget.mode == "auto":
                    return True
            elif g.live.size > max(1, target - (self.config.evict_every - 1)) or g.outside_window(n_seen).any():
                return True
        return False

    def step(self, token: int) -> np.ndarray:
        """Decode one generated token; evict every ``evict_every`` positions.

        The schedule follows the position, not a step counter, so the same tokens meet the same
        evictions whatever came before (a rewind, another request): greedy output is reproducible."""
        return step_batch([self], [token])[0]

    def _step_phase(self) -> tuple[int, bool]:
        """(the position's phase in the eviction period, whether this step is observed)."""
        every, watch = self.config.evict_every, self.config.observe_steps
        phase = self.engine.n_past % every
        return phase, watch is None or phase >= every - watch

    def check_floor(self, budget: Budget) -> None:
        """Refuse a budget that leaves a group too few cells for its protected positions (``check_floor``)."""
        check_floor(self.config, self.engine.cache_layout(), self.allocation(budget), budget)

    def check_budget(self, budget: Budget, policy: Policy | None = None, new_sequence: bool = False) -> None:
        """Every check a budget must pass before it is used with ``policy`` (default: the current one):
        the layout on the layer groups, the floor, the allocated cells, and an error model for 'auto'.
        Raises AhakvError; changes nothing. Checked with the eviction period the budget takes (``_period_for``): a
        server request's 64 cells were refused for the server's period of 32, or for whatever its slot last ran.
        ``new_sequence``: for a sequence read from the start (a server request), from even layer shares in the caches
        ``truncate(0)`` gives it, not the shares the last sequence drifted to (a request's 320 cells were refused
        after a long request and accepted after a short one)."""
        every, weights, sizes = self.config.evict_every, None, self._resize_to
        self.config.evict_every = self._period_for(budget)
        if new_sequence and self.shares is not None:
            weights = self.shares.weights.copy()
            self.shares.weights[:] = 1.0
            self._resize_to = tuple(self.allocation(self.config.budget).cache_cells)
        try:
            self._check_budget(budget, policy or self.policy)
        finally:
            self.config.evict_every, self._resize_to = every, sizes
            if weights is not None:
                self.shares.weights[:] = weights

    def _check_budget(self, budget: Budget, policy: Policy) -> None:
        # past the trained context nothing is ever evicted (chat's /budget 64GiB was taken, the open refused it)
        check_trained_context(budget, self.engine.n_ctx_train)
        allocation = self.allocation(budget)  # (once: the held cells and the floor are both checked on it)
        check_held_past_trained(budget, allocation, self.engine.n_ctx_train)
        check_policy(policy, budget, self._full_cache_cells(), self.reach)
        check_floor(self.config, self.engine.cache_layout(), allocation, budget)
        if policy.evicts and (short := self._short_cache(budget)) is not None:
            cells, held = short
            label = int(budget.value) if budget.mode == "cells" else budget
            # (a byte budget below the bytes allocated read as a contradiction: 8 MiB "does not fit" 11.3 MiB's caches,
            # where its layout holds 981 cells in a full-attention layer, the sliding ones held at their window)
            laid = f" (laid out as {held} cells there)" if budget.mode == "bytes" else ""
            room = f" and a guided reading's room of {self.config.room}" if self.config.room else ""
            raise AhakvError(
                f"budget {label}{laid} does not fit the {cells} allocated cells with a prompt chunk of "
                f"{self.engine.config.n_ubatch}{room}"
            )

    def _full_cache_cells(self) -> int:
        """The cells of the smallest cache a full-attention layer reads (what a budget in cells is held in) as the next
        decode will have them (``_sizes``), from the engine alone: ``check_budget`` runs before the groups exist."""
        e = self.engine
        full = [n for c, n in zip(e.caches, self._sizes(), strict=True) if not e.cache_sliding(c)]
        return min(full or [e.n_cells()])

    def fitted(self, budget: Budget) -> Budget:
        """``budget`` as the caches in place can hold it (``fit_to_cells``: a ratio or auto budget capped at what the
        smallest full-attention cache holds between evictions)."""
        return fit_to_cells(budget, self._full_cache_cells(), self.engine.config.n_ubatch, self.config, self.reach)

    def set_budget(self, budget: Budget, resize: bool = False) -> int:
        """Check, apply and enforce a new budget now (``fitted`` to the caches); returns how many positions were
        evicted (as ``ControllerStats.evicted`` counts them). With ``resize``, a byte budget also gives the caches
        its layout where the engine can move the sequence (``Engine.resizable``): the allocated bytes become the
        budget's, fewer or more, as if the session had been opened with it (chat's ``/budget 8MiB``). Otherwise
        every budget is held inside the caches as they are."""
        if not self.policy.evicts:  # accepted, a budget was then never held (cache 284/64)
            raise AhakvError(f"policy {self.policy.name} keeps every token: a budget needs a policy that evicts")
        lay_out = resize and self._lays_out(budget)
        planned = self._resize_to
        if lay_out:  # checked against the caches it will have (``_sizes``), not those of now, with its own period
            self._resize_to = tuple(self.allocation(budget, every=self._period_for(budget)).cache_cells)
        try:
            self._take_budget(budget)
        except AhakvError:
            self._resize_to = planned
            raise
        before = self.stats.evicted
        self.evict()  # down to the new holdings first: a cache cannot shrink below the cells it uses
        if lay_out:
            if self._pending:
                self._observe_block()  # the summed rows live in the old context's statistics
            self.resize_now()  # now: a failure is this call's, not the next decode's
            self.laid_out = self.config.budget
        return self.stats.evicted - before

    def _lays_out(self, budget: Budget) -> bool:
        """Whether ``set_budget(budget, resize=True)`` gives the caches the budget's own layout: a byte budget's, fewer
        or more bytes; adaptive, a cell budget's that the caches cannot hold as they are, within the memory the session
        was opened with (or has now, if a byte budget gave it more). Adaptive lays the caches out for the budget in
        force at each re-split anyway: after a smaller budget they shrank, and the budget the chat was opened with was
        refused for good (/reset too)."""
        e = self.engine
        if not e.resizable:
            return False
        if budget.mode == "bytes":
            return True
        if self.shares is None or budget.mode != "cells" or self.fits(budget):  # (a smaller one: at the next re-split)
            return False
        cells = self.allocation(budget, every=self._period_for(budget)).cache_cells
        needs = sum(cells[c] * e.cell_bytes(c) for c in e.caches)
        return needs <= max(self.opened_bytes, e.kv_bytes())

    def configure(self, budget: Budget, policy: Policy) -> None:
        """Check ``budget`` with ``policy`` together, then make them the ones in force: the configured budget,
        every group's eviction target (``allocation``) and the policy. Nothing is evicted now; the caller
        usually starts a new sequence next (``truncate(0)``). A ratio or auto budget is ``fitted`` to the caches."""
        self._take_budget(budget, policy)
        self.set_policy(policy)

    def restore(self, budget: Budget, policy: Policy) -> None:
        """``configure`` back to settings that were in force before a request's own (the server's). Adaptive lays the
        caches out for the budget of each new sequence (``truncate(0)``), so a request's smaller budget shrank them:
        they are laid out for the restored budget again, which is checked against them (against the shrunk caches,
        the server's own budget did not fit, and every later request ran at the request's)."""
        if self.shares is not None:
            self.schedule_resize(tuple(self.allocation(budget, every=self._period_for(budget)).cache_cells))
        self.configure(budget, policy)

    def _take_budget(self, budget: Budget, policy: Policy | None = None) -> None:
        """``budget``, ``fitted`` and checked (with ``policy``, default the current one), as the configured budget and
        every group's eviction target; nothing is evicted."""
        budget = self.fitted(budget)
        self.check_budget(budget, policy)
        self.config.evict_every = self._period_for(budget)
        self.config.budget = budget
        for g, held in zip(self.groups, self.allocation(budget).groups, strict=True):
            g.budget = held

    def _period_for(self, budget: Budget) -> int:
        """The eviction period under ``budget``: the configured one, or where it follows the budget the product's
        default for what the first group holds (as ``SessionSpec.evict_every_on`` chose it at the start)."""
        cfg = self.config
        if not cfg.period_follows_budget:
            return cfg.evict_every
        held = self.allocation(budget, every=LONGEST_PERIOD).groups[0] if budget.mode == "bytes" else budget
        return default_evict_every(held, cfg.n_sink, cfg.n_recent)

    def fits(self, budget: Budget) -> bool:
        """Whether the allocated cells of every cache hold its group's budget plus one prompt chunk, the newest token
        and a guided reading's room."""
        return self._short_cache(budget) is None

    def _short_cache(self, budget: Budget) -> tuple[int, int] | None:
        """The cells of the first cache too small for its group's share of ``budget``, and the cells that share holds
        (None: they all fit). The room
        counts: without it a chat's /budget 352 fitted Gemma's 417 cells opened for 256, and the next adaptive
        re-split laid the caches out for 352 and its room (513 cells, 23% more memory than the chat opened with)."""
        e, sizes = self.engine, self._sizes()
        groups = self.allocation(budget).groups
        for held, cells in zip(groups, [min(sizes)] if len(groups) == 1 else sizes, strict=True):
            if held.mode == "cells" and cells < cells_for(held, e.config.n_ubatch, 0, self.config.room):
                return cells, int(held.value)
        return None

    def set_policy(self, policy: Policy) -> None:
        """Switch policies; the new one learns from the next decode on (its statistics are tapped then).
        A policy the current budget cannot work with (an 'auto' budget without an error model) is refused."""
        self.check_budget(self.config.budget, policy)
        for i, g in enumerate(self.groups):
            g.policy = policy if i == 0 else policy.fresh()
            g.obs = None
        self._tap = None
        self._pending = 0

    def resync(self) -> None:
        """Take the live set from the engine after its cache was replaced (a state load): the cells
        moved, the positions did not; what the policy learned no longer matches, so it starts over."""
        self._forget_words(0)  # a loaded state's tokens are not known here: each position its own word
        for g in self.groups:
            g.live = g.read_live(self.engine)
            g.evicted = max(0, self.engine.n_past - g.live.size)  # what the saved sequence had evicted (chat /stats)
            # a fresh policy and no reconstruction scores: what the sequence before the load had learned (AhaKV's
            # head weights, the scores a /read folds in) made the loaded chat's next answers depend on it
            g.policy = g.policy.fresh()
            g.best[:] = np.nan
            g.obs = None
        self._pending = 0
        # and so do the tap's sums: llama.cpp's whole-context load (the drop-in's) leaves the last sequence's on the
        # cells it writes
        self.engine.reset_stats()
        self._tap = None  # nothing read for the policy yet (an eviction takes the oldest first: ``_evict``)
        for g in self.groups:
            g.decided = None  # the budget's own target: the saved sequence's last decision is not this one's
        self._resize_to = None  # the state was made for the caches as they are
        self._count()
        self.stats.tokens_seen = self.engine.n_past

    def truncate(self, n: int) -> None:
        """Rewind to position n: forget every position >= n (cells, bookkeeping and policy state). At the
        current position (n > 0) nothing is forgotten: the steps the tap summed but nobody read yet stay."""
        if 0 < n == self.engine.n_past:
            return
        if not 0 <= n <= self.engine.n_past:  # (n_past jumped ahead, and every later decode failed)
            raise ValueError(f"cannot rewind to {n}: {self.engine.n_past} positions decoded")
        if n < self.engine.n_past or n == 0:  # a new sequence empties the cells whatever the count says (a reset)
            self.engine.truncate(n)
        self.engine.n_past = n
        self._forget_words(n)
        for g in self.groups:
            g.live = g.live[g.live < n]
            # from the start: a fresh policy (same settings), so a replay meets exactly the same decisions
            g.policy = g.policy.fresh() if n == 0 else g.policy
            g.policy.truncate(n)
            g.best[n:] = np.nan
            g.obs = None
            # what it evicted of the positions it keeps (tokens_seen = cells_used + evicted): a rewind to a shared
            # prefix (a reused compressed history) kept the forgotten positions' evictions, "25 cells, 1685 evicted,
            # 25 seen"
            g.evicted = n - g.live.size
            if n == 0:  # a new sequence
                g.decided = None
        if self.shares is not None and n == 0:  # a new sequence starts from even shares, whatever came before
            self.shares.restart(0)
            self._hold(self.allocation(self.config.budget))
        self._pending = 0  # the summed rows may include forgotten positions' queries: drop them
        self._surprisal_row = None  # (a piece's last row: it predicted a position the rewind may replace)
        self.stats.tokens_seen = n
        if n == 0:  # a new sequence: its own peak, and no retained mass before its first eviction (/stats after
            self.stats.peak_cells, self.stats.retained_mass = 0, []  # a /reset showed the last conversation's)
        self._count()  # from n = 0, the budget's own target: the last decision belonged to the forgotten sequence

    def resume_point(self, n: int) -> int:
        """Where a read that replaces the positions from ``n`` on can start, at most ``n``: llama.cpp takes the next
        token at the newest position a cache holds + 1, so where the positions just below ``n`` were evicted (a
        compressed history reused from a prefix that ends among them) the read goes back to the newest position every
        group still holds below it, and the tokens from there are read again (they failed in llama_decode, for good:
        "the last position stored ... is X = 5 ... Y = 13"). A group holding none below it constrains nothing."""
        r = n
        while r > 0:
            tops = [int(live[live < r][-1]) for g in self.groups if (live := g.live).size and live[0] < r]
            back = min(tops, default=r - 1) + 1
            if back == r:
                return r
            r = back
        return 0

    def _record_words(self, start: int, tokens: Sequence[int]) -> None:
        self.words.add(start, tokens)
        self.spans.add(start, tokens)

    def _forget_words(self, n: int) -> None:
        self.words.truncate(n)
        self.spans.truncate(n)

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
        flags = self._before_decode(len(tokens), observe)
        self._set_tap(flags, window)
        start = self.engine.n_past
        logits = self.engine.decode(tokens, all_logits)
        self._record_words(start, tokens)
        self._after_decode(start, flags, observe)
        return logits

    def _before_decode(self, n_tokens: int, observe: bool) -> TapFlag:
        """Everything before a decode of ``n_tokens`` but the tap flags, which a batch of several sequences sets
        once for all (their union); returns this sequence's flags."""
        e = self.engine
        flags = self._flags(self.step_count)
        if not observe:
            # the norms stay current (turning them on again would recompute them all), and so does the model-softmax
            # tap where the observed step has it: a summing policy gets the rows as one block, and switching ATTN on
            # for each observation costs a scheduler reserve and two graph builds (7.9 ms a switch on an H200 against
            # 8% of a decode for ATTN on every step; 2.3 ms and 1.8% on this project's CPU: benchmarks/tap_overhead.py)
            flags &= TapFlag.VNORM | TapFlag.ATTN
        elif self._pending:
            self._observe_block()
        if self._resize_to is not None:
            self._resize()
        if flags & TapFlag.SIDE:
            target = self._side_budget(e.n_past + n_tokens) or self.stats.budget or n_tokens
            e.set_side_scale(self.policy.side_scale(e.n_past + n_tokens, target))
        if observe or (flags & TapFlag.ATTN and self.policy.accumulates and not self._pending):  # a new block
            e.reset_stats()  # (another policy's rows between observations are only summed, then dropped here)
        return flags

    def _side_budget(self, n: int) -> float | None:
        """k of the side pass's lambda(n) = sqrt(2 ln(n/k)/d) (one scale for every layer of a sequence): the cells a
        full-attention layer holds at n positions, their mean over the full-attention groups (the budget: a per-layer
        layout's shares have mean 1). It was the first group's target, in the per-layer layouts one layer's share
        (adaptive: whatever its last re-split gave it): every layer's sharpening drifted with it. None: not decided
        yet (an auto budget)."""
        targets = [g.budget.target(n) for g in self.groups if not g.window]
        if not targets or any(t is None for t in targets):
            return None
        return sum(targets) / len(targets)

    def _after_decode(self, start: int, flags: TapFlag, observe: bool) -> None:
        e = self.engine
        for g in self.groups:
            g.decoded(e, start)
            if observe:
                g.obs = self._observe(g, flags)
                if flags:
                    g.policy.observe(g.obs)
        if not observe and flags & TapFlag.ATTN and self.policy.accumulates:
            self._pending += 1
        self.stats.tokens_seen = e.n_past
        self._count()

    def _set_tap(self, flags: TapFlag, window: int) -> None:
        # a view of a shared context: another sequence may have set other flags since (the engine ignores a
        # call that changes nothing)
        if self._tap != (flags, window) or self.engine.shared:
            self.engine.set_tap(flags, window)
        self._tap = (flags, window)

    def _observe_block(self) -> None:
        """Hand each policy the attention the tap summed over the unobserved steps, as one observation."""
        for g in self.groups:
            g.policy.observe(self._observe(g, self._tap[0]))
        self._pending = 0

    def _observe(self, g: LayerGroup, flags: TapFlag) -> Observation:
        """The tapped statistics of the group's layers, aligned with its ``live`` (the engine maps cells to
        positions)."""
        e = self.engine
        if flags & TapFlag.VERR:
            flags |= TapFlag.VNORM  # the error model divides by the value norms
        target = g.budget.target(e.n_past)
        return self._observation(g, g.live, flags, target if target is not None else (g.decided or g.live.size))

    def _observation(self, g: LayerGroup, positions: np.ndarray, flags: TapFlag, budget: int) -> Observation:
        """The statistics of ``flags`` over the group's layers, aligned with ``positions``."""
        e = self.engine
        stats = e.aligned(positions, flags, g.layers)
        return Observation(
            positions=positions,
            n_seen=e.n_past,
            n_rows=e.stat_rows,
            budget=budget,
            visible=stats.visible,
            attn=stats.values.get(TapFlag.ATTN),
            side=stats.values.get(TapFlag.SIDE),
            verr=stats.values.get(TapFlag.VERR),
            vnorm=stats.values.get(TapFlag.VNORM),
            words=self.words.words(positions) if self._guided else None,
            room=self.config.evict_every - 1,
        )

    # -- eviction ------------------------------------------------------------------------------------

    def evict(self, query_scores: Sequence[np.ndarray] | None = None, alone: bool = False) -> int:
        """Evict every group down to its budget now; returns how many positions went (over all groups).
        ``query_scores`` (one array per group, aligned with its ``live``, from ``read_query``) join each
        policy's own score (``Policy.with_query``), or with ``alone`` replace it."""
        if not self.policy.evicts or not self.config.budget.evicts:
            return 0
        scores = query_scores if query_scores is not None else [None] * len(self.groups)
        gone = sum(self._evict(g, q, alone) for g, q in zip(self.groups, scores, strict=True))
        # adaptive: not while a question (or a reconstruction) guides the reading. The layers of a kind then rank
        # positions alike (pooled_by_kind) and keep the same ones only if they hold as many: re-split every 256
        # positions, Gemma 3 270M missed pass keys at 8K-16K that the even split finds, and a narrower range of
        # shares found them too (benchmarks/RESULTS.md, "Query-aware reading in each layout")
        if self.shares is not None and not self._guided and self.shares.due(self.engine.n_past):
            gone += self._adapt()
        self._count()  # the groups' targets too, when nothing went
        return gone

    def _adapt(self) -> int:
        """Adaptive layer budgets: re-split each kind's holdings over its layers (``adaptive.LayerShares``),
        evict from the layers that now hold less, and give every cache its new size (a new context: the tap
        starts over). Returns how many positions went."""
        self._hold(self.allocation(self.config.budget, self.shares.decide(self.engine.n_past)))
        return sum(self._evict(g, None, measure=False) for g in self.groups)

    def hold_budget(self) -> int:
        """Evict where a group holds more than its target now (a state saved under a larger budget: "cache 278/64"
        until the next turn); nothing where every group is within it (a state is loaded as it was saved)."""
        n = self.engine.n_past
        over = any((t := g.budget.target(n)) is not None and g.live.size > t for g in self.groups)
        return self.evict() if over else 0

    def takes_sizes(self, cells: Sequence[int]) -> bool:
        """Whether ``take_sizes`` takes these cache sizes: those of now, or adaptive shares of this budget (each kind of
        layer holding at most its even split)."""
        e = self.engine
        if tuple(cells) == e.cache_sizes():
            return True
        if self.shares is None or len(cells) != len(self.groups):
            return False
        if min(holding_of(n, e.config.n_ubatch, self.config.room).value for n in cells) < 1:
            return False
        even = self._even_split().cache_cells
        return all(a <= b for a, b in zip(self._per_kind(cells), self._per_kind(even), strict=True))

    def _per_kind(self, sizes: Sequence[int]) -> list[int]:
        """The cells of the full-attention and of the sliding-window caches, summed (``sizes`` in cache order)."""
        kinds = [bool(g.window) for g in self.groups]
        return [sum(n for n, k in zip(sizes, kinds, strict=True) if k == kind) for kind in (False, True)]

    def _even_split(self) -> Allocation:
        return self.allocation(self.config.budget, [1.0] * len(self.groups))

    def fill_budget(self) -> None:
        """After a state saved in smaller caches (``take_sizes``: a chat saved at a smaller budget), grow them back to
        this budget before the next decode (the state moves with them): they stayed that small for good, under a
        budget that said more, and a /budget of its own size was refused. Each layer keeps the share it was saved
        with (``take_sizes`` applied them), so each holds at least what it was saved holding: grown to even shares,
        a layer saved above the even split lost positions at the load (Gemma's layer 0 at 256 cells, 60 of 365,
        loaded into a chat of 300)."""
        if self.shares is None:
            return
        grown = self.allocation(self.config.budget)
        if self._per_kind(self.engine.cache_sizes()) != self._per_kind(grown.cache_cells):
            self._hold(grown)
        self._count()  # the targets of this budget (the state's were counted: /stats said its budget until a turn)

    def take_sizes(self, cells: tuple[int, ...]) -> None:
        """Empty the sequence and give the caches ``cells`` (a saved state's, made where adaptive shares had
        resized them: llama.cpp loads a cache's cells only into a cache as large), every layer holding what its
        cache was sized for. Refused in one line where the sizes do not fit this layout and budget."""
        e = self.engine
        if not self.takes_sizes(cells):
            raise AhakvError(
                f"this state was saved in caches of other sizes ({min(cells)}-{max(cells)} cells): not this context's "
                "layout and budget"
            )
        self.truncate(0)
        if tuple(cells) == e.cache_sizes():
            return
        held = [holding_of(n, e.config.n_ubatch, self.config.room) for n in cells]
        self._hold(replace(self.allocation(self.config.budget), groups=tuple(held), cache_cells=cells))
        if self._resize_to is not None:
            self._resize()  # now: llama.cpp loads the state next

    def _hold(self, allocation: Allocation) -> None:
        """Give every layer its holding of ``allocation`` (adaptive) and schedule the caches' new sizes (the layers
        that now hold less evict before the next decode: ``_adapt``, or an empty sequence)."""
        for g, held in zip(self.groups, allocation.groups, strict=True):
            g.budget = held
        self.laid_out = self.config.budget
        self.shares.applied({int(g.layers[0]): g.budget for g in self.groups})
        cells = tuple(allocation.cache_cells)  # a decision not yet applied is replaced, even by the sizes of now
        self._resize_to = cells if cells != self.engine.cache_sizes() else None

    def resize_now(self) -> None:
        """Give the caches the sizes scheduled for the next decode now (nothing decoded since needs the old context's
        logits: a budget set between messages, a server between requests)."""
        if self._resize_to is not None and self._sizes() != self.engine.cache_sizes():
            self._resize()
        self._resize_to = None

    def schedule_resize(self, cells: tuple[int, ...]) -> None:
        """Move the sequence to caches of ``cells`` (in the engine's cache order) just before the next decode."""
        self._resize_to = cells

    def _resize(self) -> None:
        """Give the caches the sizes the last adaptive decision chose, just before the next decode: the last
        decode's logits live in the old context, where a sampler (the drop-in's) still reads them."""
        e, cells = self.engine, self._resize_to
        self._resize_to = None
        e.resize_caches(cells)
        for g in self.groups:
            if g.window:  # llama.cpp reads back only what a sliding cache's window still sees
                g.live, g.obs = g.read_live(e), None

    def _evict(self, g: LayerGroup, query_scores: np.ndarray | None, alone: bool = False, measure: bool = True) -> int:
        if g.obs is None or g.obs.positions is not g.live:
            # the live set changed since the last decode (an eviction, a new budget): re-read the
            # accumulated statistics for it; the policy has already observed them
            g.obs = self._observe(g, self._tap[0] if self._tap is not None else TapFlag(0))
        obs, budget = g.obs, g.budget
        if self.shares is not None and measure and obs.attn is not None:  # adaptive: the layer's fill
            self.shares.observe(int(g.layers[0]), obs)
        if budget.mode == "auto" and (obs.verr is None or obs.vnorm is None):
            # the error model decides at the next observed step (the budget just became auto); until then nothing is
            # decided (chat's /stats showed the last budget's 256 cells as auto's)
            g.decided = None
            return 0
        n = g.live.size
        gone = g.outside_window(obs.n_seen)  # no layer of the group sees these again: they go first
        cfg = self.config
        candidates = np.flatnonzero(~g.protected(cfg.n_sink, cfg.n_recent, cfg.pinned) | gone)
        if self._tap is None:
            # nothing read for this policy yet (just switched to, or a state just loaded): the oldest positions that
            # may go, go first; a /budget then holds at once (it waited for the next message, the stats saying 56/40)
            scores = g.live.astype(np.float64)
        elif query_scores is not None and alone:
            scores = np.asarray(query_scores, dtype=np.float64)
        else:
            scores = g.policy.score(obs)
            if query_scores is not None:
                scores = g.policy.with_query(scores, query_scores)
        if gone.any():
            scores = np.where(gone, -np.inf, scores)
        scores = scores[candidates]
        order = candidates[np.lexsort((g.live[candidates], scores))]  # lowest score first, then oldest
        if budget.mode == "auto":
            k = self._auto_count(g, obs, order)
            g.decided = n - k
        else:
            target = budget.target(obs.n_seen)
            keep = max(1, target - (self.config.evict_every - 1))  # room for the steps to come
            k = min(max(0, n - keep), order.size)
            # what it may hold until the next eviction: the target, or where they are more the positions it may not
            # evict and the steps to come (a ratio of a short conversation under the sinks, the system prompt and the
            # recent ones, as check_floor refuses a cell budget): chat showed "cache 52/24 cells"
            g.decided = max(target, n - candidates.size + self.config.evict_every - 1)
        k = max(k, int(np.count_nonzero(gone)))
        if k == 0:
            return 0
        victims = np.sort(order[:k])
        if obs.attn is not None:
            kept = np.ones(n, dtype=bool)
            kept[victims] = False
            total = obs.attn.sum(axis=2)
            mass = (obs.attn[:, :, kept].sum(axis=2) / np.maximum(total, 1e-12)).mean(axis=1)
            self._record_mass(g, mass, seen=total.sum(axis=1) > 0)
        if g.cache is None:
            self.engine.evict(g.live[victims])
        else:
            self.engine.evict(g.live[victims], g.cache)
        g.live = np.delete(g.live, victims)
        g.obs = None
        g.evicted += k
        self.stats.evictions += 1
        return k

    def _record_mass(self, g: LayerGroup, mass: np.ndarray, seen: np.ndarray) -> None:
        """The retained mass of the group's layers at its last eviction, in the per-layer statistic; a layer whose
        statistics hold no attention (none observed since they started over: a resize, a reading's end) keeps its
        last figure (it showed 0.000 retained)."""
        layers = range(self.engine.n_layer) if g.layers is None else g.layers
        per_layer = self.stats.retained_mass or [1.0] * self.engine.n_layer
        for il, m, observed in zip(layers, mass, seen, strict=True):
            if observed:
                per_layer[int(il)] = float(m)
        self.stats.retained_mass = per_layer

    def _auto_count(self, g: LayerGroup, obs: Observation, order: np.ndarray) -> int:
        """Auto budget: evict the most low-scored tokens whose predicted relative output change stays
        under the tolerance, keeping between min_ratio and max_ratio of the tokens seen (at most its cap)."""
        b, n = g.budget, g.live.size
        least, most = math.ceil(b.min_ratio * obs.n_seen), math.floor(b.max_ratio * obs.n_seen)
        if b.cap is not None:  # never more than the caches hold (``fitted``), also at the steps until the next eviction
            cap = max(1, b.cap - (self.config.evict_every - 1))
            least, most = min(least, cap), min(most, cap)
        k_max = min(order.size, max(0, n - least))
        k_min = min(k_max, max(0, n - most))
        if k_max == 0:
            return 0
        errors = g.policy.predicted_error(obs, order[:k_max])
        k = int(np.searchsorted(errors, b.error_tol, side="right"))  # errors grow with k
        return max(k_min, min(k, k_max))


def pooled_by_kind(groups: Sequence[LayerGroup], scores: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each group's question score replaced, at each of its positions, by the mean of the scores (each scaled to
    mean 1) of every group of its kind (sliding-window or full-attention) that holds the position; a kind of one
    group (the shared pool, natural) keeps its scores as they are. A question is
    read through all the layers at once: where each layer kept what its own heads attend to, the full-attention
    layers of Gemma 3 270M kept different positions and the model missed pass keys the shared pool finds
    (benchmarks/RESULTS.md, "Query-aware reading in each layout")."""
    out = list(scores)
    for sliding in (False, True):
        members = [i for i, g in enumerate(groups) if bool(g.window) == sliding]
        if len(members) < 2:
            continue
        positions = np.concatenate([groups[i].live for i in members])
        values = np.concatenate([unit_mean(np.asarray(scores[i], dtype=np.float64)) for i in members])
        unique, inverse = np.unique(positions, return_inverse=True)
        mean = np.bincount(inverse, values) / np.bincount(inverse)
        for i in members:
            out[i] = mean[np.searchsorted(unique, groups[i].live)]
    return out


def step_batch(controllers: Sequence[KVController], tokens: Sequence[int]) -> np.ndarray:
    """``KVController.step`` for several sequences of one context at once: one token each, decoded in one
    llama_decode with the union of their tap flags (a cell holds one sequence's token and the KQ mask keeps
    sequences apart, so the flags one sequence does not need only add statistics it resets before its next
    observation); each observes, and evicts from its own sequence, on its own schedule. Returns the logits
    [len(controllers), n_vocab]."""
    plan = []
    for c in controllers:
        phase, observe = c._step_phase()
        plan.append((phase, observe, c._before_decode(1, observe), c.engine.n_past))
    union = TapFlag(0)
    for *_, flags, _start in plan:
        union |= flags
    if len(controllers) == 1:
        controllers[0]._set_tap(union, 1)
    else:
        controllers[0].engine.set_tap(union, 1)
        for c, (*_, flags, _start) in zip(controllers, plan, strict=True):
            c._tap = (flags, 1)
    logits = decode_batch([c.engine for c in controllers], tokens)
    for c, token, (phase, observe, flags, start) in zip(controllers, tokens, plan, strict=True):
        c._record_words(start, [token])
        c._after_decode(start, flags, observe)
        c.step_count += 1
        if phase == c.config.evict_every - 1:
            c.evict()
    return logits


def _mean(values: Sequence[int]) -> int:
    return round(sum(values) / len(values))
