"""The header-only GGUF reader (ahakv_local/gguf_header.py) against gguf.GGUFReader, and its failure modes."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ahakv_local.errors import AhakvError
from ahakv_local.fixture import ARCHITECTURES, FixtureSpec
from ahakv_local.gguf_header import SkippedArray, read_header
from ahakv_local.info import check_architecture, read_info
from ahakv_local.models import fixture_path


def assert_same_as_gguf_reader(path) -> None:
    header = read_header(path)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.version == reader.fields["GGUF.version"].contents()
    assert header.n_tensors == reader.fields["GGUF.tensor_count"].contents() == len(reader.tensors)
    assert list(header.kv) == list(fields)  # same keys, same order
    for key, f in fields.items():
        value = header.kv[key]
        if f.types[0] != gguf.GGUFValueType.ARRAY:
            assert value == f.contents() and type(value) is type(f.contents()), key  # exact: same bytes decoded
        elif isinstance(value, SkippedArray):
            assert (value.item_type, value.count) == (f.types[-1], len(f.data)), key
        else:
            assert list(value) == f.contents(), key
    last = fields[list(fields)[-1]]
    assert header.kv_end == last.offset + sum(part.nbytes for part in last.parts)
    # where the tensors' data ends, from GGUFReader's own tensors (absolute offsets and sizes)
    assert header.data_end == max((t.data_offset + t.n_bytes for t in reader.tensors), default=header.data_end)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_header_equals_gguf_reader_on_fixtures(arch):
    assert_same_as_gguf_reader(fixture_path(FixtureSpec(arch=arch)))


def test_header_equals_gguf_reader_on_the_default_model(gemma_model):
    """262K tokenizer strings, scores and types: skipped, not decoded (GGUFReader takes ~15 s and 700 MiB here)."""
    assert_same_as_gguf_reader(gemma_model)
    info = read_info(gemma_model)
    assert (info.architecture, info.n_layer, info.n_head, info.n_head_kv) == ("gemma3", 18, 4, 1)
    assert (info.head_dim_k, info.sliding_window, info.n_ctx_train) == (256, 512, 32768)


def test_a_file_cut_short_is_refused_before_llama_cpp_reads_it(fixture_model, tmp_path):
    """A model cut inside its tensor data (an unfinished copy): generate failed with llama.cpp's "Failed to load model
    from file". The tensor infos say how long the file must be: the engine and the drop-in refuse it in one line before
    llama.cpp reads it, with or without a budget; its header is whole, so its figures still read (``info``). Cut
    exactly at the end of its data, it is whole."""
    from ahakv_local import Llama
    from ahakv_local.engine import Engine

    data = fixture_model.read_bytes()
    full = read_header(fixture_model)
    assert full.kv_end < full.data_end <= len(data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: full.kv_end])  # in the tensor infos: the header is not whole
    with pytest.raises(AhakvError, match="corrupt or truncated GGUF header"):
        read_header(cut)
    for n in ((full.kv_end + full.data_end) // 2, full.data_end - 1):  # in the tensors' data
        cut.write_bytes(data[:n])
        info = read_info(cut)
        assert info.n_layer == read_info(fixture_model).n_layer
        message = rf"cut\.gguf is cut short: its tensors need {full.data_end:,} bytes, the file has {n:,} \(an "
        for load in (lambda: Engine(cut), lambda: Llama(str(cut), verbose=False),
                     lambda: Llama(str(cut), kv_budget=64, verbose=False)):  # fmt: skip
            with pytest.raises(AhakvError, match=message):
                load()
    cut.write_bytes(data[: full.data_end])
    assert read_info(cut).cut_short is None and read_header(cut) == full


def test_every_truncation_of_the_header_is_an_ahakv_error(fixture_model, tmp_path):
    data = fixture_model.read_bytes()
    end = read_header(fixture_model).kv_end
    path = tmp_path / "t.gguf"
    # every byte of the magic, the counts and the first pairs, then every 13th (keys, types, values, arrays)
    for n in [*range(512), *range(512, end, 13), end - 1]:
        path.write_bytes(data[:n])
        with pytest.raises(AhakvError, match=r"not a GGUF file|corrupt or truncated"):
            read_header(path)


def header_bytes(*kv: bytes, version: int = 3, n_kv: int | None = None) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kv) if n_kv is None else n_kv) + b"".join(kv)


def gguf_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a GGUF file"),
        (b"PK\x03\x04 a zip file", "not a GGUF file"),
        (header_bytes(version=1), "unsupported GGUF version 1"),
        (header_bytes(n_kv=2**62), "cannot fit"),
        (header_bytes(struct.pack("<Q", 2**60) + b"key"), "needs"),  # a key longer than the file
        (header_bytes(gguf_str("a") + struct.pack("<I", 13)), "unknown value type 13"),
        (header_bytes(gguf_str(b"\xff\xfe") + struct.pack("<II", 4, 1)), "not UTF-8"),
        (header_bytes(gguf_str("a") + struct.pack("<IIQ", 9, 4, 2**61)), "needs"),  # a uint32 array too long
        (header_bytes(gguf_str("a") + struct.pack("<IIQQ", 9, 8, 1, 2**40)), "runs past the end"),  # a string too
        (header_bytes(gguf_str("a") + struct.pack("<IIQ", 9, 99, 1)), "invalid array item type 99"),
        (header_bytes(gguf_str("a") + struct.pack("<IIQ", 9, 9, 1)), "invalid array item type 9"),  # nested
    ],
)
def test_garbage_is_an_ahakv_error(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(AhakvError, match=message) as exc:
        read_header(path)
    assert "\n" not in str(exc.value)


def test_missing_file_and_directory(tmp_path):
    for path in (tmp_path / "missing.gguf", tmp_path):
        with pytest.raises(AhakvError, match="cannot read"):
            read_header(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_headers_never_raise_anything_else(fixture_model, tmp_path, data):
    raw = bytearray(fixture_model.read_bytes()[:6000])  # the header and the start of the tensor infos
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        raw[data.draw(st.integers(4, len(raw) - 1), label="at")] = data.draw(st.integers(0, 255), label="byte")
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(raw[: data.draw(st.integers(4, len(raw)), label="length")]))
    try:
        read_header(path)
    except AhakvError as exc:
        assert "\n" not in str(exc)


def write_model(path, arch: str, head_count: int | list[int] = 4, endian=gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(str(path), arch, endianess=endian)
    w.add_block_count(2)
    w.add_embedding_length(16)
    w.add_context_length(64)
    w.add_head_count(head_count)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["mistral", "deci", "bert"])
def test_unsupported_architectures(tmp_path, arch):
    """Mistral GGUFs say "llama": "mistral" is no llama.cpp architecture; deci has a head count per layer."""
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch)
    with pytest.raises(AhakvError, match=rf"^unsupported architecture '{arch}' in {arch}\.gguf \(supported: ") as e:
        check_architecture(path)
    assert "\n" not in str(e.value)


def test_per_layer_head_counts_are_refused(tmp_path):
    path = tmp_path / "varying.gguf"
    write_model(path, "llama", [4, 2])
    with pytest.raises(AhakvError, match="different attention.head_count per layer"):
        check_architecture(path)
    write_model(path, "llama", [4, 4])  # an array of equal counts is one count
    assert check_architecture(path) == "llama" and read_info(path).n_head == 4


def test_engine_checks_the_architecture_before_loading(tmp_path):
    from ahakv_local.engine import Engine

    path = tmp_path / "deci.gguf"
    write_model(path, "deci")
    with pytest.raises(AhakvError, match="unsupported architecture 'deci'"):
        Engine(path)


def test_big_endian_header(tmp_path):
    path = tmp_path / "be.gguf"
    write_model(path, "llama", [4, 4], endian=gguf.GGUFEndian.BIG)
    assert_same_as_gguf_reader(path)
    assert read_info(path).n_head == 4


def test_the_drop_in_reads_the_header_once_and_a_rewritten_file_again(fixture_model, tmp_path, monkeypatch):
    """Building the drop-in asks for the model's header in five places (layout, budget, KV type, memory check,
    engine): one read serves them (reading_headers_once). Outside such a construction every call reads the file,
    so a model rewritten at the same path is seen as it is now."""
    from ahakv_local import info
    from ahakv_local.llama import Llama

    reads = []
    read = info._read_info
    monkeypatch.setattr(info, "_read_info", lambda path: reads.append(path) or read(path))
    with Llama(str(fixture_model), kv_budget=64, kv_type="f16", n_ctx=256, verbose=False):
        assert reads == [fixture_model]

    path = tmp_path / "model.gguf"
    path.write_bytes(fixture_model.read_bytes())
    assert read_info(path).architecture == "llama"
    path.write_bytes(fixture_path(FixtureSpec(arch="gemma3")).read_bytes())
    assert read_info(path).architecture == "gemma3"


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("block_count", 2**31, "2147483648, not 1 to 512"),  # info built tuples this long: out of memory
        ("block_count", 0, "0, not 1 to 512"),  # llama.cpp's load aborted, silently (GGML_ASSERT)
        ("block_count", 600, "600, not 1 to 512"),
        ("attention.head_count", 0, "0, not at least 1"),  # a ZeroDivisionError in info
        ("attention.head_count_kv", 0, "0, not at least 1"),
        ("embedding_length", None, "missing, not at least 1"),
        ("context_length", "long", "'long', not at least 1"),
    ],
)
def test_a_header_with_counts_no_model_has_is_one_line(tmp_path, fixture_model, key, value, shown):
    """A GGUF whose counts no model has, refused before anything is built from them or loaded, by every reader."""
    from ahakv_local.gguf_header import read_header

    kv = dict(read_header(fixture_model).kv)
    arch = kv["general.architecture"]
    kv.pop(f"{arch}.{key}", None)
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        if k.startswith(f"{arch}.") and isinstance(v, int) and not isinstance(v, bool):
            w.add_uint32(k, v)
    if isinstance(value, int):
        w.add_uint32(f"{arch}.{key}", value)
    elif value is not None:
        w.add_string(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = rf"^odd\.gguf is not a model ahakv-local can load: {arch}\.{re.escape(key)} is {re.escape(shown)}$"
    with pytest.raises(AhakvError, match=message):
        check_architecture(path)
    with pytest.raises(AhakvError, match=message):
        read_info(path)
    proc = subprocess.run([sys.executable, "-m", "ahakv_local", "info", str(path)], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and re.match("^error: " + message[1:], lines[0]), proc.stderr


def test_a_model_s_name_is_printed_with_its_control_characters_escaped(tmp_path, fixture_model):
    """``info`` printed general.name as the file says it: a newline or a terminal's escape sequences reached the
    terminal."""
    from ahakv_local.gguf_header import read_header

    kv = dict(read_header(fixture_model).kv)
    arch = kv["general.architecture"]
    path = tmp_path / "named.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        if k.startswith(f"{arch}.") and isinstance(v, int) and not isinstance(v, bool):
            w.add_uint32(k, v)
    w.add_name("evil\nmodel \x1b[31mred\x1b[0m")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_info(path).name == "evil\\nmodel \\x1b[31mred\\x1b[0m"
