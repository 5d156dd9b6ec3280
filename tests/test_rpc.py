"""llama.cpp RPC workers on loopback: two `ahakv-local rpc-server` processes hold the model's layers.

Tolerance: none (exact equality). The workers run the very ggml CPU kernels the client would (the same build of
the same patched tree, on the same machine), and ggml's CPU kernels give every output element to one thread that
sums in a fixed order, whatever the thread count, so a worker computes the same floats as the local run. What
does differ is weight repacking: the local CPU repacks Q4_K weights into layouts whose kernels round differently
(Gemma 270M: up to 3.54 in a logit over 100 tokens), a worker keeps the plain layout; so every local run here is
made with ``repack_weights=False``. On two machines with different SIMD paths the results would differ by
rounding; that is not what this file tests.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from ahakv_local import build, rpc, upstream
from ahakv_local.cli import main
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.fixture import FixtureSpec
from ahakv_local.models import fixture_path
from ahakv_local.native import TapFlag
from ahakv_local.session import SessionSpec, open_session

ALL = TapFlag.VNORM | TapFlag.ATTN | TapFlag.SIDE | TapFlag.VERR
KINDS = ("attn", "side", "verr", "vnorm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rpc_engine_reason() -> str | None:
    """Why the installed engine cannot run workers (None: it can)."""
    try:
        rpc.server_binary()
    except AhakvError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Two loopback workers on free ports, one thread each; their addresses as `--rpc` takes them."""
    reason = rpc_engine_reason()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("workers")
    procs, endpoints = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(logs / f"worker{i}.log", "wb")  # noqa: SIM115 (closed with the process)
            cmd = [sys.executable, "-m", "ahakv_local", "rpc-server", "--port", str(port), "--threads", "1"]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            endpoints.append(f"127.0.0.1:{port}")
        for ep in endpoints:
            deadline = time.monotonic() + 60
            while True:
                try:
                    rpc.check_worker(ep, timeout=2)
                    break
                except AhakvError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p, _ in procs):
                        raise
                    time.sleep(0.2)
        yield ",".join(endpoints)
    finally:
        for proc, log in procs:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


def config(**kw) -> EngineConfig:
    # F32 cache as in test_tap_fixture; repacking off (the module's docstring)
    return EngineConfig(n_ctx=256, n_batch=64, n_ubatch=16, type_k="f32", type_v="f32", repack_weights=False, **kw)


def run_with_tap(engine: Engine, tokens: list[int], evict: list[int]) -> list[np.ndarray]:
    """Logits and every statistic of every layer: a prompt, an eviction, then three single tokens."""
    out = []
    engine.set_tap(ALL, window=8)
    out.append(engine.decode(tokens[:40], all_logits=True))
    out += [engine.stat(k, il).values for il in range(engine.n_layer) for k in KINDS]
    out.append(engine.live_positions())
    engine.evict(evict)
    for t in tokens[40:43]:
        engine.reset_stats()
        out.append(engine.decode([t]))
        out += [engine.stat(k, il).values for il in range(engine.n_layer) for k in KINDS]
        out += [engine.stat(k, il).positions for il in range(engine.n_layer) for k in KINDS]
    out.append(engine.live_positions())
    return out


def test_logits_statistics_and_evictions_equal_the_local_run(workers, fixture_model, license_text, capfd):
    with Engine(fixture_model, config()) as local:
        tokens = local.tokenize(license_text)[:43]
        evict = [5, 6, 7, 20, 33]
        expected = run_with_tap(local, tokens, evict)
    with Engine(fixture_model, config(rpc_servers=tuple(workers.split(",")), verbose=True)) as remote:
        got = run_with_tap(remote, tokens, evict)
    log = capfd.readouterr().err
    # the layers were on the workers: llama.cpp used both, and gave every layer to one of them
    for ep in workers.split(","):
        assert re.search(rf"using device RPC\d+ \({re.escape(ep)}\)", log), log[-3000:]
    placed = re.findall(r"layer +(\d+) assigned to device (\S+),", log)
    # (llama.cpp numbers the output layer n_layer)
    assert sorted(int(il) for il, _ in placed) == list(range(remote.n_layer + 1)), log[-3000:]
    assert all(dev.startswith("RPC") for _, dev in placed) and len({dev for _, dev in placed}) == 2, placed
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.shape == b.shape and np.array_equal(a, b), f"item {i}: max diff {np.abs(a - b).max()}"


