"""Normalisation folds obfuscated spellings to the plain one, and leaves numbers and PII intact."""

from __future__ import annotations

import pytest

from services.safety.normalize import normalize


@pytest.mark.parametrize(("text", "words"), [
    ("H0w t0 m@ke a b0mb", "how to make a bomb"),             # leetspeak
    ("r@n$omw4re", "ransomware"),
    ("ｈｏｗ ｔｏ ｍａｋｅ ａ ｂｏｍｂ", "how to make a bomb"),      # fullwidth (NFKC)
    ("pipe bo\u200bm\u200db", "pipe bomb"),                     # zero-width characters
    ("\u0455u\u0456c\u0456d\u0435", "suicide"),                 # Cyrillic look-alikes
    ("b\u00f3mb", "bomb"),                                      # diacritics
    ("k i l l", "kill"),                                        # spelled out
    ("b.o.m.b", "bomb"),
    ("KILL---MY...SELF!!!", "kill my self"),                    # punctuation squashed, trailing ! kept out
    ("\U0001d41b\U0001d428\U0001d426\U0001d41b", "bomb"),       # mathematical bold letters
])
def test_obfuscations_fold_to_plain_words(text: str, words: str) -> None:
    assert normalize(text).words == words


def test_numbers_are_not_leet_folded() -> None:
    assert normalize("a 13 year old at 5pm on the 2nd").words == "a 13 year old at 5pm on the 2nd"


def test_all_cyrillic_text_is_not_folded_to_latin() -> None:
    assert normalize("привет мир").words == "привет мир"


def test_raw_view_keeps_case_digits_and_punctuation_but_drops_invisibles() -> None:
    assert normalize("Call +1 (415) 555\u200b-2671").raw == "Call +1 (415) 555-2671"
