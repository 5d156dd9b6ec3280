"""The chat as a hostile or unlucky user meets it: crafted and foreign save files, a message longer than
the model's context, a closed terminal. Nothing may run, and no conversation may be lost."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import stat
import subprocess
import sys
import zipfile

import numpy as np
import pexpect
import pytest

from ahakv_local import Llama
from ahakv_local.budget import Budget
from ahakv_local.chat import ChatSession, command, keep_transcript, kv_size
from ahakv_local.errors import AhakvError
from ahakv_local.fixture import FixtureSpec
from ahakv_local.llama import Stopped
from ahakv_local.models import fixture_path


def session(path, budget: int = 64, policy: str = "ahakv") -> ChatSession:
    llm = Llama(str(path), kv_budget=budget, kv_policy=policy, kv_recent=8, n_batch=32, verbose=False)
    return ChatSession(llm, "You are terse.", max_tokens=12, temperature=0.0)


@pytest.fixture
def chat(fixture_model):
    s = session(fixture_model)
    yield s
    s.llm.close()


def talk(s: ChatSession, text: str) -> str:
    class Sink:
        def write(self, _: str) -> None: ...
        def flush(self) -> None: ...

    return s.answer(text, Sink())


class RunsAShellCommand:
    """What a crafted pickle does on load (the defect: /load unpickled whatever it was given)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_runs_nothing(chat, tmp_path):
    talk(chat, "hello there")
    before = list(chat.messages)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.chat"
    evil.write_bytes(pickle.dumps({"messages": [], "state": RunsAShellCommand(str(marker))}))
    with pytest.raises(AhakvError, match="not a saved ahakv-local chat"):
        command(chat, "/load", str(evil))
    assert not marker.exists()
    assert chat.messages == before  # the running conversation is untouched


def test_save_is_state_bytes_and_json_and_load_continues_identically(fixture_model, tmp_path):
    # streaming decides by position alone; a policy with statistics starts them over after a load
    # (the controller's resync), so its later evictions, and answers, may differ from the original's
    chat = session(fixture_model, policy="streaming")
    talk(chat, "the cat sat on the mat and then")
    talk(chat, "tell me more about the cat")  # past the 64-cell budget: the cache has holes
    assert chat.llm.kv_stats().evicted > 0
    saved = tmp_path / "conv.chat"
    command(chat, "/save", str(saved))
    with zipfile.ZipFile(saved) as z:
        assert sorted(z.namelist()) == ["chat.json", "state.bin"]
        meta = json.loads(z.read("chat.json"))
    assert meta["messages"] == chat.messages and meta["n_tokens"] == chat.llm.n_tokens
    assert meta["cache_cells"] == list(chat.llm.kv_engine.cache_sizes())  # the caches the state was made in
    live = chat.llm.kv_controller.live.copy()
    expected = talk(chat, "and the dog?")  # the reference: the original session goes on

    chat.llm.close()
    other = session(fixture_model, policy="streaming")
    try:
        command(other, "/load", str(saved))
        assert other.messages == meta["messages"]
        np.testing.assert_array_equal(other.llm.kv_controller.live, live)
        np.testing.assert_array_equal(other.llm.kv_controller.engine.live_positions(), live)
        assert talk(other, "and the dog?") == expected  # same compressed cache, same greedy answer
    finally:
        other.llm.close()


def test_save_and_load_work_after_the_model_file_moves(fixture_model, tmp_path):
    """llama.cpp holds the weights of a loaded model, but /save and /load read the file for its identity at each
    call: a model moved or deleted during a chat (a cache cleaned, a download renamed) stopped both with a
    FileNotFoundError, and the conversation could not be saved. The identity is taken as the chat starts."""
    model = tmp_path / "model.gguf"
    model.write_bytes(fixture_model.read_bytes())
    chat = session(model, policy="streaming")
    try:
        talk(chat, "the cat sat on the mat")
        model.rename(tmp_path / "moved.gguf")
        command(chat, "/save", str(tmp_path / "a.chat"))
        expected = talk(chat, "and the dog?")
        assert command(chat, "/load", str(tmp_path / "a.chat")).startswith("loaded")
        assert talk(chat, "and the dog?") == expected  # the saved conversation, continued the same way
    finally:
        chat.llm.close()


def test_a_loaded_system_prompt_is_pinned_while_its_cache_is_held_to_this_chat_s_budget(fixture_model, tmp_path):
    """/load pinned the loaded system prompt after the loaded cache had been held to this chat's smaller budget:
    its tokens, the oldest, were the first evicted. And the file's policy was said nowhere: the chat went on with its
    own."""

    def chat(system: str | None) -> ChatSession:
        llm = Llama(str(fixture_model), kv_budget=128, kv_policy="streaming", kv_recent=8, n_batch=32, verbose=False)
        return ChatSession(llm, system, max_tokens=12, temperature=0.0)

    a = chat("Be careful and terse, always.")
    for i in range(3):
        talk(a, f"the cat sat {i}")
    command(a, "/save", str(tmp_path / "pin.chat"))
    pinned = a.llm.kv_controller.config.pinned
    a.llm.close()
    b = chat(None)
    try:
        command(b, "/budget", "64")
        command(b, "/policy", "h2o")
        said = command(b, "/load", str(tmp_path / "pin.chat"))
        assert said.endswith("(saved under streaming: this chat goes on with h2o; /policy streaming to switch)")
        kv = b.llm.kv_controller
        assert kv.config.pinned == pinned and pinned[1] > kv.config.n_sink
        assert set(range(*pinned)) <= set(kv.live.tolist())  # every token of the system prompt kept
    finally:
        b.llm.close()


