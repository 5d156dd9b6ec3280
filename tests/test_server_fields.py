"""What an app written for llama-cpp-python's server sends, on both servers (one at a time, and ``--parallel``): its
sampling fields are taken or refused by name, never ignored; a browser app of another origin may call it; HEAD health
checks and the openai client's ``models.retrieve``; a sequence that reaches the trained context ends alone."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import pytest
import uvicorn
from test_server import call, free_port

from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.llama import Llama
from ahakv_local.parallel import RANDOM_SEED, Generation, Sampling, SequencePool
from ahakv_local.server import create_app
from ahakv_local.session import SessionSpec
from ahakv_local.stream_text import stop_prefix

CHUNK = 16


@contextlib.contextmanager
def served(model, parallel: bool):
    """The fixture served in this process, one request at a time or in two sequence slots; its base URL."""
    with served_app(model, parallel) as (base, _):
        yield base


@contextlib.contextmanager
def served_app(model, parallel: bool):
    """``served``'s server; (its base URL, its runner)."""
    with contextlib.ExitStack() as stack:
        if parallel:
            spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
            e = stack.enter_context(Engine(model, EngineConfig(n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)))
            llm = SequencePool(e, spec)
        else:
            llm = stack.enter_context(Llama(str(model), kv_budget=48, kv_policy="h2o", kv_recent=8, verbose=False))
        port = free_port()
        app = create_app(llm, "fixture")
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}", app.state.runner
        finally:
            server.should_exit = True
            thread.join(timeout=10)


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_llama_cpp_python_s_sampling_fields_are_taken_or_refused_by_name(fixture_model, parallel):
    """top_k, min_p, grammar... were accepted and ignored: `"top_k": 1` at temperature 1.5 answered something else
    every time, and a grammar was dropped with a 200."""
    with served(fixture_model, parallel) as base:
        body = {"prompt": "the quick brown fox", "max_tokens": 6}
        status, greedy = call(base, "/v1/completions", {**body, "temperature": 0})
        assert status == 200
        for seed in (1, 2, 3):  # top_k 1 is greedy at any temperature
            status, out = call(base, "/v1/completions", {**body, "temperature": 1.5, "top_k": 1, "seed": seed})
            assert status == 200 and out["choices"][0]["text"] == greedy["choices"][0]["text"], out
        status, out = call(base, "/v1/completions", {**body, "temperature": 1.5, "min_p": 1.0, "seed": 4})
        assert status == 200 and out["choices"][0]["text"] == greedy["choices"][0]["text"]  # min_p 1: the likeliest
        for field, value, says in [
            ("grammar", 'root ::= "yes" | "no"', "no GBNF grammar"),
            ("mirostat_mode", 2, "no mirostat sampling"),
            ("top_k", -1, "greater than or equal to 0"),
        ]:
            status, out = call(base, "/v1/completions", {**body, field: value})
            assert status == 400 and field in out["error"]["message"] and says in out["error"]["message"], out
        status, out = call(base, "/v1/completions", {**body, "repeat_penalty": 1.3, "typical_p": 1.0})
        if parallel:  # its sampler has no repeat penalty: refused by name
            assert status == 400 and out["error"]["message"].startswith("repeat_penalty=1.3 is not supported with")
        else:
            assert status == 200


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_a_browser_app_head_checks_and_models_retrieve(fixture_model, parallel):
    with served(fixture_model, parallel) as base:
        preflight = urllib.request.Request(
            base + "/v1/chat/completions",
            method="OPTIONS",
            headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        )
        with urllib.request.urlopen(preflight, timeout=10) as r:  # it was a 405: web chat UIs could not call it
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] in ("*", "http://localhost:3000")
        for path in ("/health", "/v1/models"):
            with urllib.request.urlopen(urllib.request.Request(base + path, method="HEAD"), timeout=10) as r:
                assert r.status == 200
        assert call(base, "/v1/models/fixture") == (200, call(base, "/v1/models")[1]["data"][0])
        status, out = call(base, "/v1/models/another")
        assert status == 404 and "fixture" in out["error"]["message"]
        status, out = call(base, "/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}})
        assert status == 400 and "stream_options is only allowed with stream: true" in out["error"]["message"]


def test_a_sequence_at_the_trained_context_ends_alone_with_length(fixture_model, license_text):
    """A request whose prompt and max_tokens passed the trained context failed the batch's llama_decode, and the
    server answered every request running beside it with that error. It now ends "length" where the one-at-a-time
    server (llama-cpp-python) does: prompt + tokens = the trained context, the last one sampled, never decoded."""
    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        words = e.tokenize(license_text * 4)
        near = e.n_ctx_train - 5
        assert len(words) > near
        ends: dict[str, str] = {}
        long = Generation(words[:near], Sampling(max_tokens=40, temperature=0), lambda t, f: f and ends.update(long=f))
        short = Generation(words[:30], Sampling(max_tokens=12, temperature=0), lambda t, f: f and ends.update(short=f))
        pool.start(long)
        pool.start(short)
        while pool.active:
            pool.step()
        assert ends == {"long": "length", "short": "length"}
        assert len(long.tokens) == 5 and len(short.tokens) == 12


def test_sampling_top_k_min_p_and_a_random_seed(fixture_model):
    logits = np.array([5.0, 4.0, 0.0, -10.0], dtype=np.float32)
    rng = np.random.default_rng(0)

    def drawn(**kw) -> Counter:
        s = Sampling(max_tokens=1, temperature=1.0, top_p=1.0, **kw)
        return Counter(s.pick(logits, Counter(), rng) for _ in range(400))

    assert set(drawn(top_k=1, min_p=0.0)) == {0}
    assert set(drawn(top_k=0, min_p=0.5)) == {0}  # p1 / p0 = e^-1 = 0.37 < 0.5
    assert set(drawn(top_k=0, min_p=0.3)) == {0, 1}
    assert set(drawn(top_k=0, min_p=0.0)) == {0, 1, 2}  # p2 / p0 = e^-5: drawn in 400 at 0.67%
    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)

        def state_of(seed) -> dict:
            gen = Generation(e.tokenize("a few words"), Sampling(max_tokens=1, seed=seed), lambda t, f: None)
            seq = pool.start(gen)
            return pool._rng[seq].bit_generator.state

        assert state_of(7) == state_of(7)
        # -1 (a uint32 4294967295: llama.cpp's LLAMA_DEFAULT_SEED) is a seed drawn at random, as on the other server
        assert state_of(RANDOM_SEED) != state_of(RANDOM_SEED)


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_an_unseeded_request_draws_its_own_seed(fixture_model, parallel):
    """OpenAI's clients expect a request without a seed to sample at random. The one-at-a-time server let
    llama-cpp-python draw the seed from random.Random(the last seed given): every fresh server gave the same answers to
    the same unseeded requests, and a seeded request decided the unseeded ones after it. Three fresh servers answer
    one unseeded request (temperature 1, top-k, top-p and min-p off) alike with a probability of at most q^2, q the
    chance that two draws of its first token agree (the sum of its probabilities squared, computed here from the
    fixture's first row: about 0.01); seeded, two fresh servers agree."""
    body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    body["min_p"] = 0.0
    rows = []
    with Llama(str(fixture_model), verbose=False) as plain:
        keep = lambda ids, scores: rows.append(np.array(scores, dtype=np.float64)) or scores  # noqa: E731
        plain.create_completion(body["prompt"], max_tokens=1, temperature=0.0, logits_processor=[keep])
    p = np.exp(rows[0] - rows[0].max())
    p /= p.sum()
    assert (p**2).sum() < 0.02
    answers: dict[int | None, set[str]] = {None: set(), 5: set()}
    for seed, servers in ((None, 3), (5, 2)):
        for _ in range(servers):
            with served(fixture_model, parallel) as base:
                status, out = call(base, "/v1/completions", body | ({} if seed is None else {"seed": seed}))
            assert status == 200
            answers[seed].add(out["choices"][0]["text"])
    assert len(answers[None]) > 1 and len(answers[5]) == 1


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_an_empty_question_is_refused_on_both_servers(fixture_model, parallel):
    """kv_query "" or blank was read plainly without a word (session.guide_of is both servers' one rule now)."""
    with served(fixture_model, parallel) as base:
        for query in ("", "  "):
            status, out = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 1, "kv_query": query})
            assert status == 400 and "not an empty text" in out["error"]["message"], out


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_a_lone_surrogate_is_refused_by_field_on_both_servers(fixture_model, parallel):
    """JSON's "\\ud800" (half of a UTF-16 pair) is no character: in a prompt or a message it was a 400 in the codec's
    words ("'utf-8' codec can't encode ..."), and in a stop string a 400 one at a time and ignored by --parallel."""
    chat = {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 1}
    with served(fixture_model, parallel) as base:
        for path, body, field in (
            ("/v1/completions", {"prompt": "x\ud800y", "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["ok", "\ud800"]}, "stop"),
            ("/v1/chat/completions", chat, "messages"),
        ):
            status, out = call(base, path, body)
            message = f"{field} holds '\\ud800', half of a UTF-16 pair: not a character (give the pair whole)"
            assert status == 400 and message in out["error"]["message"], out
        status, out = call(base, "/v1/completions", {"prompt": "x \U0001f600", "max_tokens": 1, "stop": "\U0001f600"})
        assert status == 200, out  # (a whole pair is its character)
        if not parallel:  # a dict's key too (a schema's property name was taken); --parallel refuses a format at all
            schema = {"type": "object", "properties": {"\ud800": {"type": "string"}}}
            fmt = {"type": "json_object", "schema": schema}
            asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": fmt}
            status, out = call(base, "/v1/chat/completions", asked)
            assert status == 400 and "response_format holds '\\ud800'" in out["error"]["message"], out


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_an_unknown_kv_field_is_refused_by_name(fixture_model, parallel):
    """This server's own fields are kv_budget, kv_policy and kv_query: "kv_error_tol" or a misspelt "kv_budegt" was
    accepted and changed nothing (unknown OpenAI fields such as user still are: they change nothing by design)."""
    with served(fixture_model, parallel) as base:
        for field in ("kv_error_tol", "kv_budegt"):
            status, out = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 1, field: 0.5})
            assert status == 400 and f"{field} is not a field of this server" in out["error"]["message"], out
        status, out = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": "u", "kv_budget": 48})
        assert status == 200, out


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_openai_message_shapes_are_taken_or_refused_in_one_line(fixture_model, parallel):
    """An assistant turn with content null (OpenAI's history of a tool call; llama-cpp-python's server takes it) was a
    400 of three pydantic errors, and so were a tool message and an image part, naming nothing of why."""
    with served(fixture_model, parallel) as base:
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
        for turn in (history[1], {"role": "assistant"}):
            body = {"messages": [history[0], turn, {"role": "user", "content": "go on"}], "max_tokens": 2}
            status, out = call(base, "/v1/chat/completions", body)
            assert status == 200, out
        refused = [
            ({"role": "tool", "content": "42", "tool_call_id": "a"}, "messages.1.role: messages of role 'tool' are"),
            ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
             "messages.1.content: content parts of type 'image_url' are not supported: this server reads text only"),
            ({"role": "user", "content": None}, "messages.1: a user message needs its content"),
        ]  # fmt: skip
        for turn, message in refused:
            status, out = call(base, "/v1/chat/completions", {"messages": [history[0], turn], "max_tokens": 2})
            assert status == 400 and out["error"]["message"].startswith(message), out


