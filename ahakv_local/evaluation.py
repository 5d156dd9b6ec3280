"""Streaming evaluation with a bounded cache (the StreamingLLM protocol, positions kept).

The first ``prefix`` tokens go through the controller's chunked prefill (their NLL is scored from the
chunk's logits); every later token is decoded alone, scored from the previous step's logits, and
the cache is brought back to the budget after every step.

``evaluate`` runs the full cache first and stores its next-token log-probabilities on disk, compactly
(``LogProbStore``, llama.cpp's KL-divergence base); then each (policy, budget) alone, comparing every
step with the stored rows (KL divergence and top-1 agreement). One engine is open at a time, so memory
does not grow with the number of configurations. With ``reference_dir`` the full cache's rows are kept there
(``Reference``) and a later evaluation of the same tokens, model, engine and schedule reads them instead of
running the full cache again: at 16K tokens on two CPU cores that run is 15-19 of a matrix's minutes each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .budget import Budget
from .controller import KVController
from .engine import Engine, EngineConfig, kv_type_config
from .session import BoundedSession, SessionSpec, open_session

Q_LEVELS = 65535  # uint16
FULL = SessionSpec()  # the reference: every position kept
# llama.cpp's own baseline (llama-server, llama-cli: swa_full off): every position kept, the sliding-window cache
# holding its window plus one chunk, padded to 256 cells, in the caches llama.cpp itself allocates (``_open``; laid
# out by budget.allocate, unpadded, the row stated 11.7 MiB at 1,024 tokens of Gemma 3 270M where llama.cpp
# allocates 14.25); llama.cpp reuses the cells of what left the window
TRIMMED = SessionSpec("trimmed", layer_budgets="natural")


@dataclass
class PplResult:
    policy: str
    budget: Budget
    tokens: int
    ppl: float
    max_cells: int
    seconds: float
    params: dict = field(default_factory=dict)
    kl: float = 0.0  # mean KL(full || this) per scored token, nats
    top1: float = 1.0  # fraction of steps whose argmax equals the full cache's
    kv_bytes: int = 0  # K+V bytes its engine allocated (every cache)
    mean_cells: float = 0.0  # live cells after each step past the prefix, averaged (an auto budget's mean)
    mean_share: float = 0.0  # live cells / tokens seen after each step past the prefix, averaged
    evict_every: int | None = None  # the eviction period it ran with (None: it kept every token)


def text_tokens(model: Path, text: str) -> list[int]:
    """``text`` as ``model``'s tokens (with BOS), read by a small throwaway context."""
    from .engine import Engine, EngineConfig

    with Engine(model, EngineConfig(n_ctx=256)) as e:
        return e.tokenize(text)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _log_softmax32(logits: np.ndarray) -> np.ndarray:
    """log_softmax of float32 rows in place (262K-entry rows: no float64 copies; the sums are
    float32-exact to ~1e-6 relative, far below the differences measured)."""
    logits -= logits.max(axis=1, keepdims=True)
    logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return logits


