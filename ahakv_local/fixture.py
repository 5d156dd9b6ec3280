"""Tiny random-weight GGUFs for fast tests: GQA (4 query heads, 2 KV heads), one per llama.cpp architecture.

Deterministic: the same ``FixtureSpec`` always writes the same bytes (the default, a llama, is the one
tests/reference.py reproduces in numpy). F32 weights, so llama.cpp computes in F32 throughout. The tensors
and hyperparameters of each architecture are the ones its loader in the vendored llama.cpp requires
(src/models/<arch>.cpp, ``load_arch_hparams`` and ``load_arch_tensors``); the sliding-window architectures
slide on layer 0 and attend fully on layer 1. The vocabulary is SentencePiece-style with byte fallback:
three specials, 256 byte tokens and a few letters.
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .atomic import written_to

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "cohere2", "starcoder2")
SLIDING = {"gemma2", "gemma3", "cohere2"}  # sliding window on layer 0 (pattern 2), full attention on layer 1
LAYER_NORM = {"cohere2", "starcoder2"}  # LayerNorm (starcoder2 with biases everywhere) instead of RMSNorm
TIED = {"gemma2", "gemma3", "cohere2"}  # output = token_embd
QK_NORM = {"qwen3", "gemma3"}
POST_NORMS = {"gemma2", "gemma3"}
# constants of the non-llama fixtures, part of their tag: window, softcaps (small enough for tanh to bend the
# logits of this fixture), cohere's logit scale
ARCH_HPARAMS = {"sliding_window": 24, "attn_softcap": 8.0, "final_softcap": 30.0, "logit_scale": 0.5}


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
    arch: str = "llama"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"no fixture for architecture {self.arch!r}; choose from {', '.join(ARCHITECTURES)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tag(self) -> str:
        import hashlib

        items = asdict(self)
        if self.arch == "llama":
            del items["arch"]  # the llama fixture keeps the tag it had before architectures existed
        else:
            items.update(ARCH_HPARAMS)
        return hashlib.sha256(repr(sorted(items.items())).encode()).hexdigest()[:10]


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
    arch, d, hd, ff = spec.arch, spec.n_embd, spec.head_dim, spec.n_ff
    nq, nkv = spec.n_head * hd, spec.n_head_kv * hd
    biased = arch == "starcoder2"

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(t: dict[str, np.ndarray], name: str, n: int, with_bias: bool) -> None:
        t[name + ".weight"] = norm(n)
        if with_bias:
            t[name + ".bias"] = bias(n)

    # the draw order of the llama fixture is fixed: its bytes must not change
    t = {"token_embd.weight": mat(n_vocab, d, gain=np.sqrt(d))}
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        add(t, b + "attn_norm", d, biased)
        q, k, v = mat(nq, d, spec.qk_gain), mat(nkv, d, spec.qk_gain), mat(nkv, d)
        if arch == "phi3":
            t[b + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            t[b + "attn_q.weight"], t[b + "attn_k.weight"], t[b + "attn_v.weight"] = q, k, v
        if arch == "qwen2":
            t[b + "attn_q.bias"], t[b + "attn_k.bias"], t[b + "attn_v.bias"] = bias(nq), bias(nkv), bias(nkv)
        if arch in QK_NORM:
            add(t, b + "attn_q_norm", hd, False)
            add(t, b + "attn_k_norm", hd, False)
        t[b + "attn_output.weight"] = mat(d, nq)
        if biased:
            t[b + "attn_output.bias"] = bias(d)
        if arch in POST_NORMS:
            add(t, b + "post_attention_norm", d, False)
        if arch != "cohere2":  # cohere feeds the attention's input norm to the FFN too (parallel blocks)
            add(t, b + "ffn_norm", d, biased)
        if arch == "phi3":
            t[b + "ffn_up.weight"] = mat(2 * ff, d)  # gate and up, fused
        elif arch == "starcoder2":
            t[b + "ffn_up.weight"], t[b + "ffn_up.bias"] = mat(ff, d), bias(ff)  # plain GELU MLP
        else:
            t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"] = mat(ff, d), mat(ff, d)
        t[b + "ffn_down.weight"] = mat(d, ff)
        if biased:
            t[b + "ffn_down.bias"] = bias(d)
        if arch in POST_NORMS:
            add(t, b + "post_ffw_norm", d, False)
    add(t, "output_norm", d, biased)
    if arch not in TIED:
        t["output.weight"] = mat(n_vocab, d)
    return t


def write_fixture(path: str | Path, spec: FixtureSpec = FixtureSpec()) -> Path:
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = vocab()
    arch, hp = spec.arch, ARCH_HPARAMS

    with written_to(path) as tmp:  # (a name of its own: runs sharing "X.tmp" renamed each other's half-written files)
        _write(gguf.GGUFWriter(str(tmp), arch), spec, arch, hp, tokens, scores, types)
    return path


def _write(w, spec: FixtureSpec, arch: str, hp: dict, tokens, scores, types) -> None:
    """The fixture's header and random tensors, through the GGUF writer ``w``."""
    import gguf

    w.add_name("ahakv-fixture")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    if arch in LAYER_NORM:
        w.add_layer_norm_eps(spec.rms_eps)
    else:
        w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_rope_dimension_count(spec.head_dim)
    if arch != "llama":
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if arch in SLIDING:
        w.add_sliding_window(int(hp["sliding_window"]))
        w.add_sliding_window_pattern(2)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_softcap"])
        w.add_final_logit_softcapping(hp["final_softcap"])
    if arch == "cohere2":
        w.add_logit_scale(hp["logit_scale"])
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
