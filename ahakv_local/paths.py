"""Where ahakv-local keeps what it downloads, builds and assembles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$AHAKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/ahakv-local``, else ``~/.cache/ahakv-local``."""
    if env := os.environ.get("AHAKV_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ahakv-local"


def project_root() -> Path:
    """The source checkout (patches/ lives there); ahakv-local is installed editable from it."""
    return Path(__file__).resolve().parent.parent