class LogProbStore:
    """Rows of log-probabilities in a temporary file, one record per scored token, as llama.cpp's
    ``perplexity --kl-divergence-base`` stores them: the row's minimum and step (float32), its argmax,
    and every entry quantized to uint16, ``log p ~= min + q * scale`` with ``scale = (max - min) / 65535``.
    Gemma 3 (262K tokens): 512 KiB a row, 0.5 GiB per 1,024 scored tokens, read back with explicit
    reads a chunk at a time (page cache, not the process's memory).

    Error: q is rounded to the nearest step (in float64, with the float32 scale rounded up so that no
    entry is clipped), so every entry is within ``scale / 2`` of its float32 value: |d log p| <= e =
    scale / 2 (Gemma 3 on GPL-3: rows span 29-61 nats, e = 2.2e-4 to 4.7e-4). For KL(p || q) = sum p log p
    - sum p log q computed with p' = p exp(d): KL' - KL = sum p (exp(d) - 1)(log p - log q) + sum p exp(d) d,
    so |KL' - KL| <= (exp(e) - 1) E_p|log p - log q| + e exp(e) ~ e (1 + E_p|log p/q|) per token, at worst;
    the rounding errors are unbiased and mostly cancel (tests/test_evaluation.py compares with the exact KL of Gemma
    3's rows), and ``compare`` makes each stored row a distribution again, so that a row equal to the reference reads
    within e^2 / 2 of 0. The argmax is stored exactly, so top-1 is exact.
    """

    def __init__(self, n_vocab: int, directory: str | Path | None = None, file: BinaryIO | None = None):
        """A temporary store in ``directory`` (unlinked already: gone when closed), or in ``file`` (a
        ``Reference``'s, read from or written at its start), which it then owns."""
        self.dtype = np.dtype([("min", "<f4"), ("scale", "<f4"), ("top", "<i4"), ("q", "<u2", (n_vocab,))])
        self.file = file if file is not None else tempfile.TemporaryFile(dir=directory)

    @staticmethod
    def quantize(logp: np.ndarray, out: np.void) -> None:
        """One float32 row into one record."""
        lo, hi = logp.min(), float(logp.max())
        scale = np.nextafter(np.float32((hi - float(lo)) / Q_LEVELS), np.float32(np.inf))
        out["min"], out["scale"], out["top"] = lo, scale, np.argmax(logp)
        out["q"] = np.rint((logp.astype(np.float64) - float(lo)) / float(scale))

    @staticmethod
    def dequantize(rec: np.void) -> np.ndarray:
        return float(rec["min"]) + rec["q"] * float(rec["scale"])  # float64

    def write(self, logp: np.ndarray) -> None:
        recs = np.empty(len(logp), self.dtype)
        for rec, row in zip(recs, logp, strict=True):
            self.quantize(row, rec)
        self.file.write(recs.tobytes())

    def rewind(self) -> None:
        self.file.flush()
        self.file.seek(0)

    def read(self, n: int) -> np.ndarray:
        recs = np.empty(n, self.dtype)
        if self.file.readinto(recs) != recs.nbytes:
            raise EOFError("the log-probability store has fewer rows than were scored")
        return recs

    def compare(self, recs: np.ndarray, logq: np.ndarray) -> tuple[list[float], list[bool]]:
        """KL(stored || logq) and top-1 agreement per row (row by row: float64 temporaries of one row)."""
        kl, top1 = [], []
        for rec, lq in zip(recs, logq, strict=True):
            lp32 = self.dequantize(rec).astype(np.float32)
            p = np.exp(lp32).astype(np.float64)  # 2x faster; p to 6e-8 relative
            # the stored row made a distribution again (its rounding moved its sum off 1 by up to e): KL(p' || p) of a
            # run equal to the reference is then second order, at most e^2 / 2 (Hoeffding's lemma for p' = p e^d /
            # E_p e^d, |d| <= e), plus float32 exp's rounding of p (2^-23 at most); unnormalized it was first order (a
            # run whose logits are bit-identical to the reference's, eval ppl's trimmed row, read above 0 by it)
            total = p.sum()
            p /= total
            lp = lp32.astype(np.float64) - np.log(total)  # (of the float32 row p is the exp of, to match it)
            # sum p log p - sum p log q; below 0 only by float rounding: at 0 there (a NaN row stays NaN: a broken run
            # is not read as a perfect one)
            d = float(p @ (lp - lq))
            kl.append(0.0 if d < 0 else d)
            top1.append(bool(np.argmax(lq) == rec["top"]))
        return kl, top1

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class Reference:
    """The full cache's rows of one evaluation, kept in ``directory`` for the next: ``KEY.logp`` (the
    ``LogProbStore``'s records) and ``KEY.json`` (what was measured and how), ``KEY`` a digest of everything the
    rows depend on: the model file's bytes, the engine build (``build.installed_key``), the tokens, the prefix,
    the chunk, the step, the CPU threads and the RPC workers. A row is the same only where all of these are
    (ggml's kernels differ between batch sizes, and may between thread counts). The rows go to ``KEY.logp.PID.part``
    and are renamed when the run is complete, so a stopped run leaves nothing that a later one would read, and two
    runs of the same evaluation at once each write their own (the same rows: the later rename wins)."""

    logp: Path
    meta: Path

    @classmethod
    def at(
        cls,
        directory: str | Path,
        model: Path,
        tokens: list[int],
        prefix: int,
        n_ubatch: int,
        step: int,
        rpc_servers: tuple[str, ...],
        n_threads: int | None,
    ) -> Reference:
        """The reference of ``evaluate``'s arguments in ``directory`` (made if missing), complete or not."""
        from .build import installed_key
        from .engine import default_threads
        from .models import file_sha256

        h = hashlib.sha256(bytes.fromhex(file_sha256(model)))
        how = [installed_key(), prefix, n_ubatch, step, list(rpc_servers), n_threads or default_threads()]
        h.update(json.dumps(how).encode())
        h.update(np.asarray(tokens, dtype=np.int32).tobytes())
        key = h.hexdigest()[:32]
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory / f"{key}.logp", directory / f"{key}.json")

    def load(self) -> tuple[LogProbStore, PplResult] | None:
        """The stored rows and the full cache's result, or None if this evaluation was never completed here."""
        if not (self.logp.exists() and self.meta.exists()):
            return None
        meta = json.loads(self.meta.read_text())
        result = PplResult(FULL.policy, FULL.budget, **meta["result"])
        return LogProbStore(meta["n_vocab"], file=open(self.logp, "rb")), result  # the store owns it

    def _part(self, pid: int) -> Path:
        return self.logp.with_name(f"{self.logp.name}.{pid}.part")

    def create(self, n_vocab: int) -> LogProbStore:
        """An empty store for this process's full run (the rows a stopped run of this evaluation left go first)."""
        for part in self.logp.parent.glob(f"{self.logp.name}.*.part"):
            pid = part.name.split(".")[-2]
            if pid.isdigit() and not _alive(int(pid)):
                part.unlink(missing_ok=True)
        return LogProbStore(n_vocab, file=open(self._part(os.getpid()), "w+b"))

    def complete(self, store: LogProbStore, result: PplResult) -> None:
        """The full run is done: its rows take their final name, then its result is written beside them."""
        store.file.flush()
        os.replace(self._part(os.getpid()), self.logp)  # the open file follows the rename
        keep = ("tokens", "ppl", "max_cells", "seconds", "kv_bytes", "mean_cells", "mean_share")
        meta = {"n_vocab": store.dtype["q"].shape[0], "result": {k: getattr(result, k) for k in keep}}
        self.meta.write_text(json.dumps(meta))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True


