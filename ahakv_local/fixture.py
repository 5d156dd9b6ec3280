"""A tiny random-weight llama GGUF for fast tests: GQA (4 query heads, 2 KV heads), no sliding window.

Deterministic: the same ``FixtureSpec`` always writes the same bytes. F32 weights, so a numpy
forward pass (tests/reference.py) can reproduce llama.cpp's numbers closely. The vocabulary is
SentencePiece-style with byte fallback: three specials, 256 byte tokens and a few letters.
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class FixtureSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    qk_gain: float = 3.0  # larger q/k weights give peaked, non-uniform attention
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tag(self) -> str:
        import hashlib

        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:10]


def vocab() -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, token types (1 normal, 2 unknown, 3 control, 6 byte)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["\u2581"] + list(string.ascii_lowercase) + ["\u2581" + c for c in string.ascii_lowercase]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def weights(spec: FixtureSpec, n_vocab: int) -> dict[str, np.ndarray]:
    """Tensors by GGUF name, numpy shape = reversed ggml shape (a matrix W maps x to W @ x)."""
    rng = np.random.default_rng(spec.seed)
    d, hd = spec.n_embd, spec.head_dim

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(n_vocab, d, gain=np.sqrt(d))}
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm(d)
        t[b + "attn_q.weight"] = mat(spec.n_head * hd, d, spec.qk_gain)
        t[b + "attn_k.weight"] = mat(spec.n_head_kv * hd, d, spec.qk_gain)
        t[b + "attn_v.weight"] = mat(spec.n_head_kv * hd, d)
        t[b + "attn_output.weight"] = mat(d, spec.n_head * hd)
        t[b + "ffn_norm.weight"] = norm(d)
        t[b + "ffn_gate.weight"] = mat(spec.n_ff, d)
        t[b + "ffn_up.weight"] = mat(spec.n_ff, d)
        t[b + "ffn_down.weight"] = mat(d, spec.n_ff)
    t["output_norm.weight"] = norm(d)
    t["output.weight"] = mat(n_vocab, d)
    return t


def write_fixture(path: str | Path, spec: FixtureSpec = FixtureSpec()) -> Path:
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = vocab()

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("ahakv-fixture")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for name, arr in weights(spec, len(tokens)).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)  # atomic: a half-written fixture never looks valid
    return path