def test_foreign_and_damaged_files_change_nothing(chat, tmp_path, capfd):
    talk(chat, "hello")
    saved = tmp_path / "conv.chat"
    command(chat, "/save", str(saved))
    before = list(chat.messages)

    # another model: a fixture with another embedding size
    other = session(fixture_path(FixtureSpec(n_embd=96, n_head=4, n_head_kv=2)))
    try:
        with pytest.raises(AhakvError, match="another model"):
            command(other, "/load", str(saved))
    finally:
        other.llm.close()

    def tampered(name: str, edit) -> str:
        with zipfile.ZipFile(saved) as z:
            meta, blob = json.loads(z.read("chat.json")), z.read("state.bin")
        meta, blob = edit(meta, blob)
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("chat.json", json.dumps(meta))
            z.writestr("state.bin", blob)
        return str(path)

    cases = {
        "token ids outside": lambda m, b: ({**m, "input_ids": [10**6] * m["n_tokens"]}, b),
        "no valid conversation": lambda m, b: ({**m, "messages": [{"role": "x", "content": 1}]}, b),
        "another version": lambda m, b: ({**m, "version": 99}, b),
        "llama.cpp refused this state .damaged, or": lambda m, b: (m, b[: len(b) // 2]),
        "invalid KV cache sizes": lambda m, b: ({**m, "cache_cells": [0, "x"]}, b),
        "saved in KV caches of other sizes": lambda m, b: ({**m, "cache_cells": [n + 1 for n in m["cache_cells"]]}, b),
    }
    for message, edit in cases.items():
        capfd.readouterr()
        with pytest.raises(AhakvError, match=message) as refused:
            command(chat, "/load", tampered(message.replace(" ", "_").replace(".", ""), edit))
        assert "\n" not in str(refused.value) and chat.messages == before
        # the refusal is the one line: llama.cpp's own lines of its reading ("state_set_data: error loading state:
        # failed to restore kv cache") went to stderr before it
        assert capfd.readouterr().err == ""
    # the sizes' hint repeats only a budget and a layout that parse: a crafted file's text never reaches the line
    crafted = {"budget": "8MiB\nINJECTED", "layer_budgets": "adaptive\nINJECTED"}
    for key, value in crafted.items():
        odd = tampered(key, lambda m, b: ({**m, "cache_cells": [n + 1 for n in m["cache_cells"]], key: value}, b))  # noqa: B023
        with pytest.raises(AhakvError, match="saved in KV caches of other sizes") as refused:
            command(chat, "/load", odd)
        assert "INJECTED" not in str(refused.value) and "\n" not in str(refused.value)
    saved_in_bytes = tampered(
        "bytes", lambda m, b: ({**m, "cache_cells": [n + 1 for n in m["cache_cells"]], "budget": "8MiB"}, b)
    )
    with pytest.raises(AhakvError, match=r"other sizes \(\d+-\d+ cells\): /budget 8MiB first, or open the chat with"):
        command(chat, "/load", saved_in_bytes)
    assert chat.messages == before
    garbage = tmp_path / "garbage.chat"
    garbage.write_bytes(os.urandom(300))
    with pytest.raises(AhakvError, match="not a saved ahakv-local chat"):
        command(chat, "/load", str(garbage))
    with pytest.raises(AhakvError, match="is a directory"):
        command(chat, "/load", str(tmp_path))
    assert chat.messages == before
    assert talk(chat, "still there?") is not None  # the session still answers


def test_a_chat_saved_in_other_kv_types_is_refused_with_what_loads_it(gemma_model, tmp_path):
    """llama.cpp's state holds K and V as they are stored: a chat saved in q8_0 caches (flash attention on) loaded
    into f16 ones printed two lines of llama.cpp's log before the refusal, and a chat saved under a byte budget
    whose auto type was q8_0 was told "/budget 8MiB first", which keeps f16 caches and fails again."""

    def gemma_chat(**kw) -> ChatSession:
        llm = Llama(str(gemma_model), kv_recent=8, n_batch=64, n_threads=1, verbose=False, **kw)
        return ChatSession(llm, None, max_tokens=4, temperature=0.0)

    here = gemma_chat(kv_budget=1024, kv_type="auto")  # chat's default budget: f16
    try:
        for name, kw, hint in [
            ("q8.chat", {"kv_budget": 1024, "kv_type": "q8_0"}, ": open the chat with --kv-type q8_0$"),
            (
                "bytes.chat",
                {"kv_budget": "8MiB", "kv_type": "auto"},
                ": open the chat with --budget 8MiB --kv-type q8_0$",
            ),
        ]:
            saved = gemma_chat(**kw)
            try:
                talk(saved, "My name is Bob.")
                command(saved, "/save", str(tmp_path / name))
            finally:
                saved.llm.close()
            talk(here, "hello")
            before = list(here.messages)
            with pytest.raises(AhakvError, match=rf"saved in KV caches of q8_0, flash attention on{hint}"):
                command(here, "/load", str(tmp_path / name))
            assert here.messages == before and talk(here, "still there?") is not None
        # as the hint says: the same chat loads and goes on
        again = gemma_chat(kv_budget="8MiB", kv_type="q8_0")
        try:
            command(again, "/load", str(tmp_path / "bytes.chat"))
            assert [m["content"] for m in again.messages if m["role"] == "user"] == ["My name is Bob."]
        finally:
            again.llm.close()
    finally:
        here.llm.close()


def test_save_never_replaces_a_file_that_is_not_a_saved_chat(chat, tmp_path):
    talk(chat, "hello")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(AhakvError, match=r"notes.txt exists and is not a saved chat: not replaced"):
        command(chat, "/save", str(notes))
    assert notes.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    saved = tmp_path / "conv.chat"
    command(chat, "/save", str(saved))
    talk(chat, "more")
    command(chat, "/save", str(saved))  # a saved chat is replaced by the newer one, as an editor saves
    assert len(json.loads(zipfile.ZipFile(saved).read("chat.json"))["messages"]) == len(chat.messages)


def test_a_device_or_a_pipe_is_neither_replaced_by_save_nor_read_by_load(chat, tmp_path):
    """As root, /save /dev/null replaced the device with a file; /load /dev/zero read until the memory ran out."""
    talk(chat, "hello")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    before = list(chat.messages)
    for path in (pipe, "/dev/null"):
        with pytest.raises(AhakvError, match=r"exists and is not a saved chat: not replaced"):
            command(chat, "/save", str(path))
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    for path in (pipe, "/dev/zero"):
        with pytest.raises(AhakvError, match=r"is not a saved ahakv-local chat \(not a regular file\)"):
            command(chat, "/load", str(path))
    with pytest.raises(AhakvError, match=r"cannot read /dev/zero: not a regular file"):  # (was: read to 64 MiB)
        command(chat, "/read", "/dev/zero")
    assert chat.messages == before


def test_a_save_that_cannot_be_written_is_one_line_and_leaves_nothing_behind(chat, tmp_path):
    talk(chat, "hello")
    with pytest.raises(AhakvError, match=r"cannot write .*absent.*: No such file or directory"):
        command(chat, "/save", str(tmp_path / "absent" / "conv.chat"))
    # a folder where the file would go: the conversation is written in full, then cannot take the folder's place
    # (refused even to root); the folder keeps what it held and the temporary file goes
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    with pytest.raises(AhakvError, match=r"cannot write .*notes: (Is a directory|Directory not empty)"):
        command(chat, "/save", str(folder))
    assert (folder / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    assert talk(chat, "still there?") is not None  # the session goes on


def test_chats_ending_in_the_same_second_keep_a_transcript_each(chat, tmp_path, monkeypatch):
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("ahakv_local.chat.time.strftime", lambda _: "chat-20261205-120000")
    talk(chat, "first")
    keep_transcript(chat)
    talk(chat, "second")
    keep_transcript(chat)  # the same second: before, this replaced the first chat's file
    kept = sorted((tmp_path / "chats").iterdir())
    assert [p.name for p in kept] == ["chat-20261205-120000-2.json", "chat-20261205-120000.json"]
    first, second = (json.loads(p.read_text()) for p in reversed(kept))
    assert [m["content"] for m in first if m["role"] == "user"] == ["first"]
    assert [m["content"] for m in second if m["role"] == "user"] == ["first", "second"]


def test_a_history_file_that_is_no_file_is_left_alone(tmp_path):
    """A FIFO where the readline history lives (the cache's chat_history) held the chat in open() before its banner,
    for good; it is now neither read nor written, and the chat starts."""
    os.mkfifo(tmp_path / "chat_history")
    code = "from ahakv_local.chat import setup_history; setup_history(); print('started')"
    env = {**os.environ, "AHAKV_CACHE_DIR": str(tmp_path)}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the chat's start waited on the FIFO")
    assert proc.returncode == 0 and proc.stdout == "started\n", proc.stderr
    assert stat.S_ISFIFO((tmp_path / "chat_history").stat().st_mode)


def test_a_transcript_with_nowhere_to_go_is_shown_not_lost(chat, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: refused even to root
    talk(chat, "remember this")
    keep_transcript(chat)
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot keep the conversation in {blocker / 'cache' / 'chats'}: Not a directory")
    assert "remember this" in err and "Traceback" not in err


def test_a_message_longer_than_the_context_is_taken_back(chat):
    talk(chat, "hello")
    before = list(chat.messages)
    huge = "a b c d " * 3000  # 12K tokens > the fixture's trained context of 4,096 positions
    with pytest.raises(ValueError, match="trained context of 4096"):
        talk(chat, huge)
    assert chat.messages == before
    talk(chat, "a normal message")  # the next turn works without /reset
    assert chat.messages[-2]["content"] == "a normal message"


@pytest.mark.parametrize("budget", ["50%", "auto"])
@pytest.mark.parametrize("sliding", [False, True], ids=["one cache", "adaptive layers"])
def test_a_ratio_or_auto_budget_set_in_a_chat_stays_inside_its_cache(budget, sliding):
    """``/budget 50%`` or ``/budget auto`` in a chat started with 64 cells: both grow with the tokens seen (auto keeps
    at least 10% of them) and used to outgrow the caches, sized for 64 cells, until every message failed with "the
    KV cache is full" (50%: at the 4th message; auto: past ~1,300 tokens). They are capped at what the caches hold."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6)) if sliding else fixture_path()
    s = session(path)
    try:
        kv = s.llm.kv_controller
        assert kv.config.layer_budgets == ("adaptive" if sliding else "natural")
        holds = 64  # the budget the chat was started with: what its caches were sized to hold between evictions
        assert s.set_budget(budget).startswith(f"budget: {budget} (at most {holds} cells)")
        full = [g for g in kv.groups if not g.window]
        while kv.stats.tokens_seen < 1500:
            talk(s, "please tell me more about the weather " * 25)
            assert max(g.live.size for g in full) <= holds, s.stats_line()
    finally:
        s.llm.close()


def test_a_ratio_under_what_is_never_evicted_reports_what_the_cache_holds(chat):
    """``/budget 10%`` early in a chat: 10% of the tokens seen is less than the sinks, the system prompt and the recent
    tokens, which are never evicted, and the steps until the next eviction. The stats line showed "cache 52/7 cells",
    a budget the cache could not keep; its budget is now what the cache holds at most, never below the cells used."""
    cfg = chat.llm.kv_controller.config
    assert cfg.pinned[0] == 0 and cfg.pinned[1] > cfg.n_sink  # the system prompt, the sinks inside it
    chat.set_budget("10%")
    # never evicted: the system prompt and the recent tokens (the newest among them); then the steps to come (a ratio
    # budget's period: every step)
    assert cfg.evict_every == 1
    holds = cfg.pinned[1] + cfg.n_recent + cfg.evict_every - 1
    for _ in range(4):
        talk(chat, "tell me about the weather")
        s = chat.llm.kv_stats()
        assert 0.1 * s.tokens_seen < holds  # (still a short conversation)
        assert s.evicted > 0 and s.cells_used <= s.budget == holds


@pytest.mark.parametrize("sliding", [False, True], ids=["one cache", "adaptive layers"])
def test_a_byte_budget_set_in_a_chat_gives_the_caches_its_bytes(sliding, tmp_path):
    """``/budget 8MiB`` answered "budget: 8 MiB" and kept the caches allocated at the start (13.8 MiB for the default
    chat): a byte budget is allocated KV bytes. The caches are now laid out for it, smaller or larger, as in a chat
    opened with it, the conversation kept. A chat saved in them loads where the caches are laid out alike, and
    elsewhere the error names the budget that lays them out so."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6)) if sliding else fixture_path()
    s = session(path, budget=1024)
    try:
        kv, e = s.llm.kv_controller, s.llm.kv_engine
        talk(s, "please tell me about the weather " * 7)  # under 256 positions: adaptive shares still even
        seen, start = kv.stats.tokens_seen, e.kv_bytes()
        small = f"{start // 4 // 1024}KiB"
        said = re.match(
            rf"budget: {small[:-3]} KiB \(evicted (\d+) now, KV caches \d+ KiB -> \d+ KiB\)", s.set_budget(small)
        )
        assert said and int(said[1]) > 0
        # the bytes, less what whole cells leave (under one cell a cache; the session's own eviction period and
        # guide room stay, so a chat opened with the budget, which picks them for it, may split it otherwise)
        one_cell_each = sum(e.cell_bytes(c) for c in e.caches)
        assert Budget.parse(small).value - one_cell_each < e.kv_bytes() <= Budget.parse(small).value
        for g in kv.groups:  # the conversation kept, every group's positions those its cache holds
            np.testing.assert_array_equal(g.live, g.read_live(e))
        assert kv.stats.tokens_seen == seen
        talk(s, "and tomorrow?")
        assert all(g.live.size <= g.budget.value for g in kv.groups if not g.window)

        saved = tmp_path / "small.chat"
        s.save(saved)
        big = f"{2 * start // 1024}KiB"
        before = kv.stats.evicted
        assert "KV caches" in s.set_budget(big)
        assert Budget.parse(big).value - one_cell_each < e.kv_bytes() <= Budget.parse(big).value
        assert kv.stats.evicted == before  # a larger budget evicts nothing
        if sliding:  # adaptive shares of a larger budget hold the smaller caches: loaded into them
            assert s.load(saved).startswith("loaded")
            # and grown back to this budget before the next decode: they stayed small for good, under a budget that
            # said more, and /budget of that very budget was refused as larger than the caches
            s.llm.eval(s.llm.tokenize(b" and the day after?", add_bos=False))  # (where it was: see below)
            assert Budget.parse(big).value - one_cell_each < e.kv_bytes() <= Budget.parse(big).value
            assert s.set_budget(big).startswith(f"budget: {big[:-3]} KiB")
        else:
            with pytest.raises(
                AhakvError,
                match=rf"KV caches of other sizes \(\d+-\d+ cells\): /budget {small} first, or open the chat",
            ):
                s.load(saved)
            s.set_budget(small)
            assert s.load(saved).startswith("loaded")
        talk(s, "one more")
        for g in kv.groups:
            np.testing.assert_array_equal(g.live, g.read_live(e))
    finally:
        s.llm.close()


def test_a_smaller_budget_in_a_chat_takes_its_own_eviction_period(fixture_model):
    """The product's period follows the budget (budget.default_evict_every: 32 steps at 512 cells, (60 - 4 - 32) // 4
    = 6 at 60): /budget 60 was refused for 512's period, "smaller than sinks + recent + one eviction period (4 + 32 +
    32)", where a chat opened with --budget 60 ran. A period the user gave stays."""
    with Llama(str(fixture_model), kv_budget=512, n_batch=32, verbose=False) as llm:
        s = ChatSession(llm, None, max_tokens=12, temperature=0.0)
        kv = llm.kv_controller
        assert kv.config.evict_every == 32
        assert command(s, "/budget", "60").startswith("budget: 60 cells")
        assert kv.config.evict_every == 6
        for _ in range(8):
            talk(s, "tell me more about the weather today")
        assert kv.stats.tokens_seen > 120 and kv.live.size <= 60
        command(s, "/budget", "512")
        assert kv.config.evict_every == 32
    with Llama(str(fixture_model), kv_budget=512, kv_evict_every=16, n_batch=32, verbose=False) as llm:
        s = ChatSession(llm, None, max_tokens=12, temperature=0.0)
        with pytest.raises(AhakvError, match=r"smaller than sinks \+ recent \+ one eviction period \(4 \+ 32 \+ 16\)"):
            command(s, "/budget", "50")
        assert command(s, "/budget", "60").startswith("budget: 60 cells") and llm.kv_controller.config.evict_every == 16


def test_a_budget_that_cannot_hold_what_is_never_evicted_is_refused(fixture_model):
    """The system prompt is pinned beside the sinks and the recent tokens, none of them ever evicted. A budget that
    could not hold them and one eviction period was accepted, then exceeded: a 250-token system prompt under
    --budget 64 kept 222 cells and failed every message with "the KV cache is full"; ``/budget 32`` under a 22-token
    one held 41. The full cache, which keeps every token, got the same failure on caches sized for a budget. Each is
    now refused in one line, and the chat goes on."""
    s = session(fixture_model)
    try:
        kv, cfg = s.llm.kv_controller, s.llm.kv_controller.config
        start, end = cfg.pinned
        assert start == 0 and end > cfg.n_sink  # "You are terse." rendered: more tokens than the sinks
        held = cfg.n_sink + (end - cfg.n_sink) + cfg.n_recent + 1  # never evicted, the newest among them

        def period(b: int) -> int:  # the product's eviction period at b cells (README: 32, less under 164 cells)
            return max(1, min(32, (b - cfg.n_sink - cfg.n_recent) // 4))

        floor = next(b for b in range(held, 1000) if b >= held + period(b) - 1)  # + the steps to come
        with pytest.raises(AhakvError, match=r"smaller than sinks \+ pinned \+ recent \+ (one eviction period|newest)"):
            s.set_budget(str(floor - 1))
        assert s.set_budget(str(floor)).startswith(f"budget: {floor} cells")
        for _ in range(4):
            talk(s, "one more thing about the weather, please " * 3)
            assert 0 < kv.stats.cells_used <= floor
        with pytest.raises(
            AhakvError, match=f"policy full keeps every token: these caches hold {kv.allocated_cells()}"
        ):
            command(s, "/policy", "full")
        assert kv.policy.name == "ahakv"
        talk(s, "still here")
        assert s.messages[-2]["content"] == "still here"
    finally:
        s.llm.close()
    llm = Llama(str(fixture_model), kv_budget=64, kv_policy="ahakv", kv_recent=8, n_batch=32, verbose=False)
    try:
        with pytest.raises(AhakvError, match=r"the system prompt is \d+ tokens, kept whole: budget 64 is smaller"):
            ChatSession(llm, "rule " * 60, max_tokens=12, temperature=0.0)
    finally:
        llm.close()
    # a ratio in -c 200 cells: the floor does not bound a ratio, and the 160-token prompt was accepted, then every
    # message failed with "the KV cache is full" (what no eviction takes and a chunk of 50 overflow 282 cells)
    llm = Llama(str(fixture_model), kv_budget="25%", n_ctx=200, verbose=False)
    try:
        with pytest.raises(AhakvError, match=r"the system prompt is \d+ tokens, kept whole: budget 25% .* do not fit"):
            ChatSession(llm, "rule " * 160, max_tokens=12, temperature=0.0)
        ChatSession(llm, "rule " * 20, max_tokens=12, temperature=0.0)  # one it holds
    finally:
        llm.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_closed_terminal_keeps_the_transcript(tmp_path, sig):
    env = {**os.environ, "HOME": str(tmp_path), "AHAKV_CACHE_DIR": str(tmp_path / "cache")}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "ahakv_local", "chat", "fixture", "--budget", "64", "--recent", "8", "-n", "8", "--temp", "0"],
        encoding="utf-8",
        timeout=120,
        env=env,
    )
    try:
        child.expect("> ")
        child.sendline("remember the word lighthouse")
        child.expect(r"\] [\d.]+ s")  # the stats line after the answer
        child.expect("> ")
        child.kill(sig)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    transcripts = list((tmp_path / "cache" / "chats").glob("chat-*.json"))
    assert len(transcripts) == 1
    messages = json.loads(transcripts[0].read_text())
    assert any(m["content"] == "remember the word lighthouse" for m in messages)


def test_chat_commands_fuzzed(fixture_model, tmp_path_factory):
    """Any command line a user can type: a reply or one AhakvError, never another exception, and the
    conversation untouched by every command but /reset and /load (hypothesis, derandomized, bounded)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    folder = tmp_path_factory.mktemp("fuzz")
    s = session(fixture_model)
    talk(s, "hello")
    command(s, "/save", str(folder / "good.chat"))
    names = st.sampled_from(["/help", "/reset", "/stats", "/policy", "/budget", "/save", "/load", "/exit?", "/x"])
    words = st.one_of(
        st.text(max_size=30),
        st.sampled_from(["auto", "0", "-1", "1e9", "inf", "nan", "25%", "0%", "200%", "0.5", "64", "4000", "h2o"]),
    )
    tried = {"ok": 0, "refused": 0}

    @settings(max_examples=150, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(name=names, arg=words)
    def one(name: str, arg: str) -> None:
        if name in ("/save", "/load"):  # files only inside the test's folder
            arg = str(folder / ("good.chat" if not arg.strip() or "/" in arg or "\x00" in arg else arg))
        before = list(s.messages)
        try:
            assert isinstance(command(s, name, arg.strip()), str)
            tried["ok"] += 1
        except AhakvError:
            tried["refused"] += 1
            assert s.messages == before
        if name not in ("/reset", "/load"):
            assert s.messages == before
        if name == "/reset":
            command(s, "/load", str(folder / "good.chat"))  # back to a conversation for the next example

    try:
        one()
        assert talk(s, "still there?") is not None
    finally:
        s.llm.close()
    assert tried["ok"] > 0 and tried["refused"] > 0, tried


def test_save_writes_a_temporary_file_of_its_own(chat, tmp_path):
    """/save FILE wrote FILE.tmp, then renamed it: a user's file of that name was gone, and a link of that name was
    written through (the file it pointed to became a zip)."""
    talk(chat, "hello")
    (tmp_path / "talk.chat.tmp").write_text("backup notes")
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("my thesis draft")
    (tmp_path / "mine.chat.tmp").symlink_to(thesis)
    command(chat, "/save", str(tmp_path / "talk.chat"))
    command(chat, "/save", str(tmp_path / "mine.chat"))
    assert (tmp_path / "talk.chat.tmp").read_text() == "backup notes" and thesis.read_text() == "my thesis draft"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.chat", "mine.chat.tmp", "talk.chat", "talk.chat.tmp", "thesis.txt"
    ]  # fmt: skip
    assert chat.load(tmp_path / "talk.chat").startswith("loaded")
    mode = (tmp_path / "talk.chat").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # as any file the user writes, not mkstemp's private 0600


def test_a_refused_load_keeps_the_conversation_and_its_cache(fixture_model, tmp_path):
    """A chat whose system prompt the budget cannot pin: the refusal came after the cache and the messages had been
    replaced (the running conversation lost, the loaded system prompt unpinned)."""
    long_system = " ".join(["Always answer in full sentences about the weather."] * 2)
    big = session(fixture_model, budget=256)
    big.system = long_system
    big.reset()
    talk(big, "hello")
    big.save(tmp_path / "long.chat")
    big.llm.close()
    s = session(fixture_model, budget=64)
    try:
        talk(s, "my name is Zed")
        before, tokens = list(s.messages), list(s.llm.input_ids[: s.llm.n_tokens])
        pinned = s.llm.kv_controller.config.pinned
        with pytest.raises(AhakvError, match=r"the system prompt is \d+ tokens, kept whole"):
            s.load(tmp_path / "long.chat")
        assert s.messages == before and s.system == "You are terse." and s.llm.kv_controller.config.pinned == pinned
        assert list(s.llm.input_ids[: s.llm.n_tokens]) == tokens
    finally:
        s.llm.close()


def test_a_loaded_chat_without_a_system_prompt_pins_nothing(fixture_model, tmp_path):
    plain = session(fixture_model)
    plain.system = None
    plain.reset()
    talk(plain, "hello there")
    plain.save(tmp_path / "plain.chat")
    assert plain.set_budget("45").startswith("budget: 45")  # 4 sinks + 8 recent + a period: no pin to hold
    plain.llm.close()
    s = session(fixture_model)  # "You are terse." pinned
    try:
        s.load(tmp_path / "plain.chat")
        assert s.system is None and s.llm.kv_controller.config.pinned is None
        assert s.set_budget("45").startswith("budget: 45")
        s.reset()
        assert s.llm.kv_controller.config.pinned is None
    finally:
        s.llm.close()


def test_a_state_too_large_or_empty_is_refused_unread(chat, tmp_path):
    """state.bin was read whatever its size: a zip of 1 MB holding 1 GiB took 2.5 GB to refuse (3 MB: 6.7 GB), where a
    little more was the OOM killer and a lost conversation; an empty one "loaded", and every later turn failed."""
    from ahakv_local.saved_chat import max_state_bytes

    talk(chat, "hello")
    saved = tmp_path / "conv.chat"
    command(chat, "/save", str(saved))
    before, tokens = list(chat.messages), list(chat.llm.input_ids[: chat.llm.n_tokens])
    meta = zipfile.ZipFile(saved).read("chat.json")
    bound = max_state_bytes(chat.llm)
    e = chat.llm.kv_engine
    assert bound >= 2 * 4 * e.n_layer * e.n_ctx * e.n_head_kv * e.head_dim  # every cell in F32 fits under it
    for name, blob, message in [
        ("bomb", bytes(bound + 1), "holds a cache state larger than this chat's context can"),
        ("empty", b"", "holds no cache state"),
    ]:
        path = tmp_path / f"{name}.chat"
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("chat.json", meta)
            z.writestr("state.bin", blob)
        with pytest.raises(AhakvError, match=message):
            command(chat, "/load", str(path))
        assert chat.messages == before and list(chat.llm.input_ids[: chat.llm.n_tokens]) == tokens
    assert talk(chat, "still there?") is not None
    with pytest.raises(ValueError, match="holds no cache"):  # the drop-in's own load_state, as upstream's is called
        state = chat.llm.save_state()
        state.llama_state, state.llama_state_size = b"", 0
        chat.llm.load_state(state)


def test_a_chat_of_another_model_of_the_same_shape_and_size_is_refused(tmp_path):
    """Two random fixtures of one shape differ only in their weights (same size to the byte): the state of one loaded
    into the other without a word."""
    from ahakv_local.fixture import write_fixture

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_fixture(a, FixtureSpec(seed=1))
    write_fixture(b, FixtureSpec(seed=2))
    assert a.stat().st_size == b.stat().st_size
    first = session(a)
    talk(first, "hello")
    first.save(tmp_path / "a.chat")
    first.llm.close()
    other = session(b)
    try:
        with pytest.raises(AhakvError, match=r"saved with another model \(a.gguf\), not b.gguf"):
            other.load(tmp_path / "a.chat")
    finally:
        other.llm.close()
    a.rename(tmp_path / "renamed.gguf")  # the same weights under another name load
    renamed = session(tmp_path / "renamed.gguf")
    try:
        assert renamed.load(tmp_path / "a.chat").startswith("loaded")
    finally:
        renamed.llm.close()


def test_a_chat_saved_at_a_smaller_budget_is_loaded_into_this_budget(tmp_path):
    """Adaptive layouts load a state saved in smaller caches (a chat saved at 96 cells into one of 192): the caches
    then kept the smaller sizes for good (`cache 228/256 cells` under "budget: 512"), and /budget 192 was refused as
    more than the caches held. They grow back to this budget's even split before the next decode; a chat saved at
    this budget loads into the caches as they are."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    for budget in (96, 192):
        s = session(path, budget=budget)
        talk(s, "please tell me about the weather " * 5)
        s.save(tmp_path / f"{budget}.chat")
        s.llm.close()
    s = session(path, budget=192)
    try:
        kv, e = s.llm.kv_controller, s.llm.kv_engine
        fresh = e.cache_sizes()
        s.load(tmp_path / "192.chat")
        assert e.cache_sizes() == fresh and kv._resize_to is None  # this budget's own caches: nothing to move
        s.load(tmp_path / "96.chat")
        small = e.cache_sizes()
        assert sum(small) < sum(fresh)  # loaded in the sizes it was saved in
        # the conversation goes on where it was (a turn of the fixture, which has no chat template, re-renders the
        # transcript otherwise and starts over: a new sequence is laid out anew anyway)
        s.llm.eval(s.llm.tokenize(b" and tomorrow?", add_bos=False))
        assert e.cache_sizes() == fresh
        for g in kv.groups:  # the loaded positions moved with the caches
            np.testing.assert_array_equal(g.live, g.read_live(e))
        assert s.set_budget("192").startswith("budget: 192")
    finally:
        s.llm.close()


def test_a_chat_loaded_into_a_larger_budget_keeps_every_position(gemma_model, license_text, tmp_path):
    """Adaptive shares are uneven once re-split: Gemma's layer 0 held 365 cells of a 256-cell chat. Loaded into a chat
    of 300, the caches grew to the even split of 300 and the layers saved above it lost positions at once (60 of
    layer 0's), where a larger budget evicts nothing; and /stats said the saved budget until the next turn."""

    def opened(budget: int) -> ChatSession:
        llm = Llama(str(gemma_model), kv_budget=budget, n_batch=64, n_threads=2, verbose=False)
        return ChatSession(llm, None, max_tokens=40, temperature=0.0)  # (an eviction in each answer: a re-split)

    s = opened(256)
    try:
        words = license_text.split()
        for start in (0, 200):  # two turns past 512 positions: two re-splits, uneven shares
            talk(s, " ".join(words[start : start + 200]) + " What is this text about?")
        kv = s.llm.kv_controller
        assert kv.shares.decisions >= 1 and kv.shares.weights.max() > 1.1
        saved = {int(g.layers[0]): g.live.copy() for g in kv.groups}
        s.save(tmp_path / "256.chat")
    finally:
        s.llm.close()
    for budget in (300, 512):
        s = opened(budget)
        try:
            s.load(tmp_path / "256.chat")
            kv = s.llm.kv_controller
            for g in kv.groups:
                np.testing.assert_array_equal(g.live, saved[int(g.layers[0])])
            # the budget in force: the full-attention layers' mean holding, this budget's (to a cell: whole cells)
            assert abs(kv.stats.budget - budget) <= 1, kv.stats.budget
            s.llm.eval(s.llm.tokenize(b" and then?", add_bos=False))  # the caches grow before the next decode
            for g in kv.groups:  # the positions moved with them
                np.testing.assert_array_equal(g.live, g.read_live(s.llm.kv_engine))
        finally:
            s.llm.close()


def test_a_larger_cell_budget_stays_within_the_memory_the_chat_opened_with(tmp_path):
    """The fit check left out a guided reading's room: a cell budget that fitted the caches without it was taken, and
    the next adaptive re-split laid them out for it with the room (Gemma's chat of 256: /budget 352, 417 cells each
    grew to 513, 23% more memory). Such a budget is refused, one that fits with the room is taken, and the memory
    never grows past what the chat opened with."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    s = session(path, budget=96)
    try:
        kv, e = s.llm.kv_controller, s.llm.kv_engine
        room, opened = kv.config.room, e.kv_bytes()
        assert room > 1 and kv.shares is not None  # a guided reading's room, adaptive layers
        with pytest.raises(AhakvError, match=rf"budget {96 + room // 2} does not fit"):
            s.set_budget(str(96 + room // 2))
        assert s.set_budget("90").startswith("budget: 90")
        for i in range(12):  # past 256 positions: re-splits lay the caches out for the budget in force
            talk(s, f"tell me about the weather in the mountains number {i} and the sea")
            assert e.kv_bytes() <= opened
        assert kv.shares.decisions >= 1
    finally:
        s.llm.close()


def test_a_refused_load_names_the_options_that_load_it(fixture_model, tmp_path):
    """The hint of a refused /load named no option where the policy made the caches' sizes (AhaKV keeps a question's
    room, H2O none), none between a budget's caches and the full cache (llama.cpp's log, then "refused"), and for a
    byte budget the options that, followed, were refused again (--budget 8MiB opened in another K/V type)."""

    def chat(**kw) -> ChatSession:
        bounded = {"kv_recent": 8} if "kv_budget" in kw else {}  # (without a budget it would be warned of)
        llm = Llama(str(fixture_model), verbose=False, **({"n_batch": 32} | bounded | kw))
        return ChatSession(llm, None, max_tokens=4, temperature=0.0)

    made = {
        "ahakv": {"kv_budget": 64},
        "full": {"kv_policy": "full", "n_ctx": 512},
        "bytes": {"kv_budget": "64KiB"},
        # caches laid out for AhaKV, then /policy h2o: the file recorded h2o, and its hint named nothing
        "switched": {"kv_budget": 64},
        # a ratio's cells come from n_ctx: loaded at another -c, the hint named nothing
        "ratio": {"kv_budget": 0.25, "n_ctx": 1024},
        # each cache holds a ubatch beside the budget: saved at --batch-size 16, the hint named nothing
        "batch": {"kv_budget": 64, "n_batch": 16},
    }
    for name, kw in made.items():
        s = chat(**kw)
        if name == "switched":
            command(s, "/policy", "h2o")
        talk(s, "hello there")
        command(s, "/save", str(tmp_path / f"{name}.chat"))
        s.llm.close()
    ratio_cells = json.loads(zipfile.ZipFile(tmp_path / "ratio.chat").read("chat.json"))["cache_cells"]
    batch_cells = json.loads(zipfile.ZipFile(tmp_path / "batch.chat").read("chat.json"))["cache_cells"]
    expected = {  # (the chat loading, the file): the hint, then the chat those options open loads it
        ("h2o", "switched"): (
            "in KV caches of other sizes (129-129 cells): open the chat with --policy ahakv",
            "ahakv",
        ),
        ("small ratio", "ratio"): (
            f"in KV caches of other sizes ({min(ratio_cells)}-{max(ratio_cells)} cells): open the chat with -c 1024",
            "ratio",
        ),
        ("h2o", "ahakv"): ("in KV caches of other sizes (129-129 cells): open the chat with --policy ahakv", "ahakv"),
        ("ahakv", "batch"): (
            f"in KV caches of other sizes ({min(batch_cells)}-{max(batch_cells)} cells): open the chat with "
            "--batch-size 16",
            "batch",
        ),
        ("h2o", "full"): ("without a budget (the full cache): open the chat with --budget none", "full"),
        ("full", "ahakv"): ("in caches laid out for a budget: open the chat with --budget 64 --policy ahakv", "ahakv"),
        ("ahakv", "bytes"): (
            "in KV caches of other sizes (256-256 cells): /budget 64KiB first, or open the chat with --budget 64KiB "
            "--kv-type f16",
            "bytes",
        ),
    }
    opened = {"h2o": {"kv_budget": 64, "kv_policy": "h2o"}, "small ratio": {"kv_budget": 0.25, "n_ctx": 512}, **made}
    for (here, name), (hint, loads) in expected.items():
        s = chat(**opened[here])
        try:
            with pytest.raises(AhakvError) as refused:
                command(s, "/load", str(tmp_path / f"{name}.chat"))
            assert str(refused.value) == f"{tmp_path / name}.chat was saved {hint}"
        finally:
            s.llm.close()
        s = chat(**made[loads])
        try:
            assert command(s, "/load", str(tmp_path / f"{name}.chat")).startswith("loaded")
        finally:
            s.llm.close()


def test_a_refused_first_load_leaves_a_chat_that_answers(tmp_path):
    """A damaged file loaded as a chat's first command: llama.cpp restored some per-layer caches before refusing,
    nothing cleared them from an empty sequence, and every later message failed ("llama_decode failed with code -1",
    after /reset too), the caches left at the refused file's sizes."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    s = session(path, budget=96)
    talk(s, "please tell me about the weather " * 3)
    s.save(tmp_path / "good.chat")
    s.llm.close()
    with zipfile.ZipFile(tmp_path / "good.chat") as z:
        meta, blob = z.read("chat.json"), z.read("state.bin")
    with zipfile.ZipFile(tmp_path / "bad.chat", "w") as z:
        z.writestr("chat.json", meta)
        z.writestr("state.bin", blob[: 3 * len(blob) // 4])
    fresh = session(path, budget=96)
    expected, sizes = talk(fresh, "hello"), fresh.llm.kv_engine.cache_sizes()
    fresh.llm.close()
    s = session(path, budget=96)
    try:
        with pytest.raises(AhakvError, match="llama.cpp refused this state"):
            s.load(tmp_path / "bad.chat")
        assert s.messages == [{"role": "system", "content": "You are terse."}]
        assert talk(s, "hello") == expected and s.llm.kv_engine.cache_sizes() == sizes
    finally:
        s.llm.close()


def test_a_budget_set_right_after_a_policy_is_held_at_once(tmp_path):
    """The controller skipped every eviction until the new policy had read a decode: /budget 40 after /policy h2o said
    "evicted 0 now" and the stats kept "56/64"; a smaller byte budget there was refused ("the group 0 cache holds 258
    cells") with the budget already taken; a chat saved under a larger budget loaded over this one ("278/64"); and
    under /policy full a cell budget was accepted and never held ("284/64"). With nothing read for a policy yet, the
    oldest positions that may go, go first."""
    s = session(fixture_path(), budget=64)
    try:
        talk(s, "the cat sat on the mat and then the dog came in and sat too " * 3)
        command(s, "/policy", "h2o")
        assert re.match(r"budget: 40 cells \(evicted [1-9]\d* now\)", command(s, "/budget", "40"))
        st = s.llm.kv_stats()
        assert st.budget == 40 and st.cells_used <= 40
        for g in s.llm.kv_controller.groups:
            np.testing.assert_array_equal(g.live, g.read_live(s.llm.kv_engine))
        # a chat saved under a larger budget, loaded under this one: held at once
        command(s, "/budget", "100KiB")
        talk(s, "the cat sat on the mat and then the dog came in and sat too " * 8)
        command(s, "/save", str(tmp_path / "big.chat"))
        command(s, "/budget", "48")
        command(s, "/load", str(tmp_path / "big.chat"))
        st = s.llm.kv_stats()
        assert st.budget == 48 and st.cells_used <= 48
        # a policy that keeps every token takes no budget: on caches that hold every position it was taken, and a
        # cell budget set under it then was accepted and never held
        command(s, "/budget", "1MiB")  # (2 MiB: past the fixture's trained context, refused)
        with pytest.raises(AhakvError, match="policy full keeps every token: a budget needs a policy that evicts"):
            command(s, "/policy", "full")
    finally:
        s.llm.close()
    g3 = session(fixture_path(FixtureSpec(arch="gemma3", n_layer=6)), budget=64)
    try:
        command(g3, "/budget", "200KiB")
        talk(g3, "the cat sat on the mat and then the dog came in and sat too " * 4)
        command(g3, "/policy", "h2o")
        assert "KV caches 200 KiB -> 100 KiB" in command(g3, "/budget", "100KiB")
        assert g3.llm.kv_engine.kv_bytes() <= 100 * 1024
    finally:
        g3.llm.close()


def test_a_save_keeps_the_replaced_file_s_mode_and_writes_through_a_link(chat, tmp_path):
    """/save over a saved chat made private (0600) made it world-readable (mkstemp's file, then the umask's mode);
    /save through a link replaced the link with a file and left the chat it named stale."""
    talk(chat, "hello")
    private = tmp_path / "private.chat"
    command(chat, "/save", str(private))
    private.chmod(0o600)
    talk(chat, "a secret")
    command(chat, "/save", str(private))
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert len(json.loads(zipfile.ZipFile(private).read("chat.json"))["messages"]) == len(chat.messages)
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "project.chat"
    command(chat, "/save", str(target))
    link = tmp_path / "current.chat"
    link.symlink_to(target)
    talk(chat, "one more")
    command(chat, "/save", str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert len(json.loads(zipfile.ZipFile(target).read("chat.json"))["messages"]) == len(chat.messages)
    dangling = tmp_path / "next.chat"
    dangling.symlink_to(tmp_path / "real" / "next.chat")  # names a file not written yet: /save writes it
    command(chat, "/save", str(dangling))
    assert dangling.is_symlink() and (tmp_path / "real" / "next.chat").is_file()


def test_a_save_ended_by_a_signal_leaves_no_temporary_file(chat, tmp_path, monkeypatch):
    """SIGTERM or SIGHUP during /save ends the chat with SystemExit (ExitOnHangup): the half-written temporary file
    stayed in the user's folder (only an OSError removed it)."""
    talk(chat, "hello")
    real = zipfile.ZipFile.writestr

    def hangup(self, name, data, *a, **k):
        if name == "state.bin":
            raise SystemExit(143)  # what ExitOnHangup raises, mid-write
        return real(self, name, data, *a, **k)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", hangup)
    with pytest.raises(SystemExit):
        command(chat, "/save", str(tmp_path / "big.chat"))
    assert list(tmp_path.iterdir()) == []


def test_load_keeps_the_conversation_it_replaces(chat, tmp_path, monkeypatch):
    """/load replaced the running conversation, which was never written anywhere (the transcript is written on
    exit, of the conversation then): it is kept as on exit before the loaded one takes its place."""
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path / "cache"))
    talk(chat, "first chat")
    command(chat, "/save", str(tmp_path / "first.chat"))
    command(chat, "/reset", "")
    talk(chat, "call Bob at 5")  # never saved
    command(chat, "/load", str(tmp_path / "first.chat"))
    kept = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "chats").iterdir()]
    # (the first kept by /reset, the second by /load)
    assert sorted([m["content"] for m in k if m["role"] == "user"] for k in kept) == [["call Bob at 5"], ["first chat"]]
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["first chat"]


def test_reset_keeps_the_conversation_it_clears(chat, tmp_path, monkeypatch):
    """/reset threw the conversation away: the README says every conversation is written to <cache>/chats/, and only
    the one running at exit was."""
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path / "cache"))
    talk(chat, "my secret plan is to bake a cake")
    assert command(chat, "/reset", "") == "conversation cleared"
    assert chat.messages == [] or all(m["role"] == "system" for m in chat.messages)
    (kept,) = (tmp_path / "cache" / "chats").iterdir()
    users = [m["content"] for m in json.loads(kept.read_text()) if m["role"] == "user"]
    assert users == ["my secret plan is to bake a cake"]
    command(chat, "/reset", "")  # nothing said since: no empty transcript
    assert len(list((tmp_path / "cache" / "chats").iterdir())) == 1


