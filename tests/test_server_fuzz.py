"""`ahakv-local serve` under generated requests and a soak with clients that drop their connections.

Every answer must be a 200 or a 4xx with an OpenAI-shaped error, never a 500 or a hang; after the soak the
server answers a greedy request exactly as before it, with consistent cache figures. The server runs with
--max-tokens-limit 8, so that whatever max_tokens a case asks for, none takes long. Hypothesis runs
derandomized (the same cases on every run, no example database) and each test prints its number of
requests and its runtime (also recorded as junit properties).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import drop, start_server, stop_server

BUDGET = 96
ROUTES = ("/v1/completions", "/v1/chat/completions")
POLICIES = ("full", "streaming", "random", "h2o", "scissorhands", "tova", "snapkv", "ahakv")
TIMEOUT = 60  # per request: the slowest valid case (a ~400-token prompt and 8 tokens) takes ~2 s; 60 s means a hang
FUZZ = settings(
    max_examples=100,  # 0.01-1 s a case on 2 shared cores: the three fuzz tests took 45 s together
    deadline=None,  # the client's TIMEOUT catches a hang; a wall-clock deadline would flake on a loaded machine
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(gemma_model):
    proc, base = start_server(gemma_model, "--budget", str(BUDGET), "--recent", "16", "--max-tokens-limit", "8")
    yield base
    stop_server(proc)


def send(base: str, path: str, body: bytes, method: str = "POST", timeout: float = TIMEOUT):
    """One request on its own connection; (status, content type, body bytes)."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def check(status: int, ctype: str, body: bytes) -> None:
    """A 200 with a completion (or a stream of chunks ending in [DONE]), or a 4xx with an OpenAI error."""
    assert status == 200 or 400 <= status < 500, (status, body[:500])
    if status == 200 and ctype.startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body[-500:]
        for event in map(json.loads, events[:-1]):
            assert "choices" in event or isinstance(event["error"]["message"], str), event
    elif status == 200:  # a completion, or what /v1/models, /v1/kv/stats and /health answer
        assert isinstance(json.loads(body), dict), body[:500]
    else:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error", err


# -- generated requests

text = st.text(max_size=40)  # any Unicode that UTF-8 can carry
surrogates = st.sampled_from(["\ud800", "\udfff", "a\ud83d"])  # lone halves: valid JSON, not valid UTF-8
odd_text = st.one_of(st.text(st.characters(codec=None), max_size=40), surrogates)
giant = st.just("x" * 100_000)  # only where it is not read by the model: ~10K tokens take a minute here
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),  # NaN and infinities included: Python's JSON reader on the server takes them
    text,
    odd_text,
)
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=8)


# each field: (values the server must accept, values at or past its edges); a case is a body of valid
# fields with none, one or two of them (or of the unknown ones) replaced by an edge value or junk
FIELDS = {
    "model": (text, odd_text | giant),
    "stream": (st.booleans(), st.sampled_from([0, 1, "true", "no", None])),
    "max_tokens": (st.integers(1, 16), st.sampled_from([0, None, -1, 10**9, 2**64, 1.0, 2.5, "8"])),
    "temperature": (st.sampled_from([0, 0.7]), st.floats() | st.sampled_from([-0.0, 2, 2.0001, "1"])),
    "top_p": (st.floats(0, 1), st.floats()),
    "stop": (text | st.lists(text, max_size=3), odd_text | giant | st.sampled_from(["", [], [""], ["a"] * 50])),
    "seed": (st.integers(0, 2**32 - 1), st.integers() | st.integers(min_value=2**64, max_value=2**200)),
    "presence_penalty": (st.floats(-2, 2), st.floats()),
    "frequency_penalty": (st.floats(-2, 2), st.floats()),
    "kv_budget": (
        st.sampled_from([40, 64, 96, 0.5, "0.25", "25%", "auto"]),
        st.sampled_from([39, 97, 10**6, 0, -3, 1.5, 1.0, "0%", "100%", "inf", "-inf", "nan", "1e309", "", True]),
    ),
    "kv_policy": (st.sampled_from(POLICIES), giant | st.sampled_from(["nope", "", "AHAKV", " ahakv", "full\x00"])),
    "n": (st.sampled_from([1, None]), st.integers(2, 3) | junk),  # one choice only: n > 1 is a 400
    "user": (text, odd_text | giant),
}
long_text = st.just("The licenses for most software are designed to take away your freedom. " * 10)  # 140 tokens
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.one_of(text, st.lists(part, max_size=2), long_text),
    }
)
bad_message = st.one_of(
    junk,
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "model", "", None]), "content": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": odd_text}),
    st.fixed_dictionaries({"role": st.just("user")}, optional={"content": st.one_of(junk, st.just([{"type": "x"}]))}),
)
PROMPT = {
    "prompt": (
        st.one_of(text, st.lists(text, min_size=1, max_size=1), long_text),
        odd_text | st.sampled_from([[1], None, [], ["a", "b"]]),  # token ids, several prompts: a 400
    )
}
MESSAGES = {
    "messages": (
        st.lists(message, min_size=1, max_size=3),
        st.one_of(st.just([]), st.lists(bad_message, min_size=1, max_size=2), junk),
    )
}


