"""Writing a file whole or not at all: the one way ahakv-local replaces a user's file (a saved chat, a report)."""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .paths import umask


@contextlib.contextmanager
def replaced(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without an error. It is written beside ``path`` under a
    name of its own (mkstemp: a fixed "FILE.tmp" replaced a user's file of that name) and renamed over it, so a write
    that fails halfway (a full disk, a signal: SIGTERM is a SystemExit) leaves the file as it was and no half-written
    one, and a symbolic link at ``path`` is replaced, not written through. A new file gets the mode any file written
    gets (mkstemp's is private, 0600); a file replaced keeps its mode. OSError is the caller's to say."""
    mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else 0o666 & ~umask()
    # the name cut to fit the folder's limit with mkstemp's 8 characters and the dots (a legal name of 250 characters
    # was refused as "File name too long")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)``, whole or not at all (``replaced``), as UTF-8."""
    with replaced(path) as f:
        f.write(text.encode("utf-8"))


@contextlib.contextmanager
def written_to(path: Path) -> Iterator[Path]:
    """A path of this call's own beside ``path``, for a writer that opens files by name (the GGUF writer, the default
    model's assembly), renamed over ``path`` when the block ends without an error and removed otherwise, as
    ``replaced`` does for a file object. Its name is its own (mkstemp): writers sharing "FILE.tmp" truncated one
    another's, and one renamed a 24-byte model into place under another run. Leftovers of a run killed meanwhile
    (SIGKILL, or a SIGTERM that no handler turned into SystemExit) are removed first once they are ``STALE_S`` old."""
    remove_stale(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".part", dir=path.parent)
    os.close(fd)
    tmp: Path | None = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # (mkstemp's 0600: another user of a shared cache could not read it)
        yield tmp
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


# a leftover no write has touched for this long is a killed run's (a live one writes on: the default model's 250 MB
# take seconds)
STALE_S = 600.0


def remove_stale(path: Path) -> None:
    """Remove ``written_to``'s leftovers beside ``path`` unwritten for ``STALE_S``: a first run stopped by SIGTERM or
    SIGKILL while assembling the default model left a hidden copy of up to 250 MB in the cache, one per run, for
    good."""
    for leftover in path.parent.glob(f".{glob.escape(path.name[:200])}.*.part"):
        with contextlib.suppress(OSError):
            if time.time() - leftover.stat().st_mtime > STALE_S:
                leftover.unlink()
