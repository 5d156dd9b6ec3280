"""What a guided reading keeps of text written without spaces (RESULTS.md, "Session af"): a Chinese passage of 13
copies of one sentence with a pass-key sentence in the middle, read by Gemma 3 270M under kv_budget=128 with its
question (guided) or question-agnostically (reconstruction, as chat's /read), without and with spaces between the
sentences. Prints how many kept positions are neither the 4 sinks nor the last 102 (0: what streaming keeps).

    AHAKV_THREADS=1 python benchmarks/cjk_guided_read.py
"""

from __future__ import annotations

import numpy as np

from ahakv_local import Llama
from ahakv_local.models import default_model_path

FILLER = "今天天气很好我们一起去公园散步看到了很多花和树孩子们在草地上玩耍老人们在长椅上聊天"
KEY = "请记住通行码是七一四三二"


def main() -> None:
    model = str(default_model_path())
    for mode in ("guided", "reconstruct"):
        llm = Llama(model, n_ctx=2048, n_batch=64, n_ubatch=64, kv_budget=128, verbose=False,
                    kv_reuse_compressed=mode == "reconstruct")  # fmt: skip
        for sep in ("", " "):
            text = sep.join([FILLER] * 6 + [KEY] + [FILLER] * 6)
            tokens = llm.tokenize(text.encode(), add_bos=True)
            llm.reset()
            llm.set_kv_query("通行码是什么" if mode == "guided" else "reconstruct", text)
            llm.eval(tokens)
            llm.set_kv_query(False)
            live = np.sort(llm.kv_controller.live)
            kept = int(((live >= 4) & (live < len(tokens) - 102)).sum())
            print(f"{mode:12s} separator {sep!r}: kept outside sinks and the last 102: {kept}")
        llm.close()


if __name__ == "__main__":
    main()
