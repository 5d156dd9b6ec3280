"""Several generations decoded together: the sequence slots of one context (``Engine.view``), each with its
own controller (live positions, budget, policy), and one ``llama_decode`` per step for every active sequence
(``controller.step_batch``). Evictions stay inside a sequence: a controller only ever evicts its own positions.

A ``SequencePool`` is driven by one thread (the server's scheduler): ``start`` reads a new request's prompt
into a free slot (the other sequences wait meanwhile), ``step`` decodes one token for each active one. Each
slot reads its prompt from a fresh policy, as the one-at-a-time ``Llama`` does, and a request alone in the context
from its first cell, so a greedy answer does not depend on the requests before it (beside others, a sequence's cells
sit among theirs: its float sums meet them in another order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .budget import Budget, cells_for
from .controller import Reconstruct, step_batch
from .engine import Engine
from .errors import AhakvError
from .policies import Policy, make_policy
from .session import SessionSpec, guide_of
from .stream_text import completion_text, first_stop, ready_text
from .textfile import last_paragraph

TOP_K = 40  # llama-cpp-python's default for completions
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a seed drawn at random


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = TOP_K  # 0: every token
    min_p: float = 0.0  # keep the tokens at least this share of the likeliest's probability (at temperature 1)

    def pick(self, logits: np.ndarray, counts: Counter, rng: np.random.Generator) -> int:
        """The next token: penalties, then greedy (temperature 0) or top-k / min-p / top-p / temperature sampling."""
        if counts and (self.presence_penalty or self.frequency_penalty):
            ids = np.fromiter(counts.keys(), dtype=np.int64)
            n = np.fromiter(counts.values(), dtype=np.float32)
            logits = logits.copy()
            logits[ids] -= self.presence_penalty + self.frequency_penalty * n
        if self.temperature == 0:
            return int(np.argmax(logits))
        # llama-cpp-python's chain (_init_sampler): top-k, then top-p and min-p on the probabilities at temperature 1,
        # then the temperature (top-p took the tempered ones: at 2 it kept tokens llama-cpp-python cuts, below 1 fewer)
        k = min(self.top_k or logits.size, logits.size)
        top = np.argpartition(-logits, k - 1)[:k]
        top = top[np.argsort(-logits[top], kind="stable")]
        z = logits[top].astype(np.float64)
        p = np.exp(z - z[0])
        keep = int(np.searchsorted(np.cumsum(p / p.sum()), self.top_p)) + 1
        top, z = top[:keep], z[:keep]
        if self.min_p > 0:  # p / p_max = exp(z - z_max), as llama.cpp's min-p sampler compares them
            kept = int(np.count_nonzero(z >= z[0] + np.log(self.min_p)))
            top, z = top[:kept], z[:kept]
        p = np.exp((z - z[0]) / self.temperature)  # shifted first: a tiny temperature divided to inf, then NaN
        return int(rng.choice(top, p=p / p.sum()))


@dataclass
class Generation:
    """One request in a slot. ``emit(text, finish)`` receives each new piece of text with finish None, then
    once the rest with the finish reason: "stop", "length", or "cancelled" (``stopped()`` said so)."""

    prompt: list[int]
    sampling: Sampling
    emit: Callable[[str, str | None], None]
    stopped: Callable[[], bool] = lambda: False
    budget: Budget | None = None  # None: the pool's
    policy: str | None = None  # None: the pool's
    guide: Sequence[int] | Reconstruct | None = None
    tokens: list[int] = field(default_factory=list)  # generated
    sent: int = 0  # characters of text emitted


class SequencePool:
    """``n_seq`` sequence slots of one engine's context, each a view with a controller built from ``spec``."""

    def __init__(self, engine: Engine, spec: SessionSpec):
        if spec.budget.mode != "cells" or spec.layer_budgets != "shared":
            raise AhakvError("several sequences in one context need a budget in cells and shared layer budgets")
        self.engine, self.spec = engine, spec
        self.views = [engine.view(s) for s in range(engine.config.n_seq)]
        self.controllers = [spec.controller(v) for v in self.views]
        self.active: dict[int, Generation] = {}
        self.next_token: dict[int, int] = {}
        self._counts: dict[int, Counter] = {}
        self._rng: dict[int, np.random.Generator] = {}
        self.served = [0] * len(self.views)  # requests each slot has run
        self.kv_cells, self.kv_bytes = engine.n_cells(), engine.kv_bytes()

    @staticmethod
    def context_cells(budget: Budget, n_seq: int, chunk: int, room: int) -> int:
        """Cells of a context for ``n_seq`` sequences at a cell ``budget``: each holds at most its budget and
        the newest token; one prompt is read at a time (one chunk, and the room of a guided reading)."""
        return cells_for(budget, chunk, 0, room) + (n_seq - 1) * (int(budget.value) + 1)

    def free(self) -> list[int]:
        return [s for s in range(len(self.views)) if s not in self.active]

    # -- requests ------------------------------------------------------------------------------------------

    def check(self, budget: Budget | None, policy: str | None) -> tuple[Budget, Policy]:
        """A request's budget and policy (None: the pool's), checked together; raises AhakvError."""
        budget, chosen = self.check_asked(budget, policy)
        self.controllers[0].check_budget(budget, chosen)
        return budget, chosen

    def check_asked(self, budget: Budget | None, policy: str | None) -> tuple[Budget, Policy]:
        """``check``'s part that reads the server's settings alone, not a controller (which the scheduler's thread
        owns): a request's thread refuses with it before the request waits for a slot."""
        budget = budget or self.spec.budget
        if budget.mode != "cells" or budget.value > self.spec.budget.value:
            raise AhakvError(
                f"with several sequences a request's kv_budget is a cell count up to the server's "
                f"{int(self.spec.budget.value)}, not {budget}"
            )
        chosen = make_policy(policy) if policy is not None else self.spec.make_policy()
        if not chosen.evicts:  # its sequence would fill the context the others share, failing theirs
            raise AhakvError(
                f"kv_policy {chosen.name} keeps every token: with several sequences each holds at most its budget"
            )
        return budget, chosen

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise AhakvError("the prompt is empty")
        if len(prompt) + 1 > self.engine.n_ctx_train:
            raise AhakvError(
                f"the prompt has {len(prompt)} tokens, past the model's trained context of {self.engine.n_ctx_train}"
            )

    def start(self, gen: Generation) -> int:
        """Read ``gen``'s prompt into a free slot (from a fresh policy) and pick its first token; returns the
        slot. A request's mistake raises AhakvError or ValueError with the slot left empty; a generation stopped
        while its prompt is read ends "cancelled" before its next chunk."""
        seq = self.free()[0]
        ctl = self.controllers[seq]
        budget, policy = self.check(gen.budget, gen.policy)
        self.check_prompt(gen.prompt)
        ctl.configure(budget, policy)
        ctl.truncate(0)
        if not self.active:  # alone in the context (every finished slot's cells are gone: _drop): from its first cell
            self.engine.clear_cells()
        ctl.restart_stats()  # the figures of this request
        self.active[seq] = gen
        self._counts[seq] = Counter()
        seed = gen.sampling.seed
        # -1 (4294967295 as llama.cpp's uint32 seed, LLAMA_DEFAULT_SEED) asks for a random one, as the other server
        self._rng[seq] = np.random.default_rng(None if seed == RANDOM_SEED else seed)
        self.served[seq] += 1
        try:
            for chunk, ends_prompt in ctl.prompt_pieces(gen.prompt, gen.guide, self.engine.config.n_batch):
                if gen.stopped():  # the client left, or the server stops: the other slots wait while a prompt is read
                    self._finish(seq, "", "cancelled")
                    return seq
                logits = ctl.read_piece(chunk, gen.guide, ends_prompt)
        except BaseException:
            self._drop(seq)
            raise
        self._take(seq, logits)
        return seq

    def step(self) -> None:
        """One token for every active sequence, in one llama_decode; cancelled generations end first."""
        for seq, gen in list(self.active.items()):
            if gen.stopped():
                self._finish(seq, "", "cancelled")
        seqs = [s for s in self.active if s in self.next_token]
        if not seqs:
            return
        logits = step_batch([self.controllers[s] for s in seqs], [self.next_token.pop(s) for s in seqs])
        for s, row in zip(seqs, logits, strict=True):
            self._take(s, row)

    # -- one sequence ----------------------------------------------------------------------------------------

    def _take(self, seq: int, logits: np.ndarray) -> None:
        """Sample the next token of ``seq`` and pass on its text; finish at an end token, a stop string or
        max_tokens, else queue the token for the next step."""
        gen, e = self.active[seq], self.engine
        token = gen.sampling.pick(logits, self._counts[seq], self._rng[seq])
        if e.is_eog(token):
            self._finish(seq, self._text(gen)[gen.sent :], "stop")
            return
        gen.tokens.append(token)
        self._counts[seq][token] += 1
        text = self._text(gen)
        if (cut := first_stop(text, gen.sampling.stop)) >= 0:
            self._finish(seq, text[gen.sent : cut], "stop")
            return
        # at max_tokens, or where prompt and tokens fill the trained context, as llama-cpp-python cuts max_tokens (past
        # it, the batch's llama_decode failed, and every sequence in the batch with an error)
        if len(gen.tokens) >= gen.sampling.max_tokens or self.controllers[seq].engine.n_past + 1 >= e.n_ctx_train:
            self._finish(seq, text[gen.sent :], "length")
            return
        # hold back what could begin a stop string (the text's longest end that begins one; an unfinished UTF-8
        # character is not in the text yet: the "a" of a stop string "a𓀀" went out before its character was whole)
        ready = ready_text(text, gen.sampling.stop)
        if len(ready) > gen.sent:
            gen.emit(ready[gen.sent :], None)
            gen.sent = len(ready)
        self.next_token[seq] = token

    def _text(self, gen: Generation) -> str:
        """The text of the tokens sampled so far, as llama-cpp-python makes it: bytes that are no UTF-8 dropped
        (``errors="ignore"``; they came out as U+FFFD here, where the one-at-a-time server dropped them), an unfinished
        character at the end held back until its bytes are all in (at the end of a generation, dropped)."""
        return completion_text(self.engine.detokenize_bytes(gen.tokens))

    def _finish(self, seq: int, rest: str, reason: str) -> None:
        gen = self.active[seq]
        self._drop(seq)
        gen.emit(rest, reason)

    def _drop(self, seq: int) -> None:
        """Free the slot and its cells at once: every row of a unified KV stream attends over the span of all
        the cells in use (masked to its own), so cells a finished request left behind would make every later
        prompt and step of the others pay for them. The slot's figures stay those of its last request."""
        self.active.pop(seq, None)
        self.next_token.pop(seq, None)
        ctl = self.controllers[seq]
        figures = replace(ctl.stats)
        ctl.truncate(0)
        ctl.stats = figures

    # -- figures -------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Per sequence: active or not, cells used (none on an idle slot, ``_drop``), budget target, and its running or
        last request's tokens seen, evictions, policy and guide tokens; requests served."""
        seqs = []
        for s, ctl in enumerate(self.controllers):
            st = ctl.stats
            seqs.append(
                {
                    "seq": s,
                    "active": s in self.active,
                    "cells_used": st.cells_used if s in self.active else 0,  # a finished request's are freed
                    "budget": int(ctl.groups[0].budget.value),
                    "tokens_seen": st.tokens_seen,
                    "evicted": st.evicted,
                    "policy": ctl.policy.name,
                    "guide_tokens": st.guide_tokens,
                    "requests": self.served[s],
                }
            )
        return {"parallel": len(self.views), "kv_cells": self.kv_cells, "kv_bytes": self.kv_bytes, "sequences": seqs}


def prompt_of(engine: Engine, kind: str, payload, kv_query, default_query) -> tuple[list[int], list[str], object]:
    """(prompt tokens, stop strings, what the prompt is read with) of a chat ("chat", messages) or completion
    ("completion", text) request, as the one-at-a-time server's ``Llama`` builds them."""
    if kind == "chat":
        tokens, stop = engine.chat_prompt(payload)
        users = [m["content"] for m in payload if m["role"] == "user"]
        question = users[-1] if users else None
    else:
        tokens, stop = engine.tokenize(payload, add_bos=True, special=True), []
        question = last_paragraph(payload) or None
    return tokens, stop, guide_of(default_query if kv_query is None else kv_query, question, engine)
