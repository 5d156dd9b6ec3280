"""What the best possible eviction could do for the passkey test on a model: an oracle that knows where the key
is keeps the instruction, the whole key sentence and the last ``recent`` prompt tokens, evicts everything
else, and lets the model answer. If the oracle fails at a compression, no policy can be asked to succeed there.

    python benchmarks/needle_oracle.py [--length 2048] [--recent 200,64] [--out benchmarks/out/needle_oracle.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.needle import INTRO, NEEDLE, answer_key, build_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--recent", default="200,64", help="Prompt tokens kept at the end (comma-separated).")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--filler", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "needle_oracle.json"))
    args = ap.parse_args()
    model, rows = default_model_path(), []
    with Engine(model, EngineConfig(n_ctx=args.length + 256, n_batch=64, n_ubatch=64)) as e:
        filler = e.tokenize(Path(args.filler).read_text(), add_bos=False)
        intro = len(e.tokenize(INTRO, add_bos=True))
        for recent in (int(r) for r in args.recent.split(",")):
            for depth in (float(d) for d in args.depths.split(",")):
                key = "48213"
                prompt = build_prompt(e, filler, args.length, depth, key)
                needle = e.tokenize(NEEDLE.format(key=key), add_bos=False)
                at = next(i for i in range(len(prompt)) if prompt[i : i + len(needle)] == needle)
                e.truncate(0)
                body = prompt[:-recent]
                for a in range(0, len(body), 64):
                    e.decode(body[a : a + 64])
                keep = set(range(intro)) | set(range(at, at + len(needle)))
                e.evict([p for p in range(len(body) - 1) if p not in keep])  # the newest stays (llama.cpp)
                logits = None
                for a in range(len(body), len(prompt), 64):
                    logits = e.decode(prompt[a : a + 64])
                out = []
                for _ in range(8):
                    tok = int(np.argmax(logits))
                    out.append(tok)
                    logits = e.decode([tok])
                answer = e.detokenize(out)
                kept = len(keep) + 1 + recent
                rows.append(
                    {"recent": recent, "depth": depth, "kept": kept, "compression": args.length / kept,
                     "answer": answer, "solved": answer_key(answer) == key}
                )  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    out.write_text(json.dumps({"command": command, "model": str(model), "length": args.length, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
