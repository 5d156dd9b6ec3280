"""Build the patched engine: llama-cpp-python 0.3.36 + patches/, compiled with the user's CMake flags.

1. download the pinned sdist with pip (once) and check its sha256;
2. unpack it into a per-flags source folder and apply patches/*.patch in order;
3. build a wheel with a persistent per-flags build folder (only patched files recompile);
4. cache the wheel under a key of sdist hash + patch hash + flags + platform, and install it.

A second ``build`` with nothing changed finds the installed engine up to date and does nothing;
on a fresh environment with a cached wheel it only installs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import AhakvError
from .extras import require
from .paths import cache_dir, project_root

SDIST_NAME = "llama_cpp_python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_FILE = f"{SDIST_NAME}-{SDIST_VERSION}.tar.gz"

# the product loads libllama + libggml only: skip the multimodal and common libraries
BASE_CMAKE_ARGS = ("-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_COMMON=OFF")
# ggml's AMX kernels (compiled in by -march=native on Sapphire Rapids and later) crash in the first matrix product
# with this model's Q4_K weights (ggml_backend_amx_mul_mat, llama.cpp#20824, closed unfixed): leave them out.
# gcc and clang drop __AMX_INT8__ for an explicit -mno-amx-int8 whatever -march says, so the AVX-512/VNNI
# paths stay; the CPU_REPACK buffer then takes the weights, as on any AVX2 machine.
NO_AMX_CMAKE_ARGS = ("-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8")
MARKER = "ahakv_build.json"  # written next to the installed llama_cpp package


def leaves_out_amx() -> bool:
    """Whether this platform's build adds ``NO_AMX_CMAKE_ARGS``: gcc or clang on x86-64 (MSVC has no AMX either)."""
    return platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"


@dataclass(frozen=True)
class BuildPlan:
    cmake_args: tuple[str, ...]
    patches: tuple[Path, ...]

    @property
    def patch_hash(self) -> str:
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()

    @property
    def key(self) -> str:
        """Identity of the wheel: anything that changes the compiled library changes the key."""
        parts = [
            SDIST_SHA256,
            self.patch_hash,
            " ".join(self.cmake_args),  # (not shlex.join: a key must not change for flags built before)
            platform.machine(),
            sys.platform,
            f"py{sys.version_info.major}",
        ]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]

    @property
    def flags_key(self) -> str:
        return hashlib.sha256(" ".join(self.cmake_args).encode()).hexdigest()[:12]


# what ggml-vulkan compiles with: (what it is, where it is found, the Debian package that installs it)
VULKAN_REQUIREMENTS = (
    ("vulkan.hpp", "include:vulkan/vulkan.hpp", "libvulkan-dev"),
    ("glslc", "bin:glslc", "glslc"),
    ("the SPIR-V headers", "include:spirv/unified1/spirv.hpp", "spirv-headers"),
)
INCLUDE_DIRS = ("/usr/include", "/usr/local/include")


def missing_vulkan_packages() -> list[str]:
    """The Debian packages whose files a Vulkan build needs and this machine lacks (empty: all there)."""
    roots = [Path(d) for d in INCLUDE_DIRS]
    if sdk := os.environ.get("VULKAN_SDK"):
        roots.insert(0, Path(sdk) / "include")
    missing = []
    for _, where, package in VULKAN_REQUIREMENTS:
        kind, name = where.split(":", 1)
        found = shutil.which(name) if kind == "bin" else any((r / name).is_file() for r in roots)
        if not found:
            missing.append(package)
    return missing


def plan(
    cuda: bool = False, metal: bool = False, cmake_args: str = "", vulkan: bool = False, rpc: bool = False
) -> BuildPlan:
    if cuda and metal:  # ggml has no build with both (Metal is Apple's, CUDA is not there)
        raise AhakvError("--cuda and --metal cannot be built together: pick the one this machine has")
    args = list(BASE_CMAKE_ARGS)
    if leaves_out_amx():
        args += NO_AMX_CMAKE_ARGS
    if cuda:
        args.append("-DGGML_CUDA=ON")
    if metal:
        args.append("-DGGML_METAL=ON")
    if vulkan:
        args.append("-DGGML_VULKAN=ON")
    if rpc:  # the RPC backend in libggml, and its worker built from the same patched tree
        args.append("-DGGML_RPC=ON")
    for where, text in (("$CMAKE_ARGS", os.environ.get("CMAKE_ARGS", "")), ("--cmake-args", cmake_args)):
        try:
            args += shlex.split(text)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise AhakvError(f"{where} {text!r}: {str(exc).lower()}") from None
    patches = tuple(sorted(patch_dir().glob("*.patch")))
    if not patches:
        raise AhakvError(f"no patches found in {patch_dir()}")
    return BuildPlan(tuple(args), patches)


def patch_dir() -> Path:
    """patches/ of the checkout (editable install), else the copy a wheel install carries."""
    packaged = Path(__file__).parent / "patches"
    return packaged if packaged.is_dir() else project_root() / "patches"


