"""The engine build: the pinned sdist, the patch series, the cache key, a clear error for a bad patch."""

from __future__ import annotations

import pytest

from ahakv_local import build, native
from ahakv_local.errors import AhakvError


@pytest.fixture(scope="module")
def sdist():
    return build.fetch_sdist()  # cached by the engine build that ran before the tests


def test_patches_apply_to_the_pinned_sdist(sdist, tmp_path):
    tree = build.unpack(sdist, tmp_path / "src")
    bp = build.plan()
    build.apply_patches(tree, bp.patches)
    header = (tree / "vendor/llama.cpp/include/llama.h").read_text()
    assert f"LLAMA_AHAKV_ABI_VERSION {native.ABI_VERSION}\n" in header  # the version the bindings check


def test_every_patch_says_what_and_why():
    for patch in build.plan().patches:
        text = patch.read_text()
        head = text[: text.index("\n---\n")]
        assert "What:" in head and "Why:" in head, patch.name
        assert "src/models/" not in text, f"{patch.name} touches a model file"


def test_a_patch_that_does_not_apply_names_itself_and_the_hunk(sdist, tmp_path):
    tree = build.unpack(sdist, tmp_path / "src")
    good = build.plan().patches[1]
    bad = tmp_path / "0002-broken.patch"
    # change one context line so the hunk no longer matches the vendored file
    context = "uint32_t llama_kv_cache::get_stream("
    bad.write_text(good.read_text().replace(context, context.replace("stream", "strean"), 1))
    with pytest.raises(AhakvError, match=r"patch 0002-broken.patch does not apply .*llama-kv-cache.cpp:\d+"):
        build.apply_patches(tree, (bad,))


def test_cache_key_follows_flags_and_patches(tmp_path, monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    cpu, cuda = build.plan(), build.plan(cuda=True)
    assert cpu.key != cuda.key and "-DGGML_CUDA=ON" in cuda.cmake_args
    assert build.plan(cmake_args="-DGGML_NATIVE=OFF").key != cpu.key
    assert build.plan().key == cpu.key  # deterministic
    copy = tmp_path / "patches"
    copy.mkdir()
    for p in cpu.patches:
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / cpu.patches[-1].name).write_text(cpu.patches[-1].read_text() + "\n")
    monkeypatch.setattr(build, "patch_dir", lambda: copy)
    assert build.plan().key != cpu.key


def test_rpc_adds_the_backend_flag_and_changes_the_key(monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    cpu, rpc = build.plan(), build.plan(rpc=True)
    assert "-DGGML_RPC=ON" in rpc.cmake_args and "-DGGML_RPC=ON" not in cpu.cmake_args
    assert rpc.key != cpu.key and rpc.patches == cpu.patches


def test_a_plain_build_keeps_an_installed_rpc_engine(monkeypatch):
    """RPC is a superset: `build` without --rpc must not rebuild over an RPC engine of the same flags,
    and `build --rpc` must not accept a plain one."""
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(build, "installed_key", lambda: build.plan(rpc=True).key)
    assert "with RPC" in build.ensure_engine()
    assert "up to date" in build.ensure_engine(rpc=True)
    monkeypatch.setattr(build, "installed_key", lambda: build.plan().key)
    assert "up to date" in build.ensure_engine()

    def would_build():  # --rpc over a plain engine goes on to the wheel cache; stopped there, nothing is built
        raise RuntimeError("would build")

    monkeypatch.setattr(build, "cache_dir", would_build)
    with pytest.raises(RuntimeError, match="would build"):
        build.ensure_engine(rpc=True)


def test_installed_engine_carries_its_key():
    # `make setup` builds with --rpc; a plain build is as good
    assert build.installed_key() in (build.plan().key, build.plan(rpc=True).key)
