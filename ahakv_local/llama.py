"""``ahakv_local.Llama``: llama-cpp-python's ``Llama`` with a bounded KV cache.

Without ``kv_budget`` it *is* llama_cpp.Llama (same code path, same errors). With one:

- the KV caches hold what ``budget.allocate`` lays out (a cell budget: ``budget + n_batch + 1`` cells and a
  question's room, no padding), however long the text: positions run up to the model's trained context, far past
  the cells, so ``n_ctx()`` reports the trained context and completions are bounded by it;
- ``eval`` decodes through the eviction controller (prompt in n_ubatch chunks, compressed after
  each; then one token at a time, evicting every ``kv_evict_every`` steps - 32 by default - after
  observing the last ``kv_observe_steps``), keeping the cache at the budget at every step;
- prefix reuse stays honest: a prompt that extends the whole cached sequence continues it; any other
  is read from the start with a fresh policy (the cache may have holes, and the policy's statistics
  cannot be rewound), so a request that does not continue the cached sequence gets a fresh read's answer. With
  ``kv_reuse_compressed=True`` (what the chat uses) the compressed history is reused on purpose;
- a prompt longer than the budget is read guided by its question (``kv_query``), for policies that can be
  (ahakv, snapkv, tova): ``create_chat_completion`` takes the last user message, ``create_completion`` the
  ``kv_query=`` text of the call or else the prompt's last paragraph (a question guides by its last 24 tokens);
  ``kv_query=False`` reads plainly, ``kv_query="reconstruct"`` question-agnostically (KVzip's repetition);
- the token-keyed state cache (``set_cache``) is refused: it would hand back lossy states as exact.

With or without a budget, a model whose GGUF has no chat template chats as a plain transcript ("User: ...",
"Assistant: ..."), not llama-cpp-python's Llama 2 fallback (``upstream.transcript``; ``chat_format=`` still wins).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from . import rpc, upstream
from .budget import (
    KV_TYPE_AUTO,
    QUESTION_AGNOSTIC,
    Budget,
    check_room,
    check_trained_context,
    default_layer_budgets,
    reading_of,
)
from .controller import ControllerStats, KVController, Reconstruct
from .engine import Engine, clear_next_caches, kv_type_params, set_next_caches
from .errors import AhakvError
from .info import KV_CACHE_TYPES, KV_TYPES, check_kv_types, read_info, reading_headers_once
from .native import MAX_THREADS
from .policies import KINDS, check_guided, make_policy
from .session import SessionSpec, check_kv_query, guide_of
from .stream_text import completion_text, cut_at_first_stop, ready_text, stop_strings
from .textfile import last_paragraph

# the ggml types llama.cpp's own tools offer for a KV cache (--cache-type-k), by their ggml_type number
CACHE_GGML_TYPES = {name: ggml_type for name, (ggml_type, _, _) in KV_TYPES.items()}  # (upstream's type_k/type_v)
CACHE_GGML_TYPES_BY_ID = {ggml_type: name for name, ggml_type in CACHE_GGML_TYPES.items()}


def whole(n) -> int | None:
    """``n`` as an int where it is a whole number as ctypes takes one (numpy's integers too; not a bool: the
    policies' ``KINDS["int"]``); None otherwise."""
    return int(n) if KINDS["int"](n) else None


def _at_least_one(name: str, n) -> int:
    if (value := whole(n)) is None or value < 1:  # (-1: llama.cpp failed, then a crash on exit)
        raise AhakvError(f"{name} must be 1 or more, not {n!r}")
    return value


class Stopped(Exception):
    """Raised by ``eval`` when ``Llama.should_stop()`` says so: the generation (or the prompt being read)
    ends before the next decode call, with the cache consistent up to the last one."""


CLOSED_MESSAGE = "this Llama was closed: create a new one"


class _Closed:
    """Stands in for the native model, context and batch after ``close()``: upstream would pass freed
    pointers to llama.cpp and crash the process; this raises instead."""

    def __getattr__(self, name: str):
        raise ValueError(CLOSED_MESSAGE)

    def __bool__(self) -> bool:
        return False


CLOSED = _Closed()


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def llama_response_format(response_format: dict) -> dict:
    """OpenAI's ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` as llama-cpp-python's
    ``{"type": "json_object", "schema": {...}}``, whose grammar it samples under; without a ``schema`` (OpenAI's is
    optional) as ``json_object``, any JSON object (it was refused); any other format as it is. A schema its grammar
    cannot be made from is a ValueError: llama-cpp-python sampled any JSON in its place, without a word (a
    ``pattern`` without ``^...$``, an unknown type, a ``$ref`` it cannot resolve)."""
    if response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(
                'response_format of type json_schema needs "json_schema": {"name": ..., "schema": {...}} (the schema '
                "optional: without it any JSON object)"
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict | None):
            raise ValueError(f"response_format's json_schema schema is a JSON Schema object, not {schema!r}")
        response_format = {"type": "json_object"} | ({} if schema is None else {"schema": schema})
    if response_format.get("type") == "json_object" and "schema" in response_format:
        try:
            json_schema_to_gbnf(json.dumps(response_format["schema"]))
        except Exception as exc:  # (an AssertionError, mostly: the converter checks what it supports with assert)
            raise ValueError(f"response_format's schema cannot be sampled: {exc}") from None
    return response_format


def one_call_at_a_time(method):
    """``method`` refused with a RuntimeError while another thread is inside a call of this Llama (``Llama._alone``)."""

    @functools.wraps(method)
    def alone(self, *args, **kwargs):
        with self._alone(method.__name__):
            return method(self, *args, **kwargs)

    return alone


def product_layout(model_path: str | Path, n_gpu_layers: int = 0, rpc_servers: Sequence[str] = ()) -> str:
    """The layer layout a budget is held in when none is asked for: the product's for this model's kinds of layers,
    on the CPU or offloaded (``budget.default_layer_budgets``)."""
    info = read_info(Path(model_path))
    offloaded = n_gpu_layers != 0 and upstream.offload_target(rpc_servers)
    return default_layer_budgets(info.n_layer_swa, info.n_layer, offloaded)


def check_cells(
    model_path: str, cells: int, budget: Budget | None, layer_cells: Sequence[int] = (), kv_type="f16"
) -> None:
    """Refuse a budget the model can never use, or cells the machine cannot hold, before llama.cpp allocates
    (``layer_cells``: the cells of each layer's cache where a budget laid them out, K and V of ``kv_type``; else
    ``cells`` in every layer, f16). Without a budget this is llama_cpp.Llama, which loads architectures we do not
    evict from: unknown ones are left to llama.cpp."""
    try:
        info = read_info(Path(model_path))
    except AhakvError:
        if budget is None:
            return
        raise
    info.check_whole()
    cells = cells or info.n_ctx_train  # n_ctx=0: llama.cpp allocates the trained context
    if budget is not None:
        check_trained_context(budget, info.n_ctx_train)
    if layer_cells:  # what the caches really take (a natural byte budget was refused for its larger cache x 18)
        need = info.layers_bytes(layer_cells, kv_type)
    else:
        need = cells * info.kv_bytes_per_token()
    free = available_memory()
    if free is not None and need > free:
        raise AhakvError(
            f"{cells} KV cells need {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB of memory available"
        )


@dataclass
class KVStats:
    cells_used: int
    budget: int | None
    tokens_seen: int
    evicted: int
    retention_ratio: float
    kv_cells: int  # cells of the cache the budget is held in (a per-layer layout: its full-attention layers' mean)
    kv_bytes: int
    prompt_tokens: int
    prompt_tps: float
    generated_tokens: int  # decoded one at a time (the generation speed's basis)
    generation_tps: float
    sampled_tokens: int = 0  # tokens sampled since the timings were reset (a completion's length, end of turn included)
    guide_tokens: int = 0  # tokens decoded to guide long prompts' readings (a question behind each chunk), all told
    # by layer group ("shared", "base" and "sliding", or "layer <il>"): [allocated, used] K+V bytes
    kv_group_bytes: dict[str, list[int]] = field(default_factory=dict)
    # by kind ("shared", or "full" and "sliding"): [allocated, used] K+V bytes and the caches summed
    kv_kind_bytes: dict[str, list[int]] = field(default_factory=dict)
    kv_type: str = "f16"  # of K and V (kv_type "auto": the type it decided)
    # the layer layout the budget is held in (its default depends on the model and on offloading:
    # budget.default_layer_budgets); "" without a budget
    layer_budgets: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class Llama(llama_cpp.Llama):
    @reading_headers_once()  # the model's header is asked for several times below: read it once
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        kv_budget: int | float | str | None = None,
        kv_policy: str = "ahakv",
        kv_sinks: int = 4,
        kv_recent: int = 32,
        kv_error_tol: float = 0.05,
        kv_min_ratio: float = 0.10,
        kv_max_ratio: float = 0.40,
        kv_evict_every: int | None = None,
        kv_observe_steps: int | None = 1,
        kv_pinned: tuple[int, int] | None = None,
        kv_reuse_compressed: bool = False,
        kv_query: bool | str = True,
        kv_layer_budgets: str | None = None,
        kv_type: str | None = None,
        rpc_servers: str | Sequence[str] | None = None,
        repack_weights: bool = True,
        n_ctx: int = 512,
        n_batch: int = 512,
        **kwargs,
    ):
        # a pathlib.Path as every other Python API takes one (llama_cpp.Llama stopped at an AttributeError on .encode)
        if isinstance(model_path, os.PathLike):
            model_path = os.fspath(model_path)
        if not isinstance(model_path, str):
            raise TypeError(f"model_path must be a path (str or os.PathLike), not {type(model_path).__name__}")
        self._busy = threading.RLock()  # held by the thread inside a native call (``one_call_at_a_time``)
        # what this Llama was asked for, which a pickled copy is made from again (llama-cpp-python pickles the
        # constructor's arguments: its own state would say the cells allocated, not the context asked for)
        self._asked = dict(
            kv_budget=kv_budget, kv_policy=kv_policy, kv_sinks=kv_sinks, kv_recent=kv_recent, kv_error_tol=kv_error_tol,
            kv_min_ratio=kv_min_ratio, kv_max_ratio=kv_max_ratio, kv_evict_every=kv_evict_every,
            kv_observe_steps=kv_observe_steps, kv_pinned=kv_pinned, kv_reuse_compressed=kv_reuse_compressed,
            kv_query=kv_query, kv_layer_budgets=kv_layer_budgets, kv_type=kv_type, rpc_servers=rpc_servers,
            repack_weights=repack_weights, n_ctx=n_ctx, n_batch=n_batch,
        )  # fmt: skip
        self._kv: KVController | None = None
        # llama.cpp RPC workers for the layers (checked now: llama.cpp would abort on one it cannot reach)
        self.rpc_servers = rpc.parse_servers(rpc_servers) if rpc_servers else ()
        if self.rpc_servers:  # llama-cpp-python's default of 0 layers would leave the workers idle
            kwargs.setdefault("n_gpu_layers", rpc.default_layers(self.rpc_servers))
        self._rpc_devices = rpc.Devices(self.rpc_servers) if self.rpc_servers else None
        self._repack_weights = repack_weights
        # checked before every decode call (each prompt chunk, each token): a server stops a generation whose
        # client left, or the process's, without reaching into llama-cpp-python's generation loop
        self.should_stop: Callable[[], bool] = lambda: False
        self._timing = {"prompt_tokens": 0, "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0, "sampled": 0}
        # whole numbers as ctypes takes them (numpy's too: upstream took np.int64(512), this refused it), not a bool
        if (ctx := whole(n_ctx)) is None or ctx < 0:  # (a budget's plan took -1 for 0)
            raise AhakvError(f"n_ctx must be 0 (the model's trained context) or more, not {n_ctx!r}")
        n_ctx = ctx
        n_batch = _at_least_one("n_batch", n_batch)
        if "n_ubatch" in kwargs:
            kwargs["n_ubatch"] = _at_least_one("n_ubatch", kwargs["n_ubatch"])
        for name in ("n_threads", "n_threads_batch"):  # (100000: std::bad_alloc at the first decode, an abort)
            if (given := kwargs.get(name)) is not None:
                if (n := whole(given)) is None or n > MAX_THREADS:
                    raise AhakvError(f"{name} must be a whole number up to {MAX_THREADS}, not {given!r}")
                kwargs[name] = n
        for name in ("type_k", "type_v"):  # (99: llama.cpp aborted the process as it sized the cache)
            if (given := kwargs.get(name)) is not None and whole(given) not in CACHE_GGML_TYPES.values():
                kinds = ", ".join(f"{n} ({t})" for t, n in CACHE_GGML_TYPES.items())
                raise ValueError(f"{name} must be a ggml type llama.cpp keeps a KV cache in: {kinds}; not {given!r}")
        kv_type = self._kv_type_of(kv_type, kv_budget, kwargs)
        if kv_query not in (True, False, *QUESTION_AGNOSTIC):
            raise AhakvError(f"kv_query must be True, False, 'reconstruct' or 'surprisal', not {kv_query!r}")
        self._kv_query_default = kv_query
        self._kv_guide = None  # what the next prompt is read with (set per request)
        self._context_full = False  # the last completion ended because the context was full (``_counted``)
        self._usage = [0, 0]  # the last completion's prompt and completion tokens (``last_usage``)
        self._sampled: tuple[list[int], list[int]] = ([], [])  # the last generate's prompt and tokens (``_restreamed``)
        self._sampling = False  # a completion's prompt is read: what is decoded now counts as prompt (``_count``)
        # llama.cpp holds logits to sample from: something was decoded since the context was made or a state loaded
        self._has_logits = False
        self._chat_question: str | None = None
        if kv_type == KV_TYPE_AUTO and kwargs.get("flash_attn") is False:
            kv_type = "f16"  # a quantized V needs flash attention
        if kwargs.get("vocab_only") and kv_budget is not None:
            raise ValueError("vocab_only loads the tokenizer alone: a KV budget needs the model's layers")
        if kv_budget is None:
            make_policy(kv_policy)  # an unknown name is refused with or without a budget (the policy acts with one)
            asked = self._asked | {"kv_policy": _DEFAULTS["kv_policy"] if kv_policy == "full" else kv_policy}
            if unused := [name for name in BOUNDED_SETTINGS if asked[name] != _DEFAULTS[name]]:
                # (the CLI refuses them; an app's config may pass them beside a budget it sometimes leaves out)
                warnings.warn(
                    f"{', '.join(unused)} appl{'y' if unused[1:] else 'ies'} to a bounded KV cache: without "
                    "kv_budget every token is kept",
                    stacklevel=3,  # the caller's line: reading_headers_once's wrapper is the frame between
                )
            if kv_type not in (None, KV_TYPE_AUTO):  # "auto" spends a budget: without one, f16 as by default
                self._use_kv_type(model_path, kv_type, kwargs)
            check_cells(model_path, n_ctx, None)
            self._load(model_path, n_ctx=n_ctx, n_batch=n_batch, **kwargs)
            # a vocab-only model has no layers to describe (llama.cpp aborted the process on their head count)
            self._kv_engine = None if kwargs.get("vocab_only") else Engine.attach(self)
            upstream.set_position_bound(self, self._n_ctx)  # llama.cpp padded the context: hold all of it
            return

        budget = Budget.parse(kv_budget, min_ratio=kv_min_ratio, max_ratio=kv_max_ratio, error_tol=kv_error_tol)
        # the reading its cells leave room for: a chat over documents (kv_reuse_compressed) reads them
        # question-agnostically (/read), which needs a reconstruction pass's room, more than a question's
        reading = reading_of(kv_query)
        if kv_query == "reconstruct":  # (opened, then every call was refused with advice to open it so)
            check_guided(kv_policy, "kv_query 'reconstruct'", "kv_query=False or 'surprisal'")
        if kv_reuse_compressed and reading == "query":
            reading = "reconstruct"
        if kv_layer_budgets is None:
            kv_layer_budgets = product_layout(model_path, kwargs.get("n_gpu_layers", 0), self.rpc_servers)
        # an unknown policy or a policy without a budget fails here, before the model loads
        spec = SessionSpec.bounded(
            kv_policy,
            budget,
            n_sink=kv_sinks,
            n_recent=kv_recent,
            evict_every=kv_evict_every,
            observe_steps=kv_observe_steps,
            pinned=kv_pinned,
            layer_budgets=kv_layer_budgets,
            reading=reading,
            kv_type=kv_type or "f16",
        )
        if kwargs.get("logits_all"):
            raise AhakvError("logits_all keeps a row of logits per position; it cannot be combined with kv_budget")
        if kwargs.get("draft_model") is not None:  # upstream's speculative decoding samples a row per draft token
            raise AhakvError(
                "draft_model decodes with a row of logits per position (logits_all); it cannot be combined with "
                "kv_budget (llama.cpp aborted the process at the first draft)"
            )
        plan = spec.plan_on(model_path, n_ctx, n_batch, kwargs.get("n_ubatch", 512))
        spec, n_batch = plan.spec, plan.n_batch
        if kv_type is not None:
            kwargs.update(kv_type_params(spec.kv_type, kwargs.get("flash_attn")))
        if plan.allocation is not None:
            kwargs.setdefault("swa_full", not plan.allocation.cache_cells[1])
        check_cells(model_path, plan.cells, budget, plan.layer_cells, spec.kv_type)  # (before the caches are set: a
        try:  # refusal left them pending, and the next model of this thread got them)
            if plan.allocation is not None:  # for the context upstream makes next
                set_next_caches(plan.allocation.cache_cells, plan.allocation.layer_groups)
            self._load(model_path, n_ctx=plan.cells, n_batch=n_batch, **kwargs)
        finally:
            clear_next_caches()

        engine = Engine.attach(self)
        self._kv_engine = engine
        # as the caches were laid out (allocation_on above); positions, not cells, bound a sequence now: the trained
        # context (a ratio or auto budget laid out in n_ctx cells is capped at what they hold: KVController.fitted)
        self._kv = spec.controller(engine, plan.longest, positions=engine.n_ctx_train)
        self._kv_reuse_compressed = kv_reuse_compressed
        upstream.set_position_bound(self, engine.n_ctx_train)

    def __getstate__(self) -> dict:
        state = super().__getstate__() | self._asked
        if self._asked["kv_type"] is not None:  # upstream's type_k/type_v are kv_type's: it sets them again
            del state["type_k"], state["type_v"]
        if self.chat_format == upstream.TRANSCRIPT:  # made again by the constructor (a closure: not picklable)
            state |= {"chat_format": None, "chat_handler": None}
        return state

    @staticmethod
    def _kv_type_of(kv_type: str | None, kv_budget, kwargs: dict) -> str | None:
        """``kv_type``, refused beside upstream's ``type_k``/``type_v`` (it set them over the ones given, without a
        word); a byte budget counts the bytes of K and V of ``kv_type``, so there upstream's pair of one type
        ``kv_type`` names is taken as that ``kv_type``, and another is refused (a q8_0 pair was laid out as f16 and
        refused as not fitting its cells, an f32 pair allocated twice the bytes)."""
        given = {name: whole(kwargs[name]) for name in ("type_k", "type_v") if kwargs.get(name) is not None}
        if not given:
            return kv_type
        if kv_type is not None:
            raise ValueError("kv_type sets K and V (type_k and type_v): give kv_type or type_k/type_v, not both")
        if kv_budget is None or Budget.parse(kv_budget).mode != "bytes":
            return None  # cells, a ratio or auto: counted in cells, K and V as upstream allocates them
        # (one of them alone: the other is upstream's default, f16)
        names = {CACHE_GGML_TYPES_BY_ID[given.get(k, CACHE_GGML_TYPES["f16"])] for k in ("type_k", "type_v")}
        if len(names) == 1 and (name := names.pop()) in KV_CACHE_TYPES:
            for k in given:
                del kwargs[k]  # (set again from kv_type, flash attention with them)
            return name
        raise ValueError(
            f"a budget in bytes counts K and V of kv_type ({', '.join(KV_CACHE_TYPES)}): give kv_type rather than "
            "type_k/type_v"
        )

    @staticmethod
    def _use_kv_type(model_path: str, kv_type: str, kwargs: dict) -> None:
        """llama_cpp.Llama's arguments for K and V of ``kv_type`` (a quantized one: flash attention on), checked
        against the model."""
        kwargs.update(kv_type_params(kv_type, kwargs.get("flash_attn")))
        check_kv_types(read_info(Path(model_path)), kv_type, kv_type)

    def _load(self, model_path: str, **kwargs) -> None:
        """llama_cpp.Llama's constructor, with the model on the RPC workers and the repacking asked for."""
        upstream.use_ggml_log_levels()
        hook = upstream.model_params_hook(lambda p: rpc.configure(p, self._rpc_devices, self._repack_weights))
        with hook, upstream.interrupts_kept():
            super().__init__(model_path, **kwargs)
        upstream.use_transcript_without_template(self, kwargs)

    # -- what changes with a budget ---------------------------------------------------------------

    @property
    def kv_controller(self) -> KVController | None:
        return self._kv

    @property
    def kv_laid_out_for(self) -> dict:
        """What this Llama's caches were laid out for, beside its budget and layout: the policy it was opened with
        (one that reads with a question keeps that room in them; a later ``set_policy`` keeps the caches), the
        ``n_ctx`` asked (a ratio or auto budget's cells) and the ubatch (each cache holds one beside the budget). A
        saved chat names them where they differ."""
        return {
            "policy": self._asked["kv_policy"],
            "n_ctx": self._asked["n_ctx"],
            "n_ubatch": self.kv_engine.config.n_ubatch,  # (a vocab_only model's ValueError, not an AttributeError)
        }

    @property
    def kv_engine(self) -> Engine:
        """The engine view of this Llama's model and context (shapes, cell maps, statistics)."""
        if self._kv_engine is None:
            raise ValueError("a vocab_only model has no layers and no KV cache")
        return self._kv_engine

    def n_ctx(self) -> int:
        """Without a budget: the context size. With one: the model's trained context, the bound on
        positions (the KV cells stay at the budget; see ``kv_stats``)."""
        if self._kv is not None and self._kv_engine.closed:  # (as without a budget: llama.cpp's n_ctx is gone)
            raise ValueError(CLOSED_MESSAGE)
        return self._n_ctx if self._kv is not None else super().n_ctx()

    def set_cache(self, cache) -> None:
        if self._kv is not None and cache is not None:
            raise ValueError(
                "a token-keyed state cache would return compressed states as exact ones: not available with kv_budget"
            )
        super().set_cache(cache)

    # -- the question a long prompt is read with ------------------------------------------------------

    def set_kv_query(self, query: bool | str | None, prompt: str | Sequence[int] | None = None) -> None:
        """Set what the next prompt is read with: a question's text, True (the last paragraph of ``prompt``),
        "reconstruct" or "surprisal" (question-agnostic), or False / None (plainly)."""
        check_kv_query(query)
        if self._kv is None or not query:
            self._kv_guide = None
            return
        room = self._kv.config.room
        if query == "reconstruct":
            check_guided(self._kv.policy.name, "kv_query 'reconstruct'", "kv_query=False or 'surprisal'")
            check_room(
                query, self._kv_engine.config.n_ubatch, room, shown="kv_query 'reconstruct'", caches="this Llama's",
                advice="open it with kv_query='reconstruct' (or kv_reuse_compressed=True)",
            )  # fmt: skip
        question = None  # True: the prompt's last paragraph
        if query is True and prompt is not None:
            text = prompt if isinstance(prompt, str) else self.detokenize(list(prompt)).decode(errors="replace")
            question = last_paragraph(text)
        self._kv_guide = guide_of(query, question, self._kv_engine)

    @contextlib.contextmanager
    def _alone(self, name: str, wait: bool = False):
        """This Llama taken by the calling thread, or a RuntimeError where another thread has it (``wait``: wait for
        it). Two threads decoding, sampling or replacing the state of one llama.cpp context at once aborted the process
        or crashed it (as under llama_cpp.Llama), and a completion refused in its decode had already reset the other's
        sequence. Each call, and each step of a stream, takes the Llama alone: calls of several threads in turn work (a
        stream consumed through a thread pool, one ``next`` per thread), and so do nested calls in one thread."""
        busy = self.__dict__.get("_busy")
        if busy is None:  # (upstream's constructor, before this one made it)
            yield
            return
        if not busy.acquire(blocking=wait):
            raise RuntimeError(
                f"Llama.{name}: this Llama is in use by another thread (llama.cpp's context runs one call at a time): "
                "give each thread its own Llama, or take turns under a lock"
            )
        try:
            yield
        finally:
            busy.release()

    @one_call_at_a_time
    def create_completion(self, prompt, *args, kv_query: bool | str | None = None, **kwargs):
        """llama-cpp-python's, plus ``kv_query``: the question a long prompt is read with (see the module)."""
        if kv_query is None:
            kv_query = self._chat_question if self._chat_question is not None else self._kv_query_default
        logprobs = upstream.bound_arguments("create_completion", prompt, *args, **kwargs).arguments.get("logprobs")
        if self._kv is not None and logprobs is not None:  # (upstream's refusal said to open it with logits_all=True,
            raise ValueError(  # which a budget refuses)
                "logprobs need every prompt token's logits (logits_all), which a bounded cache does not keep: ask "
                "without logprobs, or open the Llama without kv_budget"
            )
        self.set_kv_query(kv_query, prompt)
        return super().create_completion(prompt, *args, **kwargs)

    @one_call_at_a_time
    def sample(self, *args, **kwargs):
        """llama_cpp.Llama's; an ``idx`` whose logits llama.cpp does not hold (without logits_all, any but the last
        token's) is a ValueError: llama.cpp aborted the process (as under llama_cpp.Llama)."""
        idx = upstream.bound_arguments("sample", *args, **kwargs).arguments.get("idx")
        if idx is not None and not self._logits_all and idx != self.n_tokens - 1:
            raise ValueError(
                f"sample(idx={idx}): llama.cpp holds the logits of the last token only (idx {self.n_tokens - 1}); "
                "open the Llama with logits_all=True for the others"
            )
        return super().sample(*args, **kwargs)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        """llama_cpp.Llama's; a token id outside the vocabulary is a ValueError (llama.cpp aborted the process)."""
        n = self.n_vocab()
        if len(tokens) and (min(tokens) < 0 or max(tokens) >= n):
            bad = next(t for t in tokens if not 0 <= t < n)
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {n} tokens")
        return super().detokenize(tokens, prev_tokens, special)

    def __call__(self, prompt, *args, kv_query: bool | str | None = None, **kwargs):
        """``create_completion``, as llama-cpp-python's (whose ``__call__`` takes the same parameters, in the same
        order, and no others: ``llm(prompt, kv_query=...)`` was a TypeError)."""
        return self.create_completion(prompt, *args, kv_query=kv_query, **kwargs)

    @one_call_at_a_time
    def create_chat_completion(self, messages, *args, kv_query: bool | str | None = None, **kwargs):
        """llama-cpp-python's; a long conversation is read guided by its last user message by default. OpenAI's
        ``response_format`` of type ``json_schema``, which llama-cpp-python 0.3.36 ignores (the answer came as prose),
        is sampled as its ``json_object`` with that schema."""
        call = upstream.bound_arguments("create_chat_completion", messages, *args, **kwargs)
        if call.arguments.get("response_format"):  # (given by name or by position)
            call.arguments["response_format"] = llama_response_format(call.arguments["response_format"])
        if kv_query is None:
            kv_query = self._kv_query_default
        if kv_query is True:  # the question is the last user message, not the template's last paragraph
            users = [m.get("content") for m in messages if m.get("role") == "user"]
            # its parts joined as the chat template renders them (with nothing between)
            # a blank message asks nothing: read plainly, as the parallel server does (``guide_of``)
            text = upstream.message_text(users[-1]) if users else ""
            kv_query = text if text.strip() else False
        self._chat_question = kv_query
        try:
            return upstream.call_bound(super().create_chat_completion, call)
        finally:
            self._chat_question = None

    @one_call_at_a_time
    def eval(self, tokens: Sequence[int]):
        if self.should_stop():
            raise Stopped
        if self._kv is None:
            # past the context llama_decode fails on the chunk that does not fit, with the chunks before it in the
            # cache and a RuntimeError (chat's /read of a long document); refused before any, in create_completion's
            # words
            if self.n_tokens + len(tokens) > self.n_ctx():
                raise ValueError(
                    f"Requested tokens ({self.n_tokens + len(tokens)}) exceed context window of {self.n_ctx()}"
                )
            # upstream's eval decodes n_batch tokens at a time: the same calls, one by one, so that should_stop is
            # asked between two of them here too (a long message was read to its end after a first Ctrl-C)
            for start in range(0, len(tokens), self.n_batch):
                if start and self.should_stop():
                    raise Stopped
                t0 = time.perf_counter()
                super().eval(tokens[start : start + self.n_batch])
                self._has_logits = True
                self._count(len(tokens[start : start + self.n_batch]), time.perf_counter() - t0)
            return
        if self.n_tokens + len(tokens) > self._n_ctx:
            raise ValueError(
                f"Requested tokens ({self.n_tokens + len(tokens)}) exceed the model's trained "
                f"context of {self._n_ctx} positions"
            )
        kv = self._kv
        tokens = list(tokens)
        resume = kv.resume_point(self.n_tokens)  # a reused compressed history may have lost the positions before it
        if resume < self.n_tokens:
            tokens = [int(t) for t in self.input_ids[resume : self.n_tokens]] + tokens
            self.n_tokens = resume
        kv.truncate(self.n_tokens)  # positions >= n_tokens are being replaced
        last = None
        try:
            for i, (chunk, ends_prompt) in enumerate(kv.prompt_pieces(tokens, self._kv_guide, self.n_batch)):
                if i and self.should_stop():  # between prompt chunks too: a long prompt need not be read to the end
                    raise Stopped
                t0 = time.perf_counter()
                last = kv.read_piece(chunk, self._kv_guide, ends_prompt)
                self._has_logits = True
                self._count(len(chunk), time.perf_counter() - t0)
                self.input_ids[self.n_tokens : self.n_tokens + len(chunk)] = chunk
                self.n_tokens += len(chunk)
                self._requires_eval = False
        except BaseException:
            if self._kv_engine.n_past != self.n_tokens:
                # an exception inside a piece (a Ctrl-C, an app's own): the engine read part of it, its compression
                # may have evicted positions before it, and the policy's statistics hold its rows. None of it can be
                # taken back, so the sequence starts over. The same request answered otherwise than a fresh Llama
                # (it read on from the over-compressed cache), and a saved state did not load (its cache ran past
                # its token list)
                self.reset()
                self._has_logits = False
            raise
        if last is not None and isinstance(self._kv_guide, Reconstruct):
            # a reconstruction decodes its repetition after the prompt's last chunk too, and the sampler reads
            # llama.cpp's last logits: the prompt's go back there (the other readings decode nothing after it, and a
            # copy of the vocabulary's row at every sampled token would cost decode time for nothing)
            self._kv_engine.put_last_logits(last)

    @one_call_at_a_time
    def generate(self, tokens: Sequence[int], *args, **kwargs):
        reset = kwargs.get("reset", args[6] if len(args) > 6 else True)  # False: ``tokens`` go after what is cached
        if not len(tokens) and not self._has_logits:
            # llama.cpp aborted the process sampling from logits it does not hold (llama_cpp.Llama does the same)
            raise ValueError(
                "generate() needs a token to read: nothing was decoded since this Llama was made or its state "
                "loaded, so there are no logits to sample from"
            )
        if self._kv is not None and not self._kv_reuse_compressed and reset and self._needs_rewind(tokens):
            # llama-cpp-python would rewind to the longest matching prefix and reuse it as if intact. The
            # cached values may have holes, and the policy's statistics include queries that a rewind
            # removes and cannot be taken back: read the prompt from the start with a fresh policy, so
            # the same request meets the same evictions and gets the same answer
            self.n_tokens = 0
            self._requires_eval = True
        self._usage = [len(tokens), 0]
        self._sampled = (list(tokens), [])
        return self._counted(super().generate(tokens, *args, **kwargs), llama_cpp.llama_model_get_vocab(self.model))

    @property
    def last_usage(self) -> dict[str, int]:
        """The last completion's token counts in OpenAI's shape, as llama-cpp-python reports them in a completion
        that is not streamed (its prompt, and what it sampled up to its end-of-generation token); a stream has them
        here once it has ended."""
        prompt, completion = self._usage
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _counted(self, tokens, vocab):
        """Pass the sampled tokens (and anything sent back) through, counting them: a completion's
        stream has one chunk per piece of text, not per token (empty and held-back pieces).

        Where decoding the next token would pass the context it ends with an end-of-generation token, which no
        model sampled: llama-cpp-python cuts max_tokens to fit the context, then samples on past it while a UTF-8
        character is incomplete, and llama_decode failed there. That token makes its completion end with the
        text so far; ``_create_completion`` reports it as "length"."""
        sent = None
        self._sampling = False  # the first send reads the prompt; every decode after it is of sampled tokens
        try:
            while True:
                try:
                    token = tokens.send(sent)
                except StopIteration:
                    return
                self._sampling = True
                self._timing["sampled"] += 1
                if not llama_cpp.llama_vocab_is_eog(vocab, token):  # the completion ends before it
                    self._usage[1] += 1
                    self._sampled[1].append(token)
                sent = yield token
                if self.n_tokens + 1 + len(sent or ()) > self.n_ctx():  # the token, and what was sent back with it
                    tokens.close()
                    self._context_full = True
                    if self.token_eos() >= 0:  # (a vocabulary without one: the completion just ends)
                        yield self.token_eos()
                    return
        finally:  # also a stream closed early: a direct eval() after it (chat's /read) reads a prompt
            self._sampling = False

    def _needs_rewind(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` fails to extend the whole cached sequence (llama-cpp-python would rewind)."""
        n = self.n_tokens
        return n > 0 and (len(tokens) <= n or list(self._input_ids[:n]) != list(tokens[:n]))

    def _create_completion(self, *args, **kwargs):
        """llama-cpp-python's completion steps (``_completion_steps``), each taken alone (``_alone``): a stream's
        consumer may take its steps on several threads, one at a time."""
        steps = self._completion_steps(*args, **kwargs)
        try:
            while True:
                with self._alone("create_completion"):
                    try:
                        out = next(steps)
                    except StopIteration:
                        return
                yield out
        finally:
            with self._alone("create_completion", wait=True):  # (a stream closed by the collector, on any thread)
                steps.close()

    def _completion_steps(self, *args, **kwargs):
        self._context_full = False
        guide = self._kv_guide  # this request's (set by its call; a later call may have set its own since)
        completion = super()._create_completion(*args, **kwargs)
        call = upstream.bound_arguments("_create_completion", *args, **kwargs).arguments
        stops = stop_strings(call.get("stop"), keep_empty=True)  # (upstream's: "" stops at once, streamed too)
        if call.get("stream") and call.get("logprobs") is None and not call.get("echo"):
            # (a stream with log probabilities or the prompt echoed stays upstream's: each chunk's offsets are its own)
            completion = self._restreamed(completion, stops)
        elif not (call.get("stream") or call.get("echo") or call.get("suffix")) and call.get("logprobs") is None:
            completion = (cut_at_first_stop(out, stops) for out in completion)  # (as the stream cuts it)
        try:
            for out in completion:
                if self._context_full and out["choices"][0]["finish_reason"] == "stop":
                    out["choices"][0]["finish_reason"] = "length"  # the context ended it (``_counted``)
                yield out
        except ValueError as exc:
            # upstream names llama_n_ctx (the allocated cells) as the limit; with a budget it is the
            # trained context, which is what _n_ctx holds and checks
            if self._kv is not None and str(exc).startswith("Requested tokens"):
                n = str(exc).split("(", 1)[1].split(")", 1)[0]
                raise ValueError(
                    f"Requested tokens ({n}) exceed the model's trained context of {self._n_ctx} positions"
                ) from None
            raise
        finally:
            completion.close()  # now, as ``yield from`` did: a stream closed early stops upstream's generator too
            # the request's question guides its own prompt only; a stream dropped when its variable was given the
            # next call's ends here, after that call set its question: that one stays (it was read unguided)
            if self._kv_guide is guide:
                self._kv_guide = None

    def _restreamed(self, chunks, stops: list[str]):
        """llama-cpp-python's stream with each chunk's text made anew from every byte sampled so far (``stream_text``):
        its own lost characters held back at a stop string's possible beginning, and everything after a byte that is
        no UTF-8. Chunks left without text are dropped; the last (its finish reason) brings the rest, up to the first
        stop string."""
        data, done, sent = bytearray(), 0, ""
        for chunk in chunks:
            prompt, tokens = self._sampled
            if done < len(tokens):  # (each token's bytes once: with prev_tokens, as upstream's stream reads them)
                data += self.detokenize(tokens[done:], prev_tokens=prompt + tokens[:done])
                done = len(tokens)
            choice = chunk["choices"][0]
            text = ready_text(completion_text(bytes(data)), stops, end=choice["finish_reason"] is not None)
            if choice["finish_reason"] is None and len(text) <= len(sent):
                continue
            choice["text"] = text[len(sent) :]
            sent = text
            yield chunk

    @one_call_at_a_time
    def reset(self):
        super().reset()
        if self._kv is not None and not self._kv_engine.closed:  # (closed: a no-op, as upstream's without a budget)
            self._kv.truncate(0)

    @one_call_at_a_time
    def save_state(self):
        """llama_cpp.Llama's state, with the cells of each KV cache it was made in (``kv_cache_cells``): adaptive
        layer budgets resize the caches, and llama.cpp loads a cache's cells only into one as large."""
        state = super().save_state()
        state.kv_cache_cells = self._kv_engine.cache_sizes() if self._kv is not None else None
        return state

    @one_call_at_a_time
    def load_state(self, state) -> None:
        """Restore a ``save_state()``; a state of another model or context size is refused before anything
        changes (upstream would fail halfway, in numpy, with the cache half-replaced), and one llama.cpp refuses as it
        reads (caches of another layout or K/V type) leaves the sequence as it was."""
        n_vocab = self.n_vocab()
        scores = np.asarray(state.scores)
        if scores.ndim != 2 or scores.shape[1] != n_vocab or scores.shape[0] > self.scores.shape[0]:
            raise ValueError(
                f"this state was saved from another model or context (logits {scores.shape}, "
                f"this model has a vocabulary of {n_vocab} and {self.scores.shape[0]} rows)"
            )
        if not state.llama_state_size:  # llama.cpp "reads" an empty one, then every decode fails
            raise ValueError("this state holds no cache (llama.cpp's state data is empty)")
        if not 0 <= state.n_tokens <= self._n_ctx or len(state.input_ids) < state.n_tokens:
            raise ValueError(f"this state holds {state.n_tokens} tokens, more than this context's {self._n_ctx}")
        ids = np.zeros(self._n_ctx, dtype=np.intc)
        ids[: state.n_tokens] = np.asarray(state.input_ids[: state.n_tokens], dtype=np.intc)
        if state.n_tokens and (ids[: state.n_tokens].min() < 0 or ids[: state.n_tokens].max() >= n_vocab):
            raise ValueError("this state holds token ids outside this model's vocabulary")
        if len(state.llama_state) < state.llama_state_size:  # (found in the copy below, after the sequence changed)
            raise ValueError(
                f"this state is damaged: its cache data holds {len(state.llama_state)} bytes of the "
                f"{state.llama_state_size} it says"
            )
        # llama.cpp checks the rest (the layers' caches, their types) only as it reads, having emptied the sequence:
        # the sequence as it is, to put back where it refuses
        backup = self.save_state() if self.n_tokens else None
        cells = getattr(state, "kv_cache_cells", None)
        if self._kv is not None and cells is not None and tuple(cells) != self._kv_engine.cache_sizes():
            try:  # the caches it was saved in, emptied (the state replaces the sequence)
                self._kv.take_sizes(tuple(int(n) for n in cells))
            except AhakvError as exc:
                raise ValueError(str(exc)) from None
        upstream.restore_positions(self, ids, state.n_tokens, state.seed, scores)
        buf = (ctypes.c_uint8 * state.llama_state_size).from_buffer_copy(state.llama_state)
        _, ctx, _ = upstream.handles(self)
        with upstream.failures_said_by_caller():  # a refusal is this method's one error, not llama.cpp's lines too
            restored = llama_cpp.llama_state_set_data(ctx.ctx, buf, state.llama_state_size)
        self._has_logits = False  # a state holds no logits (the next token must be read first), nor a refused one
        # the token list must end where the cache does (its newest position is never evicted): a state whose
        # n_tokens said otherwise loaded, and every later decode failed ("inconsistent sequence positions").
        # llama.cpp's seq_pos_max reads one cache: a position past the list in another of the per-layer caches (a
        # crafted file) loaded, and the next message failed in the policy's arrays (an IndexError, chat's traceback)
        if self._kv is not None:
            newest = self._kv_engine.newest_position()
        else:
            newest = llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx.ctx), 0)
        mismatch = restored == state.llama_state_size and newest + 1 != state.n_tokens
        if restored != state.llama_state_size or mismatch:
            # whatever llama.cpp restored is not a consistent cache: every cell goes (it left the per-layer caches
            # it had read, and from an empty sequence nothing else cleared them: every later decode failed)
            ctx.kv_cache_clear()
            self.reset()
            if backup is not None:
                self.load_state(backup)
            if mismatch:
                raise ValueError(
                    f"this state is damaged: its cache holds positions up to {newest}, its token list "
                    f"{state.n_tokens} tokens (positions 0 to {state.n_tokens - 1})"
                )
            if self._kv is None:  # llama_cpp.Llama's error (it leaves the sequence half-replaced, this one as it was)
                raise RuntimeError("Failed to set llama state data")
            raise ValueError("llama.cpp refused this state (damaged, or saved with another model or settings)")
        if self._kv is not None:
            self._kv_engine.n_past = self.n_tokens
            self._kv.resync()
            self._kv.fill_budget()
            self._kv.hold_budget()  # a state saved under a larger budget, held now

    # -- resources --------------------------------------------------------------------------------

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # frees the context and the model now, not at garbage collection

    def close(self) -> None:
        if not upstream.is_initialized(self):
            return  # __init__ refused its arguments before upstream allocated anything
        # after another thread's running call (freed under its decode, the process crashed, as under llama_cpp.Llama);
        # a stream's next step then finds it closed
        with self._alone("close", wait=True):
            super().close()
            self._rpc_devices = None  # the workers' connections closed with the model
            # every later call goes through these: raise a ValueError rather than hand freed pointers to C
            upstream.replace_handles(self, CLOSED)
            engine = getattr(self, "_kv_engine", None)
            if engine is not None:
                engine.detach(CLOSED)

    # -- statistics -------------------------------------------------------------------------------

    def _count(self, n: int, seconds: float) -> None:
        # a prompt's last piece may be one token (and every piece, at n_batch 1): counted by what is decoded, not by
        # its length ("prompt 0 tok" at --batch-size 1, and a generation rate over a prompt token)
        kind = "gen" if self._sampling else "prompt"
        self._timing[f"{kind}_tokens"] += n
        self._timing[f"{kind}_s"] += seconds

    def reset_timings(self) -> None:
        self._timing = dict.fromkeys(self._timing, 0)

    def kv_stats(self) -> KVStats:
        """Cells used and budget, tokens seen, evicted, retention, KV buffer, prompt and generation speed."""
        t, engine = self._timing, self.kv_engine
        stats = self._kv.stats if self._kv is not None else ControllerStats(self.n_tokens, None, self.n_tokens)
        return KVStats(
            cells_used=stats.cells_used,
            budget=stats.budget,
            tokens_seen=self.n_tokens,
            evicted=stats.evicted,
            retention_ratio=stats.cells_used / self.n_tokens if self.n_tokens else 1.0,
            kv_cells=self._kv.allocated_cells() if self._kv is not None else engine.n_cells(),
            kv_bytes=engine.kv_bytes(),
            prompt_tokens=t["prompt_tokens"],
            prompt_tps=t["prompt_tokens"] / t["prompt_s"] if t["prompt_s"] else 0.0,
            generated_tokens=t["gen_tokens"],
            generation_tps=t["gen_tokens"] / t["gen_s"] if t["gen_s"] else 0.0,
            sampled_tokens=t["sampled"],
            guide_tokens=stats.guide_tokens,
            kv_group_bytes={k: list(v) for k, v in self._kv.group_bytes().items()} if self._kv is not None else {},
            kv_kind_bytes={k: list(v) for k, v in self._kv.kind_bytes().items()} if self._kv is not None else {},
            kv_type=engine.config.type_k,
            layer_budgets=self._kv.config.layer_budgets if self._kv is not None else "",
        )


# the settings of a bounded cache: without kv_budget every token is kept and none of them changes anything (kv_type
# does: a K/V type is allocated with or without a budget)
BOUNDED_SETTINGS = (
    "kv_policy", "kv_sinks", "kv_recent", "kv_error_tol", "kv_min_ratio", "kv_max_ratio", "kv_evict_every",
    "kv_observe_steps", "kv_pinned", "kv_reuse_compressed", "kv_query", "kv_layer_budgets",
)  # fmt: skip
_DEFAULTS = {name: p.default for name, p in inspect.signature(Llama.__init__).parameters.items()}
