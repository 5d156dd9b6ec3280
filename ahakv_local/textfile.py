"""Reading a user's text (``generate -f``, chat's ``/read``, the eval commands' texts): one owner for what a text
file may be. A pipe or ``<(command)`` is a file too; what is not text, or has no end, is one line of error."""

from __future__ import annotations

import re
from pathlib import Path
from typing import BinaryIO

from .errors import AhakvError

# the measuring commands' default texts: real text no one here wrote, shipped by Debian's and Ubuntu's base-files
LICENSES = Path("/usr/share/common-licenses")

# far more text than any model's context holds (a million tokens of English is ~4 MiB); /dev/zero would otherwise be
# read until the memory runs out
MAX_TEXT_BYTES = 64 << 20


def decode(data: bytes, where: str) -> str:
    """UTF-8 text, without the byte-order mark some editors write (an encoding's signature, which the model read as
    a token); NUL bytes are no text (UTF-16 without its mark, a binary file: read, they were tokens of garbage)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16's byte-order mark (it read "not UTF-8 text (byte 0)")
        raise AhakvError(f"{where} is UTF-16 text: convert it to UTF-8 first, e.g. with iconv -f UTF-16 -t UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AhakvError(f"{where} is not UTF-8 text (byte {exc.start}): convert it first, e.g. with iconv") from None
    if "\0" in text:
        raise AhakvError(
            f"{where} is not UTF-8 text (a NUL byte at {text.index(chr(0))}: UTF-16, or binary?): convert it first"
        )
    return text


def typed_text(text: str, where: str) -> str:
    """Text that came as a ``str`` from outside (argv, a terminal's line) as UTF-8, or one line of error: Python hands
    bytes that are not UTF-8 on as surrogates, which failed later at the tokenizer with a codec's traceback."""
    return decode(text.encode("utf-8", "surrogateescape"), where)


def shown_name(path: Path) -> str:
    """A file's name as text a model can read: bytes of it that are not UTF-8 become U+FFFD."""
    return path.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def read_stream(stream: BinaryIO, where: str) -> str:
    data = stream.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise AhakvError(f"{where} is over {MAX_TEXT_BYTES >> 20} MiB: more text than a model's context holds")
    return decode(data, where)


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path``, or one line of error (missing, a folder, unreadable, not UTF-8, endless)."""
    try:
        with open(path, "rb") as f:
            return read_stream(f, str(path))
    except OSError as exc:
        raise AhakvError(f"cannot read {path}: {exc.strerror or exc}") from None


def last_paragraph(text: str) -> str:
    """The last paragraph of ``text`` with words in it: after its last blank line, whatever ends its lines (a CRLF
    file's question was its last 24 tokens of document with the question) or the blank line holds. The question a
    prompt is read with when none is given (the drop-in, the parallel server)."""
    paragraphs = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return next((p for p in reversed(paragraphs) if p.strip()), "")


def license_files(option: str) -> list[Path]:
    """The license texts of ``LICENSES`` (no links), in name order; where the system has none (macOS, Fedora,
    Arch), one line naming ``option``, the way to give a text instead."""
    try:
        files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    except OSError:
        files = []
    if not files:
        raise AhakvError(f"no texts in {LICENSES} (Debian's and Ubuntu's base-files ship them): give {option}")
    return files
