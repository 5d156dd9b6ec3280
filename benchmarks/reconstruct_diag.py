"""Where a reading's evictions put the hidden sentences of longdoc items (issue 12; ``--task multikey``: the asked
key's sentence only, the distractors not followed; ``--task multivalue``: each of the keys'): for each item, the
answer, which tokens of each sentence are still cached after the prompt is read, how many decode positions after
the sentence's start each of the others was evicted, and how the kept positions spread over the prompt (per 256
positions; a uniform keep at 4x is 64 each). Filler: tuning texts the
reports do not read (LGPL-2.1, GFDL-1.3, Apache-2.0).

    python benchmarks/reconstruct_diag.py --reading reconstruct --cells 512 --depths 0.1,0.3,0.5,0.7,0.9 -t 1
    python benchmarks/reconstruct_diag.py --reading surprisal --cells 512 -t 1
    python benchmarks/reconstruct_diag.py --task multikey --reading query --cells 256 --seed 3:0 -t 1 \
        --texts GFDL-1.3,LGPL-2.1,MPL-1.1
    python benchmarks/reconstruct_diag.py --reading surprisal --cells 512 --recent 192 --show-kept -t 1
    python benchmarks/reconstruct_diag.py --task multivalue --reading query --cells 512 --seed 0:0 -t 1
    python benchmarks/reconstruct_diag.py --reading query --cells 2048 --length 16384 -t 1 \
        --texts LGPL-2.1,MPL-1.1,GPL-2,MPL-2.0

At 16K the default texts are too short; LGPL-2.1, MPL-1.1, GPL-2 and MPL-2.0 share none with `eval longdoc`'s
16K filler (GPL-3, Apache-2.0, Artistic, BSD, CC0-1.0, GFDL-1.2).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import license_texts  # benchmarks/ is the script's directory: sys.path[0]

from ahakv_local.budget import READINGS
from ahakv_local.longdoc import ANSWER_TOKENS, SEPARATOR, Filler, make_item
from ahakv_local.models import default_model_path
from ahakv_local.session import SessionSpec, open_session

TUNING_TEXTS = ("LGPL-2.1", "GFDL-1.3", "Apache-2.0")


def sentence_span(e, prompt: list[int], text: str) -> np.ndarray:
    """The prompt positions of a hidden sentence with the line breaks around it."""
    sentence = e.tokenize(f"{SEPARATOR}{text}{SEPARATOR}", add_bos=False)
    at = next(i for i in range(len(prompt)) if prompt[i : i + len(sentence)] == sentence)
    return np.arange(at, at + len(sentence))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="ahakv")
    ap.add_argument(
        "--task",
        default="single",
        help="single, multikey (the asked key's sentence is followed) or multivalue (each key's)",
    )
    ap.add_argument("--reading", default="reconstruct", choices=READINGS)
    ap.add_argument("--cells", type=int, default=512)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--seed", default="1", help="the items' seed (tune_guided.py's items of seed S: S:0)")
    ap.add_argument("--recent", type=int, default=SessionSpec.n_recent, help="last prompt tokens never evicted")
    ap.add_argument("--show-kept", action="store_true", help="print the cached prompt text, run by run")
    ap.add_argument("--texts", default=",".join(TUNING_TEXTS), help="filler license texts (16K needs more)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    texts = license_texts(args.texts)
    spec = SessionSpec.bounded(args.policy, args.cells, reading=args.reading, n_recent=args.recent)
    solved = []
    with open_session(default_model_path(), spec, args.length + 16, 64, n_threads=args.threads) as s:
        e, ctl = s.engine, s.controller
        filler, evicted_at = Filler(e, texts), {}
        real_evict = e.evict

        def evict(positions, cache=None):
            evicted_at[e.n_past] = np.asarray(positions).copy()
            return real_evict(positions, cache)

        e.evict = evict
        for depth in (float(d) for d in args.depths.split(",")):
            item = make_item(e, filler, args.task, args.length, depth, args.seed)
            followed = item.sentences if args.task == "multivalue" else item.sentences[:1]
            p = item.prompt
            spans = [sentence_span(e, p, text) for text in followed]
            s.reset()
            evicted_at.clear()
            start = time.perf_counter()
            logits = s.read(item.prompt, item.question)
            seconds = time.perf_counter() - start
            out, _ = s.answer(logits, ANSWER_TOKENS[args.task])
            answer = e.detokenize(out).strip()
            solved.append(item.score(answer))
            print(f"depth {depth}: read {seconds:.1f} s, answer {answer!r} (expected {', '.join(item.expected)})")
            for i, (text, span) in enumerate(zip(followed, spans, strict=True)):
                at = int(span[0])
                kept = "".join("1" if k else "0" for k in np.isin(span, ctl.live))
                when = {int(q - at): n - at for n, v in sorted(evicted_at.items()) for q in np.intersect1d(v, span)}
                print(f"  sentence {i} at {at / len(p):.2f} ({text.strip()!r}): kept {kept}")
                if when:
                    print(f"    evicted (token offset: positions after the sentence's start) {when}")
            spread = np.bincount(ctl.live // 256, minlength=args.length // 256 + 1).tolist()
            print(f"  kept per 256 positions {spread}")
            if args.show_kept:
                live = np.sort(ctl.live[ctl.live < len(p)])
                runs = np.split(live, np.flatnonzero(np.diff(live) != 1) + 1)
                print("  cached:", " | ".join(repr(e.detokenize([p[i] for i in r])) for r in runs if r.size))
    print(f"solved {sum(solved):g}/{len(solved)}")


if __name__ == "__main__":
    main()
