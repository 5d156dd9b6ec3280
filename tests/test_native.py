"""The Python side refuses an engine without the ahakv API, or with another ABI, with a clear message;
the native eviction reports its error codes."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import engine_libs
import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib
import numpy as np
import pytest

from ahakv_local import native
from ahakv_local.budget import Budget
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError, EngineNotPatched
from ahakv_local.native import TapFlag

import device
from numerics import F32

pytestmark = pytest.mark.device


@pytest.fixture
def fresh_binding(monkeypatch):
    native.lib.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    native.lib.cache_clear()


def test_library_without_the_api_is_refused(fresh_binding):
    # a real shared library of the same build that has no llama_ahakv_* symbols
    other = engine_libs.load("ggml-base")
    fresh_binding.setattr(llama_cpp_lib, "_lib", other)
    with pytest.raises(EngineNotPatched, match=r"not patched for ahakv-local; run `ahakv-local build`"):
        native.lib()


def test_other_abi_version_is_refused(fresh_binding):
    real = llama_cpp_lib._lib

    class OtherAbi:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def llama_ahakv_abi_version():
            return native.ABI_VERSION + 1

    fresh_binding.setattr(llama_cpp_lib, "_lib", OtherAbi())
    with pytest.raises(EngineNotPatched, match=f"ABI {native.ABI_VERSION + 1}.*needs {native.ABI_VERSION}"):
        native.lib()


def test_the_patched_engine_is_accepted():
    native.lib.cache_clear()
    assert native.lib().abi_version() == native.ABI_VERSION


def test_native_evict_error_codes(fixture_model):
    lib = native.lib()
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_gpu_layers=device.N_GPU_LAYERS)) as e:
        e.decode(list(range(3, 40)))

        def evict(positions, seq=0):
            arr = np.asarray(positions, dtype=np.int32)
            return lib.evict(e.ctx, seq, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), arr.size)

        assert evict([5, 4]) == native.EvictError.NOT_SORTED
        assert evict([5, 5]) == native.EvictError.NOT_SORTED
        assert evict([2, e.n_past - 1]) == native.EvictError.NEWEST_POSITION
        assert evict([2], seq=7) == native.EvictError.BAD_ARGUMENT
        assert e.n_used() == 37  # every refusal removed nothing
        assert evict([2, 3]) == 2
        assert evict([2, 3, 4]) == 1  # positions no longer there are skipped
        assert e.n_used() == 34


def test_threads_default_to_ahakv_threads_then_every_core(fixture_model, monkeypatch):
    # what the context was created with, read back from llama.cpp (llama_n_threads), not from our config
    monkeypatch.setenv("AHAKV_THREADS", "1")
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        assert llama_cpp.llama_n_threads(e.ctx) == 1
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_threads=2)) as e:  # an explicit count wins
        assert llama_cpp.llama_n_threads(e.ctx) == 2
    monkeypatch.delenv("AHAKV_THREADS")
    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        assert llama_cpp.llama_n_threads(e.ctx) == (os.cpu_count() or 1)
    monkeypatch.setenv("AHAKV_THREADS", "two")
    for bad in ("two", "0", "513"):  # ggml takes at most 512
        monkeypatch.setenv("AHAKV_THREADS", bad)
        with pytest.raises(AhakvError, match="AHAKV_THREADS must be a whole number from 1 to 512"):
            Engine(fixture_model, EngineConfig(n_ctx=256))


def test_the_engine_s_native_calls_leave_nothing_for_the_collector(fixture_model):
    """ndarray.ctypes.data_as and np.ctypeslib.as_array cast, and every ctypes.cast leaves a reference cycle: the
    statistics, cell maps, evictions and logits of a served request left one each (a c_void_p and its dict) for
    the collector's rare full passes. The engine passes addresses instead; its values are those of the casts'."""
    import gc

    from ahakv_local.native import TapFlag

    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1)) as e:
        e.set_tap(TapFlag.ATTN | TapFlag.VNORM)
        e.decode(list(range(1, 40)))

        def calls() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            logits = e.decode([7])
            cells, attn = e.cell_positions(), e.stat_by_cell("attn", 0)
            e.evict([4, 5, 6])  # (the second time: already gone)
            return logits, cells, attn

        calls()  # (what the first calls build once, types and imports, is not the calls' garbage)
        gc.collect()
        gc.disable()
        try:
            logits, cells, attn = calls()
            left = gc.collect()
        finally:
            gc.enable()
        assert left == 0
        # the same numbers through the casts (a second code path)
        np.testing.assert_array_equal(logits, np.ctypeslib.as_array(llama_cpp.llama_get_logits(e.ctx), (e.n_vocab,)))
        again = np.empty_like(attn)
        e.native.get_attn(e.ctx, 0, again.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), again.size)
        np.testing.assert_array_equal(attn, again)
        assert sorted(cells[cells >= 0]) == [0, 1, 2, 3, *range(7, 41)]


def _run(script: str) -> subprocess.CompletedProcess:
    """A script in a process of its own: what failed here aborted the interpreter (SIGABRT), or took its stdout."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_a_context_smaller_than_the_batch_decodes_in_the_batches_llama_cpp_took(fixture_model):
    """llama.cpp caps a causal context's batch at n_ctx; the engine still cut decodes in batches of its own n_batch,
    and a decode of 240 tokens into 256 cells of n_ctx=200 aborted the process (GGML_ASSERT n_tokens_all <=
    n_batch). The engine takes llama.cpp's batch, and the logits equal a decode in batches of 64."""
    script = f"""
import numpy as np
from ahakv_local.engine import Engine, EngineConfig
tokens = [(7 * i) % 200 + 5 for i in range(240)]
with Engine({str(fixture_model)!r}, EngineConfig(n_ctx=200, n_threads=1)) as e:
    small = e.decode(tokens)
    print("batch", e.config.n_batch)
with Engine({str(fixture_model)!r}, EngineConfig(n_ctx=200, n_batch=64, n_threads=1)) as e:
    ref = e.decode(tokens)
print("diff", float(np.abs(small - ref).max()), "scale", float(np.abs(ref).max()))
"""
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batch 200" in proc.stdout, proc.stdout
    diff, scale = (float(w) for w in proc.stdout.split()[-3::2])
    # the same tokens in other batches, on the CPU: each run within FORWARD_RTOL's bound of the exact logits, whose
    # reductions here run over up to 240 positions (numerics.py assumes 128): 16 * 256 * F32 of the largest entry each
    assert diff <= 2 * 16 * 256 * F32 * scale, (diff, scale)