@dataclass
class _Run:
    """One configuration being evaluated: its session and running sums."""

    session: BoundedSession
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    peak: int = 0
    seconds: float = 0.0
    kv_bytes: int = 0
    held: list[tuple[int, int]] = field(default_factory=list)  # (live cells, tokens seen) after each step

    def __post_init__(self) -> None:
        self.kv_bytes = self.session.engine.kv_bytes()

    @property
    def ctl(self) -> KVController:
        return self.session.controller

    def result(self, n_tokens: int) -> PplResult:
        spec = self.session.spec
        return PplResult(
            spec.policy,
            spec.budget,
            n_tokens,
            float(np.exp(np.mean(self.nll))),
            self.peak,
            self.seconds,
            dict(spec.params),
            float(np.mean(self.kl)) if self.kl else 0.0,
            float(np.mean(self.top1)) if self.top1 else 1.0,
            self.kv_bytes,
            float(np.mean([c for c, _ in self.held])) if self.held else 0.0,
            float(np.mean([c / n for c, n in self.held])) if self.held else 0.0,
            self.ctl.config.evict_every if self.ctl is not None and spec.budget.evicts else None,
        )


def _open(
    model: Path,
    n_tokens: int,
    spec: SessionSpec,
    n_ubatch: int,
    step: int = 1,
    rpc_servers: tuple[str, ...] = (),
    n_threads: int | None = None,
) -> _Run:
    if spec.policy == FULL.policy:
        # every position kept, in llama.cpp's own caches at this ubatch: plain llama-cpp-python's (the reference, and
        # any other full row, in its K/V type: a quantized type's floor) or its tools' (TRIMMED: the sliding cache
        # trimmed). A cache sized exactly to a text of 300 tokens attends over 300 cells where llama.cpp's padded one
        # takes 320, which Gemma 3's Q4_K kernels round otherwise
        kv_type = spec.on_model(model, n_ubatch, n_tokens).kv_type
        config = EngineConfig(
            n_ctx=n_tokens, n_batch=n_ubatch, n_ubatch=n_ubatch, swa_full=spec != TRIMMED, rpc_servers=rpc_servers,
            n_threads=n_threads, **kv_type_config(kv_type),
        )  # fmt: skip
        return _Run(BoundedSession(_stepped(spec, step), Engine(model, config), n_tokens))
    spec = _stepped(spec, step)
    return _Run(open_session(model, spec, n_tokens, n_ubatch, rpc_servers=rpc_servers, n_threads=n_threads))


