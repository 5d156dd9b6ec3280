"""Saved chats: llama.cpp's own state bytes plus JSON metadata in one zip file, never pickle.

A saved chat is data, not code: loading one parses JSON and hands llama.cpp a byte string, after
checking that the file is what it claims to be and was saved from the same model, so a crafted or
foreign file is refused with one line and the running conversation stays as it was.

    chat.json   {"format", "version", "model": {...}, "system", "messages", "n_tokens", "input_ids", "seed",
                 "cache_cells", "budget", "layer_budgets", "policy", "laid_out_for": {"policy", "n_ctx", "n_ubatch"},
                 "kv_cache": {"type_k", "type_v", "flash_attn"}}
    state.bin   llama_state_get_data() of the context (the compressed cache, positions included)
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import upstream
from .atomic import replaced
from .budget import LAYER_BUDGETS, Budget, as_option
from .errors import AhakvError
from .info import KV_CACHE_TYPES

FORMAT = "ahakv-local chat"
VERSION = 1
ROLES = {"system", "user", "assistant"}
MAX_META_BYTES = 64 * 2**20  # a conversation's JSON; anything larger is not one of ours


WEIGHT_SAMPLES, SAMPLE_BYTES = 16, 64 * 2**10


def model_identity(llm) -> dict[str, Any]:
    """What a state depends on: the same weights (the file name may differ): their shapes, vocabulary, file size and
    a digest of samples of the file (two models of one shape and size, two fine-tunes or two seeds, differ there).
    Taken once for a loaded model (the chat takes it as it starts): llama.cpp holds the weights, and a model file
    moved or deleted during a chat stopped /save and /load with a FileNotFoundError."""
    if (known := _IDENTITIES.get(llm)) is not None:
        return known
    path = Path(llm.model_path)
    try:
        file_bytes, digest = path.stat().st_size, weights_digest(path)
    except OSError as exc:
        raise AhakvError(f"cannot read the model file {path}: {exc.strerror} (it was moved or deleted)") from None
    known = {
        "n_vocab": llm.n_vocab(),
        "n_embd": llm.n_embd(),
        "n_layer": llm.kv_engine.n_layer,
        "n_ctx_train": llm.kv_engine.n_ctx_train,
        "file_bytes": file_bytes,
        "weights_sha256": digest,
    }
    _IDENTITIES[llm] = known
    return known


_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a loaded model's identity (``model_identity``)


def weights_digest(path: Path) -> str:
    """sha256 of ``WEIGHT_SAMPLES`` slices of 64 KiB spread evenly over the file (all of a small one): reading a
    model of gigabytes at every /save and /load would take seconds."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        for i in range(WEIGHT_SAMPLES):
            f.seek(i * max(size - SAMPLE_BYTES, 0) // (WEIGHT_SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def kv_cache_kind(llm) -> dict[str, Any]:
    """How K and V are stored, which llama.cpp's state carries as it is (a state of q8_0 caches, or of V laid out by
    cell under flash attention, loads into no other)."""
    c = llm.kv_engine.config
    return {"type_k": c.type_k, "type_v": c.type_v, "flash_attn": c.flash_attn}


def save_chat(path: Path, llm, messages: list[dict], system: str | None) -> None:
    """Write the conversation and its cache; a half-written file never replaces a good one, and a file that is not
    a saved chat (a user's notes given by mistake) is never replaced at all."""
    # through a link, the file it names is the saved chat (replacing the link left that file stale)
    path = Path(os.path.realpath(path))
    # a device or a pipe is no saved chat either (/save /dev/null, as root, replaced the device with a file)
    if path.exists() and not path.is_dir() and not (path.is_file() and _is_saved_chat(path)):
        raise AhakvError(f"{path} exists and is not a saved chat: not replaced (give another name)")
    state = llm.save_state()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(llm) | {"name": Path(llm.model_path).name},
        "system": system,
        "messages": messages,
        "n_tokens": int(state.n_tokens),
        "input_ids": [int(t) for t in state.input_ids[: state.n_tokens]],
        "seed": int(state.seed),
        # the cells of each KV cache the state was made in (adaptive layer budgets resize them; None: no budget)
        "cache_cells": [int(n) for n in state.kv_cache_cells] if getattr(state, "kv_cache_cells", None) else None,
        # the budget those caches were laid out for, as --budget takes it (chat's /budget 8MiB re-sizes them)
        "budget": as_option(llm.kv_controller.laid_out) if llm.kv_controller is not None else None,
        "layer_budgets": llm.kv_controller.config.layer_budgets if llm.kv_controller is not None else None,
        # the policy that runs (chat's /policy switches it in the same caches)
        "policy": llm.kv_controller.policy.name if llm.kv_controller is not None else "full",
        # and the policy and n_ctx they were laid out for: one that reads with a question keeps its room in them, a
        # ratio or auto budget takes its cells from n_ctx (-c)
        "laid_out_for": llm.kv_laid_out_for,
        "kv_cache": kv_cache_kind(llm),
    }
    try:
        with replaced(path) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("chat.json", json.dumps(meta, ensure_ascii=False))
            z.writestr("state.bin", state.llama_state)
    except OSError as exc:  # a missing folder, no permission, a full disk: one line (and the file as it was)
        raise AhakvError(f"cannot write {path}: {exc.strerror or exc}") from None


