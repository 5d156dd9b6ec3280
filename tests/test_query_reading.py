"""Query-aware reading: a question guides what a long prompt keeps, and leaves no trace of its own."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ahakv_local import Llama, upstream
from ahakv_local.budget import QUERY_TOKENS, Budget, guide_room
from ahakv_local.controller import KVController
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.fixture import FixtureSpec
from ahakv_local.models import fixture_path
from ahakv_local.needle import NEEDLE, QUESTION, build_prompt
from ahakv_local.session import SessionSpec, open_session
from ahakv_local.words import not_space

from numerics import F32, FORWARD_RTOL
from reference import window_mean, word_max, word_starts

QUESTION_TEXT = " Which license is this, and which version?"


def tokens_of(model, text: str, n: int) -> list[int]:
    with Engine(model, EngineConfig(n_ctx=256)) as e:
        return e.tokenize(text)[:n]


def test_a_guided_read_equals_a_plain_replay_of_its_evictions(fixture_model, license_text):
    """The question's last tokens are decoded behind each span and removed again: replaying the same spans with
    the same evictions and no question gives the same cache and the same logits. The same positions may sit in other
    cells (the question's cells were used and freed), so the attention sums may run in another order: the
    logits agree within the fixture's forward bound (tests/test_tap_fixture.py: ~16 chained F32 reductions of
    <= 128 terms, relative to the largest entry)."""
    prompt = tokens_of(fixture_model, license_text, 400)
    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading="query")
    evicted: dict[int, np.ndarray] = {}  # n_past at the eviction -> the positions evicted
    with open_session(fixture_model, spec, longest=len(prompt), n_ubatch=64) as guided:
        ctl, question = guided.controller, guided.engine.tokenize(QUESTION_TEXT, add_bos=False)
        real_evict = ctl.engine.evict

        def record(positions, cache=None):
            evicted[ctl.engine.n_past] = np.asarray(positions).copy()
            return real_evict(positions, cache)

        ctl.engine.evict = record
        calls, observed = [], []
        real_read, real_decode = ctl.read_query, ctl._decode
        ctl.read_query = lambda q: calls.append(list(q)) or real_read(q)
        ctl._decode = lambda t, w, a, observe=True: observed.append(observe) or real_decode(t, w, a, observe)
        logits = guided.read(prompt, question)
        tail = question[-QUERY_TOKENS:]  # the fixture's tokens are about characters: 37 here
        assert calls and all(q == tail for q in calls)  # guided, by the question's last tokens
        assert len(calls) == len(evicted) - 1  # every compression but the last (it ends the prompt)
        # each span is a chunk and what the question leaves of the room behind it (64 cells at chunks of 64)
        span = 64 + guide_room("query", 64) - len(tail)
        assert sorted(evicted) == [*range(span, len(prompt), span), len(prompt)]
        assert observed.count(True) == len(evicted) < len(observed)  # a span is observed once, at its end
        live = guided.engine.live_positions()
        assert np.array_equal(live, ctl.live) and guided.engine.n_past == len(prompt)
        assert guided.engine.n_used() == live.size  # no cell of the question is left
    with Engine(fixture_model, EngineConfig(n_ctx=guided.engine.n_ctx, n_batch=64, n_ubatch=64)) as e:
        for end in sorted(evicted):  # the same spans, a chunk at a time
            for a in range(e.n_past, end, 64):
                replay = e.decode(prompt[a : min(a + 64, end)])
            e.evict(evicted[end])
        assert np.array_equal(e.live_positions(), live)
        forward_rtol = 16 * 128 * F32
        assert np.abs(replay - logits).max() <= forward_rtol * np.abs(logits).max()


def test_reading_a_query_leaves_the_policy_and_the_cache_as_they_were(fixture_model, license_text):
    prompt = tokens_of(fixture_model, license_text, 200)
    with open_session(fixture_model, SessionSpec.bounded("ahakv", 256), longest=400, n_ubatch=64) as s:
        ctl = s.controller
        ctl.prefill(prompt)
        ring, cells = ctl.policy.ring.total.data.copy(), s.engine.cell_positions().copy()
        (scores,) = ctl.read_query(s.engine.tokenize(QUESTION_TEXT, add_bos=False))
        assert scores.shape == ctl.live.shape and np.all(np.isfinite(scores)) and scores.max() > 0
        assert np.array_equal(ctl.policy.ring.total.data, ring)  # the running state never saw the question
        assert np.array_equal(s.engine.cell_positions(), cells) and s.engine.n_past == len(prompt)
        s.controller.step(prompt[-1])  # and decoding goes on at the next position
        assert s.engine.live_positions()[-1] == len(prompt)


@pytest.mark.parametrize("layout", ["natural", "adaptive"])
def test_a_guided_read_evicts_a_sliding_group_by_its_own_statistics(license_text, layout):
    """The question's decode may take cells of positions that left the sliding window (llama.cpp reuses them), and
    its statistics are reset with it: the group's eviction then still scores by what the span's last chunk saw,
    never by a re-read of the emptied counters (a score of zeros, and adaptive's fill of 0 for these layers).
    Every observed row puts mass 1 per head on the positions it sees, so an observation of the span is never zero."""
    model = fixture_path(FixtureSpec(arch="gemma3"))  # layer 0 slides over 24 positions
    prompt = tokens_of(model, license_text, 400)
    spec = SessionSpec.bounded("ahakv", 64, reading="query", layer_budgets=layout)
    with open_session(model, spec, longest=len(prompt), n_ubatch=16) as s:
        ctl = s.controller
        reused, scored = [], []
        read_query, score = ctl.read_query, ctl.groups[0].policy.__class__.score

        def spy_read(query):
            before = [g.live.size for g in ctl.groups]
            out = read_query(query)
            reused.append(any(g.live.size < n for g, n in zip(ctl.groups, before, strict=True)))
            return out

        def spy_score(policy, obs):
            scored.append(float(obs.attn.sum()))
            return score(policy, obs)

        ctl.read_query = spy_read
        ctl.groups[0].policy.__class__.score = spy_score
        try:
            s.read(prompt, s.engine.tokenize(QUESTION_TEXT, add_bos=False))
        finally:
            ctl.groups[0].policy.__class__.score = score
        assert any(reused)  # the case at stake happened
        assert scored and min(scored) > 0


def test_reconstruction_scores_every_chunk_and_keeps_the_best(fixture_model, license_text):
    prompt = tokens_of(fixture_model, license_text, 320)
    spec = SessionSpec.bounded("snapkv", 96, n_recent=8, reading="reconstruct")
    with open_session(fixture_model, spec, longest=len(prompt) + 64 + 16, n_ubatch=64) as s:
        queries = []
        real = s.controller.read_query
        s.controller.read_query = lambda q: queries.append(list(q)) or real(q)
        s.read(prompt)
        repeat = s.engine.tokenize("\n\nRepeat the previous context exactly.\n\n", add_bos=False)
        # one pass per chunk, each the repetition prompt and the chunk itself
        assert [q[len(repeat) :] for q in queries] == [prompt[a : a + 64] for a in range(0, len(prompt), 64)]
        assert all(q[: len(repeat)] == repeat for q in queries)
        assert np.array_equal(s.engine.live_positions(), s.controller.live) and s.controller.live.size <= 96
        best = s.controller.groups[0].best
        assert best[s.controller.live].min() > 0  # every kept position was scored by some pass


def test_a_reconstruction_reading_keeps_spans_whole(fixture_model, license_text):
    """Each of AhaKV's reconstruction passes gives a word's tokens one score, but a word read across two chunks
    keeps a best from each pass: the scores it is evicted by give every token of a span of text between spaces
    (a number and its full stop) the span's best (``reference.word_max`` over the spans of the text the prompt's
    tokens spell)."""
    prompt = tokens_of(fixture_model, license_text, 320)
    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading="reconstruct")
    with open_session(fixture_model, spec, longest=len(prompt) + 64 + 16, n_ubatch=64) as s:
        ctl = s.controller
        words = word_starts([s.engine.detokenize([t]) for t in prompt], joins=not_space)
        seen, real = [], ctl._reconstruction_scores

        def spy(query):
            out = real(query)
            seen.extend((g.live.copy(), g.best[g.live].copy(), o) for g, o in zip(ctl.groups, out, strict=True))
            return out

        ctl._reconstruction_scores = spy
        s.read(prompt)
        assert seen
        for live, best, out in seen:
            np.testing.assert_array_equal(out, word_max(best, words[live]))
        assert any(not np.array_equal(out, best) for _, best, out in seen)  # a word had two bests


def test_a_policy_that_cannot_be_guided_reads_plainly(fixture_model, license_text):
    prompt = tokens_of(fixture_model, license_text, 300)
    for policy in ("h2o", "streaming"):
        for reading in ("query", "reconstruct"):  # neither a question nor a reconstruction pass guides it
            with open_session(fixture_model, SessionSpec.bounded(policy, 96, reading=reading), 300, 64) as s:
                s.controller.read_query = lambda q: pytest.fail(f"an unguided policy read with {q}")
                s.read(prompt, [1, 2, 3])


def kernels_of(policy, pieces: list[str]) -> list[int]:
    """Wrap ``policy.score``: each call records the kernel k = ``read_kernel`` if it returned the rule's pooled
    score (the mean of the per-token running score over positions j-k//2 .. j+k//2 that exist, by the loop of
    ``reference.window_mean``, then each word's largest: ``reference.word_max`` over the words of ``pieces``, the
    text of the token at each position), 1 if the per-token score itself. Exact up to the summation order of the
    pooling (a few F64 ulps of the largest score)."""
    calls: list[int] = []
    real, k = policy.score, policy.read_kernel
    words = word_starts(pieces)

    def score(obs):
        out, per = real(obs), policy.ring.get(obs.positions)
        pooled = window_mean(per, k)
        if obs.positions[-1] < len(pieces):  # a guided read: positions of the prompt
            pooled = word_max(pooled, words[obs.positions])
        assert not np.allclose(pooled, per)  # a real text's scores: the two rules differ
        calls.append(k if np.allclose(out, pooled, rtol=0, atol=64 * 2.0**-52 * per.max()) else 0)
        calls[-1] = 1 if np.array_equal(out, per) else calls[-1]
        return out

    policy.score = score
    return calls


@pytest.mark.parametrize("reading", ["query", "reconstruct"])
def test_ahakv_pools_its_score_while_a_guided_prompt_is_read_only(fixture_model, license_text, reading):
    """Every eviction of a guided read (the unguided last chunk too) goes by the pooled running score; those of
    the answer decoded after it, of a plain read after that, and of a fresh sequence, by the per-token one."""
    prompt = tokens_of(fixture_model, license_text, 300)
    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading=reading, evict_every=4)
    with open_session(fixture_model, spec, longest=len(prompt) + 160, n_ubatch=64) as s:
        ctl, question = s.controller, s.engine.tokenize(QUESTION_TEXT, add_bos=False)
        pieces = [s.engine.detokenize([t]) for t in prompt]
        kernels = kernels_of(ctl.policy, pieces)
        logits = s.read(prompt, question)
        n_read = len(kernels)
        # one eviction a span: a question's (its last QUERY_TOKENS here) leaves a chunk and the rest of its room
        span = 64 + guide_room("query", 64) - QUERY_TOKENS if reading == "query" else 64
        assert n_read == len(range(0, len(prompt), span)) and set(kernels) == {ctl.policy.read_kernel}
        s.answer(logits, 24)
        assert len(kernels) > n_read and set(kernels[n_read:]) == {1}
        n_answered = len(kernels)
        ctl.prefill(prompt[:96])  # the conversation goes on without guidance
        assert len(kernels) > n_answered and set(kernels[n_answered:]) == {1}
        s.reset()
        kernels = kernels_of(ctl.policy, pieces)
        ctl.prefill(prompt)
        assert kernels and set(kernels) == {1}


def needle_kept(model, text, policy: str, reading: str) -> int:
    with open_session(model, SessionSpec.bounded(policy, 256, reading=reading), 2048 + 16, 64) as s:
        e = s.engine
        prompt = build_prompt(e, e.tokenize(text, add_bos=False), 2048, 0.3, "48213")
        needle = e.tokenize(NEEDLE.format(key="48213"), add_bos=False)
        at = next(i for i in range(len(prompt)) if prompt[i : i + len(needle)] == needle)
        s.read(prompt, e.tokenize(QUESTION, add_bos=False))
        return int(np.isin(np.arange(at, at + len(needle)), s.controller.live).sum())


@pytest.mark.parametrize("policy", ["ahakv", "snapkv"])
def test_the_question_keeps_more_of_the_passage_it_asks_about(gemma_model, license_text, policy):
    """Gemma 3 270M, a passkey at 30% of 2,048 tokens, 256 cells (8x): read plainly, the compression before
    the question arrives keeps 2 (ahakv) and 7 (snapkv) of the key sentence's 27 tokens; guided by the
    question, 13 and 16 (measured on an AVX2-only AMD EPYC)."""
    plain, guided = (
        needle_kept(gemma_model, license_text, policy, "plain"),
        needle_kept(gemma_model, license_text, policy, "query"),
    )
    assert guided >= plain + 4, (plain, guided)


def test_the_drop_in_reads_a_long_prompt_with_its_question(fixture_model, license_text):
    document = license_text[:2500]  # the fixture tokenizes about a character per token
    with Llama(str(fixture_model), kv_budget=128, n_batch=64, n_ctx=4096, verbose=False) as llm:
        ctl: KVController = llm.kv_controller
        seen: list[list[int]] = []
        real = ctl.read_query
        ctl.read_query = lambda q: seen.append(list(q)) or real(q)
        messages = [{"role": "user", "content": f"{document}\n\nWhich version is this?"}]
        llm.create_chat_completion(messages=messages, max_tokens=2, temperature=0)
        asked = llm.tokenize(messages[0]["content"].encode(), add_bos=False, special=False)
        # the last user message, by its last tokens: QUERY_TOKENS of them
        assert seen and len(seen[0]) == QUERY_TOKENS and seen[0] == asked[-QUERY_TOKENS:]
        seen.clear()
        llm.create_completion(f"{document}\n\nThe version is", max_tokens=2, temperature=0, kv_query=False)
        assert seen == []  # off
        llm.create_completion(f"{document}\n\nThe version is", max_tokens=2, temperature=0)
        assert seen and seen[-1] == llm.tokenize(b"The version is", add_bos=False)  # the last paragraph
        for blank in ("\r\n\r\n", "\n \n", "\r\r"):  # whatever ends the lines, or stands in the blank line
            seen.clear()
            crlf = document.replace("\n", blank[: len(blank) // 2] if blank[0] == "\r" else "\n")
            llm.create_completion(f"{crlf}{blank}The version is", max_tokens=2, temperature=0)
            assert seen and seen[-1] == llm.tokenize(b"The version is", add_bos=False), repr(blank)
        seen.clear()
        llm.create_completion(f"{document}\n\nThe version is", max_tokens=2, temperature=0, kv_query="Which?")
        assert seen and all(q == llm.tokenize(b"Which?", add_bos=False) for q in seen)
        assert np.array_equal(llm.kv_engine.live_positions(), ctl.live)
        seen.clear()  # called as llama-cpp-python's Llama is (a TypeError: its __call__ names its parameters)
        llm(f"{document}\n\nThe version is", max_tokens=2, temperature=0, kv_query="Which?")
        assert seen and all(q == llm.tokenize(b"Which?", add_bos=False) for q in seen)
        seen.clear()
        other = license_text[2500:5000]  # no prefix in common with the cache: read from the start
        llm.create_completion(f"{other}\n\nThe version is", max_tokens=2, temperature=0, kv_query="surprisal")
        # scored by surprisal, no question decoded (the answer's first token is decoded after the read: NaN, unscored)
        assert seen == [] and np.isfinite(ctl.groups[0].best[ctl.live[:-1]]).all()
        assert np.array_equal(llm.kv_engine.live_positions(), ctl.live)
        seen.clear()  # OpenAI's content parts: their text (it was the rendered template's last paragraph)
        parts = [{"type": "text", "text": document}, {"type": "text", "text": "Which version is this?"}]
        llm.create_chat_completion(messages=[{"role": "user", "content": parts}], max_tokens=2, temperature=0)
        # as the prompt renders them: the chat template (here the transcript) joins parts with nothing between
        rendered = upstream.chat_prompt_tokens(llm, [{"role": "user", "content": parts}], False)
        joined = llm.tokenize(f"{document}Which version is this?".encode(), add_bos=False, special=False)
        assert seen and seen[0] == joined[-QUERY_TOKENS:] and llm.detokenize(joined[-8:]) in llm.detokenize(rendered)
        with pytest.raises(AhakvError, match="kv_query must be a question's text, True, False"):  # was AttributeError
            llm.create_completion("The version is", max_tokens=2, kv_query=123)
    with pytest.raises(AhakvError, match="kv_query"):
        Llama(str(fixture_model), kv_budget=128, kv_query="maybe", verbose=False)


def test_chat_reads_a_document_before_the_question(fixture_model, license_text, tmp_path):
    from ahakv_local.chat import ChatSession, command

    doc = tmp_path / "license.txt"
    doc.write_text(license_text[:1500])
    llm = Llama(str(fixture_model), kv_budget=128, kv_reuse_compressed=True, n_batch=64, verbose=False)
    with llm:
        s = ChatSession(llm, "You are terse.", max_tokens=4, temperature=0.0)
        passes = []
        real = llm.kv_controller.read_query
        llm.kv_controller.read_query = lambda q: passes.append(len(q)) or real(q)
        before = list(s.messages)
        for bad, why in ((tmp_path / "missing.txt", "cannot read"), (tmp_path, "cannot read")):
            with pytest.raises(AhakvError, match=why):
                command(s, "/read", str(bad))
        (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
        with pytest.raises(AhakvError, match="not UTF-8"):
            command(s, "/read", str(tmp_path / "latin1.txt"))
        assert s.messages == before and not passes  # nothing read, nothing changed
        reply = command(s, "/read", str(doc))
        assert reply.startswith("read license.txt:") and len(s.messages) == len(before) + 2
        # question-agnostic: one reconstruction pass per 64-token chunk, the repetition prompt plus the chunk
        assert len(passes) == -(-llm.n_tokens // 64) and max(passes) > 64
        assert (
            llm.n_tokens == len(s._prompt_tokens(s.messages, generation_prompt=False))
            and llm.kv_controller.live.size <= 128
        )
        assert np.array_equal(llm.kv_engine.live_positions(), llm.kv_controller.live)
        n = llm.n_tokens
        asked = s._prompt_tokens([*s.messages, {"role": "user", "content": "Which version?"}])
        assert asked[:n] == list(llm.input_ids[:n])  # the question's rendering extends what was read
        s.answer("Which version?", open(os.devnull, "w"))  # the next turn continues the compressed history:
        assert llm.kv_stats().prompt_tokens == len(asked) - n  # only the question is decoded, nothing read again
        assert llm.kv_stats().tokens_seen > n and llm._kv_guide is None


def test_a_stopped_or_too_long_read_leaves_the_chat_as_it_was(fixture_model, license_text, tmp_path):
    """The first Ctrl-C during /read stops it between two chunks (the chat goes on, the document not added); a
    document past the model's trained context (the fixture's 4,096 positions, about a character per token) is a
    user's mistake, one line, not a failure of the command."""
    from ahakv_local.chat import ChatSession, command

    doc, long_doc = tmp_path / "license.txt", tmp_path / "long.txt"
    doc.write_text(license_text[:1500])
    long_doc.write_text(license_text[:6000])
    with Llama(str(fixture_model), kv_budget=128, kv_reuse_compressed=True, n_batch=64, verbose=False) as llm:
        s = ChatSession(llm, "You are terse.", max_tokens=4, temperature=0.0)
        asked = iter(range(100))
        chunks = []
        real = llm.kv_controller.read_piece
        llm.kv_controller.read_piece = lambda *a: chunks.append(1) or real(*a)
        before = list(s.messages)
        with pytest.raises(AhakvError, match=r"^/read stopped: license.txt was not added$"):
            command(s, "/read", str(doc), stop=lambda: next(asked) >= 3)  # asked before the 1st chunk, then per chunk
        assert len(chunks) == 3 < -(-1500 // 64) and s.messages == before and llm.should_stop() is False
        with pytest.raises(AhakvError, match=r"^Requested tokens \(\d+\) exceed the model's trained context of 4096"):
            command(s, "/read", str(long_doc))
        assert s.messages == before
        assert command(s, "/read", str(doc)).startswith("read license.txt:")  # and the chat goes on
        assert len(s.messages) == len(before) + 2


def test_chat_reads_a_document_by_surprisal_with_a_policy_no_question_guides(fixture_model, license_text, tmp_path):
    from ahakv_local.chat import ChatSession, command

    doc = tmp_path / "license.txt"
    doc.write_text(license_text[:1500])
    with Llama(str(fixture_model), kv_budget=128, kv_policy="h2o", kv_reuse_compressed=True, n_batch=64,
               verbose=False) as llm:  # fmt: skip
        s = ChatSession(llm, "You are terse.", max_tokens=4, temperature=0.0)
        ctl = llm.kv_controller
        ctl.read_query = lambda q: pytest.fail("a surprisal reading decodes no question")
        assert command(s, "/read", str(doc)).startswith("read license.txt:")
        assert ctl.groups[0].best[: llm.n_tokens].min() > 0  # every position of the read was scored
        assert np.array_equal(llm.kv_engine.live_positions(), ctl.live) and ctl.live.size <= 128


def test_generate_takes_a_question_and_refuses_it_without_a_guided_reading(fixture_model):
    import subprocess
    import sys

    base = [sys.executable, "-m", "ahakv_local", "generate", str(fixture_model), "-n", "2", "--budget", "48"]
    text = "the quick brown fox jumps over the lazy dog. " * 12
    ok = subprocess.run([*base, "-p", text, "--query", "Which animal?"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*base, "-p", text, "--query", "x", "--reading", "plain"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "--query" in bad.stderr


def test_surprisal_reading_evicts_by_each_phrases_surprisal_alone(fixture_model, license_text):
    """``reading="surprisal"`` (any policy, here H2O, which cannot be guided by a question): each chunk's tokens are
    scored by -log p(token | what precedes it) from the logits that predicted them, and every compression evicts
    the positions whose surprisal averaged over 15 neighbours is lowest, the policy's own score left out. The
    reference is numpy in float64 on the logits of a plain engine replaying the same chunks and evictions (the
    same forward bound as above: the logits agree within it, and the log-partition and the picked logit each move
    by at most that much); every eviction removes no candidate scoring above one it kept."""
    prompt = tokens_of(fixture_model, license_text, 320)
    spec = SessionSpec.bounded("h2o", 96, n_recent=8, reading="surprisal")
    evicted: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n_past -> (live before, evicted)
    with open_session(fixture_model, spec, longest=len(prompt), n_ubatch=64) as s:
        ctl = s.controller
        real_evict = ctl.engine.evict

        def record(positions, cache=None):
            evicted[ctl.engine.n_past] = (ctl.live.copy(), np.asarray(positions).copy())
            return real_evict(positions, cache)

        ctl.engine.evict = record
        ctl.read_query = lambda q: pytest.fail("a surprisal reading decodes no question")
        s.read(prompt)
        surprisal = ctl.groups[0].best[: len(prompt)].copy()
        assert np.array_equal(s.engine.live_positions(), ctl.live) and ctl.live.size <= 96
        assert sorted(evicted) == list(range(128, len(prompt) + 1, 64))  # every chunk once over the budget
    with Engine(fixture_model, EngineConfig(n_ctx=s.engine.n_ctx, n_batch=64, n_ubatch=64)) as e:
        rows = []
        for a in range(0, len(prompt), 64):
            rows.append(e.decode(prompt[a : a + 64], True).astype(np.float64))
            if e.n_past in evicted:
                e.evict(evicted[e.n_past][1])
        logits = np.concatenate(rows)
    top = logits.max(1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    ref = np.empty(len(prompt))
    ref[1:] = -log_p[np.arange(len(prompt) - 1), prompt[1:]]
    ref[0] = ref[1:64].mean()  # nothing predicts the first token: its chunk's mean stands in
    bound = 2 * 16 * 128 * F32 * np.abs(logits).max()
    np.testing.assert_allclose(surprisal, ref, rtol=0, atol=bound)
    for n, (live, gone) in evicted.items():
        pooled = np.array([ref[max(0, i - 7) : min(n, i + 8)].mean() for i in range(n)])  # 15 wide, cut at the ends
        kept = np.setdiff1d(live, gone)
        candidates = kept[(kept >= 4) & (kept < np.sort(live)[-8])]  # not the sinks, not the last 8 live
        assert pooled[gone].max() <= pooled[candidates].min() + 2 * bound


def test_a_budget_raised_into_the_question_room_is_refused(fixture_model, license_text):
    """A guided reading's spans take the room kept behind a chunk for the question. ``set_budget`` allowed a budget
    raised into that room (the cells less a chunk and the newest token), whose prompts were then read a chunk at a
    time, unguided, and whose adaptive re-splits laid the caches out for it and the room: past the memory the
    session was opened with (chat's /budget 352 of 256 on Gemma: 513 cells a layer for 417). It is refused, naming
    the room; the largest budget that keeps it reads in guided spans and holds it."""
    prompt = tokens_of(fixture_model, license_text, 600)
    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading="query")
    with open_session(fixture_model, spec, longest=len(prompt), n_ubatch=64) as s:
        ctl, question = s.controller, s.engine.tokenize(QUESTION_TEXT, add_bos=False)
        room, cells = ctl.config.room, s.engine.n_cells()
        assert room > 0
        with pytest.raises(AhakvError, match=rf"with a prompt chunk of 64 and a guided reading's room of {room}$"):
            ctl.set_budget(Budget("cells", cells - 64 - 1))
        held = cells - 64 - 1 - room
        ctl.set_budget(Budget("cells", held))
        pieces = []
        real_decode = ctl._decode
        ctl._decode = lambda t, w, a, observe=True: pieces.append(len(t)) or real_decode(t, w, a, observe)
        s.read(prompt, question)
        # guided spans (a chunk and what the question leaves of the room behind it), each read as a chunk and the rest
        span = ctl.read_span(question)
        assert span > 64 and pieces[:2] == [64, span - 64] and sum(pieces) == len(prompt)
        live = s.engine.live_positions()
        assert np.array_equal(live, ctl.live) and s.engine.n_past == len(prompt) and live.size <= held


@pytest.mark.parametrize("reading", ["reconstruct", "surprisal", True])
def test_the_drop_in_samples_from_the_prompts_own_logits(fixture_model, license_text, reading):
    """A reconstruction decodes a repetition behind the prompt's last chunk, which left its own logits where llama.cpp
    keeps the last ones, and llama-cpp-python's sampler read them: the first token came from the repetition. With
    nothing evicted (a budget over the prompt) every reading must sample from what a plain read gives."""
    seen = {}
    for query in (False, reading):
        llm = Llama(str(fixture_model), kv_budget=300, kv_policy="snapkv", kv_query=query, n_ctx=2048, n_batch=64,
                    n_ubatch=64, verbose=False)  # fmt: skip
        try:
            tokens = llm.tokenize(license_text[:1000].encode())[:120]
            rows: list[np.ndarray] = []

            def kept(ids, scores, rows=rows):
                rows.append(np.array(scores))
                return scores

            llm.create_completion(tokens, max_tokens=1, temperature=0.0, logits_processor=[kept])
            assert llm.kv_controller.stats.evicted == 0
            seen[query] = rows[0]
        finally:
            llm.close()
    # the same positions, the guided reading's in other cells (a guide's cells were freed between chunks): the sums
    # over them in another order, within the forward pass's rounding of the largest entry (it was another row)
    np.testing.assert_allclose(seen[reading], seen[False], rtol=0, atol=FORWARD_RTOL * np.abs(seen[False]).max())


@pytest.mark.parametrize("n_batch", [64, 128])
def test_a_surprisal_reading_in_pieces_keeps_what_one_read_keeps(fixture_model, license_text, n_batch):
    """The drop-in and the parallel server read a prompt in pieces of n_batch (``prompt_pieces``). A surprisal read
    gave each piece's first token its chunk's mean surprisal (nothing carried the row that predicted it), so the same
    prompt under the same spec was compressed otherwise as its pieces were cut. The reference: one ``prefill``, in
    chunks of 64, which pieces of whole chunks compress at the same points."""
    from ahakv_local.controller import Surprisal

    spec = SessionSpec.bounded("ahakv", 96, n_recent=8, reading="surprisal")
    with open_session(fixture_model, spec, longest=500, n_ubatch=64) as s:
        tokens = tokens_of(fixture_model, license_text, 400)
        ctl = s.controller
        ctl.prefill(tokens, query=Surprisal())
        whole, scored = ctl.live.copy(), ctl.groups[0].best[:400].copy()
        s.reset()
        for piece, ends in ctl.prompt_pieces(tokens, Surprisal(), n_batch):
            ctl.read_piece(piece, Surprisal(), ends)
        np.testing.assert_array_equal(ctl.groups[0].best[:400], scored)
        np.testing.assert_array_equal(ctl.live, whole)


def surprisal_of(rows: np.ndarray, tokens: list[int]) -> np.ndarray:
    """-log p(token | what precedes it) in float64: row i predicts tokens[i + 1]; the first token takes the mean of
    the others (nothing in the read predicted it, as ``KVController._evict_by_surprisal`` says)."""
    rows = rows.astype(np.float64)
    top = rows.max(1, keepdims=True)
    log_p = rows - top - np.log(np.exp(rows - top).sum(1, keepdims=True))
    out = -log_p[np.arange(len(tokens) - 1), tokens[1:]]
    return np.concatenate([[out.mean()], out])


@pytest.mark.parametrize("before", ["plainly", "by reconstruction", "as an answer"])
def test_positions_no_surprisal_read_scored_stand_at_the_mean(fixture_model, license_text, before):
    """A surprisal read ranks positions by their surprisal; those read before it otherwise (plainly, by reconstruction,
    the tokens of an answer) have none. They stood at 0, the least surprising of all (a reconstruction's scores, of
    another scale, ~1), so chat's /read of a document evicted the conversation before any of the document. They now
    stand at the mean of the scored positions. The reference: numpy in float64 on the read's own logits, each
    position pooled over 15 neighbours; the eviction removes no candidate scoring above one it kept (within the
    fixture's forward bound on the logits, as in the test above)."""
    from ahakv_local.controller import Reconstruct, Surprisal

    tokens = tokens_of(fixture_model, license_text, 164)
    first, second = tokens[:100], tokens[100:]
    spec = SessionSpec.bounded("ahakv", 128, n_recent=8, reading="reconstruct")
    with open_session(fixture_model, spec, longest=300, n_ubatch=64) as s:
        ctl = s.controller
        if before == "as an answer":
            ctl.prefill(first[:40])
            for t in first[40:]:
                ctl.step(t)
        else:
            repeat = tuple(s.engine.tokenize(" Repeat the previous context.", add_bos=False))
            ctl.prefill(first, query=Reconstruct(repeat) if before == "by reconstruction" else None)
        assert ctl.live.size == len(first)  # nothing evicted yet
        evicted = []
        real_evict = ctl.engine.evict
        ctl.engine.evict = lambda at, cache=None: evicted.append(np.array(at)) or real_evict(at, cache)
        live = ctl.live.copy()
        rows = ctl.prefill(second, all_logits=True, query=Surprisal())
        assert len(evicted) == 1
    n = len(tokens)
    ref = np.empty(n)
    ref[len(first) :] = surprisal_of(rows, second)
    ref[: len(first)] = ref[len(first) :].mean()
    pooled = np.array([ref[max(0, i - 7) : min(n, i + 8)].mean() for i in range(n)])  # 15 wide, cut at the ends
    gone = evicted[0]
    live = np.concatenate([live, np.arange(len(first), n)])
    kept = np.setdiff1d(live, gone)
    candidates = kept[(kept >= 4) & (kept < n - 8)]  # not the sinks, not the last 8
    bound = 2 * 16 * 128 * F32 * np.abs(rows).max()
    assert (gone < len(first)).any() and (gone >= len(first)).any()  # both reads lose positions
    assert pooled[gone].max() <= pooled[candidates].min() + 2 * bound


def test_a_reconstruction_after_a_surprisal_read_ranks_by_its_own_scores(fixture_model, license_text):
    """A sequence read by surprisal, then extended by reconstruction (a server's next request, a drop-in call with
    another ``kv_query``): the positions of the first read kept their surprisal (nats, ~3-10) as the best of
    reconstruction passes that score in units of their mean (~1), and outranked every position the reconstruction
    scored. They are ranked by the reconstruction's passes alone now: exactly as after the same first read made
    plainly (the same decodes, the same cells)."""
    from ahakv_local.controller import Reconstruct, Surprisal

    tokens = tokens_of(fixture_model, license_text, 300)
    spec = SessionSpec.bounded("ahakv", 128, n_recent=8, reading="reconstruct")
    kept = []
    for first in (None, Surprisal()):
        with open_session(fixture_model, spec, longest=500, n_ubatch=64) as s:
            ctl = s.controller
            repeat = tuple(s.engine.tokenize(" Repeat the previous context.", add_bos=False))
            ctl.prefill(tokens[:100], query=first)
            assert ctl.live.size == 100
            ctl.prefill(tokens[100:], query=Reconstruct(repeat))
            kept.append(ctl.live.copy())
    assert kept[0].size < 300  # the reconstruction evicted
    np.testing.assert_array_equal(kept[1], kept[0])
