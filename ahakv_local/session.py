"""A bounded sequence: the one place a front end gets a KV cache held to a budget.

``SessionSpec`` is a named, configured (policy, budget, schedule), like kvpress's configured presses:
evaluation configurations, the ``Llama`` drop-in, the passkey test and the benchmarks all describe
what they want as one. ``spec.controller(engine)`` puts it on an engine somebody else owns (the
drop-in's); ``open_session`` also opens the engine, each of its caches sized exactly as ``budget.allocate``
lays the budget out on the model's layer groups (``layer_budgets``: one shared pool, or one per cache).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .budget import (
    KV_TYPE_AUTO,
    LONGEST_PERIOD,
    NO_EVICTION,
    QUESTION_AGNOSTIC,
    READINGS,
    Allocation,
    Budget,
    CacheLayout,
    KVQuery,
    LayerBudgets,
    Reading,
    allocate,
    check_held_past_trained,
    check_layer_budgets,
    check_trained_context,
    default_evict_every,
    guide_room,
    kv_type_for,
)
from .controller import (
    ControllerConfig,
    KVController,
    Reconstruct,
    Surprisal,
    check_floor,
    check_policy,
    check_protected,
    check_schedule,
    fit_to_cells,
)
from .engine import Engine, EngineConfig, kv_type_config
from .errors import AhakvError
from .info import check_kv_cache_type, check_kv_types, read_info, reading_headers_once
from .policies import KINDS, Policy, make_policy

# what the reconstruction pass reads behind each chunk before the chunk itself again (KVzip's repeat prompt)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


@dataclass(frozen=True)
class SessionSpec:
    """What a bounded sequence is: a policy with its parameters, a budget and an eviction schedule.
    The default is the full cache (policy "full", ``NO_EVICTION``)."""

    label: str = "full"
    policy: str = "full"
    budget: Budget = NO_EVICTION
    params: dict = field(default_factory=dict)  # the policy's own settings, e.g. {"error_model": False}
    n_sink: int = 4
    n_recent: int = 32
    evict_every: int | None = None  # None: the product's default for the budget (default_evict_every)
    observe_steps: int | None = 1  # None: observe every decode step
    pinned: tuple[int, int] | None = None
    # how a prompt longer than the budget is read: compressed by the policy alone, guided by the question,
    # or question-agnostic by reconstruction (policies that cannot be guided read plainly) or by surprisal (any)
    reading: Reading = "plain"
    # how the budget is laid out on the layers (budget.allocate): one pool for every layer, or one per cache
    layer_budgets: LayerBudgets = "shared"
    sliding_share: float | None = None  # natural, a byte budget: the sliding cache's share (None: its window)
    # K and V cache type of the engine ``open_session`` opens (q8_0: about half the bytes of f16 a cell, so a byte
    # budget holds ~1.9x the cells; flash attention on), or "auto": the type the budget measured best in, decided
    # once the model and the sequence's length are known (``on_model``). The drop-in sets it from its own kv_type.
    kv_type: str = "f16"

    def __post_init__(self) -> None:
        policy = self.make_policy()  # an unknown policy or parameter fails here, before any model loads
        # the drop-in's kv_sinks/kv_recent/kv_evict_every/... come here as given: "x" or 1.5 failed deep in numpy
        whole = KINDS["int"]
        for name in ("n_sink", "n_recent", "evict_every", "observe_steps"):
            v = getattr(self, name)
            if not (v is None and name in ("evict_every", "observe_steps")) and not whole(v):
                raise AhakvError(f"{name} must be a whole number, not {v!r}")
        if self.pinned is not None and not (
            isinstance(self.pinned, tuple | list) and len(self.pinned) == 2 and all(map(whole, self.pinned))
        ):
            raise AhakvError(f"pinned must be a (start, end) pair of positions, not {self.pinned!r}")
        check_protected(self.n_sink, self.n_recent, self.pinned)  # (before: only once a session opened)
        if policy.evicts and not self.budget.evicts:
            raise AhakvError(f"policy {self.policy} evicts: give it a budget (the full cache keeps everything)")
        if self.reading not in READINGS:
            raise AhakvError(f"reading must be {', '.join(READINGS)}, not {self.reading!r}")
        check_layer_budgets(self.layer_budgets)
        check_schedule(self.evict_every, self.observe_steps)  # (0 was taken for the default period: None is that)
        if self.kv_type != KV_TYPE_AUTO:
            check_kv_cache_type(self.kv_type)

    @classmethod
    def bounded(cls, policy: str, budget: Budget | str | int | float, **kw) -> SessionSpec:
        """The usual spec: ``policy`` at ``budget``, labelled "<policy>@<budget>"."""
        budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        label = kw.pop("label", None) or f"{policy}@{budget.target(0) if budget.mode == 'cells' else budget}"
        return cls(label, policy, budget, **kw)

    def make_policy(self) -> Policy:
        try:
            return make_policy(self.policy, **self.params)
        except TypeError:  # a dataclass refusing a keyword
            raise AhakvError(f"unknown setting for policy {self.policy}: {', '.join(self.params)}") from None

    @property
    def keep(self) -> int:
        """Positions every group keeps whatever they score (sinks and recent tokens)."""
        return self.n_sink + self.n_recent

    def room(self, chunk: int) -> int:
        """Cells a guided reading decodes behind a chunk (``budget.guide_room``; 0 for a plain one)."""
        return guide_room(self.reading, chunk) if self.make_policy().reads_with_query else 0

    def evict_every_on(self, layout: CacheLayout, chunk: int) -> int:
        """The eviction period: the spec's, or the product's default for what the first group holds (a byte
        budget: laid out first, with the longest default period)."""
        if self.evict_every is not None:
            return self.evict_every
        budget = self.budget
        if budget.mode == "bytes":
            budget = allocate(
                budget, layout, self.layer_budgets, chunk, 0, self.room(chunk), LONGEST_PERIOD, self.sliding_share,
                self.keep,
            ).groups[0]  # fmt: skip
        return default_evict_every(budget, self.n_sink, self.n_recent)

    def allocation(self, layout: CacheLayout, chunk: int, longest: int) -> Allocation:
        """The budget laid out on a model (``budget.allocate``): what each layer group holds and the cells of
        each cache, for a sequence of at most ``longest`` tokens read ``chunk`` at a time."""
        every = self.evict_every_on(layout, chunk)
        return allocate(
            self.budget,
            layout,
            self.layer_budgets,
            chunk,
            longest,
            self.room(chunk),
            every,
            self.sliding_share,
            self.keep,
        )

    def on_model(self, model: str | Path, chunk: int, longest: int) -> SessionSpec:
        """This spec for a sequence of at most ``longest`` tokens of ``model`` read ``chunk`` at a time: kv_type
        "auto" decided from the budget and llama.cpp's trimmed cache for that length (``budget.kv_type_for``;
        f16 where the model's heads cannot be stored in the type chosen); any other spec as it is."""
        if self.kv_type != KV_TYPE_AUTO:
            return self
        info = read_info(Path(model))
        chosen = kv_type_for(self.budget, info.trimmed_bytes(longest, chunk))
        return replace(self, kv_type=chosen if info.stores(chosen) else "f16")  # heads too narrow: f16

    def allocation_on(self, model: str | Path, chunk: int, longest: int) -> Allocation:
        """This spec's allocation on ``model`` (the cells of each cache, and its layer groups where it has one
        cache per layer): ``allocation`` on the model's layout with K and V of ``kv_type`` ("auto": decided by
        ``on_model``). Sessions (``open_session``) and the drop-in (through ``engine.set_next_caches``, as
        llama_cpp.Llama makes its own context) both size their caches with it."""
        spec = self.on_model(model, chunk, longest)
        return spec.allocation(model_layout(Path(model), spec.kv_type), chunk, longest)

    def config(self, layout: CacheLayout, chunk: int, longest: int = 0, positions: int = 0) -> ControllerConfig:
        return ControllerConfig(
            self.budget,
            self.n_sink,
            self.n_recent,
            self.evict_every_on(layout, chunk),
            self.pinned,
            period_follows_budget=self.evict_every is None,
            observe_steps=self.observe_steps,
            layer_budgets=self.layer_budgets,
            room=self.room(chunk),
            sliding_share=self.sliding_share,
            longest=longest,
            positions=positions,
        )

    def plan_on(self, model: str | Path, n_ctx: int, n_batch: int, n_ubatch: int) -> CachePlan:
        """How the drop-in lays this spec out on ``model`` for ``Llama(n_ctx=, n_batch=, n_ubatch=)``, before
        llama.cpp allocates anything: the one computation behind what ``Llama.__init__`` opens and what ``info``
        states. Refuses K/V types the model's heads cannot be stored in (llama.cpp would abort)."""
        info = read_info(Path(model))
        # 0: llama.cpp's "the trained context"; past it no position is reached under a budget (the drop-in bounds
        # positions by it), so a ratio laid out in -c 999999 cells allocated 1,000,063 of them (244 MiB on a 0.4 MiB
        # model), and auto picked its K/V type for positions that never come
        n_ctx = min(n_ctx or info.n_ctx_train, info.n_ctx_train)
        mode = self.budget.mode
        if mode in ("ratio", "auto"):
            # laid out in n_ctx cells, which also take a prompt chunk and a question's room: a chunk of n_ctx (512
            # and 512 by default) left a 25% budget no cell (it kept the 36 protected positions, 4% of 948 tokens);
            # a quarter of them leaves it three quarters
            n_batch = min(n_batch, max(1, n_ctx // 4))
        elif mode == "bytes":
            n_batch = min(n_batch, n_ctx)
        chunk = min(n_ubatch, n_batch)
        spec = self.on_model(model, chunk, n_ctx)  # kv_type "auto": decided for n_ctx positions
        check_kv_types(info, spec.kv_type, spec.kv_type)
        # the longest sequence the caches are laid out for: under a cell or byte budget positions run to the trained
        # context, and a full-attention layer's share may grow toward it (at n_ctx, 512 by default, adaptive capped a
        # budget of 1,024 cells at 543); a ratio or auto budget at n_ctx
        longest = max(n_ctx, info.n_ctx_train) if mode in ("bytes", "cells") else n_ctx
        if mode not in ("bytes", "cells") and spec.layer_budgets == "shared":
            return CachePlan(spec, n_batch, chunk, n_ctx, longest, None, ())  # every layer n_ctx cells, as upstream
        # every cache sized exactly as the budget is laid out on the layer groups (budget.allocate), not padded to
        # 256 cells: no cell past them is allocated or scanned by attention once evictions scatter the live ones
        allocation = spec.allocation_on(model, chunk, longest)
        check_held_past_trained(spec.budget, allocation, info.n_ctx_train)
        layer_cells = allocation.layer_cells(info.layer_sliding)
        return CachePlan(spec, n_batch, chunk, max(allocation.cache_cells), longest, allocation, layer_cells)

    def check_plan_on(self, model: str | Path, plan: CachePlan, cells: int) -> None:
        """Refuse, before any engine opens, what the drop-in's controller refuses on ``plan``'s caches, whose smallest
        full-attention one holds ``cells`` (positions run to the trained context, as the drop-in lets them): the
        policy under the budget (``check_policy``), the floor, and a ratio or auto budget whose protected positions
        and chunk do not fit (``fit_to_cells``)."""
        trained = read_info(Path(model)).n_ctx_train
        reach = max(plan.longest, trained)
        layout = model_layout(Path(model), self.kv_type)
        config = self.config(layout, plan.chunk, plan.longest, trained)
        check_policy(self.make_policy(), self.budget, cells, reach)
        allocation = (
            plan.allocation if plan.allocation is not None else self.allocation(layout, plan.chunk, plan.longest)
        )
        check_floor(config, layout, allocation, self.budget)
        fit_to_cells(self.budget, cells, plan.chunk, config, reach)

    def check_drop_in(
        self, model: str | Path, n_ctx: int, n_batch: int, n_ubatch: int
    ) -> tuple[CachePlan, tuple[int, ...]]:
        """Everything the drop-in (``Llama(n_ctx=, n_batch=, n_ubatch=)``) refuses for this spec, before any engine
        opens: a cell budget past the trained context, the K/V type (``plan_on``) and what its controller refuses on
        the plan's caches (``check_plan_on``). Returns the plan and each layer's cells (``info`` states them;
        ``bench speed`` checks each of its runs before the first)."""
        with reading_headers_once():  # (plan_on and check_plan_on read the header too: ~45 ms each on Gemma)
            return self._check_drop_in(model, n_ctx, n_batch, n_ubatch)

    def _check_drop_in(
        self, model: str | Path, n_ctx: int, n_batch: int, n_ubatch: int
    ) -> tuple[CachePlan, tuple[int, ...]]:
        info = read_info(Path(model))
        check_trained_context(self.budget, info.n_ctx_train)
        plan = self.plan_on(model, n_ctx, n_batch, n_ubatch)
        if plan.allocation is None:  # a shared ratio or auto budget: llama.cpp's own cache of n_ctx cells
            context = min(n_ctx or info.n_ctx_train, info.n_ctx_train)
            cells = (info.caches(context, swa_full=True)[0].cells,) * info.n_layer
        else:
            cells = plan.layer_cells
        full = [c for c, sliding in zip(cells, info.layer_sliding, strict=True) if not sliding]
        plan.spec.check_plan_on(model, plan, min(full or cells))
        return plan, cells

    def check_floor_on(self, model: str | Path, chunk: int, longest: int) -> None:
        """Refuse, before any engine opens, a budget that leaves a layer group of ``model`` too few cells for its
        protected positions and eviction period (what the controller would refuse when it opens: a long run of
        several configurations checks each before the first)."""
        spec = self.on_model(model, chunk, longest)
        layout = model_layout(Path(model), spec.kv_type)
        config = spec.config(layout, chunk, longest)
        check_floor(config, layout, spec.allocation(layout, chunk, longest), spec.budget)

    def controller(self, engine: Engine, longest: int = 0, positions: int = 0) -> KVController:
        """A controller holding this spec's budget on ``engine`` (which the caller owns), whose caches were sized
        for sequences of at most ``longest`` tokens (``allocation_on``; 0: unknown) and whose positions may run to
        ``positions`` (0: ``longest``; a ratio budget is then capped at what the caches hold: ``fitted``)."""
        config = self.config(engine.cache_layout(), engine.config.n_ubatch, longest, positions)
        return KVController(engine, self.make_policy(), config)


@dataclass(frozen=True)
class CachePlan:
    """A spec laid out on a model for the drop-in (``SessionSpec.plan_on``)."""

    spec: SessionSpec  # its kv_type decided ("auto" no more)
    n_batch: int  # prompt tokens per decode call
    chunk: int  # tokens per graph evaluation
    cells: int  # the context llama.cpp is asked for: the largest cache's cells
    longest: int  # the longest sequence the caches are laid out for
    allocation: Allocation | None  # None: a shared ratio or auto budget, llama.cpp's own n_ctx cells in every layer
    layer_cells: tuple[int, ...]  # each layer's cells where the allocation laid them out


class BoundedSession:
    """An engine of its own plus the controller that bounds it (closed by ``close()`` or ``with``)."""

    def __init__(self, spec: SessionSpec, engine: Engine, longest: int = 0):
        self.spec, self.engine = spec, engine
        try:
            self.controller = spec.controller(engine, longest)
        except BaseException:
            engine.close()
            raise

    def reset(self) -> None:
        """Back to an empty sequence with a fresh policy (same settings)."""
        self.controller.truncate(0)

    def answer(self, logits: np.ndarray, max_tokens: int) -> tuple[list[int], int]:
        """Greedy tokens from ``logits`` on (at most ``max_tokens``, ending at an end-of-generation token) and
        the most cells the cache held since the sequence started (its prompt's chunks included)."""
        ctl, out = self.controller, []
        for _ in range(max_tokens):
            tok = int(np.argmax(logits))
            if self.engine.is_eog(tok):
                break
            out.append(tok)
            logits = ctl.step(tok)
        return out, ctl.stats.peak_cells

    def read(self, prompt: Sequence[int], question: Sequence[int] | None = None) -> np.ndarray:
        """Read ``prompt`` (which ends with ``question``, if one is known) the way the spec says; return the
        logits of its last token."""
        return self.controller.prefill(prompt, query=guide(self.spec.reading, question, self.engine))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> BoundedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_kv_query(query: KVQuery) -> None:
    """Refuse a kv_query that is none of its forms (an empty text was read plainly, without a word)."""
    what = "a question's text, True, False, 'reconstruct' or 'surprisal'"
    if query is not None and not isinstance(query, bool | str):
        raise AhakvError(f"kv_query must be {what}, not {query!r}")
    if isinstance(query, str) and not query.strip():
        raise AhakvError(f"kv_query must be {what}, not an empty text")


def guide_of(query: KVQuery, question: str | None, engine: Engine) -> Sequence[int] | Reconstruct | Surprisal | None:
    """What a request's prompt is read with for its ``kv_query`` (``guide``), the one rule of the drop-in and the
    parallel server: a question-agnostic reading by name; a question's text; True the request's own ``question`` (the
    last user message, a completion's last paragraph; none, or a blank one: plainly); False or None plainly."""
    check_kv_query(query)
    if query in QUESTION_AGNOSTIC:
        return guide(query, None, engine)
    text = question if query is True else query or None
    if not text or not text.strip():
        return None
    return guide("query", engine.tokenize(text, add_bos=False, special=False), engine)  # read by its last tokens


def guide(
    reading: Reading, question: Sequence[int] | None, engine: Engine
) -> Sequence[int] | Reconstruct | Surprisal | None:
    """What ``KVController.prefill`` is guided by in this reading mode."""
    if reading == "query":
        return question or None
    if reading == "reconstruct":
        return Reconstruct(tuple(engine.tokenize(REPEAT_PROMPT, add_bos=False)))
    if reading == "surprisal":
        return Surprisal()
    return None


@functools.lru_cache(maxsize=16)
def model_layout(model: Path, kv_type: str = "f16") -> CacheLayout:
    """A model's cache layout with K and V of ``kv_type``, from its GGUF header (``ModelInfo.cache_layout``, what
    ``Engine.cache_layout`` measures on a context: tests/test_info_caches.py). Measured on a context of its own, it
    loaded the model: info took 1.1 s, not the header's 30 ms, and refused a partly downloaded file."""
    return read_info(model).cache_layout(kv_type)


def open_session(model: str | Path, spec: SessionSpec, longest: int, n_ubatch: int = 64, **engine_kw) -> BoundedSession:
    """An engine for ``model`` sized for ``spec`` over a sequence of at most ``longest`` tokens read
    ``n_ubatch`` at a time, with K and V of ``spec.kv_type``, every cache exactly as ``spec.allocation`` says,
    with its controller. A spec with kv_type "auto" runs in the type decided for ``longest`` (``on_model``)."""
    spec = spec.on_model(model, n_ubatch, longest)
    engine_kw |= kv_type_config(spec.kv_type)
    allocation = spec.allocation_on(model, n_ubatch, longest)
    cells, groups = allocation.cache_cells, allocation.layer_groups
    engine_kw.setdefault("swa_full", not cells[1])  # the sliding cache is sized exactly: no full-size copy
    config = EngineConfig(
        n_ctx=max(cells), n_batch=n_ubatch, n_ubatch=n_ubatch, cache_cells=cells, layer_groups=groups, **engine_kw
    )
    return BoundedSession(spec, Engine(model, config), longest)
