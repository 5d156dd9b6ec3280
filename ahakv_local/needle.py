"""Passkey retrieval under a budget: a number hidden in real filler text, which the model must repeat.

The prompt follows the passkey test of Mohtashami & Jaggi (2023), used by StreamingLLM and kvpress:
an instruction, filler, the key sentence at a chosen depth, more filler, then the question. The
whole prompt goes through the controller in chunks (the cache is compressed while the model has not
yet seen the question, which is what makes the test hard for an eviction policy), then the model
answers greedily. A trial is solved when the first number of the answer is the key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .budget import Budget
from .engine import Engine
from .session import SessionSpec, open_session

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # greedy tokens of an answer: a five-digit key and what follows it


@dataclass
class NeedleTrial:
    label: str
    policy: str
    budget: Budget
    length: int  # prompt tokens
    depth: float  # where the key sits, as a fraction of the filler
    key: str
    answer: str
    solved: bool
    max_cells: int


def build_prompt(engine: Engine, filler: list[int], length: int, depth: float, key: str) -> list[int]:
    """Token ids of INTRO + filler[:a] + NEEDLE + filler[a:b] + QUESTION, ``length`` tokens in all."""
    head = engine.tokenize(INTRO, add_bos=True)
    needle = engine.tokenize(NEEDLE.format(key=key), add_bos=False)
    tail = engine.tokenize(QUESTION, add_bos=False)
    n_fill = length - len(head) - len(needle) - len(tail)
    if n_fill < 1:
        raise ValueError(f"length {length} is too short for the passkey prompt")
    if len(filler) < n_fill:
        raise ValueError(f"the filler text has {len(filler)} tokens; {n_fill} are needed")
    cut = round(depth * n_fill)
    return head + filler[:cut] + needle + filler[cut:n_fill] + tail


def answer_key(answer: str) -> str | None:
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


def needle_key(seed: int, length: int, depth: float, trial: int) -> str:
    """The five-digit key of one item, drawn from the item alone (as ``longdoc.make_item`` does): drawn in the grid's
    order, a key changed with the order and number of the lengths, depths and trials asked, so a narrower rerun of
    one item measured another (session ai's audit: "--depths 0.1,0.9" and "0.9,0.1" hid 60494 and 65125 at 0.1)."""
    return str(random.Random(f"{seed}:{length}:{depth}:{trial}").randrange(10_000, 100_000))


def run_needle(
    model: Path,
    filler_text: str,
    lengths: list[int],
    depths: list[float],
    specs: list[SessionSpec],
    trials: int = 1,
    seed: int = 0,
    n_ubatch: int = 64,
    answer_tokens: int = ANSWER_TOKENS,
    progress: Callable[[int, int], None] = lambda done, total: None,
    rpc_servers: tuple[str, ...] = (),
    n_threads: int | None = None,
) -> list[NeedleTrial]:
    """Every spec on every length x depth x trial (the full cache is ``SessionSpec()``); ``rpc_servers``:
    llama.cpp RPC workers that hold the layers; ``n_threads``: the engine's CPU threads (None: AHAKV_THREADS, else
    every core)."""
    keys = {(n, d, t): needle_key(seed, n, d, t) for n in lengths for d in depths for t in range(trials)}
    longest = max(lengths) + answer_tokens
    results: list[NeedleTrial] = []
    total, done = sum(evicts_at(spec, n) for spec in specs for n, _, _ in keys), 0
    for spec in specs:
        with open_session(model, spec, longest, n_ubatch, rpc_servers=rpc_servers, n_threads=n_threads) as session:
            engine, ctl = session.engine, session.controller
            filler = engine.tokenize(filler_text, add_bos=False)
            if spec is specs[0]:  # every length fits the filler, before any run (it failed at its turn)
                for length in lengths:
                    build_prompt(engine, filler, length, 0.0, "00000")
            for (length, depth, _), key in keys.items():
                if not evicts_at(spec, length):
                    continue
                prompt = build_prompt(engine, filler, length, depth, key)
                session.reset()  # an empty cache and a fresh policy for every trial
                out, peak = session.answer(ctl.prefill(prompt), answer_tokens)
                answer = engine.detokenize(out)
                solved = answer_key(answer) == key
                results.append(
                    NeedleTrial(spec.label, spec.policy, spec.budget, length, depth, key, answer.strip(), solved, peak)
                )
                done += 1
                progress(done, total)
    return results


def evicts_at(spec: SessionSpec, length: int) -> bool:
    """Whether ``spec`` is run on prompts of ``length`` tokens: the full cache always, a cell budget where it cannot
    hold the prompt. One that can evicts nothing: its cell of the table was the full cache's under the budget's
    name (``--lengths 256,1024 --budgets 512``), as ``eval ppl`` refuses such a row; it is left blank."""
    return not (spec.budget.mode == "cells" and spec.budget.value >= length)


def accuracy_table(trials: list[NeedleTrial]) -> list[str]:
    """Markdown: solved fraction per configuration and length."""
    lengths = sorted({t.length for t in trials})
    groups: dict[tuple[str, Budget], dict[int, list[bool]]] = {}
    for t in trials:
        groups.setdefault((t.policy, t.budget), {}).setdefault(t.length, []).append(t.solved)
    lines = [
        "| policy | budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|---:|" + "---:|" * len(lengths),
    ]
    for (policy, budget), by_len in groups.items():
        cells = [
            f"{np.mean(by_len[n]):.0%} ({sum(by_len[n])}/{len(by_len[n])})" if n in by_len else "" for n in lengths
        ]
        lines.append(f"| {policy} | {budget} | " + " | ".join(cells) + " |")
    return lines
