"""KV memory per cache read from the GGUF header (``ModelInfo.caches``) against what llama.cpp itself allocates
(``Engine.kv_bytes(cache)``: llama_kv_cache's own size_k_bytes + size_v_bytes, and its cell counts), for
swa_full on (llama-cpp-python's default) and off (llama.cpp's llama-server and llama-cli). Exact: both are
whole numbers of bytes."""

from __future__ import annotations

import pytest

from ahakv_local.engine import Engine, EngineConfig, LayerCache
from ahakv_local.errors import AhakvError
from ahakv_local.fixture import ARCHITECTURES, SLIDING, FixtureSpec
from ahakv_local.info import _swa_layers, read_info, row_bytes
from ahakv_local.models import fixture_path

MIB = 2**20


def engine_caches(model, n_ctx: int, swa_full: bool, n_ubatch: int, **kw) -> list[tuple[str, int, int, int]]:
    """(name, layers, cells, bytes) of every cache the engine allocated."""
    config = EngineConfig(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, swa_full=swa_full, **kw)
    with Engine(model, config) as e:
        names = {LayerCache.BASE: "full", LayerCache.SLIDING: "sliding"}
        return [(names[c], e.layer_cache.count(c), e.cache_cells(c), e.kv_bytes(c)) for c in e.caches]


def header_caches(model, n_ctx: int, swa_full: bool, n_ubatch: int, **kw) -> list[tuple[str, int, int, int]]:
    return [(c.name, c.n_layer, c.cells, c.bytes) for c in read_info(model).caches(n_ctx, swa_full, n_ubatch, **kw)]


@pytest.mark.parametrize("n_ctx", [2048, 4096, 32768])
@pytest.mark.parametrize("swa_full", [True, False])
def test_gemma_caches_equal_the_engines_allocation(gemma_model, n_ctx, swa_full):
    got = header_caches(gemma_model, n_ctx, swa_full, 512)
    assert got == engine_caches(gemma_model, n_ctx, swa_full, 512)
    assert [(name, layers) for name, layers, _, _ in got] == [("full", 3), ("sliding", 15)]


def test_gemma_known_answers(gemma_model):
    """The measured table of issue 11 (MiB with swa_full on / off, llama.cpp's default n_ubatch of 512)."""
    info = read_info(gemma_model)
    table = {}
    for n in (2048, 4096, 8192, 16384, 32768):
        table[n] = tuple(sum(c.bytes for c in info.caches(n, swa_full)) / MIB for swa_full in (True, False))
    assert table == {2048: (36, 21), 4096: (72, 27), 8192: (144, 39), 16384: (288, 63), 32768: (576, 111)}
    # the trimmed sliding cache: window 512 + one ubatch, padded to 256 cells
    assert [c.cells for c in info.caches(32768, False, 64)] == [32768, 768]
    assert [c.cells for c in info.caches(300, False, 512)] == [512, 512]  # never more than the full cache


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("n_ctx, n_ubatch", [(300, 64), (1024, 32)])
@pytest.mark.parametrize("swa_full", [True, False])
def test_fixture_caches_equal_the_engines_allocation(arch, n_ctx, n_ubatch, swa_full):
    """Every architecture: one cache, or (gemma2, gemma3, cohere2: window 24, pattern 2) a sliding one too."""
    model = fixture_path(FixtureSpec(arch=arch))
    got = header_caches(model, n_ctx, swa_full, n_ubatch)
    assert got == engine_caches(model, n_ctx, swa_full, n_ubatch)
    assert len(got) == (2 if arch in SLIDING else 1)


@pytest.mark.parametrize("kv_type", ["q8_0", "f32"])
def test_other_kv_types_equal_the_engines_allocation(gemma_model, kv_type):
    """ggml's row sizes: q8_0 is 34 bytes per 32 values (a 256-wide head: 272 bytes, against 512 in F16)."""
    kw = dict(type_k=kv_type, type_v=kv_type)
    got = header_caches(gemma_model, 4096, False, 512, **kw)
    assert got == engine_caches(gemma_model, 4096, False, 512, flash_attn=True, **kw)
    f16 = header_caches(gemma_model, 4096, False, 512)
    ratio = {"q8_0": 34 / 64, "f32": 2.0}[kv_type]
    assert [b for *_, b in got] == [b * ratio for *_, b in f16]


def test_row_bytes_and_bad_types():
    assert (row_bytes("f16", 256), row_bytes("q8_0", 256), row_bytes("q4_0", 64)) == (512, 272, 36)
    with pytest.raises(AhakvError, match="KV type must be one of"):
        row_bytes("q3_k", 256)
    with pytest.raises(AhakvError, match="blocks of 32"):
        row_bytes("q8_0", 48)


