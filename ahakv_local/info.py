"""``ahakv-local info``: what a GGUF model's KV cache costs, read from its metadata (no model load)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import AhakvError
from .gguf_header import Value, read_header

# llama.cpp architecture names (general.architecture; vendored src/llama-arch.cpp) that this project taps and
# evicts from, each with a random-weight fixture tested in tests/test_architectures.py. Mistral 7B GGUFs say
# "llama" ("mistral" is no llama.cpp architecture); "deci" is out: its head counts vary per layer, and the engine
# reads layer 0's for all.
SUPPORTED = frozenset({"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "cohere2", "starcoder2"})


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


def _architecture(kv: dict[str, Value], path: Path) -> str:
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise AhakvError(f"{path} has no general.architecture: not a model GGUF")
    if arch not in SUPPORTED:
        known = ", ".join(sorted(SUPPORTED))
        raise AhakvError(f"unsupported architecture {arch!r} in {path.name} (supported: {known})")
    for key in ("attention.head_count", "attention.head_count_kv"):
        counts = kv.get(f"{arch}.{key}")
        if isinstance(counts, tuple) and len(set(counts)) > 1:
            raise AhakvError(f"{path.name} has a different {key} per layer, which ahakv-local does not support")
    return arch


def check_architecture(path: str | Path) -> str:
    """The model's architecture, or an AhakvError (one line) when ahakv-local cannot tap or evict it."""
    path = Path(path)
    return _architecture(read_header(path).kv, path)


def read_info(path: Path) -> ModelInfo:
    """What ``describe`` needs, from the GGUF header only (milliseconds, whatever the model's size)."""
    kv = read_header(path).kv
    arch = _architecture(kv, path)

    def num(key: str, default: int = 0) -> int:
        v = kv.get(f"{arch}.{key}", default)
        v = v[0] if isinstance(v, tuple) and v else v  # a per-layer array of equal values
        return int(v) if isinstance(v, (int, float)) else default

    n_head = num("attention.head_count")
    head_dim = num("embedding_length") // n_head if n_head else 0
    name = kv.get("general.name")
    return ModelInfo(
        path=path,
        name=name if isinstance(name, str) else path.stem,
        architecture=arch,
        n_layer=num("block_count"),
        n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),
        head_dim_k=num("attention.key_length", head_dim),
        head_dim_v=num("attention.value_length", head_dim),
        n_ctx_train=num("context_length"),
        sliding_window=num("attention.sliding_window"),
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
