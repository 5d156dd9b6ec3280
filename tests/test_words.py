"""WordMap and max_by_word against references computed another way: word boundaries from the text the tokens
spell (the joined string, not the per-token edges WordMap keeps), and a per-word loop (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ahakv_local.words import WordMap, in_word, max_by_word, not_space

from reference import word_max, word_starts

# pieces as Gemma's tokenizer gives them: digits alone, words with and without a leading space, word pieces
PIECES = ["The", " pass", " key", " is", " ", "5", "8", "0", ".", " ABC", "DE", "x", "\n\n", ",", " =", "é"]
PIECES += ["今天", "天气", "。", "\u0301", "\ufffd"]  # Han (no spaces), an ideographic stop, a combining accent, a byte


@pytest.mark.parametrize("joins", [in_word, not_space], ids=["words", "spans"])
@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 39), max_size=4),
)
def test_words_match_the_text_they_spell_whatever_the_chunks(joins, tokens: list[int], cuts: list[int]) -> None:
    words = WordMap(lambda t: PIECES[t], joins)
    edges = sorted({c for c in cuts if c < len(tokens)})
    for a, b in zip([0, *edges], [*edges, len(tokens)], strict=True):
        words.add(a, tokens[a:b])
    positions = np.arange(len(tokens))
    np.testing.assert_array_equal(words.words(positions), word_starts([PIECES[t] for t in tokens], joins))


def test_a_span_keeps_a_number_with_its_full_stop_and_a_word_does_not() -> None:
    pieces = ["The", " key", " is", " ", "5", "8", ".", " Remember", " it", "."]
    tokens = list(range(len(pieces)))
    words, spans = WordMap(lambda t: pieces[t]), WordMap(lambda t: pieces[t], joins=not_space)
    words.add(0, tokens)
    spans.add(0, tokens)
    np.testing.assert_array_equal(words.words(np.arange(10)), [0, 1, 2, 3, 4, 4, 6, 7, 8, 9])
    np.testing.assert_array_equal(spans.words(np.arange(10)), [0, 1, 2, 3, 4, 4, 4, 7, 8, 8])


def test_a_rewind_forgets_what_follows_and_a_replay_joins_again() -> None:
    words = WordMap(lambda t: PIECES[t])
    five, eight, dot, space = PIECES.index("5"), PIECES.index("8"), PIECES.index("."), PIECES.index(" ")
    words.add(0, [space, five, eight, eight])
    words.truncate(2)  # "5" at 1 stays; positions 2, 3 go
    words.add(2, [dot, five])
    np.testing.assert_array_equal(words.words(np.arange(4)), [0, 1, 2, 3])
    words.truncate(2)
    words.add(2, [eight])
    np.testing.assert_array_equal(words.words(np.arange(3)), [0, 1, 1])
    # positions never recorded (a loaded state) are words of their own
    np.testing.assert_array_equal(words.words(np.array([1, 2, 7, 9])), [1, 1, 7, 9])


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=30))
def test_max_by_word_gives_each_token_its_word_s_best(lengths: list[int]) -> None:
    words = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)  # words of these lengths, back to back
    rng = np.random.default_rng(len(lengths))
    scores = rng.normal(size=words.size)
    scores[rng.integers(0, words.size)] = np.inf  # a policy insisting on a token keeps its whole word
    np.testing.assert_array_equal(max_by_word(words, scores), word_max(scores, words))


def test_a_script_without_spaces_is_a_word_per_character_and_a_split_character_stays_whole() -> None:
    """A line of Chinese was one word (every Han character is alphanumeric), so a guided reading gave every token its
    best score and kept what streaming keeps; a character of byte tokens (each U+FFFD alone) or an accent written
    as a combining mark was split from its letters."""
    han = ["今天", "天气", "很好", "。", "我们"]
    for joins in (in_word, not_space):
        words = WordMap(lambda t: han[t], joins)
        words.add(0, list(range(5)))
        np.testing.assert_array_equal(words.words(np.arange(5)), np.arange(5))
    pieces = [" caf", "e", "\u0301", " \ufffd", "\ufffd", "\ufffd", "\ufffd", " word"]  # "café", "𝔘" in 4 bytes
    words = WordMap(lambda t: pieces[t])
    words.add(0, list(range(len(pieces))))
    np.testing.assert_array_equal(words.words(np.arange(len(pieces))), [0, 0, 0, 3, 3, 3, 3, 7])


@pytest.mark.parametrize("earlier", [[], ["5", "8", "8", "8", "8", "8"]])
def test_positions_a_load_brought_are_words_of_their_own_after_the_next_tokens(earlier) -> None:
    """A state loaded at positions 0..4 (never recorded here), then tokens decoded from 5: the loaded positions
    read the arrays as an earlier sequence had left them (joined digits), or a fresh map's zeros (all one word, at
    0), since the first ``add`` past them counted them recorded. Each is a word of its own."""
    words = WordMap(lambda t: PIECES[t])
    words.add(0, [PIECES.index(p) for p in earlier])
    words.truncate(0)  # the load forgets what the map knew (KVController.resync)
    words.add(5, [PIECES.index("5"), PIECES.index("8")])
    np.testing.assert_array_equal(words.words(np.arange(7)), [0, 1, 2, 3, 4, 5, 5])