def load_chat(
    path: Path, llm, accept: Callable[[str | None], None] = lambda system: None
) -> tuple[list[dict], str | None, str | None]:
    """Check a saved chat and restore its cache into ``llm``; returns (messages, system prompt, the policy it ran
    under as the file names it). Every check runs
    before the cache is touched, ``accept(system)`` (the caller's, e.g. that the budget holds the system prompt)
    last; AhakvError says what is wrong in one line."""
    meta, blob = _read(path, max_state=max_state_bytes(llm))
    messages, system = _check(meta, llm, path)
    if not blob:
        raise AhakvError(f"{path} holds no cache state")
    accept(system)
    state = upstream.make_state(
        input_ids=np.asarray(meta["input_ids"], dtype=np.intc),
        scores=np.zeros((0, llm.n_vocab()), dtype=np.single),  # logits are recomputed by the next decode
        n_tokens=meta["n_tokens"],
        llama_state=blob,
        seed=meta["seed"],
    )
    cells, kv, kind = meta.get("cache_cells"), llm.kv_controller, meta.get("kv_cache")
    if kind is not None and kind != kv_cache_kind(llm):  # (llama.cpp would refuse it, in three lines of its log)
        stored = kind.get("type_k") if kind.get("type_k") in KV_CACHE_TYPES else "other"
        how = "flash attention on" if kind.get("flash_attn") else "flash attention off"
        raise AhakvError(f"{path} was saved in KV caches of {stored}, {how}{_how_to_load(meta, llm)}")
    # a budget's caches into the full cache's, or back: llama.cpp would refuse it. A file written before the caches
    # were recorded names none (not "the full cache"): llama.cpp checks its caches as it reads
    if "cache_cells" in meta and (cells is None) != (kv is None):
        how = "without a budget (the full cache)" if cells is None else "in caches laid out for a budget"
        raise AhakvError(f"{path} was saved {how}{_how_to_load(meta, llm)}")
    if cells is not None and kv is not None and not kv.takes_sizes(cells):
        raise AhakvError(
            f"{path} was saved in KV caches of other sizes ({min(cells)}-{max(cells)} cells){_how_to_load(meta, llm)}"
        )
    state.kv_cache_cells = cells  # the caches the drop-in gives the state
    try:
        llm.load_state(state)
    except AhakvError:
        raise
    except (ValueError, RuntimeError) as exc:  # llama-cpp-python's (RuntimeError: llama.cpp refused it, no budget)
        raise AhakvError(f"{path}: {exc}") from None
    policy = meta.get("policy")  # (the caller shows a name of its policies only: never a crafted file's text)
    return messages, system, policy if isinstance(policy, str) else None


