"""Ask a question about a document far longer than the KV budget.

The whole GPL-3 text (~7,500 tokens) goes through a 256-cell cache: the prompt is compressed chunk
by chunk as it is read, with the question kept at the end, so memory stays at the budget.

    python examples/long_document_qa.py [QUESTION]
"""

import sys
from pathlib import Path

from ahakv_local import Llama
from ahakv_local.models import default_model_path

question = sys.argv[1] if len(sys.argv) > 1 else "Which version of the license is this document?"
document = Path("/usr/share/common-licenses/GPL-3").read_text()

llm = Llama(str(default_model_path(progress=True)), kv_budget=256, kv_policy="ahakv", n_batch=64, verbose=False)
answer = llm.create_chat_completion(
    messages=[{"role": "user", "content": f"{document}\n\nQuestion: {question}\nAnswer in one sentence."}],
    max_tokens=64,
    temperature=0,
)
print(answer["choices"][0]["message"]["content"].strip())
s = llm.kv_stats()
print(
    f"[{s.tokens_seen} tokens read through {s.cells_used}/{s.budget} cells; {s.evicted} evicted; "
    f"KV buffer {s.kv_bytes / 2**20:.1f} MiB]",
    file=sys.stderr,
)