def test_read_refuses_a_pipe_at_once(chat, tmp_path):
    """/read of a named pipe without a writer blocked in open(), where a first Ctrl-C could not stop it: refused in one
    line, as /load refuses one, and the conversation goes on."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AhakvError, match=r"^cannot read .*fifo: not a regular file \(a pipe or a device\)$"):
        command(chat, "/read", str(fifo))
    with pytest.raises(AhakvError, match="not a regular file"):
        command(chat, "/read", "/dev/null")
    assert talk(chat, "hello") is not None


def test_a_chat_saved_before_the_caches_were_recorded_loads(fixture_model, tmp_path):
    """A version-1 file written before cache_cells (and the budget, layout and policy beside it) were recorded was
    taken for a chat without a budget: refused, with advice (--budget none) that then failed in llama.cpp. It names
    no caches: it loads into these, llama.cpp checking them as it reads."""
    s = session(fixture_model)
    try:
        talk(s, "hello there")
        path = tmp_path / "old.chat"
        s.save(path)
        with zipfile.ZipFile(path) as z:
            meta, blob = json.loads(z.read("chat.json")), z.read("state.bin")
        for key in ("cache_cells", "budget", "layer_budgets", "policy", "kv_cache"):
            del meta[key]
        old = tmp_path / "older.chat"
        with zipfile.ZipFile(old, "w") as z:
            z.writestr("chat.json", json.dumps(meta))
            z.writestr("state.bin", blob)
        before = list(s.messages)
        command(s, "/reset", "")
        assert s.load(old).startswith("loaded") and s.messages == before
    finally:
        s.llm.close()


def test_a_first_ctrl_c_as_an_answer_ends_does_not_quit(chat, monkeypatch, capsys):
    """A Ctrl-C landing between the answer's last token and the stats line (writing the newline, the line itself)
    was outside the answer's StopOnInterrupt: a KeyboardInterrupt, and the chat quit on a first Ctrl-C."""
    import signal

    from ahakv_local import chat as chat_module

    said = iter([("hello", False, 1)])

    def read_message(prompt):
        try:
            return next(said)
        except StopIteration:
            raise EOFError from None

    line = chat.stats_line

    def stats_line() -> str:  # the Ctrl-C arrives as the stats line is made
        os.kill(os.getpid(), signal.SIGINT)
        return line()

    monkeypatch.setattr(chat_module, "read_message", read_message)
    monkeypatch.setattr(chat_module, "setup_history", lambda: None)
    monkeypatch.setattr(chat, "stats_line", stats_line)
    chat_module._repl(chat)  # returns at the end of input: no KeyboardInterrupt
    assert len(chat.messages) == 3 and "seen" in capsys.readouterr().err  # the answer and its stats line


