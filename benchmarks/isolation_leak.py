"""What a leak between sequences would do to the exact isolation check of
tests/test_server_parallel.py::test_gemma_a_sequence_is_bit_identical_whatever_its_neighbour_reads: the test's two runs
(sequence 0, AhaKV at 64 cells, beside a StreamingLLM neighbour reading another text), the second with ten of the
neighbour's cells copied into sequence 0 (llama_memory_seq_cp) after both prompts are read. Prints how far sequence
0's logits moved and whether its live positions and cells changed: a leak the bitwise check catches.

    python benchmarks/isolation_leak.py
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from ahakv_local.budget import Budget
from ahakv_local.controller import ControllerConfig, KVController, step_batch
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import default_model_path
from ahakv_local.policies import make_policy

STEPS = 40


def run(words: list[str], leak: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with Engine(default_model_path(), EngineConfig(n_ctx=256, n_batch=64, n_ubatch=16, n_seq=2, n_threads=2)) as e:
        mine = e.tokenize(" ".join(words[:400]))[: 120 + STEPS]
        theirs = e.tokenize(" ".join(words[1000:1400]))[: 100 + STEPS]
        ctls = [
            KVController(
                e.view(seq), make_policy(policy), ControllerConfig(Budget.parse(cells), 4, 8, 4, observe_steps=1)
            )
            for seq, (policy, cells) in enumerate([("ahakv", 64), ("streaming", 48)])
        ]
        rows = [ctls[0].prefill(mine[:120])]
        ctls[1].prefill(theirs[:100])
        if leak:  # the neighbour's positions 90-99 become sequence 0's too
            llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(e.ctx), 1, 0, 90, 100)
        for i in range(STEPS):
            rows.append(step_batch(ctls, [mine[120 + i], theirs[100 + i]])[0])
        return np.stack(rows), ctls[0].live.copy(), ctls[0].engine.cell_positions()


def main() -> None:
    words = open("/usr/share/common-licenses/GPL-3").read().split()
    clean, leaked = run(words, False), run(words, True)
    print(f"logits moved by up to {np.abs(clean[0] - leaked[0]).max():.2f}")
    same_live, same_cells = np.array_equal(clean[1], leaked[1]), np.array_equal(clean[2], leaked[2])
    print(f"live positions equal: {same_live}, cells equal: {same_cells}")


if __name__ == "__main__":
    main()
