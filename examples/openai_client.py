"""The official openai client against `ahakv-local serve`.

ahakv-local serve --budget 512 &        # http://127.0.0.1:8000/v1
python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

stream = client.chat.completions.create(
    model="local",
    messages=[{"role": "user", "content": "Explain in three sentences what a KV cache is."}],
    max_tokens=200,
    stream=True,
    extra_body={"kv_policy": "ahakv"},  # per-request eviction settings (kv_budget too)
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
