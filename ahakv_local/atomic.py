"""Writing a file whole or not at all: the one way ahakv-local replaces a user's file (a saved chat, a report)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
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
