"""How far a sequence's statistics drift beside other sequences of one context (``serve --parallel``), by float
order only: one chat request read into a ``SequencePool`` slot alone, then again beside other requests (started
first and stepped a few times), on the random-weight fixture the parallel server test uses. Prints, per
observation of the prompt's reading, the largest difference of each statistic relative to its largest value, and
whether the live positions after the prompt and the greedy answer are the same as alone (the table stops where the
observed positions part).

    python benchmarks/parallel_drift.py [--request 5] [--others 0,1] [--policy ahakv] [--budget 88]

The requests are ``tests/test_server_parallel.py``'s ``chat_body``: 40 words of GPL-3 each, rendered as the server
renders a chat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server_parallel import chat_body  # noqa: E402

from ahakv_local.budget import Budget  # noqa: E402
from ahakv_local.controller import KVController  # noqa: E402
from ahakv_local.engine import Engine, EngineConfig  # noqa: E402
from ahakv_local.models import fixture_path  # noqa: E402
from ahakv_local.parallel import Generation, Sampling, SequencePool  # noqa: E402
from ahakv_local.session import SessionSpec  # noqa: E402

KINDS = ("attn", "side", "verr", "vnorm")


def read(args: argparse.Namespace, others: list[int]) -> tuple[list[dict], np.ndarray, list[int]]:
    """(each observation of the request's prompt, its live positions after the prompt, its greedy answer)."""
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 4, 64, spec.room(64))
    seen: list[dict] = []
    target: list[KVController | None] = [None]
    observation = KVController._observation

    def recorded(self, *a, **kw):
        obs = observation(self, *a, **kw)
        if self is target[0]:
            seen.append(
                {k: None if getattr(obs, k) is None else np.array(getattr(obs, k)) for k in (*KINDS, "positions")}
            )
        return obs

    KVController._observation = recorded
    try:
        with Engine(fixture_path(), EngineConfig(n_ctx=cells, n_batch=64, n_ubatch=64, n_seq=4)) as e:
            pool = SequencePool(e, spec)

            def generation(i: int, policy: str | None = None, budget: int | None = None) -> Generation:
                body = chat_body(i, text)
                tokens, _ = e.chat_prompt(body["messages"])
                return Generation(
                    tokens, Sampling(max_tokens=40, temperature=0), lambda t, f: None,
                    budget=Budget.parse(budget or body.get("kv_budget", 96)), policy=policy or body.get("kv_policy"),
                )  # fmt: skip

            for i in others:
                pool.start(generation(i))
            for _ in range(3):
                pool.step()
            mine = generation(args.request, args.policy, args.budget)
            target[0] = pool.controllers[pool.free()[0]]
            slot = pool.start(mine)
            live = pool.controllers[slot].live.copy()
            while slot in pool.active:
                pool.step()
            return seen, live, mine.tokens
    finally:
        KVController._observation = observation


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--request", type=int, default=5)
    ap.add_argument("--others", default="0,1", help="requests started first (comma-separated)")
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument("--budget", type=int, default=88)
    args = ap.parse_args()
    others = [int(i) for i in args.others.split(",") if i]
    alone, live_alone, answer_alone = read(args, [])
    beside, live_beside, answer_beside = read(args, others)
    print(f"request {args.request} ({args.policy}, {args.budget} cells), alone and beside requests {others}")
    print("\n| observation | " + " | ".join(KINDS) + " |\n|---:|" + "---:|" * len(KINDS))
    for k, (a, b) in enumerate(zip(alone, beside, strict=False)):
        if not np.array_equal(a["positions"], b["positions"]):
            print(f"| {k} | (another set of positions from here: an eviction went otherwise) |")
            break
        cells = [
            "" if a[kind] is None or a[kind].shape != b[kind].shape
            else f"{float(np.abs(a[kind] - b[kind]).max() / max(np.abs(a[kind]).max(), 1e-30)):.1e}"
            for kind in KINDS
        ]  # fmt: skip
        print(f"| {k} | " + " | ".join(cells) + " |")
    first = next((k for k, (x, y) in enumerate(zip(answer_alone, answer_beside, strict=False)) if x != y), None)
    where = f" (first differs at token {first})" if first is not None else ""
    print(f"\nlive positions after the prompt the same: {np.array_equal(live_alone, live_beside)}; answer the same: "
          f"{answer_alone == answer_beside}{where}")  # fmt: skip


if __name__ == "__main__":
    main()
