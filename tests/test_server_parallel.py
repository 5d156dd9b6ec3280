"""Several sequences in one context (`serve --parallel N`): sequence views, the batched decode step, the tap's
per-sequence bookkeeping (patch 0008), and the server built on them.

The reference for a sequence decoded among others is the same sequence decoded alone in a context of its own
(the one-at-a-time path). On the fixture (F32 weights) the two differ only in the order float sums meet the
cells (a sequence's cells sit at other offsets of a larger cache), which on the short prompts of the
engine-level tests leaves greedy tokens and every eviction decision unchanged; on the server's ~200-token
prompts the drift grows enough to flip near-equal evictions (see the server test); Gemma's quantized kernels
move more (see the Gemma test)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest
from test_server import call, start_server, stop_server

from ahakv_local.budget import Budget
from ahakv_local.controller import ControllerConfig, KVController, step_batch
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.llama import Llama
from ahakv_local.native import TapFlag
from ahakv_local.parallel import Generation, Sampling, SequencePool
from ahakv_local.policies import make_policy
from ahakv_local.session import SessionSpec

CHUNK = 16
# (policy, budget, evict_every, observe_steps, prompt tokens): AhaKV's side pass scale follows each sequence's
# own length; H2O sums unobserved steps in the tap; TOVA reads one row; different budgets and schedules
SEQS = [
    ("ahakv", 48, 4, 1, 90), ("h2o", 64, 8, 1, 130), ("tova", 40, 1, None, 70), ("snapkv", 56, 2, 1, 110),
    ("scissorhands", 44, 4, 1, 100),  # observes one decode step in four: the tap switches ATTN on alone
]  # fmt: skip
STEPS = 40


def run_alone(model, tokens, policy, budget, every, watch) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the live positions at the end of one sequence in its own context."""
    with Engine(model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=CHUNK)) as e:
        c = KVController(
            e, make_policy(policy), ControllerConfig(Budget.parse(budget), 4, 8, every, observe_steps=watch)
        )
        logits = c.prefill(tokens)
        out = []
        for _ in range(STEPS):
            out.append(int(np.argmax(logits)))
            logits = c.step(out[-1])
        return out, c.live.copy()


def test_batched_steps_equal_each_sequence_alone(fixture_model, license_text):
    """Five sequences with different policies, budgets and schedules, stepped together: the same greedy tokens and
    the same evictions (live positions) as each alone; the native cell map of each sequence is its controller's
    live set, and no sequence's cells were taken by another. The logits themselves are not compared here: a
    sequence's cells sit at other offsets among its neighbours', so its attention sums meet them in another order,
    and through the fixture's peaked attention that drift has no bound the rounding units give (it was held to a
    measured 1e-3 before). Isolation to the bit, logits included, is asserted on Gemma where the layout is held
    equal (``test_gemma_a_sequence_is_bit_identical_whatever_its_neighbour_reads``)."""
    words = license_text.split()
    config = EngineConfig(n_ctx=1024, n_batch=64, n_ubatch=CHUNK, n_seq=len(SEQS))
    with Engine(fixture_model, config) as e:
        prompts = [e.tokenize(" ".join(words[40 * i :]))[:n] for i, (*_, n) in enumerate(SEQS)]
        views = [e.view(s) for s in range(len(SEQS))]
        ctls = []
        for v, (policy, budget, every, watch, _) in zip(views, SEQS, strict=True):
            cfg = ControllerConfig(Budget.parse(budget), 4, 8, every, observe_steps=watch)
            ctls.append(KVController(v, make_policy(policy), cfg))
        logits = np.stack([c.prefill(p) for c, p in zip(ctls, prompts, strict=True)])
        outs = [[] for _ in SEQS]
        for _ in range(STEPS):
            tokens = [int(np.argmax(row)) for row in logits]
            for o, t in zip(outs, tokens, strict=True):
                o.append(t)
            logits = step_batch(ctls, tokens)
            for c, (_, budget, *_) in zip(ctls, SEQS, strict=True):
                assert c.live.size <= budget  # each sequence holds its own budget at every step
        cell_maps = [v.cell_positions() for v in views]
        for v, c in zip(views, ctls, strict=True):
            np.testing.assert_array_equal(v.live_positions(), c.live)
            assert c.stats.evicted == v.n_past - c.live.size  # every position it lost, it evicted itself
        held = np.stack([m >= 0 for m in cell_maps])
        assert held.sum(axis=0).max() == 1  # a cell belongs to one sequence

    for s, (policy, budget, every, watch, _) in enumerate(SEQS):
        out, live = run_alone(fixture_model, prompts[s], policy, budget, every, watch)
        assert outs[s] == out, policy
        np.testing.assert_array_equal(ctls[s].live, live)