def test_a_budget_lowered_then_raised_again_in_the_adaptive_layout(tmp_path):
    """The adaptive layout lays its caches out for the budget in force at each re-split, so after ``/budget 96`` in a
    chat started at 192 they shrank, and ``/budget 192`` was refused for good ("does not fit the 289 allocated
    cells"), /reset included: the memory the chat was opened with holds it, and it is laid out for it again."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    s = session(path, budget=192)
    try:
        kv, e = s.llm.kv_controller, s.llm.kv_engine
        assert kv.shares is not None  # the default layout of a model with both kinds of layer
        opened = e.cache_sizes()
        assert s.set_budget("96").startswith("budget: 96 cells")
        for _ in range(3):  # past a re-split: the caches are laid out for 96 cells
            talk(s, "please tell me about the weather in the mountains " * 12)
        shrunk = e.cache_sizes()
        assert sum(shrunk) < sum(opened)
        # laid out for 192 again (with the layers' shares of now), in at most the memory it was opened with
        assert re.match(r"budget: 192 cells \(evicted 0 now, KV caches .* -> .*\)", s.set_budget("192"))
        assert sum(shrunk) < sum(e.cache_sizes()) <= sum(opened)
        talk(s, "and tomorrow?")
        assert kv.groups[0].live.size <= 192
        for g in kv.groups:
            np.testing.assert_array_equal(g.live, g.read_live(e))
        s.set_budget("96")
        for _ in range(3):
            talk(s, "please tell me about the weather in the mountains " * 12)
        command(s, "/reset", "")
        assert s.set_budget("192").startswith("budget: 192 cells")  # after /reset too
        # beyond the memory it was opened with: still refused, in one line (bytes allocate more)
        with pytest.raises(AhakvError, match="does not fit the .* allocated cells"):
            s.set_budget("400")
    finally:
        s.llm.close()


def test_stats_lists_every_kv_cache_by_layer_in_readable_units():
    """/stats in a per-layer layout: one line a cache, in layer order (layer 10 after layer 9, not after layer 1;
    kv_stats lists the full-attention caches first), each the bytes kv_stats reports for that layer, and per kind
    the number of caches the layout has."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=12))  # sliding-window and full-attention layers
    llm = Llama(str(path), kv_budget=64, kv_recent=8, n_batch=32, verbose=False)
    try:
        s = ChatSession(llm, None, max_tokens=4, temperature=0.0)
        talk(s, "hello there, how are you")
        stats = llm.kv_stats()
        assert stats.layer_budgets == "adaptive"
        report = s.stats_report().splitlines()
        first = report.index(next(line for line in report if line.startswith("kv by group")))
        rows = [line.split() for line in report[first + 1 : first + 13]]
        assert [int(r[1]) for r in rows] == list(range(12))
        for layer, row in enumerate(rows):
            allocated, used = stats.kv_group_bytes[f"layer {layer}"]
            assert " ".join(row[2:]) == f"{kv_size(used)} of {kv_size(allocated)}"
        kinds = next(line for line in report if line.startswith("kv by kind"))
        n_sliding = sum(llm.kv_engine.layer_sliding)
        assert 0 < n_sliding < 12
        assert f"full {kv_size(stats.kv_kind_bytes['full'][1])} of" in kinds and f"({12 - n_sliding} caches)" in kinds
        assert f"sliding {kv_size(stats.kv_kind_bytes['sliding'][1])} of" in kinds and f"({n_sliding} caches)" in kinds
        assert sum(a for a, _ in stats.kv_group_bytes.values()) == stats.kv_bytes
    finally:
        llm.close()