def check_floors(model: Path, n_tokens: int, specs: list[SessionSpec], n_ubatch: int = 64, step: int = 1) -> None:
    """Refuse a spec whose budget its run would refuse when it opens, before the first run: a matrix of runs must
    not fail after minutes of others."""
    for spec in specs:
        _stepped(spec, step).check_floor_on(model, n_ubatch, n_tokens)


def _stepped(spec: SessionSpec, step: int) -> SessionSpec:
    """The spec a run reads ``step`` tokens at a time with. Token by token: the spec's schedule (the product's by
    default); in steps of several tokens, an eviction after each that leaves room for the next, so no step ever
    holds more than the budget."""
    return replace(spec, evict_every=step, observe_steps=1) if step > 1 else spec


def _nll(logp: np.ndarray, targets: list[int]) -> list[float]:
    return (-logp[np.arange(len(targets)), targets]).astype(np.float64).tolist()


def _stream(run: _Run, tokens: list[int], prefix: int, step: int) -> Iterator[tuple[int, np.ndarray]]:
    """Decode ``tokens`` through the run's controller (the prefix in n_ubatch chunks, then ``step`` at a
    time: token by token through ``KVController.step`` or one decode call per step, the cache brought back
    to the budget after each); yield (a, logp): float32 log-softmax rows predicting tokens[a : a + len]."""
    n_ubatch = run.session.engine.config.n_ubatch
    spans = [(a, min(a + n_ubatch, prefix)) for a in range(0, prefix, n_ubatch)]
    spans += [(a, min(a + step, len(tokens))) for a in range(prefix, len(tokens), step)]
    last: np.ndarray | None = None
    for a, b in spans:
        t0 = time.perf_counter()
        if a >= prefix and step == 1:
            rows = run.ctl.step(tokens[a])[None]
        else:
            rows = run.ctl.prefill(tokens[a:b], all_logits=True, chunk=n_ubatch if a < prefix else step)
        run.seconds += time.perf_counter() - t0
        run.peak = max(run.peak, run.ctl.stats.peak_cells)  # (live after the call: the cache taken back already)
        if a >= prefix:
            run.held.append((run.ctl.live.size, b))
        # the logits that predicted this chunk: the previous call's last row, then this call's
        logp, first = (rows[:-1], a + 1) if last is None else (np.concatenate([last[None], rows[:-1]]), a)
        last = rows[-1].copy()
        yield first, _log_softmax32(logp)