def test_a_sequence_reset_leaves_the_others_statistics(fixture_model, license_text):
    """reset_seq zeroes one sequence's cells and row count only; the row counts are per sequence."""
    with Engine(fixture_model, EngineConfig(n_ctx=512, n_batch=64, n_ubatch=CHUNK, n_seq=2)) as e:
        a, b = e.view(0), e.view(1)
        tokens = e.tokenize(license_text)
        e.set_tap(TapFlag.ATTN, 0)
        a.reset_stats()
        b.reset_stats()
        a.decode(tokens[:30])
        b.decode(tokens[30:50])
        assert (a.stat_rows, b.stat_rows) == (30, 20)
        before = b.stat("attn", 1).values.copy()
        a.reset_stats()
        assert a.stat_rows == 0 and b.stat_rows == 20
        assert not a.stat("attn", 1).values.any()
        np.testing.assert_array_equal(b.stat("attn", 1).values, before)
        # each row is a softmax over its own sequence's cells: b's columns sum to its 20 rows per head
        np.testing.assert_allclose(before.sum(axis=1), 20.0, rtol=1e-5)


def test_configure_retargets_the_eviction(fixture_model, license_text):
    """KVController.configure changes every group's target, not only the configured budget (the one-at-a-time
    server's per-request kv_budget never reached the eviction before)."""
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=CHUNK)) as e:
        c = KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(96), 4, 8, 4))
        c.configure(Budget.parse(40), make_policy("tova"))
        c.truncate(0)
        c.prefill(e.tokenize(license_text)[:150])
        assert c.groups[0].budget.value == 40 and c.live.size <= 40 and c.policy.name == "tova"


def test_the_dropin_keeps_the_summed_steps_between_calls(fixture_model, license_text):
    """Llama.eval one token per call (as generation does) meets the same evictions as KVController.step: the
    steps the tap sums between observations survive the calls (they were dropped by a rewind on every call)."""
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64)) as e:
        tokens = e.tokenize(license_text)[:160]
        c = KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(64), 4, 8, 16, observe_steps=1))
        c.prefill(tokens[:100])
        for t in tokens[100:]:
            c.step(t)
        reference = c.live.copy()
    llm = Llama(str(fixture_model), kv_budget=64, kv_policy="h2o", kv_sinks=4, kv_recent=8, kv_evict_every=16,
                kv_query=False, n_ctx=256, n_batch=64, verbose=False)  # fmt: skip
    with llm:
        llm.eval(tokens[:100])
        for t in tokens[100:]:
            llm.eval([t])
        np.testing.assert_array_equal(llm.kv_controller.live, reference)