@pytest.mark.parametrize("layout", ["adaptive", "natural"])
def test_a_chat_saved_under_a_smaller_cell_budget_names_the_budget_its_caches_were_laid_out_for(tmp_path, layout):
    """A smaller cell budget is held inside the caches as they are (adaptive: until its next re-split), but a saved
    chat recorded the budget in force: chat at 192, /budget 96, /save; loaded at 96 the hint said "open the chat with
    --budget 96", which refused it again, and only the chat's first budget (named nowhere) loaded it."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))

    def opened(budget: int) -> ChatSession:
        llm = Llama(str(path), kv_budget=budget, kv_layer_budgets=layout, kv_recent=8, n_batch=32, verbose=False)
        return ChatSession(llm, None, max_tokens=4, temperature=0.0)

    s = opened(192)
    talk(s, "hello there")
    assert s.set_budget("96").startswith("budget: 96 cells")
    s.save(tmp_path / "lowered.chat")
    s.llm.close()
    s = opened(96)
    try:
        with pytest.raises(AhakvError, match=r"other sizes \(.*\): open the chat with --budget 192$"):
            s.load(tmp_path / "lowered.chat")
    finally:
        s.llm.close()
    s = opened(192)  # what the hint names loads it
    try:
        assert s.load(tmp_path / "lowered.chat").startswith("loaded 2 messages")
    finally:
        s.llm.close()


def test_a_budget_past_the_trained_context_is_refused_in_a_chat_as_at_the_start(tmp_path):
    """The open refuses a budget past the model's trained context (nothing would ever be evicted); chat's /budget
    took it: ``/budget 1GiB`` laid out 107 MiB of caches for "1 GiB", and every later turn ran unbounded."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    s = session(path, budget=96)
    try:
        talk(s, "hello there")
        kv, e = s.llm.kv_controller, s.llm.kv_engine
        sizes, budget = e.cache_sizes(), kv.config.budget
        trained = e.n_ctx_train
        with pytest.raises(AhakvError, match=f"exceeds the model's trained context of {trained} positions"):
            s.set_budget(str(trained + 1))
        # bytes that hold more than the trained context in every full-attention layer
        cells = 2 * trained * max(e.cell_bytes(c) for c in e.caches) * len(e.layer_cache)
        with pytest.raises(
            AhakvError,
            match=f"holds more cells than the model's trained context of {trained} positions in every full-attention",
        ):
            s.set_budget(f"{cells}B")
        assert e.cache_sizes() == sizes and kv.config.budget == budget
    finally:
        s.llm.close()