def test_sliding_layer_patterns():
    """llama_hparams::set_swa_pattern: every n-th layer (counting from 1) attends fully; 0: all slide; or flags."""
    gemma3 = _swa_layers(None, 6, 18)  # gemma3's default
    assert sum(gemma3) == 15 and [il for il, s in enumerate(gemma3) if not s] == [5, 11, 17]
    assert _swa_layers(None, 0, 18) == (False,) * 18  # no pattern, no sliding layer
    assert _swa_layers(2, 6, 2) == (True, False)  # the GGUF's period wins
    assert _swa_layers(0, 6, 5) == (True,) * 5
    assert _swa_layers((True, False, True, True), 6, 4) == (True, False, True, True)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_header_layout_equals_the_engines(arch, gemma_model):
    """The layout every budget is laid out on (the header's: ``session.model_layout``, which loaded the model for it
    before) is the engine's: bytes per cell of each kind for each K/V type the heads can hold, window and which
    layers slide (a per-layer layout needs the last)."""
    models = [fixture_path(FixtureSpec(arch=arch)), fixture_path(FixtureSpec(arch=arch, n_layer=6, n_embd=128))]
    for model in models + ([gemma_model] if arch == "gemma3" else []):
        info = read_info(model)
        for kv_type in [t for t in ("f16", "q8_0", "q5_0", "q4_0") if info.stores(t)]:
            types = {} if kv_type == "f16" else {"type_k": kv_type, "type_v": kv_type, "flash_attn": True}
            with Engine(model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64, swa_full=False, **types)) as e:
                assert info.cache_layout(kv_type) == e.cache_layout(), (model.name, kv_type)


def test_info_reads_only_the_header(tmp_path):
    """A partly downloaded GGUF, its header whole: info states its caches and a budget's allocation (it loaded the
    model to lay the budget out, and refused the file as one llama.cpp cannot read)."""
    import subprocess
    import sys

    whole = fixture_path(FixtureSpec(arch="gemma3", n_layer=6, n_embd=128))
    part = tmp_path / "partial.gguf"
    part.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "-m", "ahakv_local", "info", str(part), "--budget", "256"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "KV at budget   256 cells" in proc.stdout
    # and says that no command can load it (generate failed in llama.cpp: "Failed to load model from file")
    assert proc.stderr.startswith(f"note: {part} is cut short: its tensors need ")


def test_info_command_prints_both_layouts(gemma_model):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "info", str(gemma_model), "-c", "32768"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "layers         18 (3 full attention, 15 sliding window)" in proc.stdout
    assert "KV swa_full=True  576.0 MiB = full 96.0 MiB (32,768 cells x 3 layers) + sliding 480.0 MiB" in proc.stdout
    assert "KV swa_full=False 111.0 MiB = full 96.0 MiB (32,768 cells x 3 layers) + sliding 15.0 MiB" in proc.stdout


@pytest.mark.parametrize("swa_full", [True, False])
def test_used_bytes_count_each_caches_held_cells_at_its_own_price(swa_full):
    """``Engine.kv_bytes_used`` (bench's long run, the groups' used bytes) against the cell maps and the header:
    each cache's live positions x its bytes per cell. Trimmed (window 24: 256 cells, reused once full), the sliding
    cache holds fewer positions than the full one after 300 tokens, so one price for all cells would be wrong."""
    model = fixture_path(FixtureSpec(arch="gemma3"))
    prices = {c.name: c.bytes // c.cells for c in read_info(model).caches(512, swa_full, 32)}
    config = EngineConfig(n_ctx=512, n_batch=32, n_ubatch=32, swa_full=swa_full)
    with Engine(model, config) as e:
        e.decode(list(range(10, 310)))
        names = {LayerCache.BASE: "full", LayerCache.SLIDING: "sliding"}
        live = {names[c]: len(e.live_positions(e.layer_cache.index(c))) for c in e.caches}
        assert live["full"] == 300 and (live["sliding"] < 300) == (not swa_full)
        assert e.kv_bytes_used() == sum(live[n] * prices[n] for n in live)
        assert e.kv_bytes_used(LayerCache.SLIDING) == live["sliding"] * prices["sliding"]


def test_info_without_a_budget_states_the_full_caches_in_the_kv_type_asked(gemma_model):
    """`info --budget none --kv-type q8_0` printed F16 caches, where `generate --budget none --kv-type q8_0` allocates
    q8_0 ones. The reference: what the engine allocates in q8_0 (llama-cpp-python's default, swa_full on)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "info", str(gemma_model), "-c", "4096", "--budget", "none",
         "--kv-type", "q8_0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    allocated = sum(b for *_, b in engine_caches(gemma_model, 4096, True, 512, type_k="q8_0", type_v="q8_0",
                                                  flash_attn=True))  # fmt: skip
    assert f"KV swa_full=True  {allocated / MIB:.1f} MiB" in proc.stdout, proc.stdout
    assert "at 4,096 positions, Q8_0:" in proc.stdout and "(Q8_0 K and V, all layers)" in proc.stdout
