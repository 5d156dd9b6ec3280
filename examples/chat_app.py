"""A minimal chat app on ahakv_local.Llama: the conversation stays in a 512-cell cache across turns.

python examples/chat_app.py        (type a message per line; an empty line, the input's end or Ctrl-C quits)
"""

from ahakv_local import Llama
from ahakv_local.models import default_model_path

llm = Llama(
    str(default_model_path(progress=True)),
    kv_budget=512,
    kv_policy="ahakv",
    kv_reuse_compressed=True,  # reuse the compressed history each turn instead of re-reading it
    n_batch=64,
    verbose=False,
)
messages = [{"role": "system", "content": "You are a concise, friendly assistant."}]


def read_line() -> str:
    try:
        return input("you> ").strip()
    except EOFError:  # Ctrl-D, or the end of piped input
        return ""


try:
    while line := read_line():
        messages.append({"role": "user", "content": line})
        reply = ""
        for chunk in llm.create_chat_completion(messages=messages, stream=True, max_tokens=256):
            piece = chunk["choices"][0]["delta"].get("content") or ""
            print(piece, end="", flush=True)
            reply += piece
        print()
        messages.append({"role": "assistant", "content": reply})
        s = llm.kv_stats()
        print(f"  [cache {s.cells_used}/{s.budget} cells, {s.tokens_seen} tokens seen, {s.evicted} evicted]")
except KeyboardInterrupt:  # Ctrl-C quits too, at the prompt or mid-answer (it was a traceback)
    print()