def test_retained_mass_is_kept_for_a_layer_whose_statistics_hold_no_attention(tmp_path):
    """After /read the statistics start over (no rows observed), and a /budget right then evicted with attention
    sums of zero: /stats showed 0.000 retained in those layers. A layer with nothing observed keeps its last figure;
    the others are the retained share of the attention they observed, recomputed here."""
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    doc = tmp_path / "doc.txt"
    doc.write_text("the weather in the mountains is cold and the rivers run fast in the spring. " * 20)
    s = session(path, budget=256)
    try:
        s.read_document(doc)
        kv = s.llm.kv_controller
        before = list(kv.stats.retained_mass) or [1.0] * kv.engine.n_layer
        kv.engine.reset_stats()  # nothing observed since
        observed = {}
        for g in kv.groups:
            obs = kv._observe(g, kv._tap[0])
            for i, il in enumerate(g.layers if g.layers is not None else range(kv.engine.n_layer)):
                observed[int(il)] = float(obs.attn[i].sum())
        assert not any(observed.values())
        s.set_budget("0.1")
        assert kv.stats.evicted > 0
        assert kv.stats.retained_mass == before
    finally:
        s.llm.close()


@pytest.mark.parametrize("layout", ["natural", "adaptive"])
def test_a_byte_budget_for_a_policy_without_a_question_is_laid_out_with_its_own_eviction_period(tmp_path, layout):
    """/budget in bytes planned the caches with the eviction period in force and checked them with the new budget's:
    a sliding cache holds its window plus the period, so for a policy that keeps no question's room (H2O) every byte
    budget was refused ("budget 48 KiB does not fit the 111 allocated cells"), smaller or larger, though a chat opened
    at it runs."""
    path = fixture_path(FixtureSpec(arch="gemma3"))  # 2 layers: 48 KiB hold a 64-token chunk and more
    llm = Llama(str(path), kv_budget=128, kv_policy="h2o", kv_layer_budgets=layout, n_batch=64, verbose=False)
    try:
        s = ChatSession(llm, None, max_tokens=4, temperature=0.0)
        talk(s, "hello there")
        for size in ("48KiB", "150KiB"):
            assert s.set_budget(size).startswith(f"budget: {size[:-3]} KiB")
            assert llm.kv_engine.kv_bytes() <= Budget.parse(size).value
            talk(s, "and the weather tomorrow in the hills")
            for g in llm.kv_controller.groups:
                np.testing.assert_array_equal(g.live, g.read_live(llm.kv_engine))
    finally:
        llm.close()