def test_a_budgeted_greedy_generation_equals_the_local_one(workers, fixture_model, license_text):
    spec = SessionSpec.bounded("ahakv", 48, evict_every=4)

    def generate(**kw) -> tuple[list[int], list[int], int]:
        with open_session(fixture_model, spec, 200, 16, repack_weights=False, **kw) as session:
            prompt = session.engine.tokenize(license_text)[:120]
            out, _ = session.answer(session.read(prompt), 40)
            ctl = session.controller
            return out, ctl.live.tolist(), ctl.stats.evicted

    local = generate()
    assert local[2] > 0  # the budget evicted
    assert generate(rpc_servers=tuple(workers.split(","))) == local


def test_llama_dropin_takes_rpc_servers(workers, fixture_model):
    from ahakv_local import Llama

    def complete(**kw) -> str:
        llm = Llama(str(fixture_model), kv_budget=48, n_ctx=256, verbose=False, repack_weights=False, **kw)
        try:
            prompt = "the quick brown fox jumps over the lazy dog " * 8  # longer than the budget
            return llm.create_completion(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
        finally:
            llm.close()

    assert complete(rpc_servers=workers) == complete()


def test_two_models_of_one_process_share_the_workers(workers, fixture_model, license_text):
    """A worker serves one connection at a time: a second model must not probe a worker the first one holds
    (the probe would wait there until it timed out), and both decode on it; once both are closed, a new model
    checks the workers again and connects anew."""
    servers = tuple(workers.split(","))
    with Engine(fixture_model, config(rpc_servers=servers)) as a:
        tokens = a.tokenize(license_text)[:20]
        first = a.decode(tokens)
        with Engine(fixture_model, config(rpc_servers=servers)) as b:
            assert np.array_equal(b.decode(tokens), first)
    with Engine(fixture_model, config(rpc_servers=servers)) as c:
        assert np.array_equal(c.decode(tokens), first)


def test_serve_parallel_takes_rpc(workers, fixture_model):
    """serve --parallel reads the model onto the workers too (it ignored --rpc: every layer stayed on the server),
    and refuses a malformed address in one line before the model is read."""
    from ahakv_local.cli import load_pool
    from ahakv_local.errors import AhakvError

    kw = dict(ctx_size=None, budget="48", policy="ahakv", sinks=4, recent=8, error_tol=0.05, evict_every=None,
              observe_steps=1, threads=1, n_gpu_layers=None, batch_size=16)  # fmt: skip
    with pytest.raises(AhakvError, match="bad RPC worker address 'nohost'"):
        load_pool("fixture", 2, rpc="nohost", **kw)
    pool = load_pool(str(fixture_model), 2, rpc=workers, **kw)
    try:
        assert pool.engine.config.rpc_servers == tuple(workers.split(","))
        assert pool.engine.config.n_gpu_layers == -1  # every layer on the workers (-ngl not given)
    finally:
        pool.engine.close()


def test_one_worker_under_two_names_is_refused(workers):
    """A second connection to a worker that serves one client at a time waits for ever: llama.cpp hung with
    127.0.0.1:P,localhost:P (or a port written 0P). Refused before any connection, in one line."""
    port = workers.split(",")[0].rsplit(":", 1)[1]
    # every address of this machine reaches a worker listening on all of them (0.0.0.0, 127.0.0.2: the load hung)
    pairs = [
        (f"127.0.0.1:{port}", f"localhost:{port}"),
        (f"127.0.0.1:{port}", f"127.0.0.1:0{port}"),
        (f"0.0.0.0:{port}", f"127.0.0.1:{port}"),
        (f"127.0.0.1:{port}", f"127.0.0.2:{port}"),
    ]
    for first, second in pairs:
        # both names said (the line named one of them twice: "... 127.0.0.1:P is 127.0.0.1:P, as another address is")
        with pytest.raises(AhakvError) as refused:
            rpc.Devices(rpc.parse_servers(f"{first},{second}"))
        assert str(refused.value) == f"RPC worker listed twice: {first} and {second} are both 127.0.0.1:{port}"


def test_a_worker_in_use_under_another_name_is_refused(workers):
    """A model of this process connected to 127.0.0.1:P, a second one naming localhost:P: llama.cpp shares a
    connection by name, so it opened another, which the worker left waiting (the load hung; Ctrl-C aborted)."""
    port = workers.split(",")[0].rsplit(":", 1)[1]
    held = rpc.Devices((f"127.0.0.1:{port}",))
    with pytest.raises(AhakvError) as refused:
        rpc.Devices((f"localhost:{port}",))
    assert str(refused.value) == (
        f"the RPC worker localhost:{port} is 127.0.0.1:{port}, which a model of this process is connected to: name it "
        f"127.0.0.1:{port} here too (a worker serves one connection at a time)"
    )
    assert rpc.Devices((f"127.0.0.1:{port}",)).workers == held.workers  # the same name shares the connection


def test_layers_stay_local_with_ngl_0(workers, fixture_model, capfd):
    """README: "`-ngl 0` keeps them on the CPU"; an explicit 0 was read as "not asked" and every layer went to the
    workers. Not asking still puts every layer there, for the engine and the drop-in, whose default layout then is
    the offloaded one (natural) as with -ngl -1."""
    from ahakv_local import Llama

    servers = tuple(workers.split(","))
    for layers, where in ((0, "CPU"), (None, "RPC")):
        with Engine(fixture_model, config(rpc_servers=servers, n_gpu_layers=layers, verbose=True)) as engine:
            n_layer = engine.n_layer
        placed = re.findall(r"layer +\d+ assigned to device (\S+),", capfd.readouterr().err)
        assert len(placed) == n_layer + 1 and all(dev.startswith(where) for dev in placed), (layers, placed)
    gemma3 = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))  # sliding and full layers: adaptive on the CPU
    kw = dict(kv_budget=48, n_ctx=256, n_threads=1, verbose=False, rpc_servers=workers)
    for asked, layers, layout in (({}, -1, "natural"), ({"n_gpu_layers": 0}, 0, "adaptive")):
        llm = Llama(str(gemma3), **kw, **asked)
        try:
            # (llama-cpp-python stores -1, every layer, as INT_MAX)
            offloaded = llm.model_params.n_gpu_layers != 0
            assert (offloaded, llm.kv_stats().layer_budgets) == (layers != 0, layout), asked
        finally:
            llm.close()