def bodies(fields: dict, required: tuple[str, ...] = ()):
    @st.composite
    def body(draw):
        valid = st.fixed_dictionaries(
            {k: v for k, (v, _) in fields.items() if k in required},
            optional={k: v for k, (v, _) in fields.items() if k not in required},
        )
        out = draw(valid)
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
            name = draw(st.sampled_from([*fields, "unknown"]))
            out[name] = draw(fields[name][1] if name in fields and draw(st.booleans()) else junk)
        if draw(st.integers(0, 9)) == 0:  # now and then a required field goes missing
            out.pop(draw(st.sampled_from([*fields])), None)
        return out

    return body()


completion_body = bodies({**PROMPT, **FIELDS})
chat_body = bodies({**MESSAGES, **FIELDS}, required=("messages",))
raw_body = st.one_of(
    st.binary(max_size=60),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe{}", b'{"prompt": "x"}garbage']),
    st.just(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),  # past Python's int-from-text limit
    junk.map(lambda v: json.dumps(v).encode()),
)


def run_fuzz(server, record_property, name: str, strategy, request) -> None:
    statuses: dict[int, int] = {}

    @FUZZ
    @given(strategy)
    def case(drawn):
        answer = request(drawn)
        statuses[answer[0]] = statuses.get(answer[0], 0) + 1
        check(*answer)

    t0 = time.monotonic()
    case()
    elapsed, count = time.monotonic() - t0, sum(statuses.values())
    record_property(f"{name}_requests", count)
    record_property(f"{name}_seconds", round(elapsed, 1))
    print(f"\n{name}: {count} requests in {elapsed:.1f} s, by status {dict(sorted(statuses.items()))}")
    assert call_health(server) == 200


def call_health(base: str) -> int:
    return send(base, "/health", None, "GET", timeout=10)[0]  # the model is free at once: 10 s is generous


def test_fuzz_completions(server, record_property):
    route = st.sampled_from(ROUTES)
    run_fuzz(
        server,
        record_property,
        "fuzz_completions",
        st.tuples(route, completion_body),
        lambda d: send(server, d[0], json.dumps(d[1]).encode()),  # to the chat route too: a missing messages
    )


def test_fuzz_chat(server, record_property):
    run_fuzz(server, record_property, "fuzz_chat", chat_body, lambda d: send(server, ROUTES[1], json.dumps(d).encode()))


def test_fuzz_raw_bodies_and_routes(server, record_property):
    routes = st.sampled_from([*ROUTES, "/v1/models", "/v1/kv/stats", "/health", "/v1/nothing", "/"])
    methods = st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE"])
    run_fuzz(
        server,
        record_property,
        "fuzz_raw",
        st.tuples(methods, routes, raw_body),
        lambda d: send(server, d[1], d[2], d[0]),
    )