def test_a_decode_of_several_ubatches_after_an_eviction_reads_what_each_ubatch_sees(gemma3_fixture, license_text):
    """llama.cpp places every ubatch of a call on trial before it computes the first. In a sliding-window cache whose
    holes an eviction left were refilled (its cells no longer in order of position), the trial of the second ubatch
    purged positions the first still sees: the first ubatch's logits depended on tokens after it. Patch
    0025 restores every cell the trials purged, so rows 36..51 decoded alone and decoded with 52..67 behind them in one
    call are the same computation over the same cells: equal bits."""
    victims = [3, 5, 7, 13, 14, 15, 16, 21, 22, 23, 25, 29, 31]  # holes below the 24-position window's reach

    def rows(n_new: int, evict: bool) -> np.ndarray:
        config = EngineConfig(n_ctx=256, n_batch=32, n_ubatch=16, type_k="f32", type_v="f32", n_threads=1)
        with Engine(str(gemma3_fixture), config) as e:
            tokens = e.tokenize(license_text)[:68]
            e.decode(tokens[:36])
            if evict:
                e.evict(victims)
            return e.decode(tokens[36 : 36 + n_new], all_logits=True)[:16]

    for evict in (False, True):
        assert np.array_equal(rows(16, evict), rows(32, evict)), evict


def test_a_thread_count_past_ggml_s_most_is_refused_before_the_first_decode(fixture_model):
    """n_threads=100000 was taken by the engine and the drop-in, and the first decode aborted the process
    (std::bad_alloc); the command line and AHAKV_THREADS already refused it."""
    with pytest.raises(AhakvError, match=f"n_threads must be from 1 to {native.MAX_THREADS}, not 100000"):
        Engine(fixture_model, EngineConfig(n_ctx=256, n_threads=100000))
    from ahakv_local import Llama

    for budget in (None, 64):
        with pytest.raises(AhakvError, match=f"n_threads must be a whole number up to {native.MAX_THREADS}"):
            Llama(str(fixture_model), kv_budget=budget, n_threads=100000, verbose=False)


