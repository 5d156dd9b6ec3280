"""A patched llama.cpp model + context for one sequence, with the attention tap and eviction.

This is the bottom layer: it decodes tokens at explicit positions and exposes the per-layer
statistics of the patched graph *by position*. Policies, the controller and the ``Llama``
drop-in are built on top of it.

A context made for several sequences (``EngineConfig.n_seq``; one unified KV stream) is used through
sequence views (``Engine.view(seq)``): an Engine sharing the model and context, with its own sequence id
and ``n_past``, whose cell maps, evictions, rewinds and tap bookkeeping (reset, row count, side-pass
scale) touch that sequence only. ``decode_batch`` decodes one token for each of several views in one
``llama_decode``.

Positions never move: an evicted token leaves a hole, and the next token always goes to
``n_past`` (the newest position + 1), which llama.cpp requires.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import enum
import math
import operator
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import rpc, upstream
from .budget import CacheLayout
from .errors import AhakvError, DecodeError
from .info import KV_TYPES, check_kv_cache_type, check_kv_types, read_info
from .native import MAX_THREADS, EvictError, TapFlag, lib
from .policies import KINDS

SEQ = 0  # the sequence of an engine made for one (a view has its own)

_GGML_TYPES = {name: ggml_type for name, (ggml_type, _, _) in KV_TYPES.items()}


def kv_type_config(kv_type: str) -> dict:
    """EngineConfig's fields for K and V caches of ``kv_type``: a quantized V needs flash attention, which is
    turned on (the tap then reads the model's softmax as the side pass at scale 1)."""
    return {"type_k": kv_type, "type_v": kv_type} | ({"flash_attn": True} if kv_type != "f16" else {})


def kv_type_params(kv_type: str, flash_attn: bool | None = None) -> dict:
    """llama_cpp.Llama's arguments for K and V caches of ``kv_type`` (``kv_type_config`` with ggml's type ids)."""
    check_kv_cache_type(kv_type)
    if kv_type != "f16" and flash_attn is False:
        raise AhakvError(f"a {kv_type} KV cache needs flash attention: drop flash_attn=False")
    return kv_type_config(kv_type) | {"type_k": _GGML_TYPES[kv_type], "type_v": _GGML_TYPES[kv_type]}


def default_threads() -> int:
    """CPU threads when none are given: AHAKV_THREADS (also the CLI's -t default), else every core. Several
    engines on few cores want 1 each: ggml's threads spin at each graph barrier, so oversubscribing stalls all."""
    env = os.environ.get("AHAKV_THREADS", "").strip()
    if not env:
        return os.cpu_count() or 1
    if not (env.isascii() and env.isdigit() and 0 < int(env) <= MAX_THREADS):
        raise AhakvError(f"AHAKV_THREADS must be a whole number from 1 to {MAX_THREADS}, not {env!r}")
    return int(env)


class _Closed:
    """Stands in for the native model, context and batch of a closed engine: every later call raises instead."""

    def __getattr__(self, name: str):
        raise ValueError("this engine was closed: create a new one")

    def __bool__(self) -> bool:
        return False


CLOSED = _Closed()


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096  # KV cells (llama.cpp pads to 256)
    n_batch: int = 512  # tokens per llama_decode call
    n_ubatch: int = 512  # tokens per graph evaluation
    n_threads: int | None = None  # default: AHAKV_THREADS, else every core
    n_gpu_layers: int | None = None  # None: every layer on ``rpc_servers`` where given, else none (rpc.default_layers)
    flash_attn: bool = False  # on: the tap's ATTN is the side pass at scale 1 (the flash kernel keeps its softmax)
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool = True  # Gemma 3: give the sliding-window cache as many cells as the full one
    # exact cells of the (full-attention, sliding-window) caches, overriding n_ctx and swa_full for the cache
    # sizes; 0 in either keeps llama.cpp's rule for that cache. No padding: any size >= n_ubatch is honoured
    # (a sliding-window cache below its window + n_ubatch needs evictions from it to keep decoding). With
    # ``layer_groups``, one size per cache.
    cache_cells: tuple[int, ...] | None = None
    # layer groups: the cache of each layer (one entry per layer) instead of the model's own two, each cache
    # holding its own cells (its own slots, mask and cell -> position map, evicted from on its own). Cache 0
    # holds full-attention layers, cache 1 sliding-window ones, every cache one kind and a layer at least
    # (``budget.per_layer_groups``: one cache per layer). A model with a sliding-window cache only (llama.cpp's iswa
    # cache is the one that composes several); None: the model's own caches
    layer_groups: tuple[int, ...] | None = None
    n_seq: int = 1  # sequences sharing the context (views); more than one uses one unified KV stream
    # llama.cpp RPC workers ("host:port") holding the model's layers (all of them unless n_gpu_layers says: 0 none)
    rpc_servers: tuple[str, ...] = ()
    # the CPU's repacked weight layouts (llama.cpp's default); their kernels round differently from the plain
    # ones an RPC worker runs, so a local run compared with a worker's turns this off
    repack_weights: bool = True
    verbose: bool = False

    def __post_init__(self) -> None:
        # (n_batch -5 crashed the process in llama_batch_init; an n_ubatch of 0 opened, then failed every decode)
        for name in ("n_batch", "n_ubatch", "n_seq"):
            value = getattr(self, name)
            if not KINDS["int"](value) or value < 1:
                raise ValueError(f"{name} must be a whole number of 1 or more, not {value!r}")
            object.__setattr__(self, name, int(value))  # (numpy's integers too)


class LayerCache(enum.IntEnum):
    """Which KV cache a layer reads (llama_ahakv_layer_cache). With layer groups (``EngineConfig.layer_groups``)
    caches 0 and 1 are the first full-attention and sliding-window caches and the others are numbered on from
    2 (plain ints)."""

    NONE = -1  # no KV cache (e.g. a layer that reuses another's)
    BASE = 0  # the full-attention cache: every live position
    SLIDING = 1  # the sliding-window cache (Gemma 2/3, Cohere 2): the last n_swa positions


Cache = LayerCache | int  # a cache's number: a LayerCache, or from 2 on a layer group's


def cache_name(cache: Cache) -> str:
    return cache.name.lower() if isinstance(cache, LayerCache) else f"group {cache}"


# the statistic kinds the tap computes, by flag (names as in llama_ahakv_get_<kind>)
STAT_KINDS: dict[TapFlag, str] = {
    TapFlag.ATTN: "attn",
    TapFlag.SIDE: "side",
    TapFlag.VERR: "verr",
    TapFlag.VNORM: "vnorm",
}


class Aligned(NamedTuple):
    """Every layer's statistics aligned with one ascending list of positions (zeros where a layer's cache
    does not hold, or its window does not see, a position)."""

    visible: np.ndarray  # bool [n_layer, n]: layer l sees position j
    values: dict[TapFlag, np.ndarray]  # flag -> float32 [n_layer, n_heads, n] (n_head_kv heads for VNORM)


class LayerStat(NamedTuple):
    """A per-layer statistic aligned with the live positions of the cache that layer reads."""

    positions: np.ndarray  # int32 [n_live], ascending
    values: np.ndarray  # float32 [n_heads, n_live]


def address(array: np.ndarray, dtype: type) -> int:
    """The data address of a C-contiguous ``dtype`` array, for a ``llama_ahakv_*`` pointer argument (native.py says
    why not ``ndarray.ctypes.data_as``)."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(f"a native call takes a C-contiguous {np.dtype(dtype)} array, not {array.dtype}")
    return array.ctypes.data


def set_next_caches(cells: Sequence[int], groups: Sequence[int] | None = None) -> int:
    """Size the caches of the next context this thread creates: (base, sliding) cells, or with ``groups`` (the
    cache of each layer) one size per cache. A per-thread setting of the patched engine that the next
    llama_init_from_model consumes (llama_context_params, a ctypes mirror in llama-cpp-python, cannot grow a
    field). Returns the engine's code (0, or -1 for bad sizes)."""
    native = lib()
    if not groups:
        return native.set_next_cache_cells(*cells)
    group_arr = (ctypes.c_int32 * len(groups))(*groups)
    cells_arr = (ctypes.c_int32 * len(cells))(*cells)
    return native.set_next_layer_groups(group_arr, len(groups), cells_arr, len(cells))


def clear_next_caches() -> None:
    """Forget a pending ``set_next_caches`` (llama.cpp consumed it already unless the creation failed early)."""
    native = lib()
    native.set_next_cache_cells(0, 0)
    native.set_next_layer_groups(None, 0, None, 0)
    native.set_next_tap(0, 0)


class Engine:
    """Owns one llama.cpp model and context (closed by ``close()`` or ``with``)."""

    # the tap as last set (flags, window) and every flag set since the context was made (a resize plans with them)
    _tap: tuple[TapFlag, int] = (TapFlag(0), 0)
    _tap_reserved: TapFlag = TapFlag(0)

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig = EngineConfig(), cb_eval=None):
        path = Path(model_path)
        if not path.is_file():
            raise AhakvError(f"model file not found: {path}")
        # one line for a model the tap or eviction cannot handle, or K/V types its heads cannot be stored in
        info = read_info(path)
        info.check_whole()
        check_kv_types(info, config.type_k, config.type_v)
        cache_cells = self._check_cache_cells(config, min(config.n_ubatch, config.n_batch))
        groups = config.layer_groups
        if config.n_seq < 1:
            raise ValueError(f"n_seq must be at least 1, not {config.n_seq}")
        threads = config.n_threads or default_threads()
        if not 1 <= threads <= MAX_THREADS:  # (100000: std::bad_alloc at the first decode, the process aborted)
            raise AhakvError(f"n_threads must be from 1 to {MAX_THREADS}, not {threads}")
        self.native = lib()  # refuses an unpatched engine before anything is loaded

        import llama_cpp

        upstream.set_verbose(config.verbose)
        self._llama_cpp = llama_cpp
        self.config = config
        self.path = path

        mparams = llama_cpp.llama_model_default_params()
        layers = config.n_gpu_layers
        mparams.n_gpu_layers = rpc.default_layers(config.rpc_servers) if layers is None else layers
        # the device array lives as long as the engine
        self._rpc = rpc.Devices(rpc.parse_servers(config.rpc_servers)) if config.rpc_servers else None
        rpc.configure(mparams, self._rpc, config.repack_weights)
        try:
            self._model = upstream.load_model(str(path), mparams, config.verbose)
        except ValueError as exc:
            raise AhakvError(f"cannot load {path}: not a GGUF model llama.cpp can read") from exc

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = min(config.n_ubatch, config.n_batch)
        cparams.n_seq_max = config.n_seq
        # one KV stream for every sequence: the tap's statistics are indexed by the cells of one stream
        cparams.kv_unified = config.n_seq > 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = _GGML_TYPES[config.type_k]
        cparams.type_v = _GGML_TYPES[config.type_v]
        cparams.swa_full = config.swa_full
        if cb_eval is not None:
            self._cb_eval = cb_eval  # keep the CFUNCTYPE alive as long as the context
            cparams.cb_eval = cb_eval
        try:  # past the model's load: any refusal frees it now (it waited for the garbage collector)
            if (groups or cache_cells[1:2] != (0,)) and llama_cpp.llama_model_n_swa(self._model.model) <= 0:
                what = "layer groups need one" if groups else "cache_cells=(n, 0) sizes its only cache"
                raise AhakvError(f"{path.name} has no sliding-window cache: {what}")
            if groups:
                self._check_layer_groups(groups, self._layer_sliding())
            self._cparams = cparams  # a resize (``resize_caches``) makes the next context with them
            self._ctx = self._new_context(cache_cells)
        except BaseException:
            self._model.close()
            raise
        # with causal attention llama.cpp caps the batch at n_ctx: a decode cut in batches of more aborted the
        # process (GGML_ASSERT n_tokens_all <= n_batch), n_ctx=200 with the default batch of 512
        taken = llama_cpp.llama_n_batch(self.ctx)
        if taken < config.n_batch:
            config = self.config = dataclasses.replace(config, n_batch=taken, n_ubatch=min(config.n_ubatch, taken))
        self._batch = upstream.new_batch(config.n_batch, config.verbose)
        self._owned = True
        self.seq, self.shared = SEQ, config.n_seq > 1
        self._describe()
        for cache, wanted in enumerate(cache_cells):
            got = self.cache_cells(cache)
            if wanted and got != wanted:
                self.close()
                raise AhakvError(f"the engine gave the {cache_name(cache)} cache {got} cells, not the {wanted} asked")

    def _new_context(self, cache_cells: tuple[int, ...], tap: tuple[TapFlag, int] = (TapFlag(0), 0)):
        """A context of this engine's model and parameters whose caches have ``cache_cells`` cells, and whose tap
        starts as ``tap`` (flags, window), its compute buffers planned with those flags (patch 0020)."""
        if set_next_caches(cache_cells, self.config.layer_groups) != 0:
            raise AhakvError(f"bad cache sizes {cache_cells}")
        self.native.set_next_tap(int(tap[0]), tap[1])
        try:
            return upstream.new_context(self._model, self._cparams, self.config.verbose)
        except ValueError as exc:
            raise AhakvError(f"cannot create a context for {self.path} (n_ctx={self.config.n_ctx})") from exc
        finally:
            clear_next_caches()

    def resize_caches(self, cache_cells: Sequence[int]) -> None:
        """Give the caches these cells (one count per cache, every one holding at least the cells it uses now),
        keeping the sequence: llama.cpp cannot resize a cache, so its state moves to a new context of the new
        sizes and the old one is freed (the positions stay; the cells are renumbered, and the value norms are
        recomputed from V by the reader). The new context is tapped as the old one, its buffers planned with every
        flag the old one had (patch 0020: no scheduler reserve follows); the side scale and the summed statistics
        start over: call it between observations. Memory peaks at the old context plus the state (about the bytes
        in use) during the move. An attached engine's ``llama_cpp.Llama`` gets the new context (``resizable``)."""
        if not self.resizable:
            raise AhakvError("only a one-sequence context an engine made or is attached to can resize its caches")
        config = self.config
        cells = self._check_cache_cells(
            dataclasses.replace(config, cache_cells=tuple(cache_cells)), min(config.n_ubatch, config.n_batch)
        )
        for cache, n in enumerate(cells):
            if cache not in self.layer_cache:
                continue  # no layer reads it (a model without a sliding window has no sliding cache)
            used = self.n_used(self.layer_cache.index(cache))
            if n < max(used, 1):
                # (the sliding cache was "group 1")
                name = cache_name(LayerCache(cache) if cache in (LayerCache.BASE, LayerCache.SLIDING) else cache)
                raise AhakvError(f"the {name} cache holds {used} cells: {n} cannot hold them")
        llama_cpp = self._llama_cpp
        size = llama_cpp.llama_state_seq_get_size(self.ctx, self.seq)
        state = np.empty(size, dtype=np.uint8)  # not zeroed: the engine writes every byte (~2 ms less for 8 MiB)
        buf = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        size = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, self.seq)
        self._cparams.n_ctx = max(max(cells), self.config.n_ctx)
        # planned with every flag the old context was tapped with, then tapped exactly as it was: the first decodes
        # in the new context build their graphs but reserve nothing (two reserves, ~15 ms on 2 CPU cores, before)
        new = self._new_context(cells, (self._tap_reserved, self._tap[1]))
        self.native.set_tap(new.ctx, int(self._tap[0]), self._tap[1])
        if llama_cpp.llama_state_seq_set_data(new.ctx, buf, size, self.seq) != size:
            new.close()  # the old context still holds the sequence
            raise AhakvError(f"the new caches {cells} could not take the sequence's state")
        old, self._ctx = self._ctx, new
        if not self._owned:
            upstream.replace_context(self._owner(), new)
        upstream.free_context(old)  # llama.cpp frees it now, and the model no longer holds it
        self.config = dataclasses.replace(self.config, cache_cells=cells)
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)

    @staticmethod
    def _check_cache_cells(config: EngineConfig, n_ubatch: int) -> tuple[int, ...]:
        groups = config.layer_groups
        n_caches = max(groups) + 1 if groups else 2
        if config.cache_cells is None:
            return (0,) * n_caches
        cells = tuple(config.cache_cells)
        if len(cells) != n_caches or any(not isinstance(n, int) or n < 0 for n in cells):
            what = "two cell counts >= 0 (base, sliding)"
            if groups:
                what = f"{n_caches} cell counts >= 0, one per layer group"
            raise ValueError(f"cache_cells must be {what}, not {config.cache_cells!r}")
        if any(0 < n < n_ubatch for n in cells):
            raise ValueError(f"cache_cells {cells}: a cache needs n_ubatch ({n_ubatch}) cells or more")
        return cells

    def _layer_sliding(self) -> list[bool]:
        n_layer = self._llama_cpp.llama_model_n_layer(self._model.model)
        return [self.native.layer_is_swa(self._model.model, il) == 1 for il in range(n_layer)]

    def _check_layer_groups(self, groups: tuple[int, ...], sliding: list[bool]) -> None:
        """One line for groups llama.cpp would refuse (llama_ahakv_set_next_layer_groups) or that break the
        numbering of ``LayerCache``."""
        problem = None
        kinds: dict[int, bool] = {}
        if len(groups) != len(sliding):
            problem = f"{len(groups)} entries for {len(sliding)} layers"
        elif set(groups) != set(range(max(groups) + 1)):
            problem = "every cache from 0 to the last needs a layer"
        elif any(kinds.setdefault(g, s) != s for g, s in zip(groups, sliding, strict=True)):
            problem = "a cache mixes full-attention and sliding-window layers"
        elif kinds[0] or not kinds[1]:
            problem = "cache 0 must hold full-attention layers and cache 1 sliding-window ones"
        if problem:
            self._model.close()
            raise AhakvError(f"bad layer groups: {problem}")

    @classmethod
    def attach(cls, llm) -> Engine:
        """An Engine over the model and context of a ``llama_cpp.Llama`` (which keeps owning them)."""
        import llama_cpp

        self = cls.__new__(cls)
        self.native = lib()
        self._llama_cpp = llama_cpp
        self.path = Path(llm.model_path)
        p = llm.context_params
        types = {v: k for k, v in _GGML_TYPES.items()}
        self.config = EngineConfig(  # everything the context was created with, as Engine() would have
            n_ctx=p.n_ctx,
            n_batch=p.n_batch,
            n_ubatch=p.n_ubatch,
            n_threads=p.n_threads,
            n_gpu_layers=llm.model_params.n_gpu_layers,
            flash_attn=p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            type_k=types.get(p.type_k, str(p.type_k)),
            type_v=types.get(p.type_v, str(p.type_v)),
            swa_full=bool(p.swa_full),
            rpc_servers=getattr(llm, "rpc_servers", ()),
            repack_weights=bool(llm.model_params.use_extra_bufts),
            verbose=llm.verbose,
        )
        self._model, self._ctx, self._batch = upstream.handles(llm)
        self._owned = False
        self._owner = weakref.ref(llm)  # a resize hands it the new context (``resize_caches``)
        self._cparams = p
        self.seq, self.shared = SEQ, False
        self._describe()
        if len(self.caches) > 2:  # layer groups (set_next_caches before the Llama made its context)
            self.config = dataclasses.replace(
                self.config,
                layer_groups=tuple(int(c) for c in self.layer_cache),
                cache_cells=self.cache_sizes(),
            )
        return self

    def _describe(self) -> None:
        llama_cpp = self._llama_cpp
        m = self._model.model
        self.n_layer = llama_cpp.llama_model_n_layer(m)
        self.n_head = llama_cpp.llama_model_n_head(m)
        self.n_head_kv = llama_cpp.llama_model_n_head_kv(m)
        self.n_embd = llama_cpp.llama_model_n_embd(m)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(m)
        self.n_swa = llama_cpp.llama_model_n_swa(m)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._model.vocab)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx.ctx)
        self.head_dim = int(self.meta("attention.key_length") or self.n_embd // self.n_head)
        named = {c.value for c in LayerCache}
        numbers = [self.native.layer_cache(self.ctx, il) for il in range(self.n_layer)]
        self.layer_cache: list[Cache] = [LayerCache(n) if n in named else n for n in numbers]
        self.layer_sliding = self._layer_sliding()  # whether layer il uses the sliding window
        # a layer of the base cache: it holds every live position (a sliding-window cache may drop
        # positions that fell out of its window)
        self.base_layer = self.layer_cache.index(LayerCache.BASE) if LayerCache.BASE in self.layer_cache else 0
        self.n_past = 0  # next position; every position below it was decoded (some may be evicted)

    def view(self, seq: int) -> Engine:
        """Sequence ``seq`` of this context (0 <= seq < n_seq) as an Engine of its own: the same model and
        context (owned by this engine, which must outlive the view), its own position counter, and every
        per-sequence call (cell map, eviction, rewind, tap reset, row count, side scale) on ``seq`` only."""
        if not 0 <= seq < self.config.n_seq:
            raise ValueError(f"sequence {seq} is not one of this context's {self.config.n_seq}")
        views = self.__dict__.setdefault("_views", weakref.WeakSet())  # before the copy: a view's views share it
        v = copy.copy(self)
        v.seq, v.n_past, v._owned = seq, 0, False
        views.add(v)  # (closed with this engine: ``close``)
        return v

    # -- resources ---------------------------------------------------------------------------------

    @property
    def resizable(self) -> bool:
        """Whether ``resize_caches`` can replace this engine's context: one it made for one sequence, or a
        ``llama_cpp.Llama``'s it is attached to (not a view of a shared context)."""
        owner = getattr(self, "_owner", None)
        attached = owner is not None and owner() is not None
        return self.config.n_seq == 1 and (getattr(self, "_owned", False) or attached)

    @property
    def ctx(self) -> int:
        return self._ctx.ctx

    def close(self) -> None:
        if not getattr(self, "_owned", False):
            return  # attached to a Llama, which frees its own resources
        for owner in ("_batch", "_ctx", "_model"):
            obj = getattr(self, owner, None)
            if obj is not None and obj is not CLOSED:
                obj.close()
                setattr(self, owner, CLOSED)  # (None: every later call an AttributeError on 'NoneType')
        for view in list(self.__dict__.get("_views", ())):  # (they held the freed handles: a view's next call crashed)
            view.detach(CLOSED)
        self._rpc = None  # the workers' connections closed with the model: a new model checks them again

    def detach(self, stand_in) -> None:
        """An engine whose model and context were freed by their owner (its Llama, or the engine it is a view of):
        ``stand_in`` answers every later call."""
        self._model = self._ctx = self._batch = stand_in

    @property
    def closed(self) -> bool:
        return not self._ctx  # (a closed engine's stand-in is false; None: never opened)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- model metadata ----------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value; ``key`` without the architecture prefix is looked up under it."""
        arch = self._meta_raw("general.architecture")
        full = key if key.startswith("general.") or arch is None else f"{arch}.{key}"
        return self._meta_raw(full)

    def _meta_raw(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._llama_cpp.llama_model_meta_val_str(self._model.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    # -- text --------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text.encode(), add_bos, special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.detokenize_bytes(tokens).decode(errors="replace")

    def detokenize_bytes(self, tokens: Sequence[int]) -> bytes:
        return self._model.detokenize(self.token_ids(tokens))

    def token_ids(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` as ids of this model's vocabulary; a ValueError names the first that is not one (llama.cpp
        aborted the process detokenizing an id past the vocabulary, and a batch's int32 took 2**32 + 7 as 7)."""
        ids = []
        for t in tokens:
            try:
                ids.append(operator.index(t))
            except TypeError:
                raise ValueError(f"a token id is a whole number, not {t!r}") from None
            if not 0 <= ids[-1] < self.n_vocab:
                raise ValueError(f"token id {t} is outside the model's vocabulary of {self.n_vocab} tokens")
        return ids

    def _decodable(self, tokens: Sequence[int]) -> list[int]:
        """``token_ids`` for a decode: a DecodeError, a RuntimeError too, as llama_cpp.Llama's failed decode of such
        an id is."""
        try:
            return self.token_ids(tokens)
        except ValueError as exc:
            raise DecodeError(f"cannot decode: {exc}") from None

    def chat_prompt(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        """(tokens, stop strings) of chat ``messages`` with the model's own template (``upstream.chat_prompt``)."""
        return upstream.chat_prompt(self._model, messages)

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (end of sequence, end of turn)."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._model.vocab, token))

    # -- decoding ----------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Decode ``tokens`` at positions n_past, n_past+1, ...; return the last row of logits
        ([n_vocab]) or, with ``all_logits``, one row per token ([n_tokens, n_vocab])."""
        llama_cpp = self._llama_cpp
        if not len(tokens):  # (len: a numpy array's truth value is ambiguous)
            raise ValueError("decode needs at least one token")
        tokens = self._decodable(tokens)
        if self.n_past + len(tokens) > self.n_ctx_train:
            end = self.n_past + len(tokens)
            # (it named position end, one past the last it was asked to decode)
            raise AhakvError(
                f"position {end - 1} is past the model's trained context (positions 0 to {self.n_ctx_train - 1})"
            )
        rows = []
        for start in range(0, len(tokens), self.config.n_batch):
            chunk = list(tokens[start : start + self.config.n_batch])
            n = len(chunk)
            self._fill([(t, self.n_past + i, self.seq, all_logits or i == n - 1) for i, t in enumerate(chunk)])
            self._run_batch()
            self.n_past += n
            n_rows = len(chunk) if all_logits else 1
            out = np.empty((n_rows, self.n_vocab), dtype=np.float32)  # (as_array casts: native.py says why not)
            ctypes.memmove(address(out, np.float32), llama_cpp.llama_get_logits(self.ctx), out.nbytes)
            rows.append(out)
        logits = np.concatenate(rows)
        return logits if all_logits else logits[-1]

    def put_last_logits(self, row: np.ndarray) -> None:
        """Write ``row`` where llama.cpp keeps the last decode's last logits (``llama_get_logits_ith(ctx, -1)``, which
        llama-cpp-python's sampler reads): a guide decoded after a prompt (a reconstruction's repetition) left its own
        there, and the first token was sampled from them."""
        row = np.ascontiguousarray(row, dtype=np.float32)
        if row.shape != (self.n_vocab,):
            raise ValueError(f"a row of logits has {self.n_vocab} entries, not {row.shape}")
        target = self._llama_cpp.llama_get_logits_ith(self.ctx, -1)
        if not target:
            raise RuntimeError("llama.cpp holds no logits to replace (nothing decoded)")
        ctypes.memmove(target, address(row, np.float32), row.nbytes)

    def _fill(self, rows: Sequence[tuple[int, int, int, bool]]) -> None:
        """Put (token, position, sequence, wants logits) rows into the llama_batch."""
        b = self._batch.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.seq_id[i][0], b.n_seq_id[i], b.logits[i] = token, pos, seq, 1, logits

    def _run_batch(self) -> None:
        rc = self._llama_cpp.llama_decode(self.ctx, self._batch.batch)
        if rc == 1:
            sizes = ", ".join(f"{cache_name(c)} {self.cache_cells(c)}" for c in self.caches)
            raise DecodeError(f"the KV cache is full (cells: {sizes}): evict or give it more cells")
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc}")

    # -- KV cache ----------------------------------------------------------------------------------

    def n_cells(self, layer: int | None = None) -> int:
        return self._of_layer(self.native.n_cells(self.ctx, self.base_layer if layer is None else layer), layer)

    def _of_layer(self, n: int, layer: int | None) -> int:
        """A native count of ``layer``'s cache, or a ValueError where it is llama.cpp's -1 for a layer the model has
        not ("negative dimensions are not allowed" further on, or a -1 passed on as a count)."""
        if n < 0:
            raise ValueError(f"layer {layer} is not one of the model's {self.n_layer}")
        return n

    @property
    def caches(self) -> list[Cache]:
        """The KV caches of this context: [BASE], [BASE, SLIDING], or one per layer group (BASE, SLIDING, 2, ...)."""
        return sorted({c for c in self.layer_cache if c != LayerCache.NONE})

    def cache_cells(self, cache: Cache) -> int:
        """Cells of one cache (0 if the context has none)."""
        return self.n_cells(self.layer_cache.index(cache)) if cache in self.layer_cache else 0

    def cache_sizes(self) -> tuple[int, ...]:
        """Cells of each cache, in the order of ``caches`` (what ``resize_caches`` takes)."""
        return tuple(self.cache_cells(c) for c in self.caches)

    def cache_sliding(self, cache: Cache) -> bool:
        """Whether the layers of ``cache`` use the sliding window."""
        return self.layer_sliding[self.layer_cache.index(cache)]

    def n_used(self, layer: int | None = None) -> int:
        """Cells in use in the cache ``layer`` reads (default: the base cache)."""
        return self._of_layer(self.native.n_used(self.ctx, self.base_layer if layer is None else layer), layer)

    def kv_bytes(self, cache: Cache | None = None) -> int:
        """Bytes of the K and V buffers: of every cache, or of one (0 for a cache the context does not have)."""
        if cache is None:
            return int(self.native.kv_bytes(self.ctx))
        return int(self.native.kv_bytes_cache(self.ctx, int(cache)))

    def cell_bytes(self, cache: Cache) -> int:
        """K+V bytes of one cell of ``cache`` over all its layers (kv_bytes(cache) / its cells)."""
        return self.kv_bytes(cache) // max(1, self.cache_cells(cache))

    def kv_bytes_used(self, cache: Cache | None = None) -> int:
        """Bytes of the cells holding a position: in every cache, or in one (its cells used x cell_bytes)."""
        caches = [c for c in self.caches if cache in (None, c)]
        return sum(self.n_used(self.layer_cache.index(c)) * self.cell_bytes(c) for c in caches)

    def cache_layout(self) -> CacheLayout:
        """What laying out a budget needs (``budget.allocate``): the K+V bytes of one cell of the full-attention
        and of the sliding-window layers (of every cache of that kind: layer groups add up), the sliding window
        (0 where the model has one cache) and which layers slide."""
        per_kind = {False: 0, True: 0}
        for c in self.caches:
            per_kind[self.cache_sliding(c)] += self.cell_bytes(c)
        sliding = per_kind[True]
        return CacheLayout(per_kind[False], sliding, self.n_swa if sliding else 0, tuple(self.layer_sliding))

    def cell_positions(self, layer: int | None = None) -> np.ndarray:
        """int32 [n_cells]: the position each cell holds, -1 for an empty cell (default: base cache)."""
        layer = self.base_layer if layer is None else layer
        out = np.empty(self.n_cells(layer), dtype=np.int32)
        n = self.native.cell_pos(self.ctx, layer, self.seq, address(out, np.int32), out.size)
        if n != out.size:
            raise AhakvError(f"llama_ahakv_cell_pos failed for layer {layer}")
        return out

    def live_positions(self, layer: int | None = None) -> np.ndarray:
        pos = self.cell_positions(layer)
        return np.sort(pos[pos >= 0])

    def newest_position(self) -> int:
        """The newest position any cache of this sequence holds (-1 where none holds one): llama.cpp's seq_pos_max
        reads one cache."""
        return max((int(p[-1]) for c in self.caches if (p := self.live_positions(self.layer_cache.index(c))).size),
                   default=-1)  # fmt: skip

    def truncate(self, n_past: int) -> None:
        """Forget every position >= n_past (rewind), so the next token goes to n_past."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot truncate to {n_past}: {self.n_past} positions decoded")
        # llama.cpp takes the next token only at a cache's newest position + 1: a rewind into evicted positions was
        # taken, and every decode after it failed ("the last position stored ... X = 14 ... Y = 17")
        if 0 < n_past < self.n_past:
            held = [self.live_positions(self.layer_cache.index(c)) for c in self.caches]
            below = [int(p[p < n_past][-1]) for p in held if p.size and p[0] < n_past]
            if below and min(below) != n_past - 1:
                raise ValueError(
                    f"cannot truncate to {n_past}: position {n_past - 1} was evicted (the next token must follow the "
                    f"newest one a cache holds, {min(below)})"
                )
        if n_past == 0 and not self.shared:
            self.clear_cells()
        else:
            self._ctx.kv_cache_seq_rm(self.seq, n_past, -1)
        self.n_past = n_past

    def clear_cells(self) -> None:
        """Empty every cache of the context (every sequence's cells), so that the next tokens take their cells from
        the first, as in a fresh context. Removing a sequence's positions leaves a cache's next slot at its lowest
        freed cell (a sliding cache's had moved on), so the same prompt met its cells in another order, its float
        sums rounded otherwise, and near-equal evictions flipped between identical requests. The cells' data stays:
        every cell is written before it is read."""
        llama_cpp = self._llama_cpp
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), False)

    def evict(self, positions: Sequence[int] | np.ndarray, cache: Cache | None = None) -> int:
        """Remove these positions in one native call: from every cache (``cache=None``), or from one cache only,
        whose layers then stop seeing them while the other cache's layers keep them. Returns how many were
        present (in the base cache for ``None``)."""
        if cache is LayerCache.NONE:
            raise ValueError("LayerCache.NONE is no cache to evict from")
        given = np.asarray(positions).ravel()
        if given.size and given.dtype.kind not in "iu":  # (cast to int32: 9.99 or a mask of booleans evicted others)
            raise ValueError(f"evict takes positions as whole numbers, not {given[:5].tolist()}")
        if given.size and (bad := given[(given < 0) | (given >= self.n_past)]).size:
            # (2**32 + 5 was cast to 5; one never decoded was refused as "the newest position")
            held = f"0 to {self.n_past - 1}" if self.n_past else "none: nothing was decoded"
            raise ValueError(f"evict takes positions decoded so far ({held}), not {bad[:5].tolist()}")
        pos = np.unique(given.astype(np.int32))
        if pos.size == 0:
            return 0
        ptr = address(pos, np.int32)
        if cache is None:
            rc = self.native.evict(self.ctx, self.seq, ptr, pos.size)
        else:
            rc = self.native.evict_cache(self.ctx, int(cache), self.seq, ptr, pos.size)
        if rc < 0:
            reason = {
                EvictError.NEWEST_POSITION: "the newest position can never be evicted",
                EvictError.NOT_SORTED: "positions must be strictly increasing",
                EvictError.NO_KV_CACHE: "the model has no KV cache",
            }.get(rc, "bad argument" if cache in (None, *self.layer_cache) else f"no {cache_name(cache)} cache")
            raise AhakvError(f"eviction refused: {reason}")
        return rc

    # -- attention tap -----------------------------------------------------------------------------

    def set_tap(self, flags: TapFlag, window: int = 0) -> None:
        """Statistics to compute in-graph, over the last ``window`` query rows of each decode call (0 = all).
        Under flash attention ATTN is the side pass at scale 1 (patch 0009)."""
        if not 0 <= int(flags) <= sum(TapFlag) or not isinstance(window, int) or window < 0:
            # (taken: -5 rows, or a flag bit the tap does not have)
            raise ValueError(f"set_tap takes TapFlag flags and a window of 0 or more rows, not {flags!r}, {window!r}")
        self.native.set_tap(self.ctx, int(flags), window)
        self._tap = (flags, window)
        self._tap_reserved |= flags

    def set_side_scale(self, scale: float) -> None:
        """Logit multiplier of the side pass (1.0 reproduces the model's softmax), for this sequence's rows."""
        if not math.isfinite(scale):  # (NaN was taken: every SIDE statistic after it NaN)
            raise ValueError(f"the side pass's scale is a finite number, not {scale!r}")
        if self.shared:
            self.native.set_side_scale_seq(self.ctx, self.seq, scale)
        else:
            self.native.set_side_scale(self.ctx, scale)

    def reset_stats(self) -> None:
        """Zero the accumulated statistics (of a shared context: of this sequence's cells only)."""
        if self.shared:
            self.native.reset_seq(self.ctx, self.seq)
        else:
            self.native.reset(self.ctx)

    @property
    def stat_rows(self) -> int:
        """Query rows (of this sequence) accumulated since the last reset."""
        return int(self.native.n_rows_seq(self.ctx, self.seq) if self.shared else self.native.n_rows(self.ctx))

    def stat_by_cell(self, kind: str, layer: int) -> np.ndarray:
        """float32 [n_heads, n_cells] of ``kind`` in attn, side, verr (query heads) or vnorm (KV heads)."""
        if kind not in STAT_KINDS.values():  # (an AttributeError: undefined symbol llama_ahakv_get_<kind>)
            raise ValueError(f"kind must be one of {', '.join(STAT_KINDS.values())}, not {kind!r}")
        n_heads = self.n_head_kv if kind == "vnorm" else self.n_head
        out = np.empty((n_heads, self.n_cells(layer)), dtype=np.float32)
        getter = getattr(self.native, "get_" + kind)
        n = getter(self.ctx, layer, address(out, np.float32), out.size)
        if n != out.size:
            raise AhakvError(f"llama_ahakv_get_{kind} failed for layer {layer}")
        return out

    def _live_cells(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions ascending, the cells holding them) of the cache ``layer`` reads."""
        cell_pos = self.cell_positions(layer)
        cells = np.flatnonzero(cell_pos >= 0)
        cells = cells[np.argsort(cell_pos[cells], kind="stable")]
        return cell_pos[cells], cells

    def stat(self, kind: str, layer: int) -> LayerStat:
        """A statistic by position: the live positions of the layer's cache, ascending, and their values."""
        positions, cells = self._live_cells(layer)
        return LayerStat(positions, self.stat_by_cell(kind, layer)[:, cells])

    def aligned(self, live: np.ndarray, flags: TapFlag, layers: Sequence[int] | None = None) -> Aligned:
        """The statistics of ``flags`` for every layer (or for ``layers``, in that order), aligned with ``live``
        (ascending positions; what a cache holds outside it is left out): one cell-map read per cache, one native
        read per layer and kind. Per-layer layouts read 18 one-layer groups about 36 times per 32 decode steps, so
        the common shapes skip the scatter: a cache holding exactly ``live`` (every full-attention layer's own cache,
        the shared pool) or its tail (a sliding cache: what its window still sees of ``live``) is gathered with
        ``np.take`` straight into place (benchmarks/RESULTS.md, "A cheaper resize" and "The per-layer bookkeeping made
        cheaper")."""
        n = live.size
        newest = self.n_past - 1
        layers = range(self.n_layer) if layers is None else [int(il) for il in layers]
        caches = [self.layer_cache[il] for il in layers]
        # cache -> (where its positions go in live: all of it, a tail slice, or an index; its cells holding them)
        where: dict[Cache, tuple[slice | np.ndarray, np.ndarray]] = {}
        for il, cache in zip(layers, caches, strict=True):
            if cache is LayerCache.NONE or cache in where:
                continue
            positions, cells = self._live_cells(il)
            if self.layer_sliding[il] and self.n_swa > 0:  # the window sees the last n_swa positions
                seen = newest - positions < self.n_swa
                positions, cells = positions[seen], cells[seen]
            m = positions.size
            if m <= n and np.array_equal(positions, live[n - m :]):
                where[cache] = (slice(n - m, n), cells)
                continue
            idx = np.searchsorted(live, positions)
            held = idx < n
            held[held] &= live[idx[held]] == positions[held]  # another layer's cache may hold what live does not
            where[cache] = (idx[held], cells[held])
        visible = np.zeros((len(layers), n), dtype=bool)
        for i, cache in enumerate(caches):
            if cache is not LayerCache.NONE:
                visible[i, where[cache][0]] = True
        values = {}
        wanted = int(flags)
        for flag, kind in STAT_KINDS.items():
            if not wanted & flag.value:
                continue
            out = np.zeros((len(layers), self.n_head_kv if flag is TapFlag.VNORM else self.n_head, n), np.float32)
            for i, (il, cache) in enumerate(zip(layers, caches, strict=True)):
                if cache is LayerCache.NONE:
                    continue
                to, cells = where[cache]
                by_cell = self.stat_by_cell(kind, il)
                if isinstance(to, slice) and to.start == 0:
                    np.take(by_cell, cells, axis=1, out=out[i])
                else:
                    out[i][:, to] = np.take(by_cell, cells, axis=1)
            values[flag] = out
        return Aligned(visible, values)

    def stats(self, kind: str) -> list[LayerStat]:
        """``stat`` for every layer, reading each cache's cell map once."""
        maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        out = []
        for il in range(self.n_layer):
            cache = self.layer_cache[il]
            if cache not in maps:
                maps[cache] = self._live_cells(il)
            positions, cells = maps[cache]
            out.append(LayerStat(positions, self.stat_by_cell(kind, il)[:, cells]))
        return out


def decode_batch(views: Sequence[Engine], tokens: Sequence[int]) -> np.ndarray:
    """Decode ``tokens[i]`` at ``views[i].n_past`` in sequence ``views[i].seq``, all in one llama_decode (views
    of one context, each sequence once); return their logits [len(views), n_vocab]."""
    if not views or len(views) != len(tokens):
        raise ValueError("decode_batch needs one token per view, and at least one view")
    e = views[0]
    if len({v.seq for v in views}) != len(views) or any(v.ctx != e.ctx for v in views):
        raise ValueError("decode_batch needs distinct sequences of one context")
    if len(views) > e.config.n_batch:
        raise ValueError(f"{len(views)} sequences do not fit a batch of {e.config.n_batch} tokens")
    for v in views:
        if v.n_past + 1 > v.n_ctx_train:
            raise AhakvError(
                f"position {v.n_past} is past the model's trained context (positions 0 to {v.n_ctx_train - 1})"
            )
    tokens = e._decodable(tokens)
    e._fill([(t, v.n_past, v.seq, True) for v, t in zip(views, tokens, strict=True)])
    e._run_batch()
    llama_cpp = e._llama_cpp
    out = np.empty((len(views), e.n_vocab), dtype=np.float32)
    for i, v in enumerate(views):
        ctypes.memmove(address(out[i], np.float32), llama_cpp.llama_get_logits_ith(e.ctx, i), out[i].nbytes)
        v.n_past += 1
    return out
