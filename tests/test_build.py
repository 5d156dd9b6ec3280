"""The engine build: the pinned sdist, the patch series, the cache key, a clear error for a bad patch."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import zipfile

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
    cpu, cuda, vulkan = build.plan(), build.plan(cuda=True), build.plan(vulkan=True)
    assert cpu.key != cuda.key and "-DGGML_CUDA=ON" in cuda.cmake_args
    assert len({cpu.key, cuda.key, vulkan.key}) == 3 and "-DGGML_VULKAN=ON" in vulkan.cmake_args
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


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AMX is an x86 extension")
def test_a_compiler_that_refuses_the_amx_flag_builds_without_it(tmp_path, monkeypatch):
    """gcc before 11 knows no AMX and refuses -mno-amx-int8 (Debian 11, RHEL 8: the engine's build failed); such a
    compiler generates no AMX kernels, so the flag is left out for it. Stand-ins: a compiler refusing any -m flag it
    is given, and one taking it."""
    for name, code in (("old-cc", 1), ("new-cc", 0)):
        script = tmp_path / name
        script.write_text(f'#!/bin/sh\ncase "$*" in *-mno-amx-int8*) exit {code};; esac\nexit 0\n')
        script.chmod(0o755)
    build.compiler_takes.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "old-cc"))
    monkeypatch.setenv("CXX", str(tmp_path / "new-cc"))
    assert not build.leaves_out_amx() and not set(build.NO_AMX_CMAKE_ARGS) & set(build.plan().cmake_args)
    monkeypatch.setenv("CC", str(tmp_path / "new-cc"))
    assert build.leaves_out_amx() and set(build.NO_AMX_CMAKE_ARGS) <= set(build.plan().cmake_args)
    build.compiler_takes.cache_clear()


@pytest.mark.skipif(not build.leaves_out_amx(), reason="AMX is an x86 extension (gcc or clang)")
def test_the_x86_engine_leaves_out_ggml_s_amx_kernels():
    """ggml's AMX matrix product crashes on Sapphire Rapids with Q4_K weights (llama.cpp#20824): the plan asks
    the compiler to drop AMX-INT8, and the installed library says it has none (ggml's own system info, which reads
    the compiler's macro; on a CPU without AMX this holds trivially, on one with AMX it is the fix)."""
    assert set(build.NO_AMX_CMAKE_ARGS) <= set(build.plan().cmake_args)
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info or "AVX = 1" in info  # the line is ggml's CPU report (not an empty string)
    assert "AMX_INT8 = 1" not in info


def test_installed_engine_carries_its_key():
    # `make setup` builds with --rpc; a plain build is as good
    assert build.installed_key() in (build.plan().key, build.plan(rpc=True).key)


def test_a_vulkan_build_names_the_debian_packages_it_lacks_before_compiling(tmp_path, monkeypatch):
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(build, "INCLUDE_DIRS", (str(tmp_path / "include"),))
    monkeypatch.setattr(build, "fetch_sdist", lambda: pytest.fail("the build went on without its packages"))
    with pytest.raises(AhakvError, match=r"apt-get install libvulkan-dev glslc spirv-headers$"):
        build.ensure_engine(vulkan=True, force=True)
    # each file found takes its package off the list
    (tmp_path / "include/vulkan").mkdir(parents=True)
    (tmp_path / "include/vulkan/vulkan.hpp").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/glslc").write_text("#!/bin/sh\n")
    (tmp_path / "bin/glslc").chmod(0o755)
    assert build.missing_vulkan_packages() == ["spirv-headers"]
    (tmp_path / "include/spirv/unified1").mkdir(parents=True)
    (tmp_path / "include/spirv/unified1/spirv.hpp").write_text("")
    assert build.missing_vulkan_packages() == []


def test_build_vulkan_without_its_packages_is_a_one_line_error(tmp_path):
    # no glslc on an empty PATH: refused before anything is downloaded or compiled
    env = {**os.environ, "PATH": str(tmp_path)}
    env.pop("VULKAN_SDK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "build", "--vulkan", "--force"], capture_output=True, text=True, env=env
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert re.fullmatch(r"error: a Vulkan build needs .*: apt-get install( \S+)* glslc( \S+)*", lines[0]), lines[0]


def test_a_quoted_cmake_value_reaches_cmake_as_one_argument(tmp_path, monkeypatch):
    """scikit-build-core shell-splits CMAKE_ARGS (builder.py), so the flags are handed over shell-quoted: a
    -DCMAKE_C_FLAGS with two flags stayed one argument in the plan but reached CMake as two ("-march=haswell"
    alone). The compile is stopped at `run`, which records what it was given."""
    import shlex

    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    bp = build.plan(cmake_args='-DCMAKE_C_FLAGS="-mno-amx-int8 -march=haswell" -DGGML_RPC=ON')
    assert bp.cmake_args[-2:] == ("-DCMAKE_C_FLAGS=-mno-amx-int8 -march=haswell", "-DGGML_RPC=ON")
    seen = {}

    def record(cmd, cwd=None, env=None, log_file=None):
        seen["args"] = env["CMAKE_ARGS"]
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(build, "run", record)
    with pytest.raises(RuntimeError, match="stopped before compiling"):
        build.build_wheel(tmp_path / "src", tmp_path / "build", tmp_path / "dist", bp.cmake_args)
    assert tuple(shlex.split(seen["args"])) == bp.cmake_args
    # the build type goes to scikit-build-core's own setting (it drops CMAKE_BUILD_TYPE from CMAKE_ARGS: a Debug
    # request built Release under a key that said Debug)
    seen.clear()

    def record_cmd(cmd, cwd=None, env=None, log_file=None):
        seen["cmd"], seen["args"] = cmd, env["CMAKE_ARGS"]
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(build, "run", record_cmd)
    debug = build.plan(cmake_args="-DCMAKE_BUILD_TYPE=Debug -DGGML_RPC=ON")
    with pytest.raises(RuntimeError, match="stopped before compiling"):
        build.build_wheel(tmp_path / "src", tmp_path / "build", tmp_path / "dist", debug.cmake_args)
    assert "cmake.build-type=Debug" in seen["cmd"] and "CMAKE_BUILD_TYPE" not in seen["args"]
    assert "-DGGML_RPC=ON" in shlex.split(seen["args"])


def test_the_cache_key_is_the_flags_and_the_machine_a_build_compiles_for(monkeypatch):
    """The key's parts, in order; flags with spaces inside one argument do not read as two arguments (a CPU build
    whose C flags hold "-DGGML_CUDA=ON" had the CUDA build's key); a native build's key follows the CPU's
    instruction sets (a shared wheel cache handed an AVX-512 build to an AVX2 machine), one with GGML_NATIVE off
    does not; a native CUDA build without CMAKE_CUDA_ARCHITECTURES follows the GPUs (read once per process: a
    flaky nvidia-smi changed the key between the wheel's folder and the installed marker)."""
    assert build.cpu_features() is build.cpu_features() and build.cuda_architectures() is build.cuda_architectures()
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    special = build.plan(cmake_args="-DCMAKE_CUDA_ARCHITECTURES=80;86")
    parts = [
        build.SDIST_SHA256,
        special.patch_hash,
        " ".join(special.cmake_args),  # no spaces inside an argument: joined as before
        platform.machine(),
        sys.platform,
        f"py{sys.version_info.major}",
        build.host_fingerprint(special.cmake_args),
    ]
    assert special.key == hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    one = build.plan(cmake_args="'-DCMAKE_C_FLAGS=-O2 -DGGML_CUDA=ON'")
    two = build.plan(cmake_args="-DCMAKE_C_FLAGS=-O2 -DGGML_CUDA=ON")
    assert one.cmake_args != two.cmake_args and one.key != two.key and one.flags_key != two.flags_key

    monkeypatch.setattr(build, "cpu_features", lambda: "avx avx2 fma")
    monkeypatch.setattr(build, "cuda_architectures", lambda: "9.0")
    pinned_args = "-DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF"
    native, portable = build.plan().key, build.plan(cmake_args="-DGGML_NATIVE=OFF").key  # (keys are computed now)
    cuda, pinned = build.plan(cuda=True).key, build.plan(cuda=True, cmake_args=pinned_args).key
    cuda_portable = build.plan(cuda=True, cmake_args="-DGGML_NATIVE=OFF").key  # ggml-cuda's fixed list of archs
    monkeypatch.setattr(build, "cpu_features", lambda: "avx avx2 avx512f fma")
    assert build.plan().key != native and build.plan(cmake_args="-DGGML_NATIVE=OFF").key == portable
    monkeypatch.setattr(build, "cpu_features", lambda: "avx avx2 fma")
    monkeypatch.setattr(build, "cuda_architectures", lambda: "8.0")
    assert build.plan().key == native and build.plan(cuda=True).key != cuda
    assert build.plan(cuda=True, cmake_args=pinned_args).key == pinned
    assert build.plan(cuda=True, cmake_args="-DGGML_NATIVE=OFF").key == cuda_portable


def test_cpu_features_are_this_machine_s_instruction_sets():
    """Known answer on Linux: the ISA words of /proc/cpuinfo's first flags line (x86) or all of its Features
    (ARM), in order; nothing volatile such as the clock or a hypervisor flag."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = next(ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features"))
    words = line.split(":", 1)[1].split()
    features = build.cpu_features().split()
    assert features == sorted(features) and set(features) <= set(words) and "hypervisor" not in features
    if platform.machine() == "x86_64":
        assert ("avx2" in features) == ("avx2" in words) and ("sse2" in features) == ("sse2" in words)


def test_patches_apply_inside_another_git_repository(tmp_path):
    """A cache folder inside a git work tree (a dotfiles repository in $HOME, AHAKV_CACHE_DIR in a checkout): git
    read the patch's paths from that repository's root, skipped every file and exited 0, and the build compiled an
    unpatched tree. The tree is patched as anywhere else; a patch git skips is an error."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = tmp_path / "cache" / "work" / "src"
    (tree / "vendor").mkdir(parents=True)
    (tree / "vendor" / "a.txt").write_text("one\ntwo\n")
    patch = tmp_path / "0001-two.patch"
    patch.write_text(
        "What: x\nWhy: y\n---\n"
        "diff --git a/vendor/a.txt b/vendor/a.txt\n--- a/vendor/a.txt\n+++ b/vendor/a.txt\n"
        "@@ -1,2 +1,2 @@\n one\n-two\n+three\n"
    )
    build.apply_patches(tree, (patch,))
    assert (tree / "vendor" / "a.txt").read_text() == "one\nthree\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cmake-args", '-DFOO="bar'], "--cmake-args '-DFOO=\"bar': no closing quotation"),
        (["--cuda", "--metal"], "--cuda and --metal cannot be built together: pick the one this machine has"),
        (
            ["--cmake-args", "-DCMAKE_INSTALL_PREFIX=/opt/x"],
            "-DCMAKE_INSTALL_PREFIX cannot be set: the engine is installed as a wheel into this Python",
        ),
        # CMake took it for a source path, ignored it, and a CPU engine was cached and installed for the flag
        (
            ["--cmake-args", "-DGGML_NATIVE=OFF GGML_CUDA=ON"],
            "--cmake-args: 'GGML_CUDA=ON' is not a CMake option: -DGGML_CUDA=ON sets a variable",
        ),
    ],
)
def test_a_bad_build_request_is_one_line_before_anything_is_fetched(args, message, monkeypatch):
    from click.testing import CliRunner

    from ahakv_local.cli import main

    monkeypatch.setattr(build, "fetch_sdist", lambda: pytest.fail("went on to the download"))
    result = CliRunner().invoke(main, ["build", *args, "--force"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [f"error: {message}"], result.output


def test_a_cache_that_cannot_be_written_is_one_line_before_the_download(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ahakv_local.cli import main

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path / "afile" / "cache"))  # under a file: not a directory
    monkeypatch.setattr(build, "fetch_sdist", lambda: pytest.fail("went on to the download"))
    result = CliRunner().invoke(main, ["build", "--force"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: cannot write the engine cache {tmp_path / 'afile' / 'cache'}"), lines[0]
    assert "set AHAKV_CACHE_DIR to a writable folder" in lines[0]


def test_a_build_without_its_extra_is_one_line_before_the_download(tmp_path, monkeypatch):
    """Without scikit-build-core, pip's download of the sdist (its metadata read with --no-build-isolation) ended in
    a pip traceback; the missing extra is named first."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == "scikit_build_core" else real(m))
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "fetch_sdist", lambda: pytest.fail("went on to the download"))
    with pytest.raises(AhakvError, match=r"needs the 'build' extra .*pip install 'ahakv-local\[build\]'"):
        build.ensure_engine(force=True)


def test_an_environment_without_pip_is_told_how_to_get_it(monkeypatch):
    """A venv made without pip (`uv venv` makes them so) failed the build with pip's own "No module named pip" and no
    way on; the command that installs it is named, before anything runs."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == "pip" else real(m))
    monkeypatch.setattr(build.subprocess, "Popen", lambda *a, **k: pytest.fail("ran pip"))
    with pytest.raises(AhakvError, match=r"installed with pip, which this environment lacks: run `.* -m ensurepip`"):
        build.run([sys.executable, "-m", "pip", "install", "x"])


@pytest.mark.skipif(not build.leaves_out_amx(), reason="the AMX flag is added on x86-64 only")
def test_the_user_s_own_c_flags_keep_the_amx_kernels_out(monkeypatch):
    """-DCMAKE_C_FLAGS=-O3 replaced the plan's -mno-amx-int8 (CMake takes the last value) and brought back the kernels
    that crash on Sapphire Rapids; and the plan's own value made CMake ignore $CFLAGS and $CXXFLAGS."""
    for var in ("CMAKE_ARGS", "CFLAGS", "CXXFLAGS"):
        monkeypatch.delenv(var, raising=False)
    plain = build.plan()
    assert plain.cmake_args == build.BASE_CMAKE_ARGS + build.NO_AMX_CMAKE_ARGS  # unchanged: the cache key stays
    user = build.plan(cmake_args="-DCMAKE_C_FLAGS=-O3")
    assert build._last_value(user.cmake_args, "CMAKE_C_FLAGS") == "-O3 -mno-amx-int8"
    assert build._last_value(user.cmake_args, "CMAKE_CXX_FLAGS") == "-mno-amx-int8"
    monkeypatch.setenv("CFLAGS", "-O2 -g")
    monkeypatch.setenv("CXXFLAGS", "-O1")
    env = build.plan()
    assert build._last_value(env.cmake_args, "CMAKE_C_FLAGS") == "-O2 -g -mno-amx-int8"
    assert build._last_value(env.cmake_args, "CMAKE_CXX_FLAGS") == "-O1 -mno-amx-int8"
    assert len({plain.key, user.key, env.key}) == 3  # what the library is compiled with names its wheel
    # a value that already leaves AMX out is taken as it is (the plan a quoted value makes, tested above)
    kept = build.plan(cmake_args='-DCMAKE_C_FLAGS="-mno-amx-int8 -march=haswell"')
    assert build._last_value(kept.cmake_args, "CMAKE_C_FLAGS") == "-mno-amx-int8 -march=haswell"


def test_a_failed_command_names_its_first_error_and_its_log_fills_as_it_runs(tmp_path):
    """The error showed the last 15 lines of pip's output, a summary without the cause (the CMake Error 70 lines
    above); the log the build names was written only when the command ended."""
    log, script_file = tmp_path / "build.log", tmp_path / "compile.py"
    script_file.write_text(
        "import sys, time\n"
        "print('-- configuring', flush=True)\n"
        "time.sleep(0.2)\n"
        "seen = 'configuring' in open(sys.argv[1]).read()\n"
        "print('CMake Error at ggml/CMakeLists.txt:178 (target_link_libraries):')\n"
        "print('\\n'.join(f'noise {i}' for i in range(40)))\n"
        "sys.exit(1 if seen else 3)\n"
    )
    with pytest.raises(AhakvError) as err:
        build.run([sys.executable, str(script_file), str(log)], log_file=log)
    first = str(err.value).splitlines()[0]
    assert first.endswith(f"failed: CMake Error at ggml/CMakeLists.txt:178 (target_link_libraries): (full log: {log}):")
    assert "noise 39" in str(err.value) and log.read_text().count("noise") == 40
    build.run([sys.executable, "-c", "print('fine')"])  # a command that succeeds raises nothing, without a log too


def test_a_cmake_error_says_its_cause_not_only_where_it_is():
    """CMake writes "CMake Error at FILE:LINE (command):" and its message on the indented lines below: the error
    showed the header alone, and the cause was in the log only."""
    log = [
        "-- Configuring incomplete, errors occurred!",
        "CMake Error at CMakeLists.txt:3 (project):",
        "  The CMAKE_C_COMPILER:",
        "",
        "    /nonexistent/cc",
        "",
        "  is not a full path to an existing compiler tool.",
        "",
        "",
        "*** CMake configuration failed",
        "ERROR: Failed to build one or more wheels",
    ]
    assert build.first_error(log) == (
        "CMake Error at CMakeLists.txt:3 (project): The CMAKE_C_COMPILER: /nonexistent/cc is not a full path to an "
        "existing compiler tool."
    )
    compiler = ["In file included from ggml.c:1:", "ggml.c:5:3: error: expected identifier", "  5 | x"]
    assert build.first_error(compiler) == "ggml.c:5:3: error: expected identifier"
    assert build.first_error(["-- all good"]) is None


def test_cmake_booleans_are_read_as_cmake_reads_them():
    """A number is true where it is not zero: -DGGML_NATIVE=2 is a native build, whose cache key must name the CPU
    (it was read as off: a -march=native wheel keyed for any machine)."""
    for value, on in [("ON", True), ("y", True), ("2", True), ("0.5", True), ("0", False), ("OFF", False),
                      ("NO", False), ("", False), ("0.0", False)]:  # fmt: skip
        assert build._is_on((f"-DGGML_NATIVE={value}",), "GGML_NATIVE", not on) is on, value
    assert build.host_fingerprint(("-DGGML_NATIVE=2",)) == build.host_fingerprint(("-DGGML_NATIVE=ON",))


def test_a_wheel_pip_installed_elsewhere_is_not_marked_as_installed(tmp_path, monkeypatch):
    """With pip's target elsewhere ($PIP_TARGET), the marker went on the engine this Python imports, an older one:
    `build --rpc` then said "up to date" for an engine without RPC, whose commands asked for `build --rpc`."""
    wheel = _valid_wheel(tmp_path / "wheels" / f"{build.SDIST_NAME}-{build.SDIST_VERSION}-py3-none-any.whl")
    pkg = tmp_path / "site" / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / "libllama.so").write_text("an older library")
    monkeypatch.setattr(build, "run", lambda cmd, **kw: None)  # pip "installed" it, not where llama_cpp is found
    monkeypatch.setattr(build, "installed_package", lambda: pkg)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    with pytest.raises(AhakvError, match=rf"^pip installed {wheel.name} elsewhere than where this Python imports"):
        build.install(wheel, build.plan())
    assert not (pkg / build.MARKER).exists()
    (pkg / "lib" / "libllama.so").write_text("the library")  # the wheel's: pip installed it here
    build.install(wheel, build.plan())
    assert json.loads((pkg / build.MARKER).read_text())["key"] == build.plan().key


def test_a_terminated_build_stops_the_compile_it_started(tmp_path):
    """SIGTERM ended ahakv-local and left pip -> cmake -> ninja running, orphaned, writing into the cache."""
    import signal
    import time

    pid_file = tmp_path / "pid"
    code = (
        "from pathlib import Path; from ahakv_local import build; "
        f"build.run(['sh', '-c', 'sleep 300 & echo $! > {pid_file}; wait'], log_file=Path({str(tmp_path / 'log')!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, "the command never started"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0 and "KeyboardInterrupt" in proc.stderr.read()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(grandchild, signal.SIGKILL)
    pytest.fail("the command's own child outlived the build")


def _valid_wheel(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llama_cpp/__init__.py", "")
        z.writestr("llama_cpp/lib/libllama.so", "the library")
        dist = f"{build.SDIST_NAME}-{build.SDIST_VERSION}.dist-info"
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_a_damaged_cached_wheel_is_built_again_and_a_cached_rpc_wheel_serves_a_plain_build(tmp_path, monkeypatch):
    """A wheel cut short in the cache was installed again at every build (pip: "is invalid"), and nothing said how
    to get out; a plain build compiled from scratch beside a cached RPC wheel of the same flags, its superset."""
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(build, "installed_key", lambda: None)
    installed = []
    monkeypatch.setattr(build, "install", lambda wheel, bp: installed.append((wheel, bp.key)))

    class Compiling(Exception):
        pass

    def compile_(*a, **k):
        raise Compiling

    monkeypatch.setattr(build, "fetch_sdist", compile_)
    wheel_name = f"{build.SDIST_NAME}-{build.SDIST_VERSION}-py3-none-linux_x86_64.whl"
    damaged = tmp_path / "wheels" / build.plan().key / wheel_name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(Compiling):
        build.ensure_engine()
    assert not damaged.exists() and not installed
    # a whole zip that is no wheel (pip: ".dist-info directory not found", at every build) is built again too
    with zipfile.ZipFile(damaged, "w") as z:
        z.writestr("junk.txt", "x")
    with pytest.raises(Compiling):
        build.ensure_engine()
    assert not damaged.exists() and not installed
    superset = _valid_wheel(tmp_path / "wheels" / build.plan(rpc=True).key / wheel_name)
    assert build.ensure_engine().endswith("with RPC)")
    assert installed == [(superset, build.plan(rpc=True).key)]
    with pytest.raises(Compiling):  # --force builds anew
        build.ensure_engine(force=True)


def test_a_failed_build_leaves_no_sources_and_no_empty_wheel_folder(tmp_path, monkeypatch):
    """Each failed set of flags left its patched sources (~200 MB) and an empty wheel folder in the cache."""
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(build, "installed_key", lambda: None)
    monkeypatch.setattr(build, "fetch_sdist", lambda: tmp_path / "sdist.tar.gz")

    def unpack(sdist, dest):
        (dest / "tree").mkdir(parents=True)
        return dest / "tree"

    monkeypatch.setattr(build, "unpack", unpack)
    monkeypatch.setattr(build, "apply_patches", lambda tree, patches: None)

    def failing_compile(tree, build_dir, out, cmake_args):
        build_dir.mkdir(parents=True)
        raise AhakvError("the compile failed")

    monkeypatch.setattr(build, "build_wheel", failing_compile)
    bp = build.plan(cmake_args="-DGGML_NATIVE=OFF")
    with pytest.raises(AhakvError, match="the compile failed"):
        build.ensure_engine(cmake_args="-DGGML_NATIVE=OFF")
    work = tmp_path / "work" / bp.flags_key
    assert not (work / "src").exists() and (work / "build").is_dir()  # the build folder stays: a retry is quicker
    assert not (tmp_path / "wheels" / bp.key).exists()


def test_two_builds_of_the_same_flags_take_turns(tmp_path, capsys):
    """Two builds sharing a cache unpacked into one source folder: one deleted what the other compiled
    ("Directory not empty", a patch that "does not apply")."""
    import time

    work = tmp_path / "work" / "flags"
    work.mkdir(parents=True)
    code = (
        "import sys, time; from pathlib import Path; from ahakv_local import build\n"
        f"with build._build_lock(Path({str(work)!r})):\n"
        "    print('locked', flush=True); time.sleep(1.5); print('unlocking', flush=True)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    with build._build_lock(work):
        waited = time.monotonic() - t0
        assert other.stdout.readline().strip() == "unlocking"  # said before it let go: this one waited for it
    other.wait()
    assert waited > 0.5 and "waiting for another build of these flags" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "darwin", reason="Metal builds on macOS")
def test_metal_off_macos_is_one_line_before_anything_is_fetched(monkeypatch):
    from click.testing import CliRunner

    from ahakv_local.cli import main

    monkeypatch.setattr(build, "fetch_sdist", lambda: pytest.fail("went on to the download"))
    result = CliRunner().invoke(main, ["build", "--metal", "--force"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "error: --metal builds only on macOS (Metal is Apple's): on this machine, --cuda or --vulkan"
    ], result.output


def test_a_bare_make_sets_up_the_engine_too():
    """README: "`make` installs everything". A bare `make` ran the first target, the package's stamp, and never
    built the patched engine (`make setup`, `demo` and `test` did)."""
    import shutil
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parent.parent
    planned = subprocess.run(["make", "-n"], cwd=root, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert "ahakv-local build" in planned.stdout, planned.stdout
