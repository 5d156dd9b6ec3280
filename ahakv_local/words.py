"""Which word each position belongs to, so that an eviction can keep or drop a word whole.

A pass key is five tokens for Gemma's tokenizer (one per digit), a name often two ("ABC", "DE"). Scored per
token, a compressed cache keeps the digits the question attended to most and loses the others: the model then
answers "58675." for 58678 (benchmarks/RESULTS.md, issue 12). Here a token continues the word before it when
both touch without a space or punctuation between them (the previous piece ends, and this one starts, with a
letter or digit: ``in_word``; a character of a script written without spaces is a word of its own);
``max_by_word`` gives every live token of a word the best score of its live tokens.

``WordMap(piece, joins=not_space)`` records runs of text between spaces instead ("17318." with its full stop):
the reconstruction reading gives each its best score, because there a number that lost its full stop was read
back with a digit too many ("489689." for 48968, benchmarks/RESULTS.md); a question-guided reading keeps words.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

import numpy as np


def wide(char: str) -> bool:
    """A character of a script written without spaces (Han, kana, Hangul: East Asian wide or full width): a word of
    its own, as the nearest unit without a segmenter. Joined, a line of Chinese was one word, every token of it
    took its best score, and the reading kept what streaming keeps."""
    return unicodedata.east_asian_width(char) in ("W", "F")


def in_word(char: str) -> bool:
    """A letter or digit of a spaced script, a combining mark (the accent of "café" written e + U+0301), or U+FFFD:
    a token holding some bytes of a character split over several tokens, which detokenized alone is that."""
    if wide(char):
        return False
    return char.isalnum() or char == "\ufffd" or unicodedata.category(char).startswith("M")


def not_space(char: str) -> bool:
    return not char.isspace() and not wide(char)


class WordMap:
    """Word starts by position, recorded as tokens are decoded (``add``) and forgotten on a rewind. Two tokens
    that touch are one word when the characters on both sides of their boundary satisfy ``joins`` (default:
    ``in_word``)."""

    def __init__(self, piece: Callable[[int], str], joins: Callable[[str], bool] = in_word) -> None:
        self._piece = piece  # a token's text
        self._joins = joins
        self._edges: dict[int, tuple[bool, bool]] = {}  # token -> (starts, ends) with a joining character
        self.start = np.zeros(1024, dtype=np.int64)  # position -> the first position of its word
        self.joins_next = np.zeros(1024, dtype=bool)  # position -> a joining character ends it
        self.end = 0  # one past the last position recorded

    def _token_edges(self, token: int) -> tuple[bool, bool]:
        edges = self._edges.get(token)
        if edges is None:
            text = self._piece(token)
            edges = (bool(text) and self._joins(text[0]), bool(text) and self._joins(text[-1]))
            self._edges[token] = edges
        return edges

    def add(self, first: int, tokens: Sequence[int]) -> None:
        """Record ``tokens`` decoded at positions first, first + 1, ..."""
        end = first + len(tokens)
        if end > self.start.size:
            size = max(2 * self.start.size, end)
            self.start = np.concatenate([self.start, np.zeros(size - self.start.size, dtype=np.int64)])
            self.joins_next = np.concatenate([self.joins_next, np.zeros(size - self.joins_next.size, dtype=bool)])
        known = 0 < first <= self.end  # the position before this call's first was recorded
        if first > self.end:  # positions never recorded (a loaded state): each a word of its own, whatever the
            self.start[self.end : first] = np.arange(self.end, first)  # arrays held from an earlier sequence
            self.joins_next[self.end : first] = False
        for pos, token in enumerate(tokens, first):
            starts, ends = self._token_edges(int(token))
            joined = starts and (pos > first or known) and self.joins_next[pos - 1]
            self.start[pos] = self.start[pos - 1] if joined else pos
            self.joins_next[pos] = ends
        self.end = max(self.end, end)

    def truncate(self, n: int) -> None:
        """Forget positions >= n (``add`` reads an edge only below ``end`` or of its own tokens, so nothing needs
        clearing); positions never recorded (a loaded state) count as words of their own."""
        self.end = min(self.end, n)

    def words(self, positions: np.ndarray) -> np.ndarray:
        """The first position of each position's word (a position not recorded: itself)."""
        known = positions < self.end
        out = positions.copy()
        out[known] = self.start[positions[known]]
        return out


def max_by_word(words: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Each score replaced by the highest score of its word (``words``: the first position of each position's
    word, ascending, aligned with ``scores`` along the last axis)."""
    if words.size == 0:
        return scores
    firsts = np.flatnonzero(np.r_[True, words[1:] != words[:-1]])
    best = np.maximum.reduceat(scores, firsts, axis=-1)
    return np.repeat(best, np.diff(np.r_[firsts, words.size]), axis=-1)
