"""Speed and memory: plain llama-cpp-python against each policy at the same live cells, and a long run.

Both sides are driven the way an app drives them (``generate`` and ``eval`` of llama-cpp-python) on
the same patched engine. The plain ``llama_cpp.Llama`` runs upstream's graph (no statistics), so a
ratio is exactly what the policy costs. Two plain baselines: ``plain`` is llama-cpp-python's default
(swa_full: the sliding-window cache as large as the full one), ``trimmed`` is what llama.cpp's own
tools allocate (swa_full off: the sliding-window cache holds its window plus one ubatch). Each row also
states the KV bytes it would allocate to read ``memory_context`` tokens (the baselines grow with it, a
budget does not).

- ``speed_at_budget``: every policy reads a text of 2x the budget (so its cache is full and evicting),
  then generates; the plain run reads just enough of the text to hold the same mean number of live
  cells while it generates. Configurations are interleaved round by round; medians are reported.
- ``long_run``: the full cache and one budgeted policy read the same long text up to each checkpoint
  (the model's trained context at most) and decode a few tokens there: tokens/s and KV memory against
  context length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import llama_cpp
import numpy as np

from .budget import Budget, default_evict_every
from .engine import Engine, default_threads
from .info import read_info
from .llama import Llama

BATCH = 64  # prompt tokens per decode call in the speed runs (their n_batch and n_ubatch)
BASELINES = {"plain": True, "trimmed": False}  # plain engine, no tap: swa_full on (llama-cpp-python), off (llama.cpp)


def memory_at(model: Path, rows: list[SpeedRow], context: int, n_ubatch: int) -> None:
    """Fill ``kv_bytes_at_context``: a baseline allocates for the whole context (its caches as llama.cpp sizes
    them, ``ModelInfo.caches``, read from the GGUF header), a budgeted run what it allocated already."""
    info = read_info(model)
    for row in rows:
        if row.label in BASELINES:
            row.kv_bytes_at_context = sum(c.bytes for c in info.caches(context, BASELINES[row.label], n_ubatch))
        else:
            row.kv_bytes_at_context = row.kv_bytes


@dataclass
class SpeedRow:
    label: str  # "plain" or the policy's name
    budget: int
    live_cells: float  # mean live cells while generating (of a full-attention layer; per-layer layouts: their mean)
    prompt_tokens: int
    prompt_tps: float  # median over rounds
    decode_tps: float  # median over rounds
    kv_bytes: int  # the KV buffer as allocated
    # decode tokens/s over plain's, and over trimmed's (llama.cpp's own tools), each paired round by round (the
    # configurations of a round run one after the other, so a drift of the machine hits both sides of a ratio alike):
    # the median of the rounds' ratios, and their lowest and highest
    ratio: float = 1.0
    ratio_trimmed: float = 1.0
    ratio_trimmed_range: tuple[float, float] = (1.0, 1.0)
    kv_bytes_at_context: int = 0  # what reading ``memory_context`` tokens allocates (0: not asked)
    decode_runs: list[float] = field(default_factory=list)  # decode tokens/s of each round, in round order


@dataclass
class LongRow:
    label: str  # "full" (swa_full on), "trimmed" (off) or "<policy>@<budget>"
    context: int  # tokens read before the decode
    prompt_tps: float  # over the segment since the previous checkpoint
    decode_tps: float
    kv_cells_used: int
    kv_bytes_used: int  # each cache's used cells x its bytes per cell
    kv_bytes_allocated: int
    layer_budgets: str = ""  # the budgeted run's layout (the drop-in's default for the model); "" for the baselines


def _quiet(model: Path, n_gpu_layers: int = 0, n_threads: int | None = None, **kw) -> dict:
    """llama_cpp.Llama's arguments for a measured run: quiet, and the engine's threads for decode and batch alike
    (llama-cpp-python's own default, half the cores for decode and all for a batch, measured the generate table
    and the long run with other threads than the engine table)."""
    threads = n_threads or default_threads()
    return {
        "model_path": str(model),
        "verbose": False,
        "n_gpu_layers": n_gpu_layers,
        "n_threads": threads,
        "n_threads_batch": threads,
        **kw,
    }


def _timed_generate(llm: llama_cpp.Llama, prompt: list[int], n: int, live: Callable[[], int]):
    """(prompt seconds, decode seconds for n - 1 tokens, mean live cells while decoding)."""
    llm.reset()
    t0 = time.perf_counter()
    cells = []
    it = llm.generate(prompt, temp=0.0, top_k=1)
    next(it)  # the first token: the prompt's cost
    t1 = time.perf_counter()
    for _ in range(n - 1):
        next(it)
        cells.append(live())
    t2 = time.perf_counter()
    it.close()
    return t1 - t0, t2 - t1, float(np.mean(cells))


def _policy_rows(policies: list[str], layer_budgets: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """{row label: (policy, layer budgets)}: each policy in each layout, labelled by the policy alone in the
    shared pool (the measuring commands' default) and "<policy> <layout>" otherwise."""
    return {
        name if layout == "shared" else f"{name} {layout}": (name, layout)
        for name in policies
        for layout in layer_budgets
    }


def interleave(runs: dict[str, Callable[[], tuple]], rounds: int, progress) -> dict[str, list[tuple]]:
    """Call every run once per round, rotating the order so drift of the machine hits all alike."""
    times: dict[str, list[tuple]] = {name: [] for name in runs}
    for rnd in range(rounds):
        names = list(runs)
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            progress(f"round {rnd + 1}/{rounds}: {name}")
            times[name].append(runs[name]())
    return times


@dataclass(frozen=True)
class SpeedSetup:
    """One side-by-side speed comparison: each policy in each layout at ``budget`` live cells against the plain
    baselines (``speed_at_budget`` through ``generate``, ``engine_speed_at_budget`` one layer down)."""

    budget: int  # live cells
    policies: tuple[str, ...]
    layer_budgets: tuple[str, ...] = ("shared",)
    decode_tokens: int = 64
    rounds: int = 5  # interleaved; medians are reported
    batch: int = BATCH
    evict_every: int | None = None  # None: the budget's default
    observe_steps: int | None = 1
    n_gpu_layers: int = 0
    n_threads: int | None = None  # default: engine.default_threads (AHAKV_THREADS, else every core)

    @property
    def tokens_needed(self) -> int:
        """Text tokens a run reads: 2x the budget (so the cache is full and evicting), then the decoded ones."""
        return 2 * self.budget + self.decode_tokens

    def plan(self, tokens: list[int]) -> tuple[int, int]:
        """(eviction period, plain prompt length): the plain run grows from its prompt by one cell a decoded token,
        so it starts where its mean live cells match the policies' (``policy_cells``)."""
        if len(tokens) < self.tokens_needed:
            raise ValueError(f"need {self.tokens_needed} tokens of text for budget {self.budget}, have {len(tokens)}")
        evict_every = self.evict_every or default_evict_every(Budget.parse(self.budget))
        return evict_every, max(1, round(self.policy_cells(evict_every) - self.plain_growth))

    def policy_cells(self, evict_every: int) -> float:
        """The mean live cells of a policy run while it decodes: it reads 2x the budget, compressed to budget -
        evict_every + 1 cells, then grows by one a token and evicts back at the end of each period (the schedule
        follows the position: ``KVController._step_phase``). Where the decoded tokens are no whole number of periods
        this is not budget - (evict_every - 1) / 2; the adaptive layout's full-attention layers may hold fewer."""
        keep = self.budget - (evict_every - 1)
        cells, held = [], keep
        for position in range(2 * self.budget, 2 * self.budget + self.decode_tokens):
            held = keep if position % evict_every == evict_every - 1 else held + 1
            cells.append(held)
        return float(np.mean(cells))

    @property
    def plain_growth(self) -> float:
        """The plain run's mean live cells over its prompt's: the k-th decoded token is its prompt + k-th cell."""
        return (self.decode_tokens + 1) / 2


def speed_at_budget(
    model: Path, tokens: list[int], setup: SpeedSetup, progress: Callable[[str], None] = lambda _: None
) -> list[SpeedRow]:
    """Prompt and decode tokens/s of plain llama-cpp-python and of each policy at ``setup.budget`` live cells (in
    each of its layouts), through ``Llama.generate`` (greedy), as an app sees them."""
    budget, batch, decode_tokens, n_gpu_layers = setup.budget, setup.batch, setup.decode_tokens, setup.n_gpu_layers
    evict_every, plain_prompt = setup.plan(tokens)
    models: dict[str, tuple[llama_cpp.Llama, list[int], Callable[[], int]]] = {}
    for label, swa_full in BASELINES.items():
        n_ctx = budget + evict_every + decode_tokens + batch
        kw = dict(n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, swa_full=swa_full)
        plain = llama_cpp.Llama(**_quiet(model, n_gpu_layers, setup.n_threads, **kw))
        models[label] = (plain, tokens[:plain_prompt], lambda plain=plain: plain.n_tokens)
    for label, (name, layout) in _policy_rows(setup.policies, setup.layer_budgets).items():
        llm = Llama(
            **_quiet(model, n_gpu_layers, setup.n_threads, n_batch=batch, n_ubatch=batch),
            kv_budget=budget,
            kv_policy=name,
            kv_evict_every=evict_every,
            kv_observe_steps=setup.observe_steps,
            kv_layer_budgets=layout,
        )
        models[label] = (llm, tokens[: 2 * budget], lambda llm=llm: llm.kv_controller.stats.cells_used)
    try:
        times = interleave(
            {name: (lambda m=m: _timed_generate(m[0], m[1], decode_tokens, m[2])) for name, m in models.items()},
            setup.rounds,
            progress,
        )
        kv_bytes = {name: Engine.attach(m[0]).kv_bytes() for name, m in models.items()}
        return _rows(times, {name: len(m[1]) for name, m in models.items()}, kv_bytes, budget, decode_tokens - 1)
    finally:
        for llm, _, _ in models.values():
            llm.close()


def engine_speed_at_budget(
    model: Path, tokens: list[int], setup: SpeedSetup, progress: Callable[[str], None] = lambda _: None
) -> list[SpeedRow]:
    """The same comparison one layer down: ``llama_decode`` of the text's next tokens on an Engine with
    the tap off against ``KVController.step``, no sampling, no llama-cpp-python bookkeeping. The
    per-token overhead of ``generate`` (~19 ms on a 262K vocabulary) dilutes the policy's cost there;
    this is the ratio without it."""
    from .engine import EngineConfig
    from .session import SessionSpec, open_session

    budget, batch, decode_tokens, n_gpu_layers = setup.budget, setup.batch, setup.decode_tokens, setup.n_gpu_layers
    evict_every, plain_prompt = setup.plan(tokens)
    n_ctx = budget + evict_every + decode_tokens + batch
    cfg = EngineConfig(n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_gpu_layers=n_gpu_layers, n_threads=setup.n_threads)
    engines = {label: Engine(model, replace(cfg, swa_full=swa_full)) for label, swa_full in BASELINES.items()}
    # each policy in a session as the product opens one (open_session: every cache sized exactly for the budget,
    # a chunk and the newest token, not padded to 256), so evicted cells scattered over the buffer cost what they
    # cost the product and no more
    sessions = {}
    rows = _policy_rows(setup.policies, setup.layer_budgets)
    for label, (name, layout) in rows.items():
        spec = SessionSpec.bounded(
            name, budget, evict_every=evict_every, observe_steps=setup.observe_steps, layer_budgets=layout
        )
        sessions[label] = open_session(
            model, spec, 2 * budget + decode_tokens, batch, n_gpu_layers=n_gpu_layers, n_threads=setup.n_threads
        )
        engines[label] = sessions[label].engine

    def plain_run(label: str) -> tuple[float, float, float]:
        e = engines[label]
        e.truncate(0)
        t0 = time.perf_counter()
        for i in range(0, plain_prompt, batch):
            e.decode(tokens[i : min(i + batch, plain_prompt)])
        t1 = time.perf_counter()
        for tok in tokens[plain_prompt : plain_prompt + decode_tokens]:
            e.decode([tok])
        return t1 - t0, time.perf_counter() - t1, plain_prompt + setup.plain_growth

    def policy_run(name: str) -> tuple[float, float, float]:
        sessions[name].reset()
        ctl = sessions[name].controller
        t0 = time.perf_counter()
        ctl.prefill(tokens[: 2 * budget])
        t1 = time.perf_counter()
        cells = []
        for tok in tokens[2 * budget : 2 * budget + decode_tokens]:
            ctl.step(tok)
            # what a budget in cells counts: the cells of a full-attention layer (per-layer layouts: their mean)
            cells.append(ctl.stats.cells_used)
        return t1 - t0, time.perf_counter() - t1, float(np.mean(cells))

    runs = {label: (lambda b=label: plain_run(b)) for label in BASELINES}
    runs |= {label: (lambda n=label: policy_run(n)) for label in rows}
    try:
        times = interleave(runs, setup.rounds, progress)
        prompts = {name: plain_prompt if name in BASELINES else 2 * budget for name in runs}
        kv_bytes = {name: e.kv_bytes() for name, e in engines.items()}
        return _rows(times, prompts, kv_bytes, budget, decode_tokens)
    finally:
        for e in engines.values():
            e.close()


def _rows(times: dict, prompts: dict, kv_bytes: dict, budget: int, decoded: int) -> list[SpeedRow]:
    rows = []
    for name, runs in times.items():
        decode = [decoded / d for _, d, _ in runs]
        rows.append(
            SpeedRow(
                label=name,
                budget=budget,
                live_cells=float(np.mean([c for _, _, c in runs])),
                prompt_tokens=prompts[name],
                prompt_tps=statistics.median(prompts[name] / p for p, _, _ in runs),
                decode_tps=statistics.median(decode),
                kv_bytes=kv_bytes[name],
                decode_runs=decode,
            )
        )
    by_label = {row.label: row for row in rows}
    for row in rows:
        row.ratio = paired_ratio(row.decode_runs, by_label["plain"].decode_runs)[0]
        row.ratio_trimmed, low, high = paired_ratio(row.decode_runs, by_label["trimmed"].decode_runs)
        row.ratio_trimmed_range = (low, high)
    return rows


def paired_ratio(runs: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of ``runs[i] / baseline[i]``: rates of the same rounds. On a 2-core machine one
    configuration's rounds ran from 48 to 70 tok/s; a ratio of medians took its two sides from different rounds."""
    ratios = [a / b for a, b in zip(runs, baseline, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _long(
    label: str,
    llm: llama_cpp.Llama,
    tokens: list[int],
    checkpoints: list[int],
    decode_tokens: int,
    advance: Callable[[int], None],
    layer_budgets: str = "",
) -> list[LongRow]:
    rows, done = [], 0
    for ctx in checkpoints:
        segment = tokens[done:ctx]
        t0 = time.perf_counter()
        llm.eval(segment)
        prompt_s = time.perf_counter() - t0
        advance(len(segment))
        t0 = time.perf_counter()
        for tok in tokens[ctx : ctx + decode_tokens]:  # the text goes on, one token per decode
            llm.eval([tok])
        decode_s = time.perf_counter() - t0
        advance(decode_tokens)
        done = ctx + decode_tokens
        # attached now: a resize of the caches (the adaptive layout) replaces the context an earlier view held
        engine = Engine.attach(llm)
        ctl = getattr(llm, "kv_controller", None)  # a budget's cells are a full-attention layer's (per-layer: the mean)
        used = ctl.stats.cells_used if ctl is not None else engine.n_used()
        used_bytes, allocated = engine.kv_bytes_used(), engine.kv_bytes()
        prompt_tps, decode_tps = len(segment) / prompt_s, decode_tokens / decode_s
        rows.append(LongRow(label, ctx, prompt_tps, decode_tps, used, used_bytes, allocated, layer_budgets))
    return rows


def long_run(
    model: Path,
    tokens: list[int],
    checkpoints: list[int],
    budget: int | str,
    policy: str = "ahakv",
    decode_tokens: int = 16,
    evict_every: int | None = None,
    observe_steps: int | None = 1,
    n_gpu_layers: int = 0,
    progress: Callable[[str, int, int], None] = lambda label, n, total: None,
    n_threads: int | None = None,
) -> list[LongRow]:
    """``policy`` at ``budget`` and the full cache, untrimmed and trimmed, read ``tokens`` to each checkpoint and
    decode there."""
    last = checkpoints[-1] + decode_tokens
    if len(tokens) < last:
        raise ValueError(f"the long run needs {last} tokens of text, have {len(tokens)}")
    rows = []
    label = f"{policy}@{budget}"
    with Llama(
        **_quiet(model, n_gpu_layers, n_threads, n_batch=64, n_ubatch=64),
        kv_budget=budget,
        kv_policy=policy,
        kv_evict_every=evict_every,
        kv_observe_steps=observe_steps,
    ) as llm:
        seen = [0]
        advance = _counter(progress, label, last, seen)
        rows += _long(label, llm, tokens, checkpoints, decode_tokens, advance, llm.kv_stats().layer_budgets)
    # every position kept, as the speed tables' baselines: llama-cpp-python's default (a full-size sliding cache;
    # this table has always called it "full") and llama.cpp's own tools (the sliding cache trimmed to its window)
    for baseline, swa_full in BASELINES.items():
        name = "full" if baseline == "plain" else baseline
        llm = llama_cpp.Llama(**_quiet(model, n_gpu_layers, n_threads, n_ctx=last, n_batch=512, swa_full=swa_full))
        try:
            seen = [0]
            rows += _long(name, llm, tokens, checkpoints, decode_tokens, _counter(progress, name, last, seen))
        finally:
            llm.close()
    return rows


def _counter(progress, label: str, total: int, seen: list[int]) -> Callable[[int], None]:
    def advance(n: int) -> None:
        seen[0] += n
        progress(label, seen[0], total)

    return advance