# -- soak

PROBE = {  # greedy, and long enough (~140 tokens) to run past the budget
    "prompt": "The GNU General Public License is a free, copyleft license for software and other kinds of works. "
    "The licenses for most software and other practical works are designed to take away your freedom to share "
    "and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom "
    "to share and change all versions of a program--to make sure it remains free software for all its users. "
    "We, the Free Software Foundation, use the GNU General Public License for most of our software; it applies "
    "also to any other work released this way by its authors. You can apply it to your programs, too.",
    "max_tokens": 8,
    "temperature": 0,
}
SOAK_REQUESTS, SOAK_CLIENTS = 200, 3


def probe(base: str) -> tuple[str, dict]:
    status, _, body = send(base, "/v1/completions", json.dumps(PROBE).encode())
    assert status == 200
    answer = json.loads(body)
    stats = json.loads(send(base, "/v1/kv/stats", None, "GET")[2])
    usage = answer["usage"]  # the last generated token is sampled, not decoded
    assert stats["tokens_seen"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1 > BUDGET, stats
    assert stats["budget"] == BUDGET and stats["cells_used"] <= BUDGET, stats
    assert stats["cells_used"] <= stats["kv_cells"] and stats["retention_ratio"] <= 1
    return answer["choices"][0]["text"], {k: stats[k] for k in ("cells_used", "budget", "tokens_seen")}


def soak_request(base: str, rng: random.Random) -> str:
    """One mixed request; with probability 1/2 the client leaves at a random point. Returns what happened."""
    chat = rng.random() < 0.5
    words = " ".join(rng.choice(["alpha", "beta", "one", "two", "três", "四", "🙂"]) for _ in range(9))
    body = {"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words}
    body |= {"max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.5}
    if rng.random() < 0.4:
        body["kv_budget"] = rng.choice([40, 64, 96, "0.5", "25%", "auto"])
    if rng.random() < 0.4:
        body["kv_policy"] = rng.choice(POLICIES)
    path = ROUTES[chat]
    payload = json.dumps(body).encode()
    leave = rng.choice(["stay", "stay", "stay", "mid-request", "after-request", "mid-answer"])
    if leave == "stay":
        status, ctype, answer = send(base, path, payload)
        check(status, ctype, answer)
        return str(status)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
    raw = head.encode() + b"\r\n\r\n" + payload
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    try:
        if leave == "mid-request":
            sock.sendall(raw[: rng.randrange(1, len(raw))])
        else:
            sock.sendall(raw)
            if leave == "mid-answer":  # a few bytes of the answer, up to a few chunks of a stream
                sock.recv(rng.randint(1, 600))
            else:
                time.sleep(rng.random() * 0.3)  # gone while the request waits or runs
    finally:
        drop(sock) if rng.random() < 0.5 else sock.close()  # a reset or an orderly close
    return leave


def test_soak_with_clients_that_leave(server, record_property):
    before = probe(server)
    outcomes: dict[str, int] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)  # fixed seeds: the same requests every run (their interleaving varies)
        for _ in range(SOAK_REQUESTS // SOAK_CLIENTS + (seed < SOAK_REQUESTS % SOAK_CLIENTS)):
            try:
                outcome = soak_request(server, rng)
            except BaseException as exc:  # reported below with the others
                with lock:
                    failures.append(exc)
                return
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(SOAK_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)  # ~1 minute here; 600 s only stops a wedged run
    elapsed = time.monotonic() - t0
    assert not failures, failures
    assert not any(t.is_alive() for t in threads), "a soak client hung"
    total = sum(outcomes.values())
    record_property("soak_requests", total)
    record_property("soak_seconds", round(elapsed, 1))
    print(f"\nsoak: {total} requests in {elapsed:.1f} s: {dict(sorted(outcomes.items()))}")
    assert total == SOAK_REQUESTS and "500" not in outcomes
    assert call_health(server) == 200
    assert probe(server) == before  # the same greedy text, and the same cache figures