@pytest.mark.parametrize("parallel", [False, True], ids=["one at a time", "parallel"])
def test_a_request_s_own_mistakes_are_refused_while_the_model_is_busy(fixture_model, parallel):
    """A request sure to be refused waited for the model or a slot before its 400 (15 s behind a long answer one at a
    time, 45 s behind two with --parallel; a 503 "busy" past the busy timeout), and a prompt of megabytes was
    tokenized holding the model, or the scheduler, which stalled every running stream. Each is answered while the
    model is held here (the one-at-a-time server's lock, the scheduler's condition)."""
    with served_app(fixture_model, parallel) as (base, runner):
        bad = [
            ({"prompt": "x", "kv_policy": "nonexistent"}, "unknown policy 'nonexistent'"),
            ({"prompt": "x", "kv_budget": "lots"}, "budget must be"),
            ({"prompt": "a b " * 5000}, "past the model's trained context of 4096"),
        ]
        if parallel:
            bad += [({"prompt": "x", "repeat_penalty": 1.3}, "repeat_penalty=1.3 is not supported with --parallel")]
        held = runner.cond if parallel else contextlib.nullcontext()
        if not parallel:
            assert runner.lock.acquire(timeout=5)
        try:
            with held:
                for body, message in bad:
                    t0 = time.monotonic()
                    status, out = call(base, "/v1/completions", body | {"max_tokens": 2}, timeout=30)
                    assert status == 400 and message in out["error"]["message"], out
                    assert time.monotonic() - t0 < 20  # (not waiting for the model: a tokenization's time at most)
        finally:
            if not parallel:
                runner.lock.release()
        status, out = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200, out


