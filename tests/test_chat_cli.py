"""The chat driven in a real pseudo-terminal (pexpect), as a person would."""

from __future__ import annotations

import os
import sys

import pexpect
import pytest

from ahakv_local.cli_options import offloads_by_default
from ahakv_local.paths import cache_dir

STATS = r"\[prompt [\d.]+ t/s \| gen [\d.]+ t/s \| cache (\d+)/(\d+) cells of (\d+) \| seen (\d+) \| evicted (\d+)\]"


@pytest.fixture
def chat(tmp_path):
    # HOME in tmp_path: the readline history goes there; the model cache is AHAKV_CACHE_DIR (shared)
    env = {**os.environ, "HOME": str(tmp_path), "AHAKV_CACHE_DIR": str(cache_dir())}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "ahakv_local", "chat", "--budget", "96", "--recent", "16", "-n", "200", "--temp", "0"],
        encoding="utf-8",
        timeout=240,
        dimensions=(50, 200),
        env=env,
    )
    yield child
    child.close(force=True)


def test_chat_session(chat, tmp_path):
    c = chat
    c.expect("> ")
    # an answer that would run its 200 tokens (the default model counts on), stopped as soon as it streams: a fixed
    # wait made this test depend on the machine's speed (after 2.5 s a 70 token/s CPU had seen 205 tokens)
    c.sendline("Please count from 1 to 200: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,")
    c.expect("10,\r\n")  # the echo of the line: the answer starts now
    c.expect(r"\d")  # its first digit is on the screen
    c.sendintr()  # the first Ctrl-C stops the answer, the chat goes on
    c.expect(r"\[answer stopped\]")
    c.expect(STATS)
    seen_first = int(c.match.group(4))
    assert seen_first < 200  # stopped early
    c.expect("> ")
    c.sendline("And what about coffee?")  # the second turn decodes only the new message
    c.expect(STATS)
    used, budget, _cells, seen, evicted = map(int, c.match.groups())
    assert seen > seen_first and used <= budget == 96
    c.expect("> ")

    c.sendline("/stats")
    c.expect(r"policy\s+ahakv")
    c.expect(r"tokens_seen\s+(\d+)")
    assert int(c.match.group(1)) == seen
    # the layout in use: the product's for Gemma 3, adaptive on the CPU, natural where chat offloads to a GPU
    c.expect(r"layer_budgets\s+" + ("natural" if offloads_by_default() else "adaptive"))
    c.expect("> ")

    c.sendline("/budget 64")
    c.expect(r"budget: 64 cells \(evicted (\d+) now\)")
    # what remains is within the budget, less the room left for the steps until the next eviction
    assert used <= 64 or 64 - 32 <= used - int(c.match.group(1)) <= 64
    c.expect("> ")
    c.sendline("/budget 5000")
    c.expect("error: budget 5000 does not fit")
    c.expect("> ")

    c.sendline("Write a very long poem about the sea, with many verses.")
    c.expect(STATS)
    used, budget, *_ = map(int, c.match.groups())
    assert budget == 64 and used <= 64
    c.expect("> ")

    saved = tmp_path / "conv.chat"
    c.sendline(f"/save {saved}")
    c.expect(r"saved (\d+) messages and (\d+) cached tokens")
    n_messages, cached = map(int, c.match.groups())
    assert saved.exists() and n_messages == 7  # system + 3 user + 3 assistant
    c.expect("> ")
    c.sendline("/reset")
    c.expect("conversation cleared")
    c.expect("> ")
    c.sendline(f"/load {saved}")
    c.expect(r"loaded (\d+) messages, (\d+) cached tokens")
    assert int(c.match.group(1)) == n_messages and int(c.match.group(2)) == cached
    c.expect("> ")
    c.sendline("/load /nonexistent/file.chat")
    c.expect("error: no such file")
    c.expect("> ")

    c.sendline("/exit")
    c.expect("conversation saved to")
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0


def test_ctrl_c_twice_exits(chat):
    chat.expect("> ")
    chat.sendintr()
    chat.expect(r"Ctrl-C again to quit")
    chat.sendintr()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
