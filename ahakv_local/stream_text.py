"""The text a stream sends of the tokens sampled so far: one rule for the drop-in's streams (and so for chat, generate
and the one-at-a-time server) and for the parallel server's, so that what a stream sends, joined, is the text the same
completion has unstreamed.

llama-cpp-python 0.3.36 streams token by token and flushes what it held back token by token too: a character split
over tokens that it held back (it could begin a stop string) came out as nothing, and after one byte that is no UTF-8
its stream sent nothing until the end, then dropped every character of several tokens. Here the text is always made
from all the bytes sampled so far."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def stop_strings(stop: str | Sequence[str] | None, keep_empty: bool = False) -> list[str]:
    """A request's stop strings. The empty one is in every text: llama-cpp-python answers nothing at once, and the
    --parallel server took ``"stop": ""`` as none; both servers leave it out. The drop-in keeps it (``keep_empty``):
    it is llama_cpp.Llama, whose stream and unstreamed text then say nothing, as its own do."""
    return [s for s in ([stop] if isinstance(stop, str) else stop or []) if s or keep_empty]


def cut_at_first_stop(out: dict, stops: Sequence[str]) -> dict:
    """An unstreamed completion of llama-cpp-python cut where the first of its stop strings begins in the text, as
    its stream and the parallel server cut it: where one token brought two (" commas" for ["a", "c"]) llama-cpp-python
    cut at the first in the list's order (" ... with comm"), so the stream's pieces, joined, were not its text."""
    for choice in out.get("choices", []):
        if choice.get("text"):
            choice["text"] = ready_text(choice["text"], stops, end=True)
    return out


def completion_text(data: bytes) -> str:
    """The text of a completion's bytes as llama-cpp-python makes an unstreamed one: bytes that are no UTF-8 dropped
    (``errors="ignore"``), and an unfinished character at the end left out until its bytes are all in."""
    return codecs.getincrementaldecoder("utf-8")("ignore").decode(data)


def stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is the beginning of a stop string (0: none): what a stream holds
    back until the next token says whether the stop string follows. (It held back the longest stop string's length
    less one whatever the text: a chat's 10 characters, and its stream came in odd pieces.)"""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first of the stop strings in ``text`` begins (-1: none is; 0 for the empty one, as in Python)."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def ready_text(text: str, stops: Sequence[str], end: bool = False) -> str:
    """What of ``text`` a stream may send now: up to the first stop string in it, else all but an end that could begin
    one (at the ``end`` of the stream, all)."""
    if (cut := first_stop(text, stops)) >= 0:
        return text[:cut]
    return text if end else text[: len(text) - stop_prefix(text, stops)]
