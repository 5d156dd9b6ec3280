"""``ahakv-local info``: what a GGUF model's KV cache costs, read from its metadata (no model load)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from .budget import Budget, CacheLayout
from .errors import AhakvError
from .gguf_header import Value, read_header

# llama.cpp architecture names (general.architecture; vendored src/llama-arch.cpp) that this project taps and
# evicts from, each with a random-weight fixture tested in tests/test_architectures.py. Mistral 7B GGUFs say
# "llama" ("mistral" is no llama.cpp architecture); "deci" is out: its head counts vary per layer, and the engine
# reads layer 0's for all.
SUPPORTED = frozenset({"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "cohere2", "starcoder2"})

# sliding-window layers as the vendored llama.cpp lays them out (src/models/<arch>.cpp, load_swa_pattern): every
# layer but each n-th slides, unless the GGUF's attention.sliding_window_pattern says otherwise (a period or one
# flag per layer). phi3's window is off in llama.cpp; gemma2's defaults to 4096 without the key.
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
SWA_DEFAULT = {"gemma2": 4096}

# KV cache element types: ggml type id, bytes per block, values per block (ggml/src/ggml.c type_traits)
KV_TYPES = {
    "f32": (0, 4, 1),
    "f16": (1, 2, 1),
    "q4_0": (2, 18, 32),
    "q4_1": (3, 20, 32),
    "q5_0": (6, 22, 32),
    "q5_1": (7, 24, 32),
    "q8_0": (8, 34, 32),
    "iq4_nl": (20, 18, 32),
    "bf16": (30, 2, 1),
}
# what --kv-type / kv_type offer, K and V alike: a quantized one turns flash attention on, which CPU, CUDA (its
# vector kernels read q4_0/q5_0/q8_0) and Metal (K and V of one type) all run
KV_CACHE_TYPES = ("f16", "q8_0", "q5_0", "q4_0")
N_PAD = 256  # llama.cpp pads the context, and the trimmed sliding-window cache, to a multiple of this


@dataclass(frozen=True)  # one instance may serve several readers (reading_headers_once)
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
    n_layer_swa: int = 0  # layers that read the sliding-window cache (the others read the full one)
    layer_sliding: tuple[bool, ...] = ()  # by layer: whether it reads the sliding-window cache
    data_bytes: int = 0  # the bytes the file needs: where its furthest tensor's data ends

    @property
    def cut_short(self) -> str | None:
        """What is wrong with a file shorter than its tensors need (an unfinished copy or download), else None. Its
        header is whole, so ``info`` states its caches; no command can load it (llama.cpp says only "Failed to load
        model from file")."""
        if self.data_bytes <= self.file_bytes:
            return None
        return (
            f"{self.path} is cut short: its tensors need {self.data_bytes:,} bytes, the file has {self.file_bytes:,} "
            "(an unfinished copy or download?)"
        )

    def check_whole(self) -> None:
        """One line, before llama.cpp reads the file, for a file cut short."""
        if self.cut_short is not None:
            raise AhakvError(self.cut_short)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token over all layers, F16 by default."""
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * bytes_per_value

    def cell_bytes(self, n_layers: int, type_k: str = "f16", type_v: str = "f16") -> int:
        """K and V bytes of one cell over ``n_layers`` layers, as ggml sizes a row of each type."""
        return n_layers * (
            row_bytes(type_k, self.n_head_kv * self.head_dim_k) + row_bytes(type_v, self.n_head_kv * self.head_dim_v)
        )

    def caches(
        self, n_ctx: int, swa_full: bool, n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16"
    ) -> list[CacheSize]:
        """The KV caches llama.cpp allocates for a context of ``n_ctx`` (llama_kv_cache_iswa): the full-attention
        cache gets n_ctx padded to 256 cells; the sliding-window cache as many with ``swa_full`` (llama-cpp-python's
        default) or else, as llama.cpp's own tools do, window + n_ubatch padded to 256 (never more than the other)."""
        base = -(-n_ctx // N_PAD) * N_PAD
        out = [
            CacheSize(
                "full",
                self.n_layer - self.n_layer_swa,
                base,
                self.cell_bytes(self.n_layer - self.n_layer_swa, type_k, type_v),
            )
        ]
        if self.n_layer_swa:
            trimmed = min(base, -(-min(base, self.sliding_window + n_ubatch) // N_PAD) * N_PAD)
            cells = base if swa_full else trimmed
            out.append(CacheSize("sliding", self.n_layer_swa, cells, self.cell_bytes(self.n_layer_swa, type_k, type_v)))
        return out

    def stores(self, kv_type: str) -> bool:
        """Whether each head's K and V rows hold whole blocks of ``kv_type`` (``check_kv_types`` without the error)."""
        try:
            check_kv_types(self, kv_type, kv_type)
        except AhakvError:
            return False
        return True

    def layers_bytes(self, layer_cells: Sequence[int], kv_type: str = "f16") -> int:
        """K+V bytes of caches holding ``layer_cells[l]`` cells for each layer l (every layer's rows are alike)."""
        return sum(layer_cells) * self.cell_bytes(1, kv_type, kv_type)

    def cache_layout(self, kv_type: str = "f16") -> CacheLayout:
        """What laying out a budget needs (``budget.allocate``), from the header alone, K and V of ``kv_type``: what
        ``Engine.cache_layout`` measures on a context (tests/test_info_caches.py compares the two)."""
        n_swa = self.n_layer_swa
        return CacheLayout(
            self.cell_bytes(self.n_layer - n_swa, kv_type, kv_type),
            self.cell_bytes(n_swa, kv_type, kv_type),
            self.sliding_window if n_swa else 0,
            self.layer_sliding,
        )

    def trimmed_bytes(self, n_ctx: int, n_ubatch: int = 512) -> int:
        """K+V bytes (f16) llama.cpp's own tools allocate for ``n_ctx`` positions: every cache, the sliding one
        trimmed to its window (swa_full off). The baseline a byte budget is a fraction of."""
        return sum(c.bytes for c in self.caches(n_ctx, swa_full=False, n_ubatch=n_ubatch))


@dataclass(frozen=True)
class CacheSize:
    """One KV cache as llama.cpp allocates it: the layers reading it, its cells, and K+V bytes of one cell."""

    name: str  # "full" or "sliding"
    n_layer: int
    cells: int
    cell_bytes: int  # over all its layers

    @property
    def bytes(self) -> int:
        return self.cells * self.cell_bytes


def check_kv_cache_type(kv_type: str) -> None:
    """An AhakvError (one line) for a K/V type that --kv-type / kv_type do not offer."""
    if kv_type not in KV_CACHE_TYPES:
        raise AhakvError(f"KV type must be one of {', '.join(KV_CACHE_TYPES)}, not {kv_type!r}")


def check_kv_types(info: ModelInfo, type_k: str, type_v: str) -> None:
    """An AhakvError (one line) for K/V cache types a model's heads cannot be stored in (llama.cpp would abort):
    each head's row must hold whole blocks of a quantized type."""
    row_bytes(type_k, info.head_dim_k)
    row_bytes(type_v, info.head_dim_v)


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of ``n`` values of a KV type (ggml_row_size)."""
    if type_name not in KV_TYPES:
        raise AhakvError(f"KV type must be one of {', '.join(KV_TYPES)}, not {type_name!r}")
    _, block_bytes, block = KV_TYPES[type_name]
    if n % block:
        raise AhakvError(f"a KV row of {n} values cannot be stored as {type_name} (blocks of {block})")
    return n // block * block_bytes


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
    _check_shape(kv, arch, path)
    return arch


LLAMA_MAX_LAYERS = 512  # llama.cpp's own bound (llama-hparams.h): past it, or at 0, the load aborts the process
# the counts a model's shape needs, and the most each may be: (key, required, at most)
SHAPE_COUNTS = (
    ("block_count", True, LLAMA_MAX_LAYERS),
    ("embedding_length", True, None),
    ("context_length", True, None),
    ("attention.head_count", True, None),
    ("attention.head_count_kv", False, None),
)


def _check_shape(kv: dict[str, Value], arch: str, path: Path) -> None:
    """Refuse, in one line, a header whose counts no model has: a block_count of 2**31 made ``info`` build tuples of
    that length until the machine ran out of memory, one of 0 or past 512 aborted llama.cpp's load silently, and a
    head count of 0 divided by zero."""
    for key, required, most in SHAPE_COUNTS:
        value = kv.get(f"{arch}.{key}")
        values = value if isinstance(value, tuple) and value else (value,)
        if value is None and not required:
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values) or (
            most is not None and max(values) > most
        ):
            shown = "missing" if value is None else repr(value if len(repr(value)) <= 40 else values[0])
            bound = f"1 to {most}" if most else "at least 1"
            raise AhakvError(f"{path.name} is not a model ahakv-local can load: {arch}.{key} is {shown}, not {bound}")


def check_architecture(path: str | Path) -> str:
    """The model's architecture, or an AhakvError (one line) when ahakv-local cannot tap or evict it."""
    path = Path(path)
    return _architecture(read_header(path).kv, path)


# path -> ModelInfo while a reading_headers_once() block runs; None outside one
_HEADERS_READ: ContextVar[dict[Path, ModelInfo] | None] = ContextVar("headers_read", default=None)


@contextmanager
def reading_headers_once() -> Iterator[None]:
    """Inside this block ``read_info`` reads each file's header once. Building the drop-in asks for the model's
    several times (layout, budget, KV type, memory check, engine), each ~45 ms for Gemma 3 270M's header with its
    262,144-token vocabulary; scoped to one construction, so a file rewritten later is read again. A block inside
    another shares the outer one's reads (``SessionSpec.check_drop_in`` inside ``bench speed``'s checks)."""
    if _HEADERS_READ.get() is not None:
        yield
        return
    token = _HEADERS_READ.set({})
    try:
        yield
    finally:
        _HEADERS_READ.reset(token)


def read_info(path: Path) -> ModelInfo:
    """What ``describe`` needs, from the GGUF header only (tens of milliseconds, whatever the model's size)."""
    path = Path(path)
    read = _HEADERS_READ.get()
    if read is None:
        return _read_info(path)
    if path not in read:
        read[path] = _read_info(path)
    return read[path]


def _read_info(path: Path) -> ModelInfo:
    header = read_header(path)
    kv = header.kv
    arch = _architecture(kv, path)

    def num(key: str, default: int = 0) -> int:
        v = kv.get(f"{arch}.{key}", default)
        v = v[0] if isinstance(v, tuple) and v else v  # a per-layer array of equal values
        return int(v) if isinstance(v, (int, float)) else default

    n_head = num("attention.head_count")
    n_layer = num("block_count")
    window = num("attention.sliding_window", SWA_DEFAULT.get(arch, 0)) if arch in SWA_PATTERN else 0
    sliding = _swa_layers(kv.get(f"{arch}.attention.sliding_window_pattern"), SWA_PATTERN.get(arch, 0), n_layer)
    sliding = sliding if window > 0 else (False,) * n_layer
    head_dim = num("embedding_length") // n_head if n_head else 0
    name = kv.get("general.name")
    return ModelInfo(
        path=path,
        # the file's own text: printed by info, so its control characters (a newline, a terminal's escapes) are shown
        name=printable(name) if isinstance(name, str) else path.stem,
        architecture=arch,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),
        head_dim_k=num("attention.key_length", head_dim),
        head_dim_v=num("attention.value_length", head_dim),
        n_ctx_train=num("context_length"),
        sliding_window=window,
        file_bytes=path.stat().st_size,
        n_layer_swa=sum(sliding),
        layer_sliding=sliding,
        data_bytes=header.data_end,
    )


def printable(text: str, most: int = 200) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x1b``), at most ``most`` characters."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:most])
    return shown + ("..." if len(text) > most else "")


def _swa_layers(pattern: Value | None, default: int, n_layer: int) -> tuple[bool, ...]:
    """Which layers slide (llama_hparams::set_swa_pattern): one flag per layer, or a period n (every n-th
    layer attends fully; 0: every layer slides; no period: no layer does)."""
    if isinstance(pattern, tuple):
        return tuple(bool(f) for f in pattern[:n_layer]) + (False,) * (n_layer - len(pattern))
    period = int(pattern) if isinstance(pattern, (int, float)) else default
    if period == 0:
        return (pattern is not None,) * n_layer
    return tuple(il % period < period - 1 for il in range(n_layer))


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class BudgetAllocation:
    """What generate and serve allocate for a budget (``SessionSpec.allocation``, computed by the caller so that
    ``info`` reads no session code): the cells of the cache each layer reads, by layer."""

    budget: Budget
    layer_budgets: str
    layer_cells: tuple[int, ...]
    chunk: int  # the prompt chunk the allocation holds on top of the budget
    kv_type: str = "f16"  # of K and V in its caches
    room: str = "a question's room"  # what else it holds on top ("": nothing; a plain reading or a policy not guided)


def _cells(counts: set[int]) -> str:
    """The cells of a kind's caches: one count, or the range of their counts (pyramid)."""
    return f"{min(counts):,}" if len(counts) == 1 else f"{min(counts):,}-{max(counts):,}"


def saving(baseline: int, allocated: int, who: str) -> str:
    """How much less than ``who`` a budget allocates (e.g. "51x less than ... (98.0% saved)"), or that it saves
    nothing when it is near the context (its chunk and a question's room come on top of it)."""
    if allocated >= baseline:
        return f"no saving against {who} ({allocated / baseline:.2f}x its bytes)"
    ratio = baseline / allocated
    times = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"
    return f"{times} less than {who} ({100 * (1 - allocated / baseline):.1f}% saved)"


def describe(
    info: ModelInfo,
    context: int | None,
    n_ubatch: int = 512,
    at: BudgetAllocation | None = None,
    kv_type: str = "f16",
) -> str:
    """What ``info`` prints: the model's shape, the KV bytes of what a user would otherwise run at ``context``
    positions (llama-cpp-python's default and, for a sliding-window model, llama.cpp's trimmed cache) with K and V
    of ``kv_type`` (the full caches a run without a budget allocates in it: ``--budget none --kv-type q8_0``), and
    what a budget really allocates, compared with both."""
    context = context or info.n_ctx_train
    typed_name = kv_type.upper()
    lines = [
        f"model          {info.name} ({info.path.name}, {mib(info.file_bytes)})",
        f"architecture   {info.architecture}",
        f"layers         {info.n_layer}"
        + (
            f" ({info.n_layer - info.n_layer_swa} full attention, {info.n_layer_swa} sliding window)"
            if info.n_layer_swa
            else ""
        ),
        f"heads          {info.n_head} query, {info.n_head_kv} KV (head size {info.head_dim_k})",
        f"sliding window {info.sliding_window or 'none'}" + (" (a second KV cache)" if info.n_layer_swa else ""),
        f"trained ctx    {info.n_ctx_train:,} positions",
        f"KV per token   {info.cell_bytes(info.n_layer, kv_type, kv_type):,} bytes ({typed_name} K and V, all layers)",
        f"at {context:,} positions, {typed_name}:",
    ]
    baselines: list[tuple[str, int]] = []
    if info.n_layer_swa:
        for swa_full, tools, who in (
            (True, "llama-cpp-python's default", "llama-cpp-python's default"),
            (False, "llama-server, llama-cli", "llama.cpp's trimmed cache"),
        ):
            caches = info.caches(context, swa_full, n_ubatch, kv_type, kv_type)
            parts = " + ".join(f"{c.name} {mib(c.bytes)} ({c.cells:,} cells x {c.n_layer} layers)" for c in caches)
            total = sum(c.bytes for c in caches)
            lines.append(f"KV swa_full={swa_full!s:<5} {mib(total)} = {parts} ({tools})")
            baselines.append((who, total))
    else:
        (cache,) = info.caches(context, swa_full=True, n_ubatch=n_ubatch, type_k=kv_type, type_v=kv_type)
        lines.append(
            f"KV full cache  {mib(cache.bytes)} ({cache.cells:,} cells x {cache.n_layer} layers; "
            "llama-cpp-python and llama.cpp alike)"
        )
        baselines.append(("the full cache", cache.bytes))
    if at is not None:
        allocated = info.layers_bytes(at.layer_cells, at.kv_type)
        sliding = info.layer_sliding or (False,) * info.n_layer
        parts = " + ".join(
            f"{name} {_cells({c for c, s in zip(at.layer_cells, sliding, strict=True) if s == kind})} cells"
            for name, kind in (("full", False), ("sliding", True))
            if kind in sliding
        )
        how = "each kind's cells re-split over its layers every 256 positions, in these bytes"
        b = at.budget
        named = f"{int(b.value):,} cells" if b.mode == "cells" else str(b)
        typed = "" if at.kv_type == "f16" else f", K and V in {at.kv_type}"
        at_context = "" if b.mode == "cells" else f" -c {context}"  # (info's -c defaults to the trained context)
        on_top = f"a prompt chunk of {at.chunk}" + (f" and {at.room}" if at.room else "")
        lines.append(
            f"KV at budget   {named}, {at.layer_budgets} layer budgets{typed}: {mib(allocated)} = {parts} "
            f"(as generate{at_context} and serve{at_context} allocate it for one sequence: {on_top} on top"
            + (f"; {how})" if at.layer_budgets == "adaptive" else ")")
        )
        if b.mode == "cells" and b.value >= context:
            whole = f"{int(b.value):,} cells hold all {context:,} positions"
            lines.append(f"budget saves   nothing: {whole} (run without one)")
        else:
            lines.append("budget saves   " + ", ".join(saving(total, allocated, who) for who, total in baselines))
    return "\n".join(lines)
