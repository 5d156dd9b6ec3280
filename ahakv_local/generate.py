"""Token generation on an Engine: prefill, then one decode per token, as a stream.

Prefill and decode are separate on purpose: the prompt goes through in n_batch chunks, every
generated token through a single-row decode. ``GenerationStats`` records both speeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .engine import Engine


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_generated: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    evicted: int = 0
    cells_used: list[int] = field(default_factory=list)  # after each step

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_generated / self.decode_seconds if self.decode_seconds else 0.0


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    return int(rng.choice(p.size, p=p / p.sum()))


def stream_tokens(
    engine: Engine,
    prompt: Sequence[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stats: GenerationStats | None = None,
    after_step: Callable[[Engine], int] | None = None,
    stop: Sequence[int] = (),
) -> Iterator[int]:
    """Yield generated token ids. ``after_step(engine)`` runs between decodes (an eviction hook) and
    returns how many positions it evicted."""
    stats = stats if stats is not None else GenerationStats()
    rng = np.random.default_rng(seed)

    t0 = time.perf_counter()
    logits = engine.decode(list(prompt))
    stats.prompt_seconds += time.perf_counter() - t0
    stats.n_prompt += len(prompt)

    for _ in range(max_tokens):
        if after_step:
            stats.evicted += after_step(engine)
        stats.cells_used.append(engine.n_used())
        token = sample(logits, temperature, rng)
        if token in stop:
            return
        yield token
        if engine.n_past >= engine.n_ctx_train:
            return
        t0 = time.perf_counter()
        logits = engine.decode([token])
        stats.decode_seconds += time.perf_counter() - t0
        stats.n_generated += 1