def log(msg: str) -> None:
    print(f"[ahakv-local build] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None, log_file: Path | None = None) -> None:
    """Run a command; on failure raise with the tail of its output (full log kept in log_file)."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_file:
        log_file.write_text(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        where = f" (full log: {log_file})" if log_file else ""
        raise AhakvError(f"{' '.join(cmd[:4])} ... failed{where}:\n{tail}")


# -- steps -------------------------------------------------------------------------------------------


def fetch_sdist() -> Path:
    """The pinned sdist, downloaded once with pip and verified by sha256."""
    folder = cache_dir() / "sdist"
    path = folder / SDIST_FILE
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        log(f"downloading {SDIST_FILE} with pip")
        # --no-build-isolation: pip only reads the metadata, with the scikit-build-core we already have
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                f"llama-cpp-python=={SDIST_VERSION}",
                "-d",
                str(folder),
            ]
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        path.unlink()
        raise AhakvError(f"{SDIST_FILE} has sha256 {digest}, expected {SDIST_SHA256}; deleted it, run build again")
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    """A fresh copy of the sdist. Archive mtimes are kept, so only patched files look new to ninja."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        # extraction filters came with Python 3.11.4 (Debian 12 ships 3.11.2); the sdist is hash-pinned (fetch_sdist),
        # so without them its contents are still the ones checked
        tar.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    tree = dest / f"{SDIST_NAME}-{SDIST_VERSION}"
    # the sdist carries git metadata of its own; without it `git apply` treats the tree as plain files
    shutil.rmtree(tree / ".git", ignore_errors=True)
    (tree / "vendor" / "llama.cpp" / ".git").unlink(missing_ok=True)
    return tree


def apply_patches(tree: Path, patches: tuple[Path, ...]) -> None:
    for patch in patches:
        proc = subprocess.run(["git", "apply", "--verbose", str(patch)], cwd=tree, capture_output=True, text=True)
        if proc.returncode != 0:
            # git says "error: patch failed: <file>:<line>" for the first hunk that does not match
            errors = [ln.removeprefix("error: ") for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
            hunk = [e for e in errors if e.startswith("patch failed:")]
            detail = (hunk or errors or [proc.stderr.strip()])[0]
            raise AhakvError(f"patch {patch.name} does not apply to {SDIST_FILE}: {detail}")
    log(f"applied {len(patches)} patches")


def build_wheel(tree: Path, build_dir: Path, out: Path, cmake_args: tuple[str, ...]) -> Path:
    require("build")
    # scikit-build-core shell-splits CMAKE_ARGS: a value with spaces (-DCMAKE_C_FLAGS="-O3 -march=x") stays one
    env = dict(os.environ, CMAKE_ARGS=shlex.join(cmake_args))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    out.mkdir(parents=True, exist_ok=True)
    log_file = build_dir.parent / f"{build_dir.name}.log"
    log(f"compiling ({' '.join(cmake_args)}); log: {log_file}")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            "-C",
            f"build-dir={build_dir}",
            str(tree),
        ],
        env=env,
        log_file=log_file,
    )
    wheels = sorted(out.glob(f"{SDIST_NAME}-{SDIST_VERSION}-*.whl"))
    if not wheels:
        raise AhakvError(f"the build produced no wheel in {out}")
    return wheels[-1]


def installed_package() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def library_digest(pkg: Path) -> str:
    libs = sorted((pkg / "lib").glob("*llama*"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in libs)).hexdigest() if libs else ""


def installed_key() -> str | None:
    """The key of the engine installed in this environment, if ahakv-local built it and its library
    is still the one it installed (another pip install of llama-cpp-python replaces it)."""
    pkg = installed_package()
    if pkg is None:
        return None
    try:
        marker = json.loads((pkg / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("key") if marker.get("library_sha256") == library_digest(pkg) else None


def install(wheel: Path, bp: BuildPlan) -> None:
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", str(wheel)])
    pkg = installed_package()
    marker = {
        "key": bp.key,
        "cmake_args": bp.cmake_args,
        "patches": [p.name for p in bp.patches],
        "library_sha256": library_digest(pkg),
    }
    (pkg / MARKER).write_text(json.dumps(marker, indent=1))


def ensure_engine(
    cuda: bool = False,
    metal: bool = False,
    cmake_args: str = "",
    force: bool = False,
    vulkan: bool = False,
    rpc: bool = False,
) -> str:
    """Make the patched engine for these flags the installed one; return what was done. An installed RPC
    engine of the same flags serves a build without --rpc too (it is a superset) and is kept."""
    bp = plan(cuda, metal, cmake_args, vulkan=vulkan, rpc=rpc)
    installed = installed_key()
    if not force and installed == bp.key:
        return f"engine up to date (key {bp.key})"
    if not force and not rpc and installed == plan(cuda, metal, cmake_args, vulkan=vulkan, rpc=True).key:
        return f"engine up to date (key {installed}, with RPC)"

    wheel_dir = cache_dir() / "wheels" / bp.key
    cached = sorted(wheel_dir.glob("*.whl"))
    if cached and not force:
        install(cached[-1], bp)
        return f"installed cached engine {cached[-1].name} (key {bp.key})"

    if vulkan and (missing := missing_vulkan_packages()):
        raise AhakvError(
            "a Vulkan build needs vulkan.hpp, glslc and the SPIR-V headers; on Debian/Ubuntu: "
            f"apt-get install {' '.join(missing)}"
        )
    start = time.monotonic()
    work = cache_dir() / "work" / bp.flags_key
    for folder in (cache_dir() / "sdist", work, wheel_dir):  # before the download, not after the compile
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AhakvError(
                f"cannot write the engine cache {folder} ({exc.strerror or exc}): "
                "set AHAKV_CACHE_DIR to a writable folder"
            ) from None
    sdist = fetch_sdist()
    tree = unpack(sdist, work / "src")
    apply_patches(tree, bp.patches)
    wheel = build_wheel(tree, work / "build", work / "dist", bp.cmake_args)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    final = wheel_dir / wheel.name
    shutil.move(wheel, final)
    install(final, bp)
    return f"built and installed {final.name} in {time.monotonic() - start:.0f} s (key {bp.key})"
