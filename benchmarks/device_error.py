"""How far the engine's logits and tapped attention are from the numpy reference forward on the llama fixture
(F32 weights, F32 cache), on the CPU and with every layer offloaded: the figures behind FORWARD_RTOL of
tests/numerics.py (32 F16 on a device, both operands of a product may be rounded; 16 x 128 F32 on the CPU).

    GGML_VK_VISIBLE_DEVICES=0 python benchmarks/device_error.py [--tokens 70] [--flash-attn]

Prints, per run, the largest error relative to the largest entry (the tests' measure) of the logits of every
row and of the attention column sums (model softmax, ATTN) and the side pass at scale 1 (SIDE) over all rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.models import fixture_path
from ahakv_local.native import TapFlag

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import device  # noqa: E402
from numerics import F16, F32  # noqa: E402
from reference import LlamaReference, window_column_sums  # noqa: E402


def rel(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=70)
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    path = fixture_path()
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ref = LlamaReference(path)
    fa = "on" if args.flash_attn else "off"
    print(f"fixture, {args.tokens} tokens of GPL-3, F32 cache, flash attention {fa}; devices: {device.devices()}")
    print("| layers offloaded | logits | ATTN (worst layer) | SIDE at scale 1 (worst layer) |")
    print("|---|---:|---:|---:|")
    for ngl in (0, -1):
        kw = dict(type_k="f32", type_v="f32", flash_attn=args.flash_attn, n_gpu_layers=ngl)
        config = EngineConfig(n_ctx=512, n_batch=256, n_ubatch=16, **kw)
        with Engine(path, config) as e:
            toks = e.tokenize(text)[: args.tokens]
            flags = TapFlag.SIDE if args.flash_attn else TapFlag.ATTN | TapFlag.SIDE
            e.set_tap(flags, 0)
            logits = e.decode(toks, all_logits=True)
            ref_logits, traces = ref.forward(toks)
            rows = slice(0, len(toks))
            sums = [window_column_sums(tr.p, rows) for tr in traces]
            attn = max(rel(e.stat("attn", il).values, s) for il, s in enumerate(sums)) if not args.flash_attn else None
            side = max(rel(e.stat("side", il).values, s) for il, s in enumerate(sums))
        shown = "n/a (flash attention)" if attn is None else f"{attn:.2e}"
        print(f"| {'all' if ngl else 'none (CPU)'} | {rel(logits, ref_logits):.2e} | {shown} | {side:.2e} |")
    print(f"\nbounds: CPU 16 x 128 F32 = {16 * 128 * F32:.2e}; device 32 F16 = {32 * F16:.2e}")


if __name__ == "__main__":
    main()
