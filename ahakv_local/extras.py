"""Optional parts of ahakv-local, installed as extras: a missing one is one line that says what to install."""

from __future__ import annotations

import importlib.util

from .errors import AhakvError

EXTRAS = {
    "serve": ("fastapi", "uvicorn"),  # ahakv-local serve
    "eval": ("tqdm", "matplotlib"),  # ahakv-local eval / bench: progress bars and PNG plots
    "build": ("scikit_build_core", "cmake", "ninja"),  # ahakv-local build: compile the patched engine
}


def require(extra: str) -> None:
    """Refuse a command whose extra is not installed, naming the pip command that installs it."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise AhakvError(
            f"this needs the {extra!r} extra ({', '.join(missing)} not installed): pip install 'ahakv-local[{extra}]'"
        )
