"""A bounded sequence: the one place a front end gets a KV cache held to a budget.

``SessionSpec`` is a named, configured (policy, budget, schedule), like kvpress's configured presses:
evaluation configurations, the ``Llama`` drop-in, the passkey test and the benchmarks all describe
what they want as one. ``spec.controller(engine)`` puts it on an engine somebody else owns (the
drop-in's); ``open_session`` also opens the engine, with the cells ``budget.cells_for`` allots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from .budget import NO_EVICTION, Budget, cells_for, default_evict_every, guide_room
from .controller import ControllerConfig, KVController, Reconstruct
from .engine import Engine, EngineConfig
from .errors import AhakvError
from .policies import Policy, make_policy

# what the reconstruction pass reads behind each chunk before the chunk itself again (KVzip's repeat prompt)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"
Reading = Literal["plain", "query", "reconstruct"]


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
    # or question-agnostic by reconstruction (policies that cannot be guided read plainly)
    reading: Reading = "plain"

    def __post_init__(self) -> None:
        policy = self.make_policy()  # an unknown policy or parameter fails here, before any model loads
        if policy.evicts and not self.budget.evicts:
            raise AhakvError(f"policy {self.policy} evicts: give it a budget (the full cache keeps everything)")
        if self.reading not in ("plain", "query", "reconstruct"):
            raise AhakvError(f"reading must be plain, query or reconstruct, not {self.reading!r}")

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

    def cells(self, chunk: int, longest: int) -> int:
        """KV cells to allocate (the one rule, ``budget.cells_for``), with room for a guided reading."""
        room = guide_room(self.reading, chunk) if self.make_policy().reads_with_query else 0
        return cells_for(self.budget, chunk, longest, room)

    def config(self) -> ControllerConfig:
        every = self.evict_every or default_evict_every(self.budget, self.n_sink, self.n_recent)
        return ControllerConfig(
            self.budget, self.n_sink, self.n_recent, every, self.pinned, observe_steps=self.observe_steps
        )

    def controller(self, engine: Engine) -> KVController:
        """A controller holding this spec's budget on ``engine`` (which the caller owns)."""
        return KVController(engine, self.make_policy(), self.config())


class BoundedSession:
    """An engine of its own plus the controller that bounds it (closed by ``close()`` or ``with``)."""

    def __init__(self, spec: SessionSpec, engine: Engine):
        self.spec, self.engine = spec, engine
        try:
            self.controller = spec.controller(engine)
        except BaseException:
            engine.close()
            raise

    def reset(self) -> None:
        """Back to an empty sequence with a fresh policy (same settings)."""
        self.controller.truncate(0)

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


def guide(reading: Reading, question: Sequence[int] | None, engine: Engine) -> Sequence[int] | Reconstruct | None:
    """What ``KVController.prefill`` is guided by in this reading mode."""
    if reading == "query":
        return question or None
    if reading == "reconstruct":
        return Reconstruct(tuple(engine.tokenize(REPEAT_PROMPT, add_bos=False)))
    return None


def open_session(model: str | Path, spec: SessionSpec, longest: int, n_ubatch: int = 64, **engine_kw) -> BoundedSession:
    """An engine for ``model`` sized for ``spec`` over a sequence of at most ``longest`` tokens read
    ``n_ubatch`` at a time, with its controller."""
    cells = spec.cells(n_ubatch, longest)
    engine = Engine(model, EngineConfig(n_ctx=cells, n_batch=n_ubatch, n_ubatch=n_ubatch, **engine_kw))
    return BoundedSession(spec, engine)