def test_gemma_ahakv_budget_128_greedy_equals_local_without_repacking(workers, gemma_model, license_text):
    spec = SessionSpec.bounded("ahakv", 128)

    def generate(**kw) -> list[int]:
        with open_session(gemma_model, spec, 700, 64, repack_weights=False, **kw) as session:
            prompt = session.engine.tokenize(license_text)[:600]
            return session.answer(session.read(prompt), 32)[0]

    assert generate(rpc_servers=tuple(workers.split(","))) == generate()


# -- errors: one line, non-zero exit ---------------------------------------------------------------------


def one_line(result, pattern: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert pattern in lines[0], lines[0]


# (the last two: digits str.isdigit() takes and llama.cpp's parser aborts the process on)
BAD_ADDRESSES = [
    "localhost",
    "host:",
    ":50052",
    "host:port",
    "host:0",
    "host:70000",
    "::1:5",
    "host:\u0665\u0660",
    "host:5\u00b2",
]


@pytest.mark.parametrize("bad", BAD_ADDRESSES)
def test_bad_worker_address(bad):
    with pytest.raises(AhakvError, match="bad RPC worker address"):
        rpc.parse_servers(f"127.0.0.1:50052,{bad}")
    one_line(CliRunner().invoke(main, ["generate", "fixture", "--rpc", bad, "-p", "x"]), "bad RPC worker address")


@pytest.mark.parametrize(
    "command", [["chat"], ["generate", "-p", "x"], ["serve"], ["eval", "ppl"], ["eval", "needle"], ["eval", "longdoc"]]
)
def test_every_model_command_takes_rpc(command, monkeypatch):
    """--rpc and AHAKV_RPC reach the address check of every command that loads a model (before the model)."""
    one_line(CliRunner().invoke(main, [*command, "fixture", "--rpc", "nohost"]), "bad RPC worker address 'nohost'")
    monkeypatch.setenv("AHAKV_RPC", "127.0.0.1:99999")
    one_line(CliRunner().invoke(main, [*command, "fixture"]), "bad RPC worker address '127.0.0.1:99999'")


def test_parse_servers():
    assert rpc.parse_servers(" a:1, b.example:50052 ") == ("a:1", "b.example:50052")
    assert rpc.parse_servers(["10.0.0.2:50052"]) == ("10.0.0.2:50052",)
    with pytest.raises(AhakvError, match="listed twice"):
        rpc.parse_servers("a:1,a:1")
    with pytest.raises(AhakvError, match="no RPC worker"):
        rpc.parse_servers(" , ")


def test_unreachable_worker(fixture_model):
    port = free_port()  # nothing listens there
    result = CliRunner().invoke(main, ["generate", str(fixture_model), "--rpc", f"127.0.0.1:{port}", "-p", "x"])
    one_line(result, f"cannot reach the RPC worker 127.0.0.1:{port}")
    with pytest.raises(AhakvError, match="cannot reach"):
        Engine(fixture_model, EngineConfig(n_ctx=256, rpc_servers=(f"127.0.0.1:{port}",)))


def test_a_port_that_is_not_a_worker():
    with socket.socket() as server:  # listens, never answers the handshake
        server.bind(("127.0.0.1", 0))
        server.listen()
        with pytest.raises(AhakvError, match="accepted the connection but did not answer the RPC handshake"):
            rpc.check_worker(f"127.0.0.1:{server.getsockname()[1]}", timeout=0.5)


def test_rpc_server_without_an_rpc_engine(monkeypatch, tmp_path):
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(build, "installed_package", lambda: tmp_path)  # an engine built without --rpc
    one_line(CliRunner().invoke(main, ["rpc-server", "--port", str(free_port())]), "ahakv-local build --rpc")
    monkeypatch.setattr(build, "installed_package", lambda: None)  # no engine at all
    one_line(CliRunner().invoke(main, ["rpc-server"]), "ahakv-local build --rpc")


def test_a_client_engine_without_the_rpc_backend(workers, fixture_model, monkeypatch):
    class NoRpcBackend:  # a libggml built without GGML_RPC: the registry has no "RPC"
        def __getattr__(self, name):
            return lambda *args: None

    monkeypatch.setattr(upstream, "ggml_cdll", NoRpcBackend)
    with pytest.raises(AhakvError, match=r"no RPC backend: run `ahakv-local build --rpc`"):
        Engine(fixture_model, config(rpc_servers=tuple(workers.split(","))))


@pytest.mark.parametrize("host", ["localhost", "", "no-such-host.invalid"])
def test_rpc_server_host_names(host, monkeypatch):
    """The worker takes a numeric IPv4 address only: `--host localhost` failed there and exited 0. A name is
    resolved here (the worker gets its address), one that does not resolve is one line and exit 1."""
    seen = []
    monkeypatch.setattr(rpc.os, "execv", lambda exe, args: seen.append(args))
    result = CliRunner().invoke(main, ["rpc-server", "--host", host, "--port", str(free_port())])
    if host == "localhost":
        assert result.exit_code == 0 and seen and seen[0][seen[0].index("--host") + 1] == "127.0.0.1", result.output
    else:
        assert not seen
        one_line(result, "--host")


def test_rpc_server_on_a_port_in_use(workers):
    port = workers.split(",")[0].rsplit(":", 1)[1]
    one_line(CliRunner().invoke(main, ["rpc-server", "--port", port]), f"cannot listen on 127.0.0.1:{port}")
