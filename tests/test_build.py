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


def test_installed_engine_carries_its_key():
    assert build.installed_key() == build.plan().key
