"""Where ahakv-local keeps what it downloads, builds and assembles."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import AhakvError


def cache_dir() -> Path:
    """``$AHAKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/ahakv-local``, else ``~/.cache/ahakv-local``."""
    if env := os.environ.get("AHAKV_CACHE_DIR"):
        return _home_expanded(env, "AHAKV_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return _home_expanded(xdg, "XDG_CACHE_HOME") / "ahakv-local"
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and a user without a passwd entry (a container run with --user)
        raise AhakvError("no home folder to keep the cache in: set AHAKV_CACHE_DIR (or HOME)") from None
    return home / ".cache" / "ahakv-local"


def _home_expanded(text: str, variable: str) -> Path:
    """``text`` with a leading ``~`` or ``~user`` expanded; a user without a home folder is refused in one line (a
    RuntimeError traceback from every command; left as it is, the cache would be a folder named "~nobody" here)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise AhakvError(f"{variable}={text}: {text.split('/')[0]} has no home folder") from None


def project_root() -> Path:
    """The source checkout (patches/ lives there); ahakv-local is installed editable from it."""
    return Path(__file__).resolve().parent.parent


def umask() -> int:
    """This process's umask: the mode bits a file it makes with ``open`` leaves out (read by setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
