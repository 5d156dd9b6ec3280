"""An independent numpy forward pass of the llama fixture, read from its GGUF weights.

It mirrors llama.cpp's LLM_ARCH_LLAMA graph: RMSNorm, NORM RoPE (adjacent pairs), GQA attention
with query head h reading KV head h // (n_head / n_head_kv), SwiGLU FFN. ``visible[t, j]`` says
whether query row t may attend to position j (causal, minus evicted positions), so evictions can
be replayed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


@dataclass
class LayerTrace:
    q: np.ndarray  # [T, n_head, hd] after RoPE
    k: np.ndarray  # [T, n_head_kv, hd] after RoPE
    v: np.ndarray  # [T, n_head_kv, hd]
    p: np.ndarray  # [n_head, T, T] attention probabilities (rows: queries, columns: positions)
    o: np.ndarray  # [T, n_head, hd] per-head outputs


class LlamaReference:
    def __init__(self, path):
        reader = gguf.GGUFReader(str(path))
        self.w = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}

        def field(name):
            f = reader.fields[name]
            return f.parts[f.data[0]][0]

        self.n_layer = int(field("llama.block_count"))
        self.n_head = int(field("llama.attention.head_count"))
        self.n_head_kv = int(field("llama.attention.head_count_kv"))
        self.n_embd = int(field("llama.embedding_length"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(field("llama.rope.freq_base"))
        self.hd = self.n_embd // self.n_head

    def rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def rope(self, x, pos):
        # NORM rope: rotate (x[2i], x[2i+1]) by pos * base^(-2i/hd)
        hd = x.shape[-1]
        theta = pos[:, None] * self.base ** (-np.arange(0, hd, 2) / hd)  # [T, hd/2]
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def forward(self, tokens, visible: np.ndarray | None = None, kv_dtype=np.float64):
        """Logits [T, n_vocab] and one LayerTrace per layer. ``kv_dtype`` rounds K and V like the cache."""
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        if visible is None:
            visible = np.tril(np.ones((T, T), dtype=bool))
        r = self.n_head // self.n_head_kv
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        traces = []
        for il in range(self.n_layer):
            b = f"blk.{il}."
            h = self.rms(x, self.w[b + "attn_norm.weight"])
            q = self.rope((h @ self.w[b + "attn_q.weight"].T).reshape(T, self.n_head, self.hd), pos)
            k = self.rope((h @ self.w[b + "attn_k.weight"].T).reshape(T, self.n_head_kv, self.hd), pos)
            v = (h @ self.w[b + "attn_v.weight"].T).reshape(T, self.n_head_kv, self.hd)
            kc, vc = k.astype(kv_dtype).astype(np.float64), v.astype(kv_dtype).astype(np.float64)
            kh, vh = np.repeat(kc, r, axis=1), np.repeat(vc, r, axis=1)  # query head h -> KV head h // r
            logits = np.einsum("thd,jhd->htj", q, kh) / np.sqrt(self.hd)
            logits = np.where(visible[None], logits, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("htj,jhd->thd", p, vh)
            x = x + o.reshape(T, -1) @ self.w[b + "attn_output.weight"].T
            h2 = self.rms(x, self.w[b + "ffn_norm.weight"])
            g = h2 @ self.w[b + "ffn_gate.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * (h2 @ self.w[b + "ffn_up.weight"].T)) @ self.w[b + "ffn_down.weight"].T
            traces.append(LayerTrace(q=q, k=k, v=v, p=p, o=o))
        logits = self.rms(x, self.w["output_norm.weight"]) @ self.w["output.weight"].T
        return logits, traces


def window_mean(x: np.ndarray, kernel: int) -> np.ndarray:
    """[n] -> [n]: entry i the plain mean of x over [i - kernel // 2, i + kernel // 2] clipped to the array, by a
    loop (the pooling reference of the policies' tests)."""
    a = kernel // 2
    return np.array([x[max(0, i - a) : i + a + 1].mean() for i in range(x.size)])


def word_starts(pieces: list[str], joins=str.isalnum) -> np.ndarray:
    """The first position of each token's word, from the text the tokens spell: a token continues the one before
    when the joined text has a ``joins`` character (default: a letter or digit) on both sides of the boundary
    between them (``words.WordMap``'s reference)."""
    text, bounds = "", []
    for piece in pieces:
        bounds.append(len(text))
        text += piece
    out = np.arange(len(pieces))
    for i in range(1, len(pieces)):
        b = bounds[i]
        if pieces[i] and 0 < b < len(text) and joins(text[b - 1]) and joins(text[b]):
            out[i] = out[i - 1]
    return out


def word_max(x: np.ndarray, words: np.ndarray) -> np.ndarray:
    """[n] -> [n]: entry i the largest x over the positions of its word (``words``: a label per position), by a
    loop."""
    return np.array([x[words == w].max() for w in words])


def window_column_sums(p: np.ndarray, rows: slice) -> np.ndarray:
    """[n_head, T, T] probabilities -> [n_head, T] attention mass per position over the query rows."""
    return p[:, rows, :].sum(axis=1)


def reconstruction_term(p: np.ndarray, v: np.ndarray, o: np.ndarray, rows: slice, r: int) -> np.ndarray:
    """[n_head, T]: sum over rows t of a_tj * ||v_j - o_t||, computed directly (no norm expansion)."""
    vh = np.repeat(v, r, axis=1)  # [T, n_head, hd]
    a = p[:, rows, :]  # [n_head, W, T]
    ot = o[rows]  # [W, n_head, hd]
    dist = np.linalg.norm(vh[None, :, :, :] - ot[:, None, :, :], axis=-1)  # [W, T, n_head]
    return np.einsum("hwj,wjh->hj", a, dist)


def reconstruction_scale(p: np.ndarray, v: np.ndarray, o: np.ndarray, rows: slice, r: int) -> np.ndarray:
    """[n_head, T]: sum over rows t of a_tj * (||v_j|| + ||o_t||), the scale of the rounding of ||v_j - o_t||."""
    vn = np.repeat(np.linalg.norm(v, axis=-1), r, axis=1)  # [T, n_head]
    on = np.linalg.norm(o[rows], axis=-1)  # [W, n_head]
    a = p[:, rows, :]  # [n_head, W, T]
    return np.einsum("hwj,jh->hj", a, vn) + np.einsum("hwj,wh->hj", a, on)