def test_a_finished_request_frees_its_cells_at_once(fixture_model, license_text):
    """A request that ends leaves no cell behind (every row of the unified stream attends over the span of all
    cells in use, so a finished request's cells would slow every other sequence), while its slot's figures stay
    those of its request; the sequence still running keeps exactly its own cells."""
    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 2, CHUNK, 0)
    with Engine(fixture_model, EngineConfig(n_ctx=cells, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        tokens = e.tokenize(license_text)
        ends: list = []
        short = Generation(tokens[:90], Sampling(max_tokens=3, temperature=0), lambda t, f: f and ends.append(f))
        long = Generation(tokens[90:200], Sampling(max_tokens=30, temperature=0), lambda t, f: None)
        assert (pool.start(short), pool.start(long)) == (0, 1)
        while 0 in pool.active:
            pool.step()
        assert ends == ["length"] and len(short.tokens) == 3
        assert not (pool.views[0].cell_positions() >= 0).any()  # slot 0 holds no cell
        np.testing.assert_array_equal(pool.views[1].live_positions(), pool.controllers[1].live)
        assert e.n_used() == pool.controllers[1].live.size  # every used cell of the stream is slot 1's
        figures = pool.stats()["sequences"][0]
        # the request's own figures: its prompt and every generated token but the last (sampled, never decoded)
        assert not figures["active"] and figures["tokens_seen"] == 90 + 3 - 1
        # an idle slot holds no cell, as /v1/kv/stats says (it said the 34 cells of the request that had ended)
        assert figures["cells_used"] == 0 and 0 < figures["tokens_seen"] - figures["evicted"] <= figures["budget"]


def test_a_request_keeping_every_token_is_refused(fixture_model):
    """kv_policy "full" in one slot filled the context the other sequences share: its own request ended in a 500
    ("the KV cache is full") and another client's ordinary request in a 400 that blamed it."""
    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        gen = Generation(e.tokenize("a few words"), Sampling(max_tokens=3), lambda t, f: None, policy="full")
        with pytest.raises(AhakvError, match="kv_policy full keeps every token: with several sequences each holds"):
            pool.start(gen)
        assert not pool.active


def test_a_requests_budget_is_checked_with_its_own_eviction_period(fixture_model):
    """A request's kv_budget was checked with the period slot 0 last ran (the server's 19 for 96 cells, or the 2 of
    an earlier request of 30): 30 cells were refused or served by what ran before, where `generate --budget 30` runs
    (its period 2). Checked with the period the budget takes, whatever ran before."""
    spec = SessionSpec.bounded("h2o", 96, n_recent=16, reading="plain")
    with Engine(fixture_model, EngineConfig(n_ctx=512, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        assert pool.controllers[0].config.evict_every == 19  # the server's own, for 96 cells
        for _ in range(2):  # before and after a request of its own budget ran in slot 0
            assert pool.check(Budget.parse("30"), None)[0].value == 30
            with pytest.raises(AhakvError, match=r"smaller than sinks \+ recent \+ newest \(4 \+ 16 \+ 1\)"):
                pool.check(Budget.parse("20"), None)
            words = e.tokenize("a few words " * 20)
            pool.start(Generation(words, Sampling(max_tokens=2), lambda t, f: None, budget=Budget.parse("30")))
            while pool.active:
                pool.step()


def test_a_request_stopped_while_its_prompt_is_read_ends_before_the_next_chunk(fixture_model, license_text):
    """The scheduler reads a prompt while every other slot waits: a client that leaves (or a server that stops)
    during a long prompt ended it only after the whole prompt (38 s of blocked requests on Gemma at 3,000
    tokens). It now ends "cancelled" before the next chunk, leaves no cell behind, and the slot serves again."""
    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 2, CHUNK, 0)
    with Engine(fixture_model, EngineConfig(n_ctx=cells, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        tokens = e.tokenize(license_text)[:200]  # 13 chunks
        ends: list = []
        asked = []  # how often the request was asked whether it stopped: once per chunk

        def stopped() -> bool:
            asked.append(1)
            return len(asked) > 2  # the client leaves while the second chunk is read

        gen = Generation(tokens, Sampling(max_tokens=3, temperature=0), lambda t, f: ends.append((t, f)), stopped)
        decodes: list = []
        read = pool.controllers[0].read_piece
        pool.controllers[0].read_piece = lambda *a: decodes.append(1) or read(*a)
        assert pool.start(gen) == 0
        assert ends == [("", "cancelled")] and len(decodes) == 2 and not gen.tokens
        assert not pool.active and e.n_used() == 0
        again = Generation(tokens[:40], Sampling(max_tokens=3, temperature=0), lambda t, f: f and ends.append(f))
        assert pool.start(again) == 0
        while pool.active:
            pool.step()
        assert ends[-1] == "length" and len(again.tokens) == 3


# -- the server ------------------------------------------------------------------------------------------------

BUDGETS = [48, 56, 64, 72, 80, 88, 96, None]  # None: the server's (96)
POLICIES = ["ahakv", "h2o", "streaming", "tova", "snapkv", "ahakv", "scissorhands", None]


def chat_body(i: int, text: str) -> dict:
    body = {
        "messages": [{"role": "user", "content": " ".join(text.split()[30 * i : 30 * i + 40])}],
        "max_tokens": 40,
        "temperature": 0,
    }
    if BUDGETS[i] is not None:
        body["kv_budget"] = BUDGETS[i]
    if POLICIES[i] is not None:
        body["kv_policy"] = POLICIES[i]
    return body


def test_eight_concurrent_requests_each_in_its_own_sequence(fixture_model, license_text):
    """`serve --parallel 4`, eight chat requests with different budgets and policies sent at once: each is
    answered, from the same prompt tokens as alone, /v1/kv/stats reports each sequence within its budget, and
    the answers of position-only eviction (streaming) are the ones alone.
    The other policies' answers are not compared here: beside other sequences' cells a sequence's statistics
    drift by float order (on this fixture's ~200-token prompts, 2e-4 relative in the attention and 5e-4 in the
    reconstruction term after the first chunk: its peaked attention amplifies the 1e-7 of one sum), enough to
    flip an eviction between near-equal cells (`python benchmarks/parallel_drift.py`: beside two other requests,
    AhaKV at 88 cells keeps other positions after its prompt and answers otherwise from the 8th token), which no
    answer can tell from a real difference. Their decisions are compared with each sequence alone, statistic by
    statistic, in test_batched_steps_equal_each_sequence_alone (every policy, shorter prompts). Before patch
    0015 Scissorhands differed in every round for a real reason: alone, its one-token decodes read every layer's
    attention from the last layer."""
    proc, base = start_server(fixture_model, "--parallel", "4", "--budget", "96", "--recent", "8")
    try:
        alone = [call(base, "/v1/chat/completions", chat_body(i, license_text)) for i in range(8)]
        assert all(status == 200 for status, _ in alone), alone
        together: list = [None] * 8

        def send(i: int) -> None:
            together[i] = call(base, "/v1/chat/completions", chat_body(i, license_text), timeout=120)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(8):
            assert together[i][0] == 200, together[i]
            assert together[i][1]["usage"]["prompt_tokens"] == alone[i][1]["usage"]["prompt_tokens"], i
            if POLICIES[i] == "streaming":  # its evictions follow positions only
                assert together[i][1]["choices"][0]["message"] == alone[i][1]["choices"][0]["message"], i
        assert sum(1 for _, b in alone if b["choices"][0]["message"]["content"]) >= 4  # the texts are not all empty

        status, stats = call(base, "/v1/kv/stats")
        assert status == 200 and stats["parallel"] == 4 and len(stats["sequences"]) == 4
        assert sum(s["requests"] for s in stats["sequences"]) == 16
        for s in stats["sequences"]:
            assert not s["active"] and s["cells_used"] == 0 and s["budget"] <= 96  # idle: its cells freed
            assert 0 < s["tokens_seen"] - s["evicted"] <= s["budget"] < s["tokens_seen"]  # each read past its budget

        # a budget past the slot's cells, and an unknown policy: one-line 400s, the server goes on
        status, body = call(base, "/v1/chat/completions", {**chat_body(0, license_text), "kv_budget": 500})
        assert status == 400 and "up to the server's 96" in body["error"]["message"]
        status, body = call(base, "/v1/chat/completions", {**chat_body(0, license_text), "kv_policy": "nope"})
        assert status == 400
        # JSON needs llama-cpp-python's grammar sampler: refused here, never answered as plain text
        asking_json = {**chat_body(0, license_text), "response_format": {"type": "json_object"}}
        status, body = call(base, "/v1/chat/completions", asking_json)
        assert status == 400 and "not supported with --parallel" in body["error"]["message"]
        # streamed: the same text in pieces
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            json.dumps({**chat_body(3, license_text), "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
        assert "".join(pieces) == alone[3][1]["choices"][0]["message"]["content"]
        # asking for the usage (stream_options.include_usage): one more chunk, no choice, the counts alone had
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            json.dumps(
                {**chat_body(3, license_text), "stream": True, "stream_options": {"include_usage": True}}
            ).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            counted = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
        assert len(counted) == len(events) + 1 and counted[-1] == "[DONE]"
        usage = json.loads(counted[-2])
        assert usage["choices"] == [] and usage["usage"] == alone[3][1]["usage"]
    finally:
        stop_server(proc)


def test_parallel_checks_the_memory_before_llama_cpp_allocates(gemma_model, monkeypatch):
    """serve --parallel made its context with no memory check: llama.cpp printed four lines of allocation failures
    (and a context between the free and the total memory would have been allocated and zeroed). The pool's cells,
    every layer of them in f16 and padded as llama.cpp pads them, are checked against the memory available, as the
    one-at-a-time server's are."""
    import ahakv_local.llama as dropin
    from ahakv_local.cli import load_pool
    from ahakv_local.info import read_info
    from ahakv_local.parallel import SequencePool

    kw = dict(parallel=4, ctx_size=None, budget="256", policy="h2o", sinks=4, recent=8, error_tol=None,
              evict_every=None, observe_steps=0, threads=1, n_gpu_layers=0, batch_size=None,
              reading="plain")  # fmt: skip
    cells = -(-SequencePool.context_cells(Budget.parse(256), 4, 64, 0) // 256) * 256  # 1,092 padded
    need = cells * read_info(gemma_model).kv_bytes_per_token()
    monkeypatch.setattr(dropin, "available_memory", lambda: need - 1)
    made = []
    monkeypatch.setattr("ahakv_local.engine.Engine.__init__", lambda *a, **k: made.append(1) or pytest.fail("made"))
    with pytest.raises(AhakvError, match=rf"^{cells} KV cells need .* GiB, more than the .* GiB of memory available"):
        load_pool(str(gemma_model), **kw)
    assert not made
    monkeypatch.undo()
    monkeypatch.setattr(dropin, "available_memory", lambda: need)
    pool = load_pool(str(gemma_model), **kw)
    try:
        assert pool.engine.n_cells() == cells and pool.engine.kv_bytes() == need  # what was checked, to the byte
    finally:
        pool.engine.close()


def test_parallel_needs_a_cell_budget_and_f16(fixture_model):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ahakv_local", "serve", str(fixture_model), "--parallel", "2", "--budget", "0.25"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--parallel needs --budget in cells" in out.stderr.strip().splitlines()[-1]
    # a quantized K/V is refused, not silently dropped (the pool's context is f16)
    cmd[-1] = "96"
    out = subprocess.run([*cmd, "--kv-type", "q8_0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].endswith("drop --kv-type q8_0")
    # a policy that keeps every token started, then answered every request naming no kv_policy with a 400; a reading
    # its policy cannot take was dropped (the one-at-a-time server refuses both at startup)
    refused = {
        ("--policy", "full"): "error: --parallel needs a policy that evicts: full keeps every token, and each "
        "sequence holds at most its budget in the context they share",
        ("--policy", "h2o", "--reading", "reconstruct"): "error: --reading reconstruct needs a policy a question can "
        "guide (tova, snapkv, ahakv), not h2o: read with --reading plain or surprisal",
    }
    for args, message in refused.items():
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.strip().splitlines() == [message], out.stderr


# -- Gemma -----------------------------------------------------------------------------------------------------


def test_gemma_a_sequence_is_bit_identical_whatever_its_neighbour_reads(gemma_model, license_text):
    """Isolation on Gemma 3 (a sliding and a full cache per sequence, quantized kernels), exactly: sequence 0 (AhaKV,
    64 cells, evicting) is read and decoded beside sequence 1, which reads one text in the first run and another in
    the second. Sequence 1 runs StreamingLLM, whose evictions depend on positions only, so both runs lay every cell
    out the same way: sequence 0's cells, its row in each batch and the order of every float sum are the same, and
    the KQ mask gives the neighbour's cells exp(-inf) = 0 weight, which adds exact zeros. So sequence 0's logits,
    live positions and cells are the same to the bit; no tolerance is needed. (A neighbour's ten cells copied into
    sequence 0 move its logits by 2.8 and change what it evicts: `python benchmarks/isolation_leak.py`.) The
    tokens are fed from the texts, not sampled, so neither run depends on the other's choices."""
    words = license_text.split()
    steps = 40

    def run(neighbour: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        with Engine(gemma_model, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=16, n_seq=2, n_threads=2)) as e:
            mine = e.tokenize(" ".join(words[:400]))[: 120 + steps]
            theirs = e.tokenize(" ".join(words[neighbour : neighbour + 400]))[: 100 + steps]
            ctls = [
                KVController(
                    e.view(seq), make_policy(policy), ControllerConfig(Budget.parse(cells), 4, 8, 4, observe_steps=1)
                )
                for seq, (policy, cells) in enumerate([("ahakv", 64), ("streaming", 48)])
            ]
            rows = [ctls[0].prefill(mine[:120])]
            ctls[1].prefill(theirs[:100])
            for i in range(steps):
                logits = step_batch(ctls, [mine[120 + i], theirs[100 + i]])
                rows.append(logits[0])
                assert ctls[0].live.size <= 64 and ctls[1].live.size <= 48
            assert ctls[0].stats.evicted > 0  # it chose what to keep, by content
            return np.stack(rows), logits[1], ctls[0].live.copy(), ctls[0].engine.cell_positions()

    first, second = run(1000), run(3000)
    assert not np.array_equal(first[1], second[1])  # the neighbours did read different texts
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[2], second[2])
    np.testing.assert_array_equal(first[3], second[3])


def test_gemma_sequences_hold_their_budgets_and_agree_where_the_choice_is_clear(gemma_model, license_text):
    """Gemma 3 270M, 8 requests over 4 slots of one context with different budgets. Cells at offsets that are not a
    multiple of 8 change the float summation order of Gemma's quantized kernels, which moves logits (0.73 and 0.94
    in two runs), so whole answers may differ from the one-at-a-time answers where two tokens are close. How far
    is no bound of the numerics (a quantized activation that flips moves the next layer's input by a whole step),
    so it is measured here, not asserted; that no sequence reads another's cells is asserted exactly, to the bit,
    by the test above, through ``step_batch``, which ``SequencePool.step`` runs for its slots (the pool adds the
    scheduling, whose budgets and answers this test checks). Asserted: every sequence holds its budget, every answer
    is non-empty, and the first token equals the alone-run's wherever the alone-run's margin between its top two
    logits exceeds twice the measured drift (each logit moved by at most the drift, so their order cannot change)."""
    budgets = [48, 64, 80, 96, 48, 64, 80, 96]
    spec = SessionSpec.bounded("ahakv", 96, n_recent=16, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 4, 64, 0)
    words = license_text.split()

    def run(together: bool) -> tuple[list[list[int]], list[np.ndarray]]:
        with Engine(gemma_model, EngineConfig(n_ctx=cells, n_batch=64, n_ubatch=64, n_seq=4, n_threads=2)) as e:
            pool = SequencePool(e, spec)
            outs: list[list[int]] = [[] for _ in budgets]
            firsts: list = [None] * len(budgets)
            gens = []
            for i, b in enumerate(budgets):
                prompt = e.tokenize(" ".join(words[50 * i : 50 * i + 150]))
                greedy = Sampling(max_tokens=24, temperature=0)
                gens.append(Generation(prompt, greedy, lambda t, f: None, budget=Budget.parse(b)))
            waiting = list(range(len(budgets)))
            orig = pool._take

            def take(seq, logits):
                i = slot_of[seq]
                if firsts[i] is None:
                    firsts[i] = logits.copy()
                orig(seq, logits)
                for s, c in enumerate(pool.controllers):
                    assert c.live.size <= int(c.groups[0].budget.value), s

            pool._take = take
            slot_of: dict[int, int] = {}
            while waiting or pool.active:
                while waiting and pool.free() and (together or not pool.active):
                    i = waiting.pop(0)
                    slot_of[pool.free()[0]] = i
                    pool.start(gens[i])
                pool.step()
            for i, g in enumerate(gens):
                outs[i] = g.tokens
            return outs, firsts

    alone, alone_first = run(False)
    both, both_first = run(True)
    drift = max(float(np.abs(a - b).max()) for a, b in zip(alone_first, both_first, strict=True))
    clear = 0
    for a, b, logits in zip(alone, both, alone_first, strict=True):
        assert a and b  # non-empty answers
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 2 * drift:  # each logit moved by <= drift: their difference by <= 2 drift
            clear += 1
            assert a[0] == b[0]
    print(f"gemma: first-token drift {drift:.3f}, {clear}/8 clear first choices, "
          f"{sum(a == b for a, b in zip(alone, both, strict=True))}/8 whole answers equal")  # fmt: skip


class BusyPool:
    """Every slot taken, and the scheduler held in a step as it is while it reads a long prompt (seconds)."""

    def __init__(self, free: int = 0) -> None:
        self.active = {0: None}
        self.slots = list(range(1, 1 + free))
        self.release = threading.Event()

    def free(self) -> list[int]:
        return self.slots

    def step(self) -> None:
        self.release.wait(10)


def test_clients_that_left_free_their_places_in_the_queue_and_health_says_busy():
    """Clients that left while the scheduler read a prompt still counted as waiting: after 32 had gone, every new
    request was a 503 "too many requests are waiting" for as long as the prompt took. And /health said 200 "ok" with
    every slot taken ("free_slots": 0), where README says 503 while a request would wait."""
    import asyncio

    from ahakv_local.server import Job, ParallelRunner

    class Client:  # still connected
        async def is_disconnected(self) -> bool:
            return False

    async def main() -> None:
        pool = BusyPool()
        runner = ParallelRunner(pool, "m", 16, busy_timeout=600, max_waiting=2, default_query=False)
        runner._prepare = lambda req, kind, payload: None  # (what a request starts from: not this test's)
        try:
            gone = [Job(runner.shutdown) for _ in range(2)]
            for job in gone:
                job.since = time.monotonic()
            with runner.cond:
                runner.waiting.extend(gone)
            for job in gone:
                job.cancelled.set()  # their clients left while the scheduler was held
            task = asyncio.ensure_future(runner.submit(Client(), None, "completion", None))
            await asyncio.sleep(0.5)
            assert not task.done(), task.result().body  # it waits for a slot: no 503
            assert len(runner.waiting) == 1 and runner.waiting[0] not in gone
            busy = runner.health()
            assert busy.status_code == 503 and b"every sequence slot is taken (1 waiting)" in busy.body
            task.cancel()
        finally:
            runner.shutdown.set()
            pool.release.set()
        pool.slots = [1]
        assert runner.health().status_code == 200 and json.loads(runner.health().body)["free_slots"] == 1

    asyncio.run(main())


def test_a_parallel_completion_is_read_with_the_same_question_as_the_drop_in(fixture_model):
    """The parallel server found a completion's default question with a twin of the drop-in's rule (the text after
    its last "\\n\\n"): a CRLF prompt's question was the document's tail. Both now take ``last_paragraph``."""
    from ahakv_local.parallel import prompt_of
    from ahakv_local.textfile import last_paragraph

    with Engine(fixture_model, EngineConfig(n_ctx=256)) as e:
        for blank in ("\n\n", "\r\n\r\n", "\n \n"):
            payload = f"Some document text.{blank}What is this?"
            assert last_paragraph(payload) == "What is this?"
            _, _, question = prompt_of(e, "completion", payload, None, True)
            assert list(question) == e.tokenize("What is this?", add_bos=False), repr(blank)


@pytest.mark.parametrize("parallel", [True, False])
def test_the_scheduler_thread_ends_with_the_app_s_server_and_the_app_serves_again(fixture_model, parallel):
    """An app made in a process that goes on (a test's, an application embedding it): its --parallel scheduler
    thread polled for the life of the process after the server had stopped; it returns when the app's server shuts
    down (the app's lifespan sets its shutdown). A second server of the same app serves again (a first version of
    that fix left it answering 503 "shutting down" to every request, one-at-a-time apps too)."""
    import uvicorn
    from test_server import free_port

    from ahakv_local.server import create_app

    spec = SessionSpec.bounded("h2o", 48, n_recent=8, reading="plain")
    with Engine(fixture_model, EngineConfig(n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, n_seq=2)) as e:
        llm = SequencePool(e, spec) if parallel else Llama(str(fixture_model), kv_budget=48, kv_policy="h2o",
                                                           kv_recent=8, n_threads=1, verbose=False)  # fmt: skip
        before = set(threading.enumerate())
        app = create_app(llm, "fixture")
        for _ in range(2):
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.05)
            # greedy: an unseeded draw is random (it may end at once, or run past max_tokens to end a character)
            request = {"prompt": "the", "max_tokens": 3, "temperature": 0}
            status, body = call(f"http://127.0.0.1:{port}", "/v1/completions", request)
            assert status == 200 and body["usage"]["completion_tokens"] == 3, body
            schedulers = [t for t in set(threading.enumerate()) - before if t.name == "ahakv-scheduler"]
            assert len(schedulers) == (1 if parallel else 0)
            server.should_exit = True
            thread.join(timeout=10)
            for t in schedulers:
                t.join(timeout=5)
            assert not thread.is_alive() and not any(t.is_alive() for t in schedulers)
        if not parallel:
            llm.close()


def test_a_request_alone_in_the_pool_meets_its_cells_as_the_first_did(license_text):
    """A parallel server's request alone in its context, after others have come and gone: its cells start where the
    first request's did (the context emptied, ``Engine.clear_cells``), so every cell map and answer is the first
    one's (the sliding cache's next slot stayed where the last request's lowest cell was: other cells, other float
    sums, and on Gemma 3 near-equal evictions that flip)."""
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    model = fixture_path(FixtureSpec(arch="gemma3"))  # a sliding cache: layer 0 slides over 24 positions
    spec = SessionSpec.bounded("h2o", 128, n_recent=8, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 2, 64, 0)
    with Engine(model, EngineConfig(n_ctx=cells, n_batch=64, n_ubatch=64, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        tokens = e.tokenize(license_text)
        maps: list = []

        def run(prompt) -> list[int]:
            gen = Generation(prompt, Sampling(max_tokens=30, temperature=0), lambda t, f: None)
            pool.start(gen)
            maps.append([[e.cell_positions(il).copy() for il in range(e.n_layer)]])
            while pool.active:
                pool.step()
                maps[-1].append([e.cell_positions(il).copy() for il in range(e.n_layer)])
            return gen.tokens

        first = run(tokens[:300])
        run(tokens[300:700])  # another request, alone too: its cells, then gone
        again = run(tokens[:300])
    assert again == first
    for step, (a, b) in enumerate(zip(maps[0], maps[2], strict=True)):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"


def test_a_stop_string_ending_in_a_character_of_several_tokens_is_never_sent_in_part(gemma_model):
    """A stop string "a𓀀" (𓀀 is four byte tokens on Gemma): the stream held back what may begin a stop string of the
    text still ending in an unfinished character, which matched nothing, so the "a" went out; once the character was
    whole the stop was found before what had been sent, and the answer kept the "a". The reference: the same greedy
    answer without the stop string, cut where the stop string begins."""
    prompt = "a𓀀 a𓀀 a𓀀 a𓀀 a𓀀 a𓀀 a𓀀 a𓀀 a"
    spec = SessionSpec.bounded("ahakv", 256, reading="plain")
    cells = SequencePool.context_cells(spec.budget, 2, 64, 0)
    with Engine(gemma_model, EngineConfig(n_ctx=cells, n_batch=64, n_ubatch=64, n_seq=2)) as e:
        pool = SequencePool(e, spec)
        tokens = e.tokenize(prompt)

        def answer(stop: tuple[str, ...]) -> tuple[str, list[str]]:
            pieces, ends = [], []
            gen = Generation(tokens, Sampling(max_tokens=12, temperature=0, stop=stop),
                             lambda t, f: (pieces.append(t), f and ends.append(f)))  # fmt: skip
            pool.start(gen)
            while pool.active:
                pool.step()
            return "".join(pieces), ends

        free, _ = answer(())
        for stop in ("a𓀀", " a𓀀", "𓀀 a𓀀"):
            assert stop in free, free  # the model repeats the pattern: the stop string comes
            text, ends = answer((stop,))
            assert (text, ends) == (free[: free.find(stop)], ["stop"]), stop