def _how_to_load(meta: dict, llm) -> str:
    """The options that lay the caches out as a saved chat's were: its budget, layout and K/V type, where they differ
    from this chat's (older files name none). Only what parses as a budget, names a layout or a type is repeated: a
    crafted file's text never reaches the error line."""
    kv, here = llm.kv_controller, kv_cache_kind(llm)
    try:
        saved = Budget.parse(meta.get("budget"))
    except (AhakvError, TypeError, ValueError):
        saved = None
    laid_out = meta.get("laid_out_for") if isinstance(meta.get("laid_out_for"), dict) else {}
    policy = laid_out.get("policy", meta.get("policy"))  # (files written before it was kept: the running policy)
    ours = llm.kv_laid_out_for
    options = []
    if saved is not None and (kv is None or as_option(saved) != as_option(kv.laid_out)):
        options.append(f"--budget {as_option(saved)}")
    n_ctx = laid_out.get("n_ctx")
    if saved is not None and saved.mode in ("ratio", "auto") and type(n_ctx) is int and n_ctx != ours["n_ctx"]:
        options.append(f"-c {n_ctx}")  # (an int only: a crafted file's text never reaches the error line)
    n_ubatch = laid_out.get("n_ubatch")  # (chat's --batch-size sets it; files written before it was kept: none)
    if kv is not None and type(n_ubatch) is int and n_ubatch != ours["n_ubatch"]:
        options.append(f"--batch-size {n_ubatch}")
    layout = meta.get("layer_budgets")
    if layout in LAYER_BUDGETS and kv is not None and layout != kv.config.layer_budgets:
        options.append(f"--layer-budgets {layout}")
    if "cache_cells" in meta and meta["cache_cells"] is None and kv is not None:  # the full cache's (--policy full is
        options.append("--budget none")  # refused beside a --budget given on the command line)
    elif _a_name(policy) and policy != "full" and policy != (ours["policy"] if kv is not None else "full"):
        options.append(f"--policy {policy}")
    kind = meta.get("kv_cache") if isinstance(meta.get("kv_cache"), dict) else {}
    stored = kind.get("type_k") if kind.get("type_k") in KV_CACHE_TYPES else None
    if stored is not None and stored != here["type_k"]:
        options.append(f"--kv-type {stored}")
    if not options:
        return ""  # (laid out as here, and still not these caches: nothing to suggest)
    in_bytes = saved is not None and saved.mode == "bytes"
    if in_bytes and stored is not None and f"--kv-type {stored}" not in options:
        # a byte budget opened afresh picks its own K/V type (--kv-type auto), maybe not the saved one: name it
        opened = f"open the chat with {' '.join(options)} --kv-type {stored}"
    else:
        opened = f"open the chat with {' '.join(options)}"
    # chat's /budget re-sizes the caches for bytes only, in their K/V type
    if in_bytes and options == [f"--budget {as_option(saved)}"]:
        return f": /budget {as_option(saved)} first, or {opened}"
    return f": {opened}"


def _a_name(text: object) -> bool:
    """Whether a file's policy field reads as a policy's name (a crafted file's text never reaches the error line;
    the registry is a layer above this module, and the command line refuses a name it does not know)."""
    return isinstance(text, str) and text.isascii() and text.isidentifier() and len(text) <= 32


def _is_saved_chat(path: Path) -> bool:
    """Whether ``path`` is a saved chat of any version (its metadata only)."""
    try:
        _read(path, state=False)
    except AhakvError:
        return False
    return True


def max_state_bytes(llm) -> int:
    """A bound on a state of ``llm``'s context: every layer's K and V in F32 at the context's cells, twice (a V head
    wider than K's), the logits of a batch, and 1 MiB of llama.cpp's headers. A larger state.bin is no state of this
    chat; unpacked unchecked, a zip of a few MB held gigabytes (memory the running conversation was then lost with)."""
    e = llm.kv_engine
    kv = 2 * (2 * 4 * e.n_layer * e.n_ctx * e.n_head_kv * e.head_dim)
    return kv + 4 * llm.n_vocab() * e.config.n_batch + 2**20


