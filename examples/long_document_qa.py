"""Ask about a document far longer than the KV budget, and check the answer.

A pass key is hidden in the middle of the GPL-3 text (~7,600 tokens), which is read through a 256-cell cache: the
prompt is compressed chunk by chunk as it is read, guided by the question (query-aware reading), so memory stays
at the budget. The answer is scored against the hidden key.

    python examples/long_document_qa.py [--document FILE] [--budget 256] [--depth 0.5] [--key 71432]

Exit status 0 when the answer names the key, 1 when it does not, 2 for a bad argument (one line). The embedded
Gemma 3 270M is a base model, so the question is asked as a completion with the start of the answer ("The pass key
is number"), as the RULER-style suite does (`ahakv-local eval longdoc`); through a chat template it does not answer
even with the whole document in its cache.
"""

import argparse
import re
import sys
from pathlib import Path

from ahakv_local import Llama
from ahakv_local.errors import AhakvError
from ahakv_local.models import default_model_path

# the wording of the suite's single-needle task (ahakv_local/longdoc.py), which the 270M model answers best
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
QUESTION = "What is the pass key? Remember: the pass key is a number."


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage block first: the error alone, one line
        self.exit(2, f"{self.prog}: error: {message}\n")


parser = OneLineErrors(description=__doc__.splitlines()[0])
parser.add_argument("--document", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
parser.add_argument("--budget", type=int, default=256, help="KV cells of a full-attention layer")
parser.add_argument("--depth", type=float, default=0.5, help="where the key sits, as a fraction of the paragraphs")
parser.add_argument("--key", default="71432", help="the pass key: a number")
args = parser.parse_args()
if not 0 <= args.depth <= 1:
    parser.error(f"--depth is a fraction of the paragraphs, from 0 to 1, not {args.depth}")
if not args.key.isdecimal():  # the question says "the pass key is a number"
    parser.error(f"--key must be a number, not {args.key!r}")
try:
    paragraphs = args.document.read_text().split("\n\n")
except (OSError, UnicodeDecodeError) as exc:
    parser.error(f"cannot read {args.document}: {getattr(exc, 'strerror', None) or exc}")
needle = f"The pass key is {args.key}. Remember it. {args.key} is the pass key."
paragraphs.insert(round(args.depth * len(paragraphs)), needle)
prompt = f"{INTRO}\n\n" + "\n\n".join(paragraphs) + f"\n\n{QUESTION} The pass key is number"

try:
    llm = Llama(str(default_model_path(progress=True)), kv_budget=args.budget, n_batch=64, verbose=False)
except AhakvError as exc:  # a budget the model cannot use (0, below the protected positions, ...)
    parser.error(str(exc))
# room for the whole key and a token either side (8 tokens cut a key of 8 digits, one token each on Gemma, to 7)
room = len(llm.tokenize(f" {args.key}.".encode(), add_bos=False)) + 2
out = llm.create_completion(prompt, kv_query=QUESTION, max_tokens=room, temperature=0)
answer = out["choices"][0]["text"].strip()
found = re.search(r"\d+", answer)  # the first number of the answer, whole ("714320" does not name 71432)
correct = found is not None and found.group(0) == args.key

print(f"answer: {answer!r} ({'correct' if correct else 'wrong'}: the key is {args.key})")
s = llm.kv_stats()
print(
    f"[{s.tokens_seen} tokens read through {s.cells_used}/{s.budget} cells; {s.evicted} evicted; "
    f"KV buffer {s.kv_bytes / 2**20:.1f} MiB]",
    file=sys.stderr,
)
llm.close()
sys.exit(0 if correct else 1)
