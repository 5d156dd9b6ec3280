"""The budget: how much of a sequence's KV cache to keep, and how many cells that takes.

This module is the one owner of budgets: their grammar (``Budget.parse``), their meaning at a given
length (``Budget.target``), the one spelling of "no eviction" (``NO_EVICTION``), the one rule for how
many KV cells a bounded sequence allocates (``cells_for``), how a budget is laid out on a model's layer
groups and caches (``allocate``: a budget in bytes; ``shared``, ``natural``, or one cache per layer: ``uniform``
and ``pyramid``) and the default eviction
schedule. The controller enforces a budget (``KVController.set_budget``); nothing else parses or sizes one.

A cell or ratio budget counts the cells of a full-attention layer (the base cache); a byte budget counts
the allocated K+V bytes of every layer (every cache, as llama.cpp allocates them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Literal, get_args

from .errors import AhakvError

BudgetMode = Literal["cells", "ratio", "auto", "none", "bytes"]
BUDGET_MODES = get_args(BudgetMode)


@dataclass(frozen=True)
class Budget:
    """How many cells to keep: a fixed count, a fraction of the tokens seen, ``auto`` (decided by the
    policy's error model), or ``none`` (keep everything: ``NO_EVICTION``)."""

    mode: BudgetMode
    value: float = 0.0
    min_ratio: float = 0.10  # auto: never keep less than this fraction of the tokens seen
    max_ratio: float = 0.40  # auto: never keep more
    error_tol: float = 0.05  # auto: evict while the predicted relative output change stays below this
    cap: int | None = None  # ratio, auto: never more than this many cells (a sliding group's; KVController.fitted)

    def __post_init__(self) -> None:
        if self.mode not in BUDGET_MODES:  # (Budget("bogus", 3) ran, labelled "the full cache")
            raise AhakvError(f"a budget's mode is one of {', '.join(BUDGET_MODES)}, not {self.mode!r}")
        # the drop-in's kv_min_ratio/kv_max_ratio/kv_error_tol come here unchecked: "x" ran, and reached numpy
        for name in ("min_ratio", "max_ratio", "error_tol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not 0 < v <= 1:
                raise AhakvError(f"{name} must be a number in (0, 1], not {v!r}")
        if self.min_ratio > self.max_ratio:
            raise AhakvError(f"min_ratio {self.min_ratio} is more than max_ratio {self.max_ratio}")

    def parsed(self, text: str | int | float) -> Budget:
        """Another budget from ``text`` with this one's auto parameters (min and max ratio, error tolerance): what a
        chat's /budget or a server request's kv_budget sets in a session opened with them."""
        return Budget.parse(text, min_ratio=self.min_ratio, max_ratio=self.max_ratio, error_tol=self.error_tol)

    @classmethod
    def parse(cls, text: str | int | float, **kw) -> Budget:
        """'128' -> 128 cells, '0.25' or '25%' -> a quarter of the tokens seen, 'auto' -> error-driven,
        '16MiB' (B, KiB, MiB, GiB; '1.5 GiB') -> allocated KV bytes over every layer. The one parser of
        budgets; anything else (0, 0%, 100%, inf, nan, 1.5, -3, 0.5B) is an AhakvError."""
        s = str(text).strip().lower()
        if s == "auto":
            return cls("auto", **kw)
        unit = next((u for u in BYTE_UNITS if s.endswith(u.lower())), None)
        if unit is not None:
            try:
                n = float(s[: -len(unit)].strip()) * BYTE_UNITS[unit]
            except ValueError:  # '1TiB' ends in B too: a unit this parser does not know, or no number
                units = ", ".join(BYTE_UNITS)
                raise AhakvError(
                    f"a budget in bytes is a number and one of {units}, like 16MiB, not {text!r}"
                ) from None
            if not (math.isfinite(n) and n >= 1 and n == int(n)):
                raise AhakvError(
                    f"a budget in bytes must be a positive whole number of bytes, like 16MiB, not {text!r}"
                )
            return cls("bytes", int(n), **kw)
        percent = s.endswith("%")
        try:  # a whole number as written (a float made 99999999999999999999 "budget 100000000000000000000 cells")
            v = int(s) if s.isdigit() else float(s[:-1] if percent else s)
        except ValueError:
            raise AhakvError(
                f"budget must be a cell count, bytes (16MiB), a ratio (0.25 or 25%) or 'auto', not {text!r}"
            ) from None
        if percent:
            v /= 100
            if not 0 < v < 1:
                raise AhakvError(f"a budget in percent must be above 0% and below 100%, not {text!r}")
            return cls("ratio", v, **kw)
        if v < 2**1023 and math.isfinite(v) and v >= 1 and v == int(v):  # (an int past float's range: OverflowError)
            return cls("cells", int(v), **kw)
        if 0 < v < 1:
            return cls("ratio", v, **kw)
        raise AhakvError(f"budget must be a positive whole number of cells or a ratio in (0, 1), not {text!r}")

    @property
    def evicts(self) -> bool:
        return self.mode != "none"

    def target(self, n_seen: int) -> int | None:
        """Cells to keep after ``n_seen`` tokens; None where the error model decides (auto) or nothing
        is evicted (none)."""
        if self.mode == "cells":
            target = int(self.value)
        elif self.mode == "ratio":
            target = max(1, math.ceil(self.value * n_seen))
        else:
            return None  # bytes: cells only once laid out on a model (allocate)
        return target if self.cap is None else min(target, self.cap)

    def compression(self, n_seen: int) -> float:
        """Tokens seen per cell kept (1.0 for the full cache; auto: unknown before it runs, also 1.0)."""
        target = self.target(n_seen)
        return n_seen / target if target else 1.0

    def __str__(self) -> str:
        if self.mode == "cells":
            return f"{int(self.value)} cells"
        if self.mode == "ratio":
            return f"{100 * self.value:.15g}%" + (f" (at most {self.cap} cells)" if self.cap is not None else "")
        if self.mode == "bytes":
            return format_bytes(int(self.value))
        if self.mode == "auto":
            return "auto" + (f" (at most {self.cap} cells)" if self.cap is not None else "")
        return "full cache"


def as_option(budget: Budget) -> str:
    """The text ``--budget`` (and chat's ``/budget``) takes for ``budget``: "1024", "25%", "8MiB", "auto" (a cap is
    the caches', not the budget's)."""
    if budget.mode == "cells":
        return str(int(budget.value))
    if budget.mode == "ratio":  # in percent where that reads back to the same ratio, else as the fraction it is
        percent = f"{100 * budget.value:.15g}%"
        return percent if float(percent[:-1]) / 100 == budget.value else repr(float(budget.value))
    if budget.mode == "bytes":
        return format_bytes(int(budget.value)).replace(" ", "")
    return budget.mode


BYTE_UNITS = {"GiB": 1024**3, "MiB": 1024**2, "KiB": 1024, "B": 1}  # largest first; "B" ends them all: last


def format_bytes(n: int) -> str:
    """'16 MiB', '1.5 GiB', '1000 B': the largest unit that spells ``n`` exactly (Budget.parse reads it back)."""
    for unit, size in BYTE_UNITS.items():
        if n >= size and float(f"{n / size:g}") * size == n:
            return f"{n / size:g} {unit}"
    return f"{n} B"


NO_EVICTION = Budget("none")  # the full cache: every position is kept


# how a prompt longer than the budget is read: by the policy alone, guided by its question, or without one
Reading = Literal["plain", "query", "reconstruct", "surprisal"]
READINGS: tuple[str, ...] = get_args(Reading)
QUESTION_AGNOSTIC: tuple[str, ...] = ("reconstruct", "surprisal")  # readings no question guides
# the drop-in's and the server's kv_query: a question's text, True (the request's own question), False or None
# (plainly), or a question-agnostic reading by name
KVQuery = bool | str | None


def kv_query_of(reading: Reading) -> bool | str:
    """The kv_query a reading (the command line's ``--reading``) is asked with."""
    return {"query": True, "plain": False}.get(reading, reading)


def reading_of(kv_query: bool | str | None) -> Reading:
    """The reading a ``Llama`` opened with ``kv_query`` (True, False, None or a reading by name) lays its caches out
    for (``guide_room``)."""
    return "query" if kv_query is True else kv_query or "plain"


# A question guides the reading of a long prompt by its last QUERY_TOKENS tokens (the suite's questions, 14-23
# tokens, whole), decoded behind each span of the prompt: a chunk and what the question leaves of the room behind
# it (KVController.read_span). At the sessions' chunk of 64 a span and its question fill 128 cells, so the question
# is at most 24 / 128 of the tokens decoded: a guided reading decodes at most 1.23x the plain one's tokens
QUERY_TOKENS = 24
QUERY_ROOM = 128  # the most cells kept behind a chunk for a question
REPEAT_TOKENS = 32  # room for the repetition prompt of a question-agnostic (reconstruction) reading


def guide_room(reading: str, chunk: int) -> int:
    """Cells a guided reading needs on top: the question (or a repetition prompt and the chunk again)
    is decoded behind each chunk before the compression; a question shorter than the room leaves the rest to
    a longer span of the prompt."""
    return {"query": min(QUERY_ROOM, chunk), "reconstruct": REPEAT_TOKENS + chunk}.get(reading, 0)


def room_short(reading: str, chunk: int, room: int) -> int | None:
    """The cells ``reading`` decodes beside a chunk of ``chunk`` where caches that keep ``room`` beside it hold fewer
    (None: they hold it). Such a reading went without its guide once the cache was full, read plainly without a word:
    a reconstruction in caches laid out for a question's room."""
    needs = guide_room(reading, chunk)
    return needs if needs > room else None


def check_room(reading: str, chunk: int, room: int, *, shown: str, caches: str, advice: str) -> None:
    """Refuse ``reading`` where caches that keep ``room`` beside a chunk of ``chunk`` cannot hold what it decodes
    (``room_short``), in the caller's words: ``shown`` is the reading as its user wrote it, ``caches`` whose caches they
    are ("this server's") and ``advice`` how to open them with the room."""
    if (needs := room_short(reading, chunk, room)) is not None:
        raise AhakvError(
            f"{shown} decodes a repetition of {needs} tokens beside each chunk, and {caches} caches keep {room}: "
            f"{advice}"
        )


def cells_for(budget: Budget, chunk: int, longest: int, room: int = 0) -> int:
    """KV cells to allocate for a sequence under ``budget`` that is read ``chunk`` tokens at a time and is
    at most ``longest`` tokens long: a cell budget needs itself, one chunk on top (the cache is compressed
    after each chunk), the newest token and the ``room`` a guided reading decodes behind a chunk
    (``guide_room``); any other budget can need every position (capped by ``longest``: a ratio of the
    whole, or an error model, or no eviction)."""
    if budget.mode == "cells":
        return int(budget.value) + chunk + 1 + room
    if budget.cap is not None:  # a ratio that never holds more than its cap: as a cell budget of the cap
        capped = budget.cap + chunk + 1
        return (min(capped, longest) if longest else capped) + room
    return longest + room


def holding_of(cells: int, chunk: int, room: int = 0) -> Budget:
    """The cells a cache of ``cells`` holds between evictions: ``cells_for`` of a cell budget, inverted."""
    return Budget("cells", cells - chunk - 1 - room)


LayerBudgets = Literal["shared", "natural", "uniform", "pyramid", "adaptive"]
LAYER_BUDGETS: tuple[str, ...] = get_args(LayerBudgets)
PER_LAYER: tuple[str, ...] = ("uniform", "pyramid", "adaptive")  # one cache per layer (EngineConfig.layer_groups)
# the product's layout (chat, generate, serve, the drop-in; not the measuring commands, whose SessionSpec default is
# the shared pool) on a model with sliding-window and full-attention layers: at 1,024 cells on Gemma 3 270M, 4,096
# tokens, adaptive and natural allocate 11.9 MiB (the shared pool 19.1) and adaptive is lower in perplexity and KL on
# LGPL-2.1 and GPL-3 (RESULTS.md, "The default layout"). On any other model `natural`, which there is the shared pool
DEFAULT_LAYER_BUDGETS: LayerBudgets = "adaptive"


def default_layer_budgets(n_sliding: int, n_layer: int, offloaded: bool = False) -> LayerBudgets:
    """The product's layout on a model whose ``n_layer`` layers include ``n_sliding`` sliding-window ones:
    ``DEFAULT_LAYER_BUDGETS`` where it has layers of both kinds (what a per-layer layout needs) and they run on the
    CPU, else ``natural``. With layers ``offloaded`` to a GPU the per-layer bookkeeping (a statistics read and an
    eviction per layer, from Python) no longer hides behind the model's own compute: on an H200, Gemma 3 270M read
    prompts 3.3x and decoded 1.7x slower in adaptive than in natural (benchmarks/gpu_h200.md), where on the CPU
    the two read and decode alike."""
    return DEFAULT_LAYER_BUDGETS if 0 < n_sliding < n_layer and not offloaded else "natural"


def check_layer_budgets(name: str) -> str:
    """``name`` if it is a layout of ``LAYER_BUDGETS``, else a one-line error naming them."""
    if name not in LAYER_BUDGETS:
        raise AhakvError(f"layer budgets must be {', '.join(LAYER_BUDGETS)}, not {name!r}")
    return name


# pyramid: a kind's first layer holds (1 + PYRAMID_SLOPE) times the kind's mean, its last (1 - PYRAMID_SLOPE)
# times, linearly in between (PyramidKV: lower layers attend broadly, upper ones to few tokens). Not tuned
PYRAMID_SLOPE = 0.5
# adaptive: a layer's holding stays within (1 -/+ ADAPTIVE_RANGE) times its kind's mean, the pyramid's range
ADAPTIVE_RANGE = 0.5


@dataclass(frozen=True)
class CacheLayout:
    """What laying out a budget needs to know of a model's KV caches (``Engine.cache_layout``): the K+V bytes
    of one cell of each cache, over every layer that reads it, and the sliding window (0: one cache)."""

    base_bytes: int  # one cell of the full-attention cache, all its layers
    sliding_bytes: int = 0  # one cell of the sliding-window cache, all its layers (0: the model has none)
    window: int = 0  # positions a sliding-window layer sees
    sliding: tuple[bool, ...] = ()  # by layer: whether it reads the sliding-window cache (per-layer layouts)

    def bytes(self, cache_cells: tuple[int, int]) -> int:
        """Allocated K+V bytes of caches of these sizes (base, sliding)."""
        return cache_cells[0] * self.base_bytes + cache_cells[1] * self.sliding_bytes


@dataclass(frozen=True)
class Allocation:
    """A budget laid out on a model: the budget each layer group holds (the base or shared group first, then
    the sliding group under ``natural``) and the cells of each cache, (base, sliding); 0 for a cache the
    model does not have."""

    layer_budgets: str
    groups: tuple[Budget, ...]
    cache_cells: tuple[int, ...]  # by cache: (base, sliding), or one per layer group
    layer_groups: tuple[int, ...] | None = None  # per-layer layouts: each layer's cache (EngineConfig.layer_groups)
    sliding: tuple[bool, ...] = ()  # by group: whether its layers slide (empty: the second group alone)

    def group_slides(self, i: int) -> bool:
        return self.sliding[i] if self.sliding else i == 1

    def layer_cells(self, layer_sliding: Sequence[bool]) -> tuple[int, ...]:
        """The cells of the cache each layer reads (``layer_sliding``: by layer, whether it slides)."""
        if self.layer_groups is not None:
            return tuple(self.cache_cells[g] for g in self.layer_groups)
        return tuple(self.cache_cells[int(s)] for s in layer_sliding)


def allocate(
    budget: Budget,
    layout: CacheLayout,
    layer_budgets: str = "shared",
    chunk: int = 64,
    longest: int = 0,
    room: int = 0,
    every: int = 1,
    sliding_share: float | None = None,
    keep: int = 0,
    layer_weights: Sequence[float] | None = None,
    sliding_cells: int = 0,
) -> Allocation:
    """Lay ``budget`` out on the layer groups and caches of a model read ``chunk`` tokens at a time, at most
    ``longest`` long, with ``room`` for a guided reading and an eviction every ``every`` steps; ``sliding_cells``:
    the cells of a sliding cache that exists already (a budget changed at run time; 0: none yet).

    ``shared``: one group over every layer, one cell count for every cache (a position is evicted from all
    of them at once: the single pool). ``natural`` (a model with a sliding-window cache; with one cache it is
    ``shared``): one group per cache. The sliding group never holds more than its window plus the positions
    that leave it between two evictions (window + every - 1), nor more than the full-attention group.

    A cell or ratio budget is what the full-attention group holds (cells of a full-attention layer); the
    sliding group holds as much, up to its window. A byte budget is the allocated K+V bytes of every layer,
    each cache sized by ``cells_for`` (a group's cells + one chunk + the newest token + ``room``): ``shared``
    gives every cache the most cells the bytes allow. ``natural`` splits them evenly: what is left once each
    cache has its chunk, newest token and room, half to the cells each group holds (five full-attention cells
    for one sliding cell on Gemma 3 270M), the sliding group holding at least twice its ``keep`` (sinks + recent:
    as many positions to choose from as it must keep; at most the shared layout's cells) and at most its window,
    the full-attention group the rest.
    ``sliding_share`` gives the sliding cache that share of the bytes instead. The even split was chosen on
    LGPL-2.1 against shares of 0.3-0.83 (benchmarks/group_split.py: best 0.5, 0.55 and 0.7 at 1/2, 1/4 and 1/8 of
    llama.cpp's trimmed cache at 4,096 tokens; the rule gives 0.53, 0.57 and 0.69) and checked on GPL-3 and
    MPL-1.1 (benchmarks/RESULTS.md)."""
    check_layer_budgets(layer_budgets)
    if layer_budgets in PER_LAYER:
        return _per_layer(
            budget, layout, layer_budgets, chunk, longest, room, every, sliding_share, keep, layer_weights,
            sliding_cells,
        )  # fmt: skip
    two = layout.sliding_bytes > 0
    # natural needs both kinds: a model whose every layer slides (a gemma2 whose pattern says so) has one group, as
    # in the shared pool (two groups, one of no layer, failed inside the controller)
    natural = two and layout.base_bytes > 0 and layout.window > 0 and layer_budgets == "natural"
    extra = chunk + 1 + room  # what cells_for adds to the cells a group holds
    window = layout.window + every - 1
    if budget.mode == "bytes":
        total = int(budget.value)
        shared = total // (layout.base_bytes + layout.sliding_bytes)
        sliding = shared
        if natural and sliding_share is None:  # the even split of what the groups hold
            free = total - extra * (layout.base_bytes + layout.sliding_bytes)
            floor = min(2 * keep, shared - extra)  # never more than the shared layout's cells
            sliding = min(window, max(floor, free // 2 // layout.sliding_bytes)) + extra
        elif natural:
            if not 0 < sliding_share < 1:
                raise AhakvError(f"the sliding cache's share of the bytes must be in (0, 1), not {sliding_share}")
            sliding = min(window + extra, int(sliding_share * total) // layout.sliding_bytes)
        base = (total - sliding * layout.sliding_bytes) // layout.base_bytes if natural else shared
        if min(base, sliding) <= extra:
            raise AhakvError(
                f"budget {budget} allocates {shared} cells per layer: not enough for a prompt chunk of {chunk}, "
                f"the newest token{' and a guided reading' if room else ''} ({extra} cells) and one kept"
            )
        groups = (Budget("cells", base - extra),) + ((Budget("cells", sliding - extra),) if natural else ())
        return Allocation(layer_budgets, groups, (base, sliding if two else 0))
    base = max(chunk, cells_for(budget, chunk, longest, room))  # a cache holds one chunk at least
    if not natural:
        return Allocation(layer_budgets, (budget,), (base, base if two else 0))
    if budget.mode == "cells":
        held = Budget("cells", min(int(budget.value), window))
    elif budget.mode == "ratio":  # at most its window, and the budget's own cap (KVController.fitted)
        held = Budget("ratio", budget.value, cap=window if budget.cap is None else min(budget.cap, window))
    else:  # auto: its window; none: nothing evicted (llama.cpp drops what leaves the window itself)
        held = Budget("cells", window) if budget.evicts else budget
        if budget.evicts and extra < sliding_cells < min(window + extra, longest + room if longest else math.inf):
            # caches sized for fewer cells (a server request's 'auto', chat's /budget auto): the window would not
            # fit, so the sliding group holds what its cache has room for, chosen by the policy's scores
            held = Budget("cells", sliding_cells - extra)
    sliding = min(
        max(chunk, cells_for(held if held.mode == "cells" else Budget("cells", window), chunk, longest, room)), base
    )
    if held.mode == "cells" and held.value + extra > sliding:
        # an auto budget on caches of fewer cells than the window needs (a context of 512 positions): as above,
        # the sliding group holds what its cache has room for
        held = Budget("cells", max(1, sliding - extra))
    return Allocation(layer_budgets, (budget, held), (base, sliding))


# kv_type "auto": K and V in the type that measured best for the bytes (AhaKV, natural groups, KL from the full
# cache at 4,096 tokens, benchmarks/RESULTS.md): f16 while the budget holds llama.cpp's whole trimmed cache (nothing
# to evict: rounding would be the only change), q8_0 below it (at 1/2 and 1/4 of it: KL 3x and 4x lower than f16),
# q5_0 below 1/Q5_0_BELOW of it (1.55x the cells of q8_0 win over its coarser rounding: chosen on LGPL-2.1 from 1/4,
# 1/5, 1/6, 1/8, where the two tie in KL at 1/5; checked on GPL-3 and MPL-1.1 at 1/4 and 1/8, and at 16K)
KV_TYPE_AUTO = "auto"
Q5_0_BELOW = 5


def kv_type_for(budget: Budget, trimmed_bytes: int) -> str:
    """The K/V type ``kv_type="auto"`` spends ``budget`` in, for a sequence whose llama.cpp trimmed cache (f16,
    ``ModelInfo.trimmed_bytes``) is ``trimmed_bytes``. Only a byte budget is spent in a smaller type: a cell or
    ratio budget names cells, which a smaller type would only round."""
    if budget.mode != "bytes" or budget.value >= trimmed_bytes:
        return "f16"
    return "q8_0" if budget.value * Q5_0_BELOW >= trimmed_bytes else "q5_0"


def check_trained_context(budget: Budget, n_ctx_train: int) -> None:
    """Refuse a cell budget past the model's trained context (0: unknown): nothing would ever be evicted."""
    if budget.mode == "cells" and n_ctx_train and budget.value > n_ctx_train:
        raise AhakvError(
            f"budget {int(budget.value)} cells exceeds the model's trained context of {n_ctx_train} positions, "
            "so nothing would ever be evicted: use a smaller budget, or none for the full cache"
        )


def check_held_past_trained(budget: Budget, allocation: Allocation, n_ctx_train: int) -> None:
    """Refuse a byte budget whose every full-attention layer holds more cells than the trained context has positions
    (as ``check_trained_context`` refuses such a cell budget): nothing would ever be evicted. 100GiB was accepted and
    allocated caches that held every position."""
    if budget.mode != "bytes" or not n_ctx_train:
        return
    held = [b.value for i, b in enumerate(allocation.groups) if not allocation.group_slides(i) and b.mode == "cells"]
    if held and min(held) > n_ctx_train:
        raise AhakvError(
            f"budget {budget} holds more cells than the model's trained context of {n_ctx_train} positions in every "
            "full-attention layer, so nothing would ever be evicted: use a smaller budget, or none for the full cache"
        )


# the product's eviction period, shorter only where a budget leaves it no room (default_evict_every)
LONGEST_PERIOD = 32


def default_evict_every(budget: Budget, n_sink: int = 4, n_recent: int = 32) -> int:
    """The eviction period the product uses: 32 decode steps, observed on the last one (tapping every
    step costs a third of the decode speed; see benchmarks/RESULTS.md), shorter for a budget too
    small to leave that much room; every step for ratio and auto budgets."""
    if budget.mode != "cells":
        return 1
    return max(1, min(LONGEST_PERIOD, (int(budget.value) - n_sink - n_recent) // 4))


def parse_schedule(evict_every: int | None, observe_steps: int) -> tuple[int | None, int | None]:
    """The command-line form (--evict-every N or default, --observe-steps N with 0 = every step) checked and
    turned into the controller's (None = the product's default period; None = observe every step)."""
    if (evict_every is not None and evict_every < 1) or observe_steps < 0:
        raise AhakvError("--evict-every must be at least 1 and --observe-steps at least 0")
    return evict_every, observe_steps or None


def per_layer_groups(sliding: Sequence[bool]) -> tuple[int, ...]:
    """The cache of each layer with one cache per layer (``EngineConfig.layer_groups``), numbered as the engine
    wants them: the first full-attention layer's is 0, the first sliding-window layer's 1, the others on from 2
    in layer order."""
    first = [sliding.index(False), sliding.index(True)]
    rest = iter(range(2, len(sliding)))
    return tuple(first.index(il) if il in first else next(rest) for il in range(len(sliding)))


def pyramid_weights(n: int, slope: float = PYRAMID_SLOPE) -> list[float]:
    """n weights of mean 1, falling linearly from 1 + slope (the first layer) to 1 - slope (the last)."""
    return [1.0] if n == 1 else [1 + slope * (1 - 2 * i / (n - 1)) for i in range(n)]


def spread(weights: list[float], low: float, high: float) -> list[float]:
    """``weights`` (mean 1) held within [low, high] with their sum kept where it can be: what clamped weights gain
    or lose is taken from or given to the weights that can still move that way (below ``high`` for a deficit,
    above ``low`` for a surplus), in proportion; a few passes settle it. Only where every weight is at ``high``
    (or at ``low``) does the sum change: bytes no layer can use are left unallocated, never taken from a layer
    that could."""
    w = [min(max(x, low), high) for x in weights]
    target = sum(weights)
    for _ in range(len(w)):
        excess = sum(w) - target
        movable = [i for i, x in enumerate(w) if (x < high if excess < 0 else x > low)]
        if abs(excess) < 1e-9 or not movable:
            break
        room = sum(w[i] for i in movable)
        for i in movable:
            w[i] = min(max(w[i] * (1 - excess / room), low), high)
    return w


def check_layer_kinds(layer_budgets: str, n_sliding: int, n_layer: int) -> None:
    """Refuse, in one line, a per-layer layout on a model whose ``n_layer`` layers are not of both kinds (``n_sliding``
    of them read the sliding-window cache): each kind's holdings are laid out around its own mean."""
    if layer_budgets in PER_LAYER and not 0 < n_sliding < n_layer:
        raise AhakvError(f"--layer-budgets {layer_budgets} needs a model with sliding-window and full-attention layers")


def _per_layer(
    budget: Budget,
    layout: CacheLayout,
    layer_budgets: str,
    chunk: int,
    longest: int,
    room: int,
    every: int,
    sliding_share: float | None,
    keep: int,
    layer_weights: Sequence[float] | None = None,
    sliding_cells: int = 0,
) -> Allocation:
    """One cache per layer (``uniform``, ``pyramid``, ``adaptive``): the ``natural`` layout's holdings of each kind,
    every layer of the kind holding the same (uniform; adaptive until it has measured the layers), a share
    falling with depth around it (pyramid, mean kept) or ``layer_weights`` times it (adaptive: by layer, mean 1
    over each kind, held within ``ADAPTIVE_RANGE`` of it), each layer's cache its holding + one chunk + the
    newest token + ``room`` (a cell or byte budget: the bytes stay those of ``natural``, less where a sliding
    layer's share is capped at its window or a holding is rounded down)."""
    sliding = layout.sliding
    check_layer_kinds(layer_budgets, sum(sliding) if layout.sliding_bytes > 0 and layout.window else 0, len(sliding))
    natural = allocate(
        budget, layout, "natural", chunk, longest, room, every, sliding_share, keep, sliding_cells=sliding_cells
    )
    window = layout.window + every - 1
    # a ratio, auto or none budget keeps natural's caches: no layer may hold more than its cache has room for beside a
    # chunk, the newest token and the room (auto's sliding layers, spread up to their window in caches of -c 384,
    # filled the cache: "the KV cache is full")
    extra = chunk + 1 + room
    sized_by_natural = budget.mode not in ("bytes", "cells")
    layers_of = {kind: [il for il, s in enumerate(sliding) if s == kind] for kind in (False, True)}
    held: dict[int, Budget] = {}
    for kind, layers in layers_of.items():
        mean = natural.groups[int(kind)]
        weights = [1.0] * len(layers)
        low, high = 0.0, math.inf
        if layer_budgets == "pyramid":
            weights = pyramid_weights(len(layers))
        elif layer_budgets == "adaptive" and layer_weights is not None:
            given = [float(layer_weights[il]) for il in layers]
            weights = [w * len(given) / sum(given) for w in given]  # mean 1 over the kind
            low, high = 1 - ADAPTIVE_RANGE, 1 + ADAPTIVE_RANGE
        # no layer below what its protected positions and one eviction period need (KVController.check_floor),
        # none above its window, and no full-attention layer above the longest sequence: cells it can never fill
        # would be taken from the layers that must evict (what spread cannot give back stays unallocated)
        floor = min(keep + 1, layout.window if kind else math.inf) + every - 1
        most = window if kind else (longest + every - 1 if longest else math.inf)  # as the window: + 1 period
        room_in_cache = natural.cache_cells[int(kind)] - extra if sized_by_natural else math.inf
        most = min(most, room_in_cache)
        if mean.mode == "cells" and mean.value >= floor:  # below it, check_floor refuses as for natural
            low, high = max(low, floor / mean.value), min(high, max(most, floor) / mean.value)
        weights = spread(weights, low, high)
        if mean.mode == "cells":  # whole cells, as many as the shares add up to (a cell budget's mean is kept)
            top = min(high * mean.value, window if kind else math.inf, room_in_cache)
            cells = whole_cells([min(mean.value * w, top) for w in weights], top)
            held |= {il: Budget("cells", max(1, n)) for il, n in zip(layers, cells, strict=True)}
        else:
            cap = min(window if kind else math.inf, room_in_cache)
            cap = None if cap == math.inf else int(cap)
            held |= {il: _scaled(mean, w, cap) for il, w in zip(layers, weights, strict=True)}
    groups = per_layer_groups(sliding)
    order = sorted(range(len(sliding)), key=lambda il: groups[il])  # the layer of each cache, by cache
    budgets = tuple(held[il] for il in order)
    if budget.mode in ("bytes", "cells"):  # each layer holds cells: its cache is what cells_for says they need
        cells = tuple(cells_for(b, chunk, longest, room) for b in budgets)
    else:  # a ratio, auto or none can need every position: each layer's cache as natural sizes its kind's
        cells = tuple(natural.cache_cells[int(sliding[il])] for il in order)
    return Allocation(layer_budgets, budgets, cells, groups, tuple(sliding[il] for il in order))


def _scaled(mean: Budget, weight: float, cap: int | None) -> Budget:
    """``mean`` times ``weight`` (a ratio holding; at most ``cap`` cells); auto and none as they are."""
    if mean.mode == "ratio":
        caps = [c for c in (mean.cap, cap) if c is not None]
        return Budget("ratio", min(mean.value * weight, 1.0), cap=min(caps) if caps else None)
    return mean


def whole_cells(values: Sequence[float], most: float = math.inf) -> list[int]:
    """``values`` rounded to whole cells that add up to their sum rounded down (largest remainders round up, none
    above ``most``): a byte budget is never exceeded, and a kind of layers holding a cell budget on average holds
    exactly that where no share is at ``most``."""
    cells = [math.floor(v + 1e-9) for v in values]
    short = math.floor(sum(values) + 1e-9) - sum(cells)
    up = [i for i in range(len(values)) if cells[i] + 1 <= most + 1e-9]
    for i in sorted(up, key=lambda i: cells[i] - values[i])[:short]:  # the largest remainder first
        cells[i] += 1
    return cells
