"""What llama.cpp logs while a resize of the adaptive layout makes its new context (one KV cache per layer: 18 on
Gemma 3 270M), by level, and how much of it still reaches the log callback when ahakv-local is not verbose (patch
0024 drops the debug lines before they are formatted; before it, every message was formatted and handed to the
callback, which printed none of them).

    python benchmarks/context_log_lines.py

A counting callback stands in for ahakv-local's for the two resizes; the table gives the messages by level for the
move with nothing dropped (what the engine did before patch 0024) and with the product's setting.
"""

from __future__ import annotations

import argparse
from collections import Counter

import llama_cpp
from common import file_tokens  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local import upstream
from ahakv_local.models import default_model_path
from ahakv_local.native import lib
from ahakv_local.session import SessionSpec, open_session

LEVELS = {1: "debug", 2: "info", 3: "warn", 4: "error", 0: "none", 5: "cont"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--budget", type=int, default=512)
    args = ap.parse_args()
    model = default_model_path()
    tokens = file_tokens(model, args.text, 2 * args.budget)
    spec = SessionSpec.bounded("ahakv", args.budget, layer_budgets="adaptive")
    seen: Counter[int] = Counter()
    counting = llama_cpp.llama_log_callback(lambda level, _text, _data: seen.update([level]))
    rows = {}
    with open_session(model, spec, len(tokens)) as session:
        e = session.engine
        session.controller.prefill(tokens)
        llama_cpp.llama_log_set(counting, None)
        try:
            settings = (
                ("nothing dropped (before 0024)", lambda: lib().set_log_level(0)),
                ("not verbose (0024)", lambda: upstream.set_verbose(False)),  # the product's setting
            )
            for label, setting in settings:
                setting()
                seen.clear()
                e.resize_caches(tuple(n + 16 for n in e.cache_sizes()))
                rows[label] = dict(seen)
        finally:
            llama_cpp.llama_log_set(upstream._log_callback, None)
            upstream.set_verbose(False)
    print(f"messages llama.cpp logs in one resize of the adaptive layout ({len(e.caches)} caches), by level")
    print("| messages formatted | " + " | ".join(LEVELS[k] for k in sorted(LEVELS)) + " | all |")
    print("|---|" + "---:|" * (len(LEVELS) + 1))
    for label, got in rows.items():
        print(f"| {label} | " + " | ".join(str(got.get(k, 0)) for k in sorted(LEVELS)) + f" | {sum(got.values())} |")


if __name__ == "__main__":
    main()
