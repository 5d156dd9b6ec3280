"""A header-only GGUF reader: magic, version, tensor count, the key/value metadata and where the tensors' data ends
(from the tensor infos after the metadata), nothing after.

``gguf.GGUFReader`` maps the whole file and builds numpy views of every field and tensor (seconds and
hundreds of MiB for a 250 MB model, mostly the tokenizer's string arrays). This walks the KV section of
an mmap with ``struct.unpack_from`` and stops there: arrays of strings and long numeric arrays are
skipped by offset arithmetic (each string's length is read, its bytes are not), so only the pages of the
header are touched. Any truncated or inconsistent header is an ``AhakvError``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import AhakvError

# GGUFValueType: code -> struct format of one item (STRING = 8 and ARRAY = 9 are variable-sized)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DECODED_ARRAY = 4096  # numeric arrays up to this length are decoded (per-layer hparams); longer ones skipped


@dataclass(frozen=True)
class SkippedArray:
    """An array that was skipped, not decoded: its item type (a GGUFValueType code) and length."""

    item_type: int
    count: int


Value = int | float | bool | str | tuple | SkippedArray


@dataclass
class GGUFHeader:
    version: int
    n_tensors: int
    kv: dict[str, Value] = field(default_factory=dict)
    kv_end: int = 0  # byte offset where the tensor infos start
    data_end: int = 0  # the bytes the file needs: where its furthest tensor's data ends


class _Corrupt(Exception):
    pass


class _Cursor:
    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order, self.pos, self.size = buf, order, 0, len(buf)

    def need(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Corrupt(f"needs {n} bytes at offset {start}, the file ends at {self.size}")
        self.pos = start + n
        return start

    def scalar(self, fmt: str):
        fmt = self.order + fmt
        return struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        start = self.need(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"string at offset {start} is not UTF-8") from None

    def skip_strings(self, count: int) -> None:
        # read each length, jump over the bytes (an offset past the end makes unpack_from raise)
        unpack, fmt, buf, pos = struct.unpack_from, self.order + "Q", self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + unpack(fmt, buf, pos)[0]
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            raise _Corrupt(f"string array at offset {self.pos} runs past the end of the file")
        self.pos = pos

    def value(self, vtype: int) -> Value:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                width = struct.calcsize(fmt)
                start = self.need(count * width)
                if count <= MAX_DECODED_ARRAY:
                    return struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, start)
            elif item == STRING:
                self.skip_strings(count)
            else:  # llama.cpp's gguf reader refuses arrays of arrays too
                raise _Corrupt(f"invalid array item type {item}")
            return SkippedArray(item, count)
        raise _Corrupt(f"unknown value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """The GGUF header of ``path`` up to the end of its metadata; an AhakvError for anything else."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # (a folder: open's own error, below)
        # a named pipe blocked open() for good (the drop-in's model_path; the CLI checks it first)
        raise AhakvError(f"not a model file: {path} is a pipe or a device")
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise AhakvError(f"not a GGUF file: {path}")
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError) as exc:
                raise AhakvError(f"cannot map {path}: {exc}") from None
    except OSError as exc:
        raise AhakvError(f"cannot read {path}: {exc.strerror or exc}") from None
    with buf:
        try:
            return _parse(buf)
        except (_Corrupt, struct.error) as exc:
            raise AhakvError(f"corrupt or truncated GGUF header in {path}: {exc}") from None


def _parse(buf: mmap.mmap) -> GGUFHeader:
    cur = _Cursor(buf, "<")
    cur.need(4)  # magic, checked by the caller
    version = cur.scalar("I")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.order, version = ">", struct.unpack("<I", struct.pack(">I", version))[0]
    if version not in (2, 3):
        raise _Corrupt(f"unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
    header = GGUFHeader(version=version, n_tensors=cur.scalar("Q"))
    n_kv = cur.scalar("Q")
    if n_kv > cur.size:  # every pair takes more than one byte
        raise _Corrupt(f"{n_kv} metadata pairs cannot fit in {cur.size} bytes")
    for _ in range(n_kv):
        key = cur.string()
        header.kv[key] = cur.value(cur.scalar("I"))
    header.kv_end = cur.pos
    header.data_end = _tensor_data_end(cur, header)
    return header


def _tensor_data_end(cur: _Cursor, header: GGUFHeader) -> int:
    """Where the furthest tensor's data ends: the tensor infos (name, dims, type, offset: a few dozen bytes each),
    then the data section at the next multiple of ``general.alignment``. A tensor of a type ``gguf`` does not know
    counts from its offset alone."""
    from gguf.constants import GGML_QUANT_SIZES  # (gguf's package imports numpy: not at the CLI's start)

    end = 0
    for _ in range(header.n_tensors):
        cur.string()
        n_dims = cur.scalar("I")
        if n_dims > 8:  # GGML_MAX_DIMS is 4
            raise _Corrupt(f"a tensor of {n_dims} dimensions")
        count = 1
        for _ in range(n_dims):
            count *= cur.scalar("Q")
        block, type_size = GGML_QUANT_SIZES.get(cur.scalar("I"), (0, 0))
        offset = cur.scalar("Q")
        end = max(end, offset + (count // block * type_size if block else 0))
    align = header.kv.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    return cur.pos + (-cur.pos % align) + end
