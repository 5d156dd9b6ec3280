"""``ahakv-local info``: what a GGUF model's KV cache costs, read from its metadata (no model load)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import AhakvError

# architectures the vendored llama.cpp builds with a KV cache this project can tap and evict from
SUPPORTED = {
    "llama", "gemma", "gemma2", "gemma3", "qwen2", "qwen3", "mistral", "mistral3", "phi3", "granite",
    "olmo", "olmo2", "smollm3", "exaone", "internlm2", "starcoder2", "stablelm", "deci", "cohere2",
}  # fmt: skip


@dataclass
class ModelInfo:
    path: Path
    name: str
    architecture: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    sliding_window: int  # 0 = none
    file_bytes: int

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token over all layers, F16 by default."""
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * bytes_per_value


def read_info(path: Path) -> ModelInfo:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf reader raises many kinds of errors on bad files
        raise AhakvError(f"cannot read {path} as GGUF: {exc}") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return v[0] if isinstance(v, list) and v and not isinstance(v[0], str) else v

    arch = field("general.architecture")
    if not arch:
        raise AhakvError(f"{path} has no general.architecture: not a model GGUF")
    if arch not in SUPPORTED:
        known = ", ".join(sorted(SUPPORTED))
        raise AhakvError(f"unsupported architecture {arch!r} in {path.name} (supported: {known})")
    n_head = int(field(f"{arch}.attention.head_count", 0) or 0)
    n_embd = int(field(f"{arch}.embedding_length", 0) or 0)
    head_dim = n_embd // n_head if n_head else 0
    return ModelInfo(
        path=path,
        name=str(field("general.name", path.stem)),
        architecture=arch,
        n_layer=int(field(f"{arch}.block_count", 0)),
        n_head=n_head,
        n_head_kv=int(field(f"{arch}.attention.head_count_kv", n_head)),
        head_dim_k=int(field(f"{arch}.attention.key_length", head_dim)),
        head_dim_v=int(field(f"{arch}.attention.value_length", head_dim)),
        n_ctx_train=int(field(f"{arch}.context_length", 0)),
        sliding_window=int(field(f"{arch}.attention.sliding_window", 0) or 0),
        file_bytes=path.stat().st_size,
    )


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe(info: ModelInfo, budget: int, context: int | None) -> str:
    context = context or info.n_ctx_train
    per_token = info.kv_bytes_per_token()
    full, bounded = per_token * context, per_token * budget
    lines = [
        f"model          {info.name} ({info.path.name}, {mib(info.file_bytes)})",
        f"architecture   {info.architecture}",
        f"layers         {info.n_layer}",
        f"heads          {info.n_head} query, {info.n_head_kv} KV (head size {info.head_dim_k})",
        f"sliding window {info.sliding_window or 'none'}" + (" (a second KV cache)" if info.sliding_window else ""),
        f"trained ctx    {info.n_ctx_train:,} positions",
        f"KV per token   {per_token:,} bytes (F16 K and V, all layers)",
        f"at {context:,} tokens  full cache {mib(full)}; budget {budget:,} cells {mib(bounded)} "
        f"({full / bounded:.0f}x smaller, {100 * (1 - bounded / full):.1f}% saved)",
    ]
    return "\n".join(lines)