def test_loads_overlapping_in_threads_leave_stdout_and_the_load_hook_as_they_were(fixture_model):
    """llama-cpp-python's load with verbose=False points file descriptors 1 and 2 at /dev/null while it runs, and the
    drop-in's model_params_hook swaps a module attribute: two loads overlapping in threads left /dev/null as the
    process's stdout and stderr for good, and one instance's hook installed for every later load. Each load here is
    slowed so that the two overlap whatever the machine; ours take turns (upstream.LOADING)."""
    script = f"""
import os, sys, threading, time
from llama_cpp import _internals
from ahakv_local import Llama
real, init = _internals.LlamaModel, _internals.LlamaModel.__init__
def slow(self, *a, **k):
    time.sleep(0.5)
    return init(self, *a, **k)
_internals.LlamaModel.__init__ = slow
made = []
def load(budget):
    made.append(Llama({str(fixture_model)!r}, kv_budget=budget, n_threads=1, verbose=False))
threads = [threading.Thread(target=load, args=(b,)) for b in (None, 64)]
for t in threads:
    t.start()
    time.sleep(0.1)
for t in threads:
    t.join()
_internals.LlamaModel.__init__ = init
print("loaded", len(made), "hook", _internals.LlamaModel is real, file=sys.stderr)
print("fd1", os.readlink("/proc/self/fd/1") != "/dev/null", "fd2", os.readlink("/proc/self/fd/2") != "/dev/null")
"""
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loaded 2 hook True" in proc.stderr and "fd1 True fd2 True" in proc.stdout, (proc.stdout, proc.stderr)


def test_a_closed_engine_raises_a_value_error_not_an_attribute_error(fixture_model):
    e = Engine(fixture_model, EngineConfig(n_ctx=256, n_threads=1))
    e.decode([1, 2, 3])
    e.close()
    e.close()  # twice: nothing more to free
    for call in (lambda: e.decode([1]), lambda: e.tokenize("x"), e.kv_bytes, e.live_positions):
        with pytest.raises(ValueError, match="this engine was closed"):
            call()


def test_a_layer_or_statistic_the_model_has_not_is_named(fixture_model):
    """Layer 99 was "negative dimensions are not allowed" (llama.cpp's -1 cells), n_used(-3) returned -1, and an
    unknown statistic an AttributeError on an undefined native symbol."""
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_threads=1)) as e:
        e.decode([1, 2, 3])
        for call in (lambda: e.stat("attn", 99), lambda: e.n_used(-3), lambda: e.cell_positions(99)):
            with pytest.raises(ValueError, match=rf"layer -?\d+ is not one of the model's {e.n_layer}"):
                call()
        with pytest.raises(ValueError, match="kind must be one of attn, side, verr, vnorm, not 'bogus'"):
            e.stat("bogus", 0)


def test_the_engine_refuses_what_would_crash_it_in_one_named_error(fixture_model):
    """Each of these crashed the interpreter: a token id past the vocabulary detokenized (std::out_of_range), a view
    used after its engine was closed (it kept the freed context: a segfault), a negative n_batch (llama_batch_init).
    Each is a ValueError now. In a child process: the old code's crash would end the suite."""
    script = f"""
from ahakv_local.engine import Engine, EngineConfig
def said(f):
    try:
        f()
        print("ran")
    except ValueError as exc:
        print(type(exc).__name__, exc)
e = Engine({str(fixture_model)!r}, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_seq=2, n_threads=1))
print("vocabulary", e.n_vocab)
said(lambda: e.detokenize([e.n_vocab]))
v = e.view(1)
v.decode([1, 2, 3])
w = v.view(0)  # a view's view
e.close()
print("view closed:", v.closed, w.closed)
said(lambda: v.reset_stats())
said(lambda: w.reset_stats())
said(lambda: Engine({str(fixture_model)!r}, EngineConfig(n_batch=-5)))
said(lambda: EngineConfig(n_ubatch=0))
"""
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    n = int(lines.pop(0).split()[1])
    assert lines == [
        f"ValueError token id {n} is outside the model's vocabulary of {n} tokens",
        "view closed: True True",
        "ValueError this engine was closed: create a new one",
        "ValueError this engine was closed: create a new one",
        "ValueError n_batch must be a whole number of 1 or more, not -5",
        "ValueError n_ubatch must be a whole number of 1 or more, not 0",
    ]


