"""What the benchmark scripts here share: a text file as the model's tokens, license texts by name, the command
line that ran, the time spent inside llama_decode, and a report written as JSON with its markdown table beside it
(same name, .md)."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ahakv_local.engine import Engine
from ahakv_local.evaluation import text_tokens
from ahakv_local.textfile import LICENSES


def file_tokens(model: Path, path: str | Path, n: int | None = None) -> list[int]:
    """The first ``n`` tokens (all with None) of a text file, BOS first; "a+b+c" reads the files one after the
    other, a blank line between (a document longer than any one license text, for 16K-token runs)."""
    text = "\n\n".join(Path(p).read_text(encoding="utf-8") for p in str(path).split("+"))
    return text_tokens(model, text)[:n]


@contextlib.contextmanager
def llama_decode_times() -> Iterator[list[float]]:
    """While active, the seconds of every engine's llama_decode call (``Engine._run_batch``), one entry a call."""
    run = Engine._run_batch
    seconds: list[float] = []

    def timed(self: Engine) -> None:
        t0 = time.perf_counter()
        run(self)
        seconds.append(time.perf_counter() - t0)

    Engine._run_batch = timed
    try:
        yield seconds
    finally:
        Engine._run_batch = run


def license_texts(names: str) -> list[str]:
    """The texts of Debian's license files named in a comma-separated list ("GFDL-1.3,LGPL-2.1"), in that order."""
    return [(LICENSES / name).read_text() for name in names.split(",")]


def text_name(path: str | Path) -> str:
    """A text's short name for titles: its file name, "GPL-3+GPL-2" for files read one after the other."""
    return "+".join(Path(p).name for p in str(path).split("+"))


def command_line() -> str:
    """How this script was run, to paste back into a shell (recorded beside every number)."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def write_report(report: dict, out: Path, markdown: str) -> None:
    """``report`` to ``out`` (JSON) and ``markdown`` beside it; rewritten after each step of a long run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown)
