"""What guiding the reading of a long prompt by its question costs, against reading it plainly (issue 12: <= 1.3x).

A document longer than the budget is read in chunks and compressed after each; guided by a question, the question's
last QUERY_TOKENS tokens are decoded behind each span of the prompt (a chunk and what the question leaves of the room
behind it) and removed again. Three readings of the same document, round by round in one run (AhaKV, the product's
path: ``BoundedSession.read``): plainly, guided by a short question, and guided by the document's last paragraph
(what ``generate`` and the drop-in ask by default); and, to show what the spans buy, the last paragraph's question
behind every chunk (``--per-chunk``: ``KVController.read_span`` held at one chunk).

    AHAKV_THREADS=2 python benchmarks/guided_read_cost.py --rounds 3
    AHAKV_THREADS=2 python benchmarks/guided_read_cost.py --rounds 3 --layer-budgets adaptive --per-chunk

Prints, per reading (medians over the rounds): the tokens decoded to guide it, prompt tokens a second, the time
against the plain reading, and where the seconds go: llama_decode of observed chunks (the tap's side pass and error
term over every cell), of chunks read unobserved (a span's first), of the question behind a span, and the rest
(statistics read from the tap, scores, evictions).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from common import file_tokens, llama_decode_times  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.controller import KVController
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session

QUESTION = "What does the GPL say about proprietary programs?"


@contextlib.contextmanager
def decode_seconds_by_kind() -> Iterator[dict[str, float]]:
    """While active, the seconds of llama_decode (``common.llama_decode_times``) by what the controller decoded:
    "observed" chunks, "unobserved" ones, "question"s (any other call is left out)."""
    seconds: dict[str, float] = {}
    decode, read_query = KVController._decode, KVController.read_query
    with llama_decode_times() as calls:

        def tagged(kind: str, run, *args):
            before = len(calls)
            try:
                return run(*args)
            finally:
                seconds[kind] = seconds.get(kind, 0.0) + sum(calls[before:])

        def tagged_decode(ctl, tokens, window, all_logits, observe=True):
            kind = "observed" if observe else "unobserved"
            return tagged(kind, decode, ctl, tokens, window, all_logits, observe)

        KVController._decode = tagged_decode
        KVController.read_query = lambda ctl, query: tagged("question", read_query, ctl, query)
        try:
            yield seconds
        finally:
            KVController._decode, KVController.read_query = decode, read_query


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--layer-budgets", default="shared")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-chunk", action="store_true", help="also the last paragraph behind every chunk (no spans)")
    args = ap.parse_args()
    model = default_model_path()
    text = Path(args.text).read_text(encoding="utf-8")
    tokens = file_tokens(model, args.text)
    paragraph = next(p for p in reversed(text.split("\n\n")) if p.strip())  # generate's default question
    readings = {"plain": None, "short question": QUESTION, "last paragraph": paragraph}
    if args.per_chunk:
        readings["last paragraph, behind every chunk"] = paragraph
    rows: dict[str, list[tuple[int, float, dict[str, float]]]] = {name: [] for name in readings}
    sessions = {}
    try:
        for name, question in readings.items():
            reading = "plain" if question is None else "query"
            spec = SessionSpec.bounded("ahakv", args.budget, reading=reading, layer_budgets=args.layer_budgets)
            sessions[name] = open_session(model, spec, len(tokens) + 1)
        for _ in range(args.rounds):
            for name, question in readings.items():
                session = sessions[name]
                session.reset()
                asked = session.engine.tokenize(question, add_bos=False) if question else None
                ctl = session.controller
                if name.endswith("every chunk"):  # the reading before spans: the question behind every chunk
                    ctl.read_span = lambda query, chunk=None, n=session.engine.config.n_ubatch: chunk or n
                with decode_seconds_by_kind() as by_kind:
                    t0 = time.perf_counter()
                    session.read(tokens, asked)
                    seconds = time.perf_counter() - t0
                rows[name].append((ctl.stats.guide_tokens, seconds, by_kind))
    finally:
        for session in sessions.values():
            session.close()
    plain = statistics.median(s for _, s, _ in rows["plain"])
    print(
        f"{len(tokens)} tokens of {Path(args.text).name}, AhaKV, budget {args.budget}, {args.layer_budgets}, "
        f"medians of {args.rounds} rounds"
    )
    print("| reading | guide tokens | prompt t/s | vs plain | observed chunks s | unobserved s | question s | rest s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, got in rows.items():
        seconds = statistics.median(s for _, s, _ in got)
        parts = [statistics.median(b.get(k, 0.0) for _, _, b in got) for k in ("observed", "unobserved", "question")]
        rest = seconds - sum(parts)
        cols = [f"{len(tokens) / seconds:.1f}", f"{seconds / plain:.3f}x", *(f"{p:.2f}" for p in parts), f"{rest:.2f}"]
        print(f"| {name} | {got[0][0]} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