def test_the_engine_refuses_what_would_leave_it_wrong_in_one_named_error(fixture_model):
    """Each of these was taken, silently wrong: a token id of 2**32 + 7 decoded as 7 (a batch's int32); positions
    given as floats, booleans or past int32 were cast and evicted others (9.99 evicted 5... 9, a mask evicted 0 and
    1); a position never decoded was refused as "the newest"; a rewind to a position whose predecessor was evicted was
    taken, and every decode after it failed in llama.cpp."""
    with Engine(str(fixture_model), EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)) as e:
        with pytest.raises(RuntimeError, match=rf"cannot decode: token id {2**32 + 7} is outside the model's vocab"):
            e.decode([2**32 + 7])
        with pytest.raises(RuntimeError, match=r"cannot decode: a token id is a whole number, not 1\.7"):
            e.decode([1.7])
        assert e.n_past == 0  # refused before anything was decoded
        e.decode(list(range(1, 21)))
        live = e.live_positions()
        for bad, said in (([9.99], "as whole numbers, not [9.99]"), (live == 12, "as whole numbers, not [False"),
                          (np.array([2**32 + 5]), f"decoded so far (0 to 19), not [{2**32 + 5}]"),
                          ([1, 2, -1, 25], "decoded so far (0 to 19), not [-1, 25]")):  # fmt: skip
            with pytest.raises(ValueError, match=rf"^evict takes positions {re.escape(said)}"):
                e.evict(bad)
        np.testing.assert_array_equal(e.live_positions(), live)  # nothing went
        assert e.evict(np.array([3, 4], dtype=np.uint64)) == 2  # unsigned whole numbers are positions
        assert EngineConfig(n_batch=np.int64(64)).n_batch == 64  # and numpy's integers are whole numbers
        e.evict([15, 16, 17])
        with pytest.raises(ValueError, match=r"cannot truncate to 17: position 16 was evicted .* holds, 14\)$"):
            e.truncate(17)
        e.truncate(15)  # after the newest held below the gap: the next token goes there
        e.decode([5])
        assert int(e.live_positions()[-1]) == 15 and e.n_past == 16
        # taken, to no effect or to NaN statistics: a window of -5 rows, a flag bit the tap has not, a NaN scale; a
        # statistic of another name failed on an undefined symbol
        for flags, window in ((TapFlag.ATTN, -5), (TapFlag(1024), 0)):
            with pytest.raises(ValueError, match=r"^set_tap takes TapFlag flags and a window of 0 or more rows"):
                e.set_tap(flags, window)
        with pytest.raises(ValueError, match=r"^the side pass's scale is a finite number, not nan$"):
            e.set_side_scale(float("nan"))
        with pytest.raises(ValueError, match=r"^kind must be one of attn, side, verr, vnorm, not 'foo'$"):
            e.stats("foo")
    with pytest.raises(AhakvError, match=r"^a budget's mode is one of cells, ratio, auto, none, bytes, not 'bogus'$"):
        Budget("bogus", 3)


def test_a_position_past_the_trained_context_is_named_as_it_is():
    """The refusal named the position one past the one refused ("position 257 is past the model's trained context 256"
    for position 256, the 257th)."""
    from ahakv_local.engine import decode_batch
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(n_ctx_train=64))
    with Engine(str(path), EngineConfig(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)) as e:
        e.decode(list(range(1, 61)))
        refused = r"^position 64 is past the model's trained context \(positions 0 to 63\)$"
        with pytest.raises(AhakvError, match=refused):
            e.decode(list(range(1, 6)))  # positions 60 to 64
        e.decode([1, 2, 3, 4])  # positions 60 to 63: the last there is
        with pytest.raises(AhakvError, match=refused):
            decode_batch([e], [5])