@pytest.mark.parametrize("budget", [64, None], ids=["bounded", "full cache"])
def test_a_first_ctrl_c_stops_the_reading_of_a_long_message(fixture_model, budget):
    """The first Ctrl-C was seen only once a long message had been read to its end (32 s for 2,600 tokens on
    Gemma 3 270M), and users then pressed a second one, which ends the chat. It now stops between two prompt chunks:
    the message is taken back, the conversation is as before it, and the next one is answered."""
    kw = dict(kv_budget=budget, kv_recent=8, kv_reuse_compressed=True) if budget else dict(n_ctx=4096)
    llm = Llama(str(fixture_model), n_batch=32, verbose=False, **kw)  # (as the chat opens each)
    try:
        s = ChatSession(llm, "You are terse.", max_tokens=6, temperature=0.0)
        talk(s, "hello")
        before, n_before = list(s.messages), llm.n_tokens
        asked = []

        def stop() -> bool:  # false when the reading starts, true after its first chunk: a Ctrl-C landing then
            asked.append(llm.n_tokens)
            return len(asked) > 1

        long_message = "the quick brown fox jumps over the lazy dog " * 30  # ~1,100 fixture tokens: 35 chunks of 32
        with pytest.raises(Stopped):
            s.answer(long_message, io.StringIO(), stop)
        assert len(asked) == 2 and n_before < asked[1] < n_before + 300  # stopped early in the message
        assert s.messages == before and llm.should_stop() is False
        assert talk(s, "and now?") is not None and s.messages[-2]["content"] == "and now?"
        if budget:
            kv = llm.kv_controller
            assert all(np.array_equal(g.live, g.read_live(kv.engine)) for g in kv.groups)
    finally:
        llm.close()


def test_damaged_saved_chats_and_long_names_are_lines_of_their_own(chat, tmp_path):
    """A saved chat damaged on the disk (deflate data that does not decode), with JSON nested past the recursion
    limit or a 5,000-digit number, an entry marked encrypted or compressed in a way zipfile does not read: each fell
    to the chat's catch-all ("/load failed: RecursionError"), and /save over one did too. And /save refused a legal
    name of 250 characters: its temporary file's name passed the folder's limit."""
    import struct

    talk(chat, "hello")
    saved = tmp_path / "conv.chat"
    command(chat, "/save", str(saved))
    before = list(chat.messages)
    data = saved.read_bytes()

    def central(flag: int | None = None, method: int | None = None) -> bytes:  # chat.json's central directory entry
        b = bytearray(data)
        at = b.index(b"PK\x01\x02")
        if flag is not None:
            b[at + 8 : at + 10] = struct.pack("<H", flag)
        if method is not None:
            b[at + 10 : at + 12] = struct.pack("<H", method)
        return bytes(b)

    def with_meta(text: str) -> bytes:
        path = tmp_path / "meta.zip"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("chat.json", text)
            z.writestr("state.bin", b"")
        return path.read_bytes()

    at = data.index(b"state.bin") + 40  # inside the deflated state
    cases = {
        "damaged": data[:at] + bytes(x ^ 0xFF for x in data[at : at + 60]) + data[at + 60 :],
        "RecursionError": with_meta("[" * 100_000 + "]" * 100_000),
        "ValueError": with_meta('{"format": ' + "9" * 5000 + "}"),
        "RuntimeError": central(flag=1),  # "is encrypted, password required"
        "NotImplementedError": central(method=99),  # "That compression method is not supported"
    }
    for what, content in cases.items():
        path = tmp_path / f"{what}.chat"
        path.write_bytes(content)
        with pytest.raises(AhakvError, match=rf"^{re.escape(str(path))} is not a saved ahakv-local chat \(") as e:
            command(chat, "/load", str(path))
        assert what in str(e.value) and chat.messages == before
        if what == "damaged":
            continue  # its metadata reads: a saved chat, which /save may replace
        with pytest.raises(AhakvError, match="exists and is not a saved chat: not replaced"):  # nor does /save
            command(chat, "/save", str(path))
        assert path.read_bytes() == content
    long_name = tmp_path / ("n" * 245 + ".chat")  # 250 characters: a legal name
    command(chat, "/save", str(long_name))
    command(chat, "/load", str(long_name))
    assert chat.messages == before and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    # a token list that does not end where the cache does (the chat's JSON edited): refused, the chat as it was
    with zipfile.ZipFile(saved) as z:
        meta, blob = json.loads(z.read("chat.json")), z.read("state.bin")
    edited = tmp_path / "edited.chat"
    with zipfile.ZipFile(edited, "w") as z:
        z.writestr("chat.json", json.dumps({**meta, "n_tokens": 10, "input_ids": meta["input_ids"][:10]}))
        z.writestr("state.bin", blob)
    with pytest.raises(AhakvError, match="damaged: its cache holds positions up to"):
        command(chat, "/load", str(edited))
    assert chat.messages == before and talk(chat, "still there?") is not None