def test_a_request_without_max_tokens_gets_llama_cpp_python_s_defaults(fixture_model):
    """A completion 16 tokens, a chat's answer up to the server's limit (llama-cpp-python's server and OpenAI's
    defaults; both were 256). Greedy continuations of the fixture end at no end-of-generation token here."""
    with served(fixture_model, False) as base:
        status, out = call(base, "/v1/completions", {"prompt": "the quick brown fox", "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 16
    from ahakv_local.server import ChatRequest, CompletionRequest, sampling_of

    assert sampling_of(ChatRequest(messages=[{"role": "user", "content": "hi"}]), 300)["max_tokens"] == 300
    assert sampling_of(CompletionRequest(prompt="hi"), 300)["max_tokens"] == 16


def test_top_p_takes_the_probabilities_before_the_temperature():
    """llama-cpp-python chains top-k, top-p, min-p, then the temperature: top-p cuts the probabilities at temperature 1.
    The parallel sampler cut the tempered ones. Known answers for logits [1.5, 1.0, 0.0]: at temperature 1 their
    probabilities are 0.547, 0.332, 0.122, so top-p 0.5 keeps the first token alone (it drew the second 44% of the
    time at temperature 2) and top-p 0.85 the first two, drawn at temperature 2 as exp(0.75) : exp(0.5)."""
    logits = np.array([1.5, 1.0, 0.0] + [-30.0] * 5, dtype=np.float32)
    rng = np.random.default_rng(0)

    def drawn(top_p: float, n: int) -> Counter:
        s = Sampling(max_tokens=1, temperature=2.0, top_p=top_p, top_k=40, min_p=0.0)
        return Counter(s.pick(logits, Counter(), rng) for _ in range(n))

    assert drawn(0.5, 300) == Counter({0: 300})
    two = drawn(0.85, 4000)
    assert set(two) == {0, 1}
    p0 = np.exp(0.75) / (np.exp(0.75) + np.exp(0.5))  # 0.562
    # within 4 binomial standard deviations of 4,000 draws (0.031)
    assert abs(two[0] / 4000 - p0) < 4 * np.sqrt(p0 * (1 - p0) / 4000)


def test_a_stream_holds_back_only_what_may_begin_a_stop_string():
    stops = ("\nAssistant:", "###")
    assert stop_prefix("Hello there", stops) == 0  # it held 10 characters back whatever the text
    assert stop_prefix("Hello\nAssis", stops) == 6
    assert stop_prefix("Hello ##", stops) == 2
    assert stop_prefix("\n", stops) == 1


def test_a_second_ctrl_c_ends_the_server_at_once_without_tracebacks(monkeypatch, capsys):
    """A second Ctrl-C while a prompt was read: uvicorn's forced exit cancelled the request mid-way, four tracebacks
    in the log and a 500 to the client. It now ends the process at once, as "interrupted" (exit 130)."""
    import os
    import signal

    from fastapi import FastAPI

    from ahakv_local.server import Server

    stopping = threading.Event()
    server = Server(uvicorn.Config(FastAPI()), stopping)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    server.handle_exit(signal.SIGINT, None)  # the first: a graceful stop, the generations told to end
    assert server.should_exit and stopping.is_set() and not server.force_exit
    with pytest.raises(SystemExit) as ended:
        server.handle_exit(signal.SIGINT, None)
    assert ended.value.code == 130 and capsys.readouterr().err == "interrupted\n" and not server.force_exit


def test_a_body_that_is_not_json_says_so(fixture_model):
    """curl -d without -H Content-Type sends a form: the 400 said "Input should be a valid dictionary or object to
    extract fields from", and an empty body "Field required"."""
    with served(fixture_model, parallel=False) as base:
        form = "application/x-www-form-urlencoded"  # (urllib's, as curl's -d: what a body without a type is sent as)
        for body, sent in [(b"prompt=hi", form), (b"", form)]:
            req = urllib.request.Request(base + "/v1/completions", body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(req, timeout=10)
            message = json.load(answer.value)["error"]["message"]
            assert answer.value.code == 400 and message == (
                f"the body must be a JSON object, sent as Content-Type: application/json (it was {sent})"
            )


def test_a_reconstruction_needs_the_room_of_its_repetition():
    """The room of a question (64 cells beside a chunk of 64) holds no repetition (32 tokens and the chunk again):
    such a request was read plainly once the cache was full. Known answers from ``guide_room``."""
    from ahakv_local.errors import AhakvError
    from ahakv_local.policies import make_policy
    from ahakv_local.server import check_request_query

    ahakv = make_policy("ahakv")
    check_request_query("reconstruct", ahakv, room=96, chunk=64)  # a server started with --reading reconstruct
    check_request_query("Who may copy it?", ahakv, room=64, chunk=64)  # a question fits the question's room
    with pytest.raises(AhakvError, match='kv_query "reconstruct" decodes a repetition of 96 tokens .* keep 64'):
        check_request_query("reconstruct", ahakv, room=64, chunk=64)


def test_requests_waiting_for_the_model_take_it_in_the_order_they_came():
    """The one-at-a-time server's requests polled a threading.Lock, which promises no order: 25 requests sent 30 ms
    apart were served 97 of 300 pairs out of order, and the first could wait past the busy timeout while later ones
    ran. Its FifoLock is taken in the order of asking; a waiter that gives up (its client left) leaves the line, and
    one past its timeout is refused."""
    from ahakv_local.server import FifoLock, SerialRunner

    lock, order, gave_up = FifoLock(), [], threading.Event()
    assert lock.acquire(1.0)  # a request holds the model

    def wait(i: int) -> None:
        if lock.acquire(30.0, give_up=(gave_up.is_set if i == 3 else lambda: False)):
            order.append(i)
            lock.release()

    threads = []
    for i in range(8):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        while len(lock._waiting) < i + 1:  # in the line before the next one asks
            time.sleep(0.001)
    assert not lock.acquire(0.05)  # the line is long: refused past its timeout, and it left the line
    gave_up.set()  # the fourth one's client leaves
    while len(lock._waiting) > 7:
        time.sleep(0.001)
    lock.release()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 4, 5, 6, 7]
    assert "FifoLock" in SerialRunner.__init__.__code__.co_names


def test_connections_past_the_cap_are_refused_not_left_to_use_up_the_files(fixture_model):
    """Connections that never finish their request held a file each: 1,100 of them used up a 1,024-file limit, then
    every client waited and uvicorn logged "Too many open files" ~16,000 times a second. Past MAX_CONNECTIONS a new
    one gets a 503 at once, and once they close the server answers again."""
    import socket

    from test_server import start_server, stop_server

    from ahakv_local.server import MAX_CONNECTIONS

    proc, base = start_server(fixture_model, "--budget", "48")
    host, port = base.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /hea")  # a request line never finished
            held.append(s)
        time.sleep(0.5)  # (uvicorn counts a connection once it has read from it)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/health", timeout=10)
        assert refused.value.code == 503
    finally:
        for s in held:
            s.close()
    try:
        time.sleep(0.5)
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            assert r.status == 200
    finally:
        stop_server(proc)


def test_the_parallel_server_drops_bytes_that_are_no_utf8_as_llama_cpp_python_does(fixture_model):
    """The random-weight fixture samples bytes that are no UTF-8 all the time. llama-cpp-python drops them
    (errors="ignore"), and so does the one-at-a-time server; the parallel server's text had U+FFFD in their place, in
    the middle and at a "length" finish. The reference: llama_cpp.Llama's 24 greedy tokens, read in the same chunks
    (the budget of 48 evicts nothing), their bytes decoded as llama-cpp-python decodes them."""
    import llama_cpp

    prompt = "Once upon a time"
    upstream = llama_cpp.Llama(str(fixture_model), n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, verbose=False)
    try:
        tokens = upstream.tokenize(prompt.encode())
        sampled = []
        for token in upstream.generate(tokens, temp=0.0):
            sampled.append(token)
            if len(sampled) == 24:
                break
        assert len(tokens) + len(sampled) < 48 and not any(upstream.token_eos() == t for t in sampled)
        want = upstream.detokenize(sampled).decode("utf-8", errors="ignore")
        assert "\ufffd" in upstream.detokenize(sampled).decode("utf-8", errors="replace")  # (bytes to drop)
    finally:
        upstream.close()
    with served(fixture_model, True) as base:
        status, out = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert status == 200, out
        assert out["choices"][0]["text"] == want
