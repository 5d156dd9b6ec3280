"""Read per-position attention from every layer of Gemma 3 270M, then evict the least attended tokens.

python examples/attention_tap.py
"""

from pathlib import Path

import numpy as np

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.native import TapFlag

text = Path("/usr/share/common-licenses/GPL-3").read_text()[:3000]

with Engine(default_model_path(progress=True), EngineConfig(n_ctx=2048)) as engine:
    tokens = engine.tokenize(text)
    engine.decode(tokens[:-32])  # the tap is off: no statistics
    # the tap sums the last 32 query rows of each llama_decode (Engine.decode makes one per n_batch tokens): on for
    # the last call only, it holds the attention of the prompt's last 32 rows
    engine.set_tap(TapFlag.ATTN, window=32)
    logits = engine.decode(tokens[-32:])

    # holistic score: attention mass summed over all layers and heads, by position
    stats = engine.stats("attn")
    positions = stats[5].positions  # a full-attention layer sees every live position
    score = np.zeros(engine.n_past)
    for layer in stats:
        score[layer.positions] += layer.values.sum(axis=0)

    keep_first, keep_last, budget = 4, 32, 256
    candidates = positions[keep_first : positions.size - keep_last]
    victims = candidates[np.argsort(score[candidates])[: positions.size - budget]]
    freed = engine.evict(victims)
    rows = engine.stat_rows  # query rows the statistics summed
    print(f"{rows} query rows scored {len(tokens)} prompt tokens, evicted {freed}, cache now {engine.n_used()} cells")
    print("most attended:", repr(engine.detokenize([tokens[p] for p in np.argsort(-score)[:8]])))

    engine.set_tap(TapFlag(0))
    out = []
    for _ in range(24):  # greedy continuation on the compressed cache
        out.append(int(np.argmax(logits)))
        logits = engine.decode(out[-1:])
    print("continuation:", repr(engine.detokenize(out)))