def test_a_transcript_the_disk_cannot_take_leaves_no_empty_file(chat, tmp_path, monkeypatch, capsys):
    """On a full disk the transcript was shown on the terminal, and an empty chat-*.json was left beside the others.
    The full disk is Path.open's file (Python 3.10's Path.open holds its own io.open: patching io.open missed it)."""
    import pathlib

    talk(chat, "hello")
    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    real_open = pathlib.Path.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opened(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if "x" in mode else f

    monkeypatch.setattr(pathlib.Path, "open", opened)
    keep_transcript(chat)
    assert list((tmp_path / "chats").iterdir()) == []
    err = capsys.readouterr().err
    assert "cannot keep the conversation" in err and '"content": "hello"' in err


def test_a_document_past_the_full_cache_s_context_is_one_line_and_leaves_nothing(fixture_model, tmp_path):
    """Without a budget, /read of a document past -c reached llama_decode, which failed on the chunk that did not fit:
    "/read failed: RuntimeError: llama_decode returned 1" (the chat's catch-all), the chunks before it left in the
    cache. It is refused before anything is decoded, in llama-cpp-python's words for a prompt too long."""
    llm = Llama(str(fixture_model), kv_policy="full", n_ctx=512, n_batch=32, verbose=False)
    try:
        s = ChatSession(llm, "You are terse.", max_tokens=4, temperature=0.0)
        # a conversation whose rendering the cache holds (the fixture's own answers are bytes that render otherwise)
        s.messages += [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
        llm.eval(s._prompt_tokens(s.messages, generation_prompt=False))
        before, n_before = list(s.messages), llm.n_tokens
        doc = tmp_path / "doc.txt"
        doc.write_text("the quick brown fox jumps over the lazy dog " * 30)  # ~1,100 fixture tokens
        with pytest.raises(AhakvError, match=r"^Requested tokens \(\d+\) exceed context window of 512$"):
            command(s, "/read", str(doc))
        assert s.messages == before and llm.n_tokens == n_before  # the cache kept (it was emptied, read again next)
        assert llm.kv_engine.n_used() == n_before  # nothing of the document decoded into the cache
        assert talk(s, "and now?") is not None
    finally:
        llm.close()


def run_repl(chat, monkeypatch, said: list, quit_window: float | None = None) -> None:
    """chat's REPL over ``said``: (text, block, lines) typed, or KeyboardInterrupt (a Ctrl-C at the prompt), or
    "stop" (a message whose answer a Ctrl-C stops as it streams); it ends at the input's end or by quitting."""
    import signal

    from ahakv_local import chat as chat_module

    typed = iter(said)

    def read_message(prompt):
        item = next(typed, None)
        if item is None:
            raise EOFError
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        if item == "stop":
            real = chat.answer

            class Interrupting:  # the Ctrl-C lands as the first piece of the answer is written
                def write(self, piece: str) -> None:
                    if piece:
                        os.kill(os.getpid(), signal.SIGINT)
                    sys.stdout.write(piece)

                def flush(self) -> None:
                    sys.stdout.flush()

            def answer(text, out, stop):
                return real(text, Interrupting(), stop)

            monkeypatch.setattr(chat, "answer", answer)
            return ("count on", False, 1)
        monkeypatch.setattr(chat, "answer", type(chat).answer.__get__(chat))
        return item

    monkeypatch.setattr(chat_module, "read_message", read_message)
    monkeypatch.setattr(chat_module, "setup_history", lambda: None)
    if quit_window is not None:
        monkeypatch.setattr(chat_module, "QUIT_WINDOW", quit_window)
    chat_module._repl(chat)


@pytest.mark.parametrize(("window", "quits"), [(0.0, False), (60.0, True)])
def test_a_ctrl_c_at_the_prompt_long_after_a_stopped_answer_warns_first(chat, monkeypatch, capsys, window, quits):
    """The Ctrl-C that stopped an answer left the chat one Ctrl-C from quitting for as long as the prompt waited: one
    pressed minutes later (to clear a half-typed line) quit without a word. Within QUIT_WINDOW it is the second of
    "twice to quit"; later it warns first."""
    run_repl(chat, monkeypatch, ["stop", KeyboardInterrupt, ("hello", False, 1)], quit_window=window)
    err = capsys.readouterr().err
    assert "[answer stopped]" in err
    assert ("(Ctrl-C again to quit" in err) is not quits
    assert chat.messages[-2]["content"] == ("count on" if quits else "hello")  # the chat went on: "hello" was sent


def test_a_refused_message_is_one_line_and_nothing_else(chat, monkeypatch, capsys):
    """A message longer than the model's context printed its error, then a stats line of "0.0 t/s" and an empty line
    among the answers; one that is not UTF-8 printed the error alone. Both print the error alone now."""
    long = "word " * 5000  # past the fixture's trained context
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")
    run_repl(chat, monkeypatch, [(long, False, 1), (bad, False, 1)])
    out, err = capsys.readouterr()
    assert out == ""  # nothing was answered
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ahakv-local chat")]
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert len(chat.messages) == 1  # the system prompt alone: both were taken back


def test_commands_are_case_blind_refuse_stray_arguments_and_take_quoted_names(chat, tmp_path, capsys):
    """/HELP was an unknown command; "/reset please" cleared the conversation; /read "doc.txt" looked for a file
    named with its quotes; /stats after /reset showed the last conversation's retained mass and speeds; a chat
    without a budget answered /policy with an error."""
    from ahakv_local.chat import HELP, command

    talk(chat, "Tell me a story about " + "dragons and knights " * 30)  # past the 64-cell budget: evictions
    assert chat.llm.kv_controller.stats.retained_mass
    with pytest.raises(AhakvError, match="^/reset takes no argument$"):
        command(chat, "/reset", "please")
    assert len(chat.messages) == 3
    command(chat, "/reset", "")
    assert "retained mass" not in command(chat, "/stats", "") and "prompt_tokens      0" in command(chat, "/stats", "")
    doc = tmp_path / "my doc.txt"
    doc.write_text("The lighthouse keeper's name is Ada. " * 3)
    assert command(chat, "/read", f'"{doc}"').startswith("read my doc.txt")
    assert command(chat, "/help", "") == HELP
    with Llama(str(chat.llm.model_path), n_ctx=256, verbose=False) as full:
        assert command(ChatSession(full, None), "/policy", "") == "policy: full (this chat runs without a budget)"


def test_an_answer_cut_by_the_end_of_the_context_says_so(fixture_model, monkeypatch, capsys):
    """Without a budget llama-cpp-python cuts max_tokens to what the context (-c) still holds: the answer stopped
    mid-sentence, and nothing said why."""
    with Llama(str(fixture_model), n_ctx=256, verbose=False) as llm:
        s = ChatSession(llm, None, max_tokens=400, temperature=0.0)
        run_repl(s, monkeypatch, [("one two three four five six", False, 1)])
        assert s.cut_by_context and "[the context is full: the answer stops here" in capsys.readouterr().err


def test_stats_right_after_budget_auto_show_no_decision_yet(chat):
    """``/budget auto`` on a chat held at 64 cells: the error model decides at the next observed step. Until then
    /stats said "budget 64", the last budget's target, for auto's; the report and the stats line both show "-"."""
    talk(chat, "tell me about the weather " * 4)
    assert chat.llm.kv_stats().budget == 64
    chat.set_budget("auto")
    assert chat.llm.kv_stats().budget is None
    assert re.search(r"^budget +-$", chat.stats_report(), re.M) and "/- cells" in chat.stats_line()
    talk(chat, "and tomorrow?")  # decided now: between 10% and 40% of the tokens seen
    s = chat.llm.kv_stats()
    assert 0.10 * s.tokens_seen - 1 <= s.budget <= 0.40 * s.tokens_seen


@pytest.mark.parametrize(("window", "quits"), [(0.0, False), (60.0, True)])
def test_a_ctrl_c_right_after_a_stopped_read_is_the_second_of_twice_to_quit(chat, monkeypatch, capsys, window, quits):
    """A /read stopped by a first Ctrl-C ends as an error line ("/read stopped: doc was not added"), and the stop was
    then not noted: a second Ctrl-C within QUIT_WINDOW warned instead of quitting, where after a stopped answer it
    quits. The stopped /read is stood in for by a command that takes the first Ctrl-C and says so."""
    import signal

    from ahakv_local import chat as chat_module

    def stopped_read(session, cmd, arg, stop):
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, as the document is read
        assert stop()
        raise AhakvError(f"/read stopped: {arg} was not added")

    monkeypatch.setattr(chat_module, "command", stopped_read)
    run_repl(chat, monkeypatch, [("/read doc.txt", False, 1), KeyboardInterrupt, ("hello", False, 1)], window)
    err = capsys.readouterr().err
    assert "error: /read stopped: doc.txt was not added" in err
    assert ("(Ctrl-C again to quit" in err) is not quits
    assert any(m["content"] == "hello" for m in chat.messages) is not quits  # warned: the chat went on


def test_after_a_message_stopped_while_read_the_next_answer_is_a_fresh_chat_s(fixture_model):
    """A first Ctrl-C stops a long message between two chunks and takes it back ("not sent"), but the chunks read had
    been compressed, evicting the conversation's history for it, and their rows were in the policy's statistics: the
    next answer differed from a fresh chat's (Gemma 3 270M at 256 cells: 117 cells kept of 461 seen, a fresh chat 233).
    The history is read again with the next message, as after a stopped /read. Reference: a fresh chat given the kept
    messages (as /load gives them), asked the same."""
    kw = dict(kv_budget=64, kv_recent=8, n_batch=32, kv_reuse_compressed=True, verbose=False)

    def chat_of(llm):
        return ChatSession(llm, "You are terse.", max_tokens=6, temperature=0.0)

    with Llama(str(fixture_model), **kw) as llm:
        s = chat_of(llm)
        talk(s, "hello there, tell me about " + "the weather and the sea " * 4)
        kept = list(s.messages)
        asked = []

        def stop() -> bool:  # true after three chunks of the long message: history evicted for them
            asked.append(0)
            return len(asked) > 3

        with pytest.raises(Stopped):
            s.answer("the quick brown fox jumps over the lazy dog " * 30, io.StringIO(), stop)
        assert s.messages == kept
        got, stats = talk(s, "and the mountains?"), llm.kv_stats()
    with Llama(str(fixture_model), **kw) as fresh_llm:
        fresh = chat_of(fresh_llm)
        fresh.messages = list(kept)
        want, want_stats = talk(fresh, "and the mountains?"), fresh_llm.kv_stats()
    assert got == want
    assert (stats.cells_used, stats.evicted, stats.tokens_seen) == (
        want_stats.cells_used,
        want_stats.evicted,
        want_stats.tokens_seen,
    )


def test_a_ctrl_c_while_the_transcript_is_written_on_exit_keeps_it(chat, tmp_path, monkeypatch):
    """Ctrl-C pressed on as the chat quits (a key held down): one landing while the transcript was written kept no file,
    or printed a traceback. On exit the transcript is written with Ctrl-C ignored, and the handler is put back."""
    import signal

    from ahakv_local import chat as chat_module

    monkeypatch.setenv("AHAKV_CACHE_DIR", str(tmp_path))
    talk(chat, "hello")
    transcript = chat.transcript

    def interrupted_transcript():
        os.kill(os.getpid(), signal.SIGINT)  # lands as the transcript is being made
        return transcript()

    monkeypatch.setattr(chat, "transcript", interrupted_transcript)
    monkeypatch.setattr(chat_module, "_repl", lambda session: None)  # quits at once
    before = signal.getsignal(signal.SIGINT)
    try:
        chat_module.run_chat(chat)
    except KeyboardInterrupt:  # (a failure of this test, not the end of the suite)
        pytest.fail("the Ctrl-C cut the transcript's writing short")
    kept = list((tmp_path / "chats").iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text())[1]["content"] == "hello"
    assert signal.getsignal(signal.SIGINT) is before


def test_crlf_input_is_read_as_its_lines(monkeypatch):
    """Piped CRLF text kept each line's \\r (input() strips \\n only): it went to the model, and a line ending in a
    backslash, "Say\\\\\\r", no longer continued the message. Lines are read without it, as LF input's are."""
    from ahakv_local import chat as chat_module

    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal: no prompts shown
    for typed, expected in [
        (["Say\\\r", "hello\r"], chat_module.Typed("Say\nhello", block=False, lines=2)),
        (['"""\r', "one\r", "two\r", '"""\r'], chat_module.Typed("one\ntwo", block=True, lines=2)),
        (["Hi there\r"], chat_module.Typed("Hi there", block=False, lines=1)),
    ]:
        lines = iter(typed)
        monkeypatch.setattr("builtins.input", lambda prompt="", lines=lines: next(lines))
        assert chat_module.read_message("> ") == expected