def evaluate(
    model: Path,
    tokens: list[int],
    specs: list[SessionSpec],
    prefix: int = 128,
    n_ubatch: int = 64,
    step: int = 1,
    progress: Callable[[int, int], None] = lambda done, total: None,
    store_dir: str | Path | None = None,
    rpc_servers: tuple[str, ...] = (),
    n_threads: int | None = None,
    on_result: Callable[[str, PplResult], None] = lambda label, result: None,
    reference_dir: str | Path | None = None,
) -> dict[str, PplResult]:
    """Streaming perplexity, KL from the full cache and top-1 agreement for each spec, by its label, plus
    the full cache itself under the label "full".

    After the prefix, tokens go in ``step`` at a time (1: token by token through ``KVController.step``;
    more: one decode call per step, every row scored, the cache brought back to the budget after
    each, so it never holds more than budget + 1 cells: the newest token's). The full cache runs first and leaves its
    rows in a ``LogProbStore`` (a temporary file in ``store_dir``, default the system's); then each
    configuration runs alone, and its engine is closed before the next opens. ``progress`` counts
    tokens over all runs: (done, len(tokens) * (len(specs) + 1)). ``rpc_servers``: llama.cpp RPC workers
    that hold the layers of every run; ``n_threads``: the engines' CPU threads (None: AHAKV_THREADS, else
    every core); ``on_result``: called with each run's label and result as soon as it is done (the full cache's
    first), so that a caller can keep what a long matrix measured so far; ``reference_dir``: keep the full cache's
    rows there, or read them from there if this evaluation's were kept before (``Reference``; its result is the one
    stored, seconds included)."""
    if not 1 <= step <= n_ubatch:
        raise ValueError(f"step must be between 1 and n_ubatch ({n_ubatch})")
    labels = [spec.label for spec in specs]
    if FULL.label in labels or len(set(labels)) != len(labels):
        raise ValueError(f"configuration labels must be unique and not {FULL.label!r}: {labels}")
    if not 1 <= prefix < len(tokens) - 1:  # (nothing to score: "need at least one array to concatenate")
        raise ValueError(f"prefix must be from 1 to two tokens short of the {len(tokens)} tokens, not {prefix}")
    check_floors(model, len(tokens), specs, n_ubatch, step)
    runs = [FULL, *specs]
    total = len(tokens) * len(runs)
    results: dict[str, PplResult] = {}
    store: LogProbStore | None = None
    reference = None
    if reference_dir is not None and specs:
        reference = Reference.at(reference_dir, model, tokens, prefix, n_ubatch, step, rpc_servers, n_threads)
        if (kept := reference.load()) is not None:
            store, results[FULL.label] = kept
            on_result(FULL.label, results[FULL.label])
            runs = runs[1:]
    try:
        for spec in runs:
            is_full = spec is FULL
            run = _open(model, len(tokens), spec, n_ubatch, step, rpc_servers, n_threads)
            try:
                if is_full and specs:
                    n_vocab = run.session.engine.n_vocab
                    store = reference.create(n_vocab) if reference else LogProbStore(n_vocab, store_dir)
                for a, logp in _stream(run, tokens, prefix, step):
                    run.nll += _nll(logp, tokens[a : a + len(logp)])
                    if store is not None and a >= prefix:  # the steps after the prefix are compared
                        if is_full:
                            store.write(logp)
                        else:
                            kl, top1 = store.compare(store.read(len(logp)), logp)
                            run.kl += kl
                            run.top1 += top1
                    progress(len(results) * len(tokens) + a + len(logp), total)
            finally:
                run.session.close()
            results[spec.label] = run.result(len(tokens))
            if is_full and reference is not None:
                reference.complete(store, results[spec.label])
            on_result(spec.label, results[spec.label])
            if store is not None:
                store.rewind()
        return results
    finally:
        if store is not None:
            store.close()


def streaming_perplexity(
    model: Path, tokens: list[int], spec: SessionSpec = FULL, prefix: int = 128, n_ubatch: int = 64
) -> PplResult:
    """One configuration alone (no reference run): perplexity and the peak cell count."""
    run = _open(model, len(tokens), spec, n_ubatch)
    try:
        for a, logp in _stream(run, tokens, prefix, 1):
            run.nll += _nll(logp, tokens[a : a + len(logp)])
        return run.result(len(tokens))
    finally:
        run.session.close()