def _read(path: Path, state: bool = True, max_state: int | None = None) -> tuple[dict, bytes]:
    """A saved chat's metadata and state bytes, checked to be this version's (``state`` False: its metadata only, of
    any version); a state.bin larger than ``max_state`` is not read."""
    if path.exists() and not (path.is_file() or path.is_dir()):  # a device, a pipe: read to its end, or forever
        raise AhakvError(f"{path} is not a saved ahakv-local chat (not a regular file)")
    try:
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("chat.json")
            if info.file_size > MAX_META_BYTES:
                raise AhakvError(f"{path} is not a saved ahakv-local chat (its metadata is too large)")
            meta = json.loads(z.read(info).decode("utf-8"))
            if state and max_state is not None and z.getinfo("state.bin").file_size > max_state:
                raise AhakvError(f"{path} holds a cache state larger than this chat's context can ({max_state} bytes)")
            blob = z.read("state.bin") if state else b""
    except FileNotFoundError:
        raise AhakvError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise AhakvError(f"{path} is a directory") from None
    except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as exc:  # (zlib: data damaged on the disk)
        raise AhakvError(
            f"{path} is not a saved ahakv-local chat (damaged, or not one: {type(exc).__name__})"
        ) from None
    except OSError as exc:
        raise AhakvError(f"cannot read {path}: {exc.strerror or exc}") from None
    except AhakvError:  # (a ValueError: ours, above, say it already)
        raise
    except (ValueError, RuntimeError, NotImplementedError, RecursionError) as exc:
        # JSON that is not UTF-8 or not JSON, an integer of 5,000 digits, JSON nested past the recursion limit, an
        # encrypted entry, a compression zipfile does not read: none is one of ours (they fell to chat's catch-all,
        # "/load failed: RecursionError")
        raise AhakvError(f"{path} is not a saved ahakv-local chat ({exc.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AhakvError(f"{path} is not a saved ahakv-local chat")
    if state and meta.get("version") != VERSION:
        raise AhakvError(f"{path} was saved by another version of ahakv-local (format {meta.get('version')!r})")
    return meta, blob


def _check(meta: dict, llm, path: Path) -> tuple[list[dict], str | None]:
    saved, here = meta.get("model"), model_identity(llm)
    # (files saved before the weights' digest was kept are checked without it)
    if not isinstance(saved, dict) or any(
        saved.get(k, v) != v if k == "weights_sha256" else saved.get(k) != v for k, v in here.items()
    ):
        name = saved.get("name", "?") if isinstance(saved, dict) else "?"
        raise AhakvError(f"{path} was saved with another model ({name}), not {Path(llm.model_path).name}")
    messages, system = meta.get("messages"), meta.get("system")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
    ):
        raise AhakvError(f"{path} holds no valid conversation (messages of role and text)")
    if system is not None and not isinstance(system, str):
        raise AhakvError(f"{path} holds an invalid system prompt")
    n, ids, seed = meta.get("n_tokens"), meta.get("input_ids"), meta.get("seed")
    if not (isinstance(n, int) and isinstance(ids, list) and len(ids) == n and isinstance(seed, int)):
        raise AhakvError(f"{path} holds an invalid token list")
    if not all(isinstance(t, int) and 0 <= t < here["n_vocab"] for t in ids):
        raise AhakvError(f"{path} holds token ids outside this model's vocabulary")
    if meta.get("kv_cache") is not None and not isinstance(meta["kv_cache"], dict):
        raise AhakvError(f"{path} holds an invalid KV cache type")
    cells = meta.get("cache_cells")
    if cells is not None and not (isinstance(cells, list) and cells and all(type(c) is int and c > 0 for c in cells)):
        raise AhakvError(f"{path} holds invalid KV cache sizes")
    return [{"role": m["role"], "content": m["content"]} for m in messages], system
