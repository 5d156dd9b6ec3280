"""Build the patched engine: llama-cpp-python 0.3.36 + patches/, compiled with the user's CMake flags.

1. download the pinned sdist with pip (once) and check its sha256;
2. unpack it into a per-flags source folder and apply patches/*.patch in order;
3. build a wheel with a persistent per-flags build folder (only patched files recompile);
4. cache the wheel under a key of sdist hash + patch hash + flags + platform + what a native build compiles for
   (the CPU's instruction sets, the GPUs, the C library), and install it.

A second ``build`` with nothing changed finds the installed engine up to date and does nothing;
on a fresh environment with a cached wheel it only installs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
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
NO_AMX_FLAG = "-mno-amx-int8"
NO_AMX_CMAKE_ARGS = (f"-DCMAKE_C_FLAGS={NO_AMX_FLAG}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAG}")
# the environment's flags, which CMake reads only where CMAKE_<LANG>_FLAGS is not given (NO_AMX_CMAKE_ARGS gives it)
FLAGS_ENV = {"CMAKE_C_FLAGS": "CFLAGS", "CMAKE_CXX_FLAGS": "CXXFLAGS"}
MARKER = "ahakv_build.json"  # written next to the installed llama_cpp package


def leaves_out_amx() -> bool:
    """Whether this platform's build adds ``NO_AMX_CMAKE_ARGS``: gcc or clang on x86-64 (MSVC has no AMX either) whose
    C and C++ compilers take the flag. gcc before 11 knows no AMX and refuses it (Debian 11's gcc 10, RHEL 8's gcc 8:
    the engine's build failed), and a compiler without AMX generates no AMX kernels, so nothing is left to leave out."""
    on_x86 = platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"
    return on_x86 and all(compiler_takes(os.environ.get(env) or default, NO_AMX_FLAG) for env, default in COMPILERS)


COMPILERS = (("CC", "cc"), ("CXX", "c++"))  # CMake's C and C++ compilers where the environment names none


@functools.cache
def compiler_takes(compiler: str, flag: str) -> bool:
    """Whether ``compiler`` compiles an empty C translation unit with ``flag``; True where it cannot be run at all
    (CMake's own check will say what is missing)."""
    argv = shlex.split(compiler)
    if not argv or shutil.which(argv[0]) is None:
        return True
    try:
        proc = subprocess.run(
            [*argv, flag, "-x", "c", "-c", "-", "-o", os.devnull], input=b"int x;\n", capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return proc.returncode == 0


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
        """Identity of the wheel: anything that changes the compiled library changes the key, the machine a
        native build compiles for included (a wheel cache shared between machines, an NFS home or a CI cache,
        must not hand an AVX-512 build to an AVX2 machine)."""
        parts = [
            SDIST_SHA256,
            self.patch_hash,
            flags_text(self.cmake_args),
            platform.machine(),
            sys.platform,
            f"py{sys.version_info.major}",
            host_fingerprint(self.cmake_args),
        ]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]

    @property
    def flags_key(self) -> str:
        return hashlib.sha256(flags_text(self.cmake_args).encode()).hexdigest()[:12]


def flags_text(cmake_args: tuple[str, ...]) -> str:
    """The flags as one string, an argument with spaces quoted: '-DCMAKE_C_FLAGS=-O2 -DGGML_CUDA=ON' (one flag, a
    CPU build) and '-DCMAKE_C_FLAGS=-O2', '-DGGML_CUDA=ON' (two, a CUDA build) joined alike with spaces alone."""
    return " ".join(shlex.quote(a) if any(c.isspace() for c in a) or not a else a for a in cmake_args)


def _sets(arg: str, name: str) -> bool:
    """Whether a CMake argument is -D<name>=... or -D<name>:TYPE=..."""
    return arg.startswith((f"-D{name}=", f"-D{name}:"))


def _last_value(cmake_args: tuple[str, ...], name: str) -> str | None:
    """The value the last -D<name>=... sets (CMake takes the last), or None."""
    values = [a.split("=", 1)[1] for a in cmake_args if _sets(a, name)]
    return values[-1] if values else None


def _is_on(cmake_args: tuple[str, ...], name: str, default: bool) -> bool:
    """Whether -D<name> is on as CMake reads a boolean (``default`` where it is not given)."""
    value = _last_value(cmake_args, name)
    if value is None:
        return default
    try:  # a number is true where it is not zero (CMake's if(<constant>)): GGML_NATIVE=2 is a native build
        return float(value) != 0
    except ValueError:
        return value.upper() in ("ON", "TRUE", "YES", "Y")


# the CPU features a native x86 build's -march=native turns into compiled code (ggml's own checks and the compiler's)
X86_ISA = re.compile(r"^(sse\w*|ssse3|avx\w*|fma\w*|f16c|bmi\d|amx\w*|\w*vnni\w*|popcnt|lzcnt|abm|movbe|aes|pclmulqdq|"
                     r"sha_ni|gfni|vaes|vpclmulqdq|adx)$")  # fmt: skip


@functools.cache
def cpu_features() -> str:
    """The instruction sets of this machine's CPU as a native build sees them: Linux's /proc/cpuinfo, macOS's sysctl
    (an Intel Mac's feature lists, an Apple chip's name: M1 and M2 differ in what -mcpu=native uses), elsewhere the
    processor's name (Windows': family, model and stepping). Read once per process: a key must not change within
    a build."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, ARM
            words = value.split()
            return " ".join(sorted(w for w in words if name.strip() == "Features" or X86_ISA.match(w)))
    if sys.platform == "darwin":
        keys = ["machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features"]
        try:  # (an Apple chip has no feature lists: sysctl names the ones it lacks on stderr)
            out = subprocess.run(["sysctl", "-n", *keys], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out.strip():
            return " ".join(out.split())
    return platform.processor() or platform.machine()


@functools.cache
def cuda_architectures() -> str:
    """The compute capabilities of this machine's NVIDIA GPUs (what CMAKE_CUDA_ARCHITECTURES=native compiles for),
    read once per process."""
    try:
        query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
        proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    return ",".join(sorted(set(proc.stdout.split()))) if proc.returncode == 0 else "none"


def host_fingerprint(cmake_args: tuple[str, ...]) -> str:
    """What the library is compiled for beyond its flags, where GGML_NATIVE is on (ggml's default): the CPU's
    instruction sets (-march=native) and, for a CUDA build without CMAKE_CUDA_ARCHITECTURES, the GPUs' compute
    capabilities (ggml-cuda asks for "native" only then); always the C library the wheel links against."""
    parts = [" ".join(platform.libc_ver())]
    if not _is_on(cmake_args, "GGML_NATIVE", default=True):
        return parts[0]
    parts.append("cpu " + cpu_features())
    if _is_on(cmake_args, "GGML_CUDA", default=False) and _last_value(cmake_args, "CMAKE_CUDA_ARCHITECTURES") is None:
        parts.append("gpu " + cuda_architectures())
    return "; ".join(parts)


# what ggml-vulkan compiles with: (what it is, where it is found, the Debian package that installs it)
VULKAN_REQUIREMENTS = (
    ("vulkan.hpp", "include:vulkan/vulkan.hpp", "libvulkan-dev"),
    ("glslc", "bin:glslc", "glslc"),
    ("the SPIR-V headers", "include:spirv/unified1/spirv.hpp", "spirv-headers"),
)
INCLUDE_DIRS = ("/usr/include", "/usr/local/include", "/opt/homebrew/include")


def include_roots(cmake_args: tuple[str, ...] = ()) -> list[Path]:
    """Where a compiler and CMake look for headers: the Vulkan SDK, -DVulkan_INCLUDE_DIR, CPATH and its C/C++
    variants, each CMAKE_PREFIX_PATH's include/, Homebrew's, then the system's."""
    roots = []
    if sdk := os.environ.get("VULKAN_SDK"):
        roots.append(Path(sdk) / "include")
    if given := _last_value(cmake_args, "Vulkan_INCLUDE_DIR"):
        roots.append(Path(given))
    for var in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"):
        roots += [Path(d) for d in os.environ.get(var, "").split(os.pathsep) if d]
    roots += [Path(d) / "include" for d in os.environ.get("CMAKE_PREFIX_PATH", "").split(os.pathsep) if d]
    return roots + [Path(d) for d in INCLUDE_DIRS]


def missing_vulkan_packages(cmake_args: tuple[str, ...] = ()) -> list[str]:
    """The Debian packages whose files a Vulkan build needs and this machine lacks (empty: all there)."""
    roots = include_roots(cmake_args)
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
            given = shlex.split(text)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise AhakvError(f"{where} {text!r}: {str(exc).lower()}") from None
        # (CMake takes GGML_CUDA=ON for a source path and ignores it: a CPU engine was built and cached for the flag)
        if bare := next((arg for arg in given if BARE_DEFINITION.match(arg)), None):
            raise AhakvError(f"{where}: {bare!r} is not a CMake option: -D{bare} sets a variable")
        args += given
    if leaves_out_amx():
        args += _keep_amx_out(tuple(args))
    if _last_value(tuple(args), "CMAKE_INSTALL_PREFIX") is not None:  # (scikit-build-core drops it: the wheel's)
        raise AhakvError("-DCMAKE_INSTALL_PREFIX cannot be set: the engine is installed as a wheel into this Python")
    patches = tuple(sorted(patch_dir().glob("*.patch")))
    if not patches:
        raise AhakvError(f"no patches found in {patch_dir()}")
    return BuildPlan(tuple(args), patches)


BARE_DEFINITION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(:[A-Za-z]+)?=")  # GGML_CUDA=ON, without its -D


def _keep_amx_out(args: tuple[str, ...]) -> list[str]:
    """The C and C++ flags again, last (CMake takes the last), where the user's own would drop NO_AMX_FLAG: a
    -DCMAKE_C_FLAGS=-O3 of --cmake-args or $CMAKE_ARGS replaced it, and NO_AMX_CMAKE_ARGS made CMake ignore $CFLAGS
    and $CXXFLAGS. Nothing where the user sets neither (the plan, and so the cache key, stay as they were)."""
    extra = []
    for name, env in FLAGS_ENV.items():
        value = _last_value(args, name)
        if value == NO_AMX_FLAG:  # ours: the user's environment may still carry flags of its own
            value = os.environ.get(env, "").strip() or None
        if value is not None and NO_AMX_FLAG not in value.split():
            extra.append(f"-D{name}={value} {NO_AMX_FLAG}")
    return extra


def patch_dir() -> Path:
    """patches/ of the checkout (editable install), else the copy a wheel install carries."""
    packaged = Path(__file__).parent / "patches"
    return packaged if packaged.is_dir() else project_root() / "patches"


def log(msg: str) -> None:
    print(f"[ahakv-local build] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None, log_file: Path | None = None) -> None:
    """Run a command; on failure raise with its first error line and the tail of its output (the whole output is
    written to ``log_file`` as it comes, so a long compile can be followed there). The command runs in a process
    group of its own, stopped with it when this process is interrupted or terminated (a compile went on, orphaned,
    writing into the cache the next build unpacks)."""
    if cmd[:3] == [sys.executable, "-m", "pip"] and importlib.util.find_spec("pip") is None:
        # (a venv made without pip, as `uv venv` makes them: "No module named pip", and no way on)
        raise AhakvError(
            "the engine is fetched and installed with pip, which this environment lacks: run "
            f"`{sys.executable} -m ensurepip` (or `uv pip install pip`) first"
        )
    with tempfile.TemporaryFile("w+") if log_file is None else open(log_file, "w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with _terminate_as_interrupt():
                returncode = proc.wait()
        except BaseException:
            _stop_group(proc)
            raise
        if returncode == 0:
            return
        out.seek(0)
        lines = out.read().strip().splitlines()
    where = f" (full log: {log_file})" if log_file else ""
    cause = f": {first}" if (first := first_error(lines)) else ""
    tail = "\n".join(lines[-15:])
    raise AhakvError(f"{' '.join(cmd[:4])} ... failed{cause}{where}:\n{tail}")


# the line that says why a build failed, above pip's and CMake's summaries at its end: "CMake Error at ...",
# a compiler's "file.c:1:2: error: ...", pip's "ERROR: ..."
FIRST_ERROR = re.compile(r"CMake Error|(^|\s|:)(fatal )?error:|^ERROR:", re.IGNORECASE)


def first_error(lines: list[str]) -> str | None:
    """The first error of a failed build's output, in one line: CMake's "CMake Error at FILE:LINE (command):" with
    the indented lines below it, which say what went wrong (the header alone named no cause)."""
    at = next((i for i, line in enumerate(lines) if FIRST_ERROR.search(line)), None)
    if at is None:
        return None
    said = [lines[at].strip()]
    if "CMake Error" in lines[at]:
        for line in lines[at + 1 :]:
            if line.strip() and not line.startswith((" ", "\t")):
                break
            said.append(line.strip())
    return " ".join(filter(None, said))


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt here (its default ends Python at once, with no chance to stop the child)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the command and everything it started (pip -> cmake -> ninja -> the compilers)."""
    if not hasattr(os, "killpg"):  # (Windows: no process groups of this kind)
        proc.kill()
        proc.wait()
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
    # git must not look for a repository above the tree: inside one (a cache under a dotfiles repository, or
    # AHAKV_CACHE_DIR in a checkout) it reads the patches' paths from that repository's root and skips them all
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
    for patch in patches:
        cmd = ["git", "apply", "--verbose", str(patch)]
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
        if skipped := [ln for ln in proc.stderr.splitlines() if ln.startswith("Skipped patch")]:
            raise AhakvError(f"patch {patch.name} was not applied to {tree}: git says {skipped[0]!r}")
        if proc.returncode != 0:
            # git says "error: patch failed: <file>:<line>" for the first hunk that does not match
            errors = [ln.removeprefix("error: ") for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
            hunk = [e for e in errors if e.startswith("patch failed:")]
            detail = (hunk or errors or [proc.stderr.strip()])[0]
            raise AhakvError(f"patch {patch.name} does not apply to {SDIST_FILE}: {detail}")
    log(f"applied {len(patches)} patches")


def build_wheel(tree: Path, build_dir: Path, out: Path, cmake_args: tuple[str, ...]) -> Path:
    require("build")
    # scikit-build-core shell-splits CMAKE_ARGS: a value with spaces (-DCMAKE_C_FLAGS="-O3 -march=x") stays one;
    # it drops CMAKE_BUILD_TYPE from there (a warning in the log) and takes it as a setting of its own instead
    build_type = _last_value(cmake_args, "CMAKE_BUILD_TYPE")
    passed = [a for a in cmake_args if not _sets(a, "CMAKE_BUILD_TYPE")]
    env = dict(os.environ, CMAKE_ARGS=shlex.join(passed))
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
            "-v",  # the compile's own output in the log
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            "-C",
            f"build-dir={build_dir}",
            *(["-C", f"cmake.build-type={build_type}"] if build_type else []),
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


def wheel_library_digest(wheel: Path) -> str:
    """``library_digest`` of the package a wheel installs, read from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("llama_cpp/lib/") and "llama" in n.rsplit("/", 1)[1])
        return hashlib.sha256(b"".join(z.read(n) for n in names)).hexdigest() if names else ""


def installed_marker() -> dict | None:
    """The marker of the engine installed in this environment, if ahakv-local built it and its library is still the
    one it installed (another pip install of llama-cpp-python replaces it); None otherwise."""
    pkg = installed_package()
    if pkg is None:
        return None
    try:
        marker = json.loads((pkg / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("library_sha256") == library_digest(pkg) else None


def installed_key() -> str | None:
    """The key of the installed engine (``installed_marker``), if ahakv-local built it."""
    return (installed_marker() or {}).get("key")


def patch_hash_of(marker: dict | None) -> str | None:
    """The sha256 of the patch series an installed engine (its ``installed_marker``) was built from: the marker's
    (recorded since this field existed), else the source tree's where the marker's key says it is that one; None
    where neither can say."""
    if not marker or "key" not in marker:
        return None
    if "patch_sha256" in marker:
        return marker["patch_sha256"]
    bp = BuildPlan(tuple(marker.get("cmake_args") or ()), tuple(sorted(patch_dir().glob("*.patch"))))
    return bp.patch_hash if bp.key == marker["key"] else None


def install(wheel: Path, bp: BuildPlan) -> None:
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", str(wheel)])
    pkg = installed_package()
    if pkg is None or library_digest(pkg) != wheel_library_digest(wheel):
        # (pip's target= or $PIP_TARGET: the marker went on the old engine, and `build --rpc` said "up to date"
        # to an engine without RPC, whose commands then asked for `build --rpc`)
        raise AhakvError(
            f"pip installed {wheel.name} elsewhere than where this Python imports llama_cpp from "
            f"({pkg or 'nowhere'}): unset PIP_TARGET (or pip.conf's target) and build again"
        )
    marker = {
        "key": bp.key,
        "cmake_args": bp.cmake_args,
        "patches": [p.name for p in bp.patches],
        "patch_sha256": bp.patch_hash,
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
    """Make the patched engine for these flags the installed one; return what was done. An installed or cached
    RPC engine of the same flags serves a build without --rpc too (it is a superset)."""
    bp = plan(cuda, metal, cmake_args, vulkan=vulkan, rpc=rpc)
    if metal and sys.platform != "darwin":
        raise AhakvError("--metal builds only on macOS (Metal is Apple's): on this machine, --cuda or --vulkan")
    superset = None if rpc else plan(cuda, metal, cmake_args, vulkan=vulkan, rpc=True)
    installed = installed_key()
    if not force and installed == bp.key:
        return f"engine up to date (key {bp.key})"
    if not force and superset is not None and installed == superset.key:
        return f"engine up to date (key {installed}, with RPC)"
    if not force and (done := _install_cached(bp, superset)):
        return done

    if vulkan and (missing := missing_vulkan_packages(bp.cmake_args)):
        raise AhakvError(
            "a Vulkan build needs vulkan.hpp, glslc and the SPIR-V headers (elsewhere than the system's folders: "
            f"set VULKAN_SDK or CPATH); on Debian/Ubuntu: apt-get install {' '.join(missing)}"
        )
    require("build")  # before the download: pip reads the sdist's metadata with scikit-build-core
    start = time.monotonic()
    work = cache_dir() / "work" / bp.flags_key
    wheel_dir = cache_dir() / "wheels" / bp.key
    for folder in (cache_dir() / "sdist", work, wheel_dir):  # before the download, not after the compile
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AhakvError(
                f"cannot write the engine cache {folder} ({exc.strerror or exc}): "
                "set AHAKV_CACHE_DIR to a writable folder"
            ) from None
    with _build_lock(work):
        if not force and (done := _install_cached(bp, superset)):
            return done  # another process built it while this one waited
        sdist = fetch_sdist()
        try:
            tree = unpack(sdist, work / "src")
            apply_patches(tree, bp.patches)
            wheel = build_wheel(tree, work / "build", work / "dist", bp.cmake_args)
        except BaseException:
            # the patched sources (~200 MB) are unpacked anew by every build; the build folder is kept (a retry
            # compiles only what changed), and so is the log it names
            shutil.rmtree(work / "src", ignore_errors=True)
            with contextlib.suppress(OSError):
                wheel_dir.rmdir()  # (empty: nothing was built under this key)
            raise
        final = wheel_dir / wheel.name
        shutil.move(wheel, final)
        install(final, bp)
    return f"built and installed {final.name} in {time.monotonic() - start:.0f} s (key {bp.key})"


def _install_cached(bp: BuildPlan, superset: BuildPlan | None) -> str | None:
    """Install the cached wheel of ``bp`` (or of its RPC ``superset``) if there is a sound one; a damaged one (a
    copy cut short, a disk that filled up) is removed so that it is built again. None: none to install."""
    for plan_ in filter(None, (bp, superset)):
        for wheel in sorted((cache_dir() / "wheels" / plan_.key).glob("*.whl"), reverse=True):
            if not wheel_is_sound(wheel):
                log(f"the cached engine {wheel} is damaged: removed, building it again")
                wheel.unlink(missing_ok=True)
                continue
            install(wheel, plan_)
            rpc = ", with RPC" if plan_ is superset else ""
            return f"installed cached engine {wheel.name} (key {plan_.key}{rpc})"
    return None


def wheel_is_sound(wheel: Path) -> bool:
    """Whether a wheel reads whole and is one: a zip whose every member matches its CRC, with the metadata pip
    installs it by (a zip without it was refused by pip at every build, and never replaced)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            whole = z.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError):
        return False
    return whole and {"WHEEL", "RECORD"} <= {name.split("/", 1)[1] for name in names if ".dist-info/" in name}


@contextlib.contextmanager
def _build_lock(work: Path):
    """One build of a set of flags at a time, across processes sharing the cache (two CI jobs, two environments):
    both unpacked into one source folder, and one deleted what the other compiled."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        yield
        return
    with open(work.parent / f"{work.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build of these flags ({work})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
