"""Incremental detokenization on real SmolLM2 tokens: split characters, stop strings, flush."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenization.detokenizer import INCOMPLETE_CHAR, IncrementalDetokenizer
from tokenization.tokenizer import Tokenizer

PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
EOS = 2


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def run(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), **kw: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop, **kw)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


def test_emoji_split_over_three_tokens_waits_for_the_whole_character(tok: Tokenizer) -> None:
    ids = tok.encode(" 🤖 ok")
    assert len(tok.encode(" 🤖")) == 3  # 'ĠðŁ', '¤', 'ĸ': the bytes of one character
    deltas, tail = run(tok, ids)
    assert deltas[:3] == ["", "", " 🤖"]
    assert all(INCOMPLETE_CHAR not in d for d in deltas)
    assert "".join(deltas) + tail == " 🤖 ok"


def test_cjk_split_over_tokens_never_emits_replacement_chars(tok: Tokenizer) -> None:
    text = "Tokyo is 東京, and 語 is a word."
    ids = tok.encode(text)
    assert any(INCOMPLETE_CHAR in tok.decode([i]) for i in ids)  # the test needs split characters
    deltas, tail = run(tok, ids)
    assert all(INCOMPLETE_CHAR not in d for d in deltas)
    assert "".join(deltas) + tail == text


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "Mixed 🇫🇷 flags, 👨‍👩‍👧 families, naïve café, 3.14159 and\n\nnewlines  with   spaces.",
    "def f(x):\n    return x ** 2\n",
])
def test_concatenated_deltas_equal_decode_of_all(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text) + [EOS]
    deltas, tail = run(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_kept_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("Done.") + [EOS]
    deltas, tail = run(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "Done.<|im_end|>"


def test_first_token_keeps_its_leading_space(tok: Tokenizer) -> None:
    deltas, _ = run(tok, tok.encode(" Paris"))
    assert deltas[0] == " Paris"


def test_stop_string_straddling_two_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world. More text")
    assert tok.convert_ids_to_tokens(ids[:3]) == ["Hello", "Ġworld", "."]
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), ("ld.",))
    assert detok.add(ids[0]) == "Hello"
    assert detok.add(ids[1]) == " wor"  # "ld" could begin the stop string: held back
    assert detok.add(ids[2]) == ""  # "ld." completes it
    assert detok.stopped and detok.stop_reason == "ld."
    assert detok.add(ids[3]) == "" and detok.flush() == ""
    assert detok.text == "Hello wor"


def test_stop_string_at_the_very_beginning(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), ("Hello",))
    assert detok.add(ids[0]) == ""
    assert detok.stopped and detok.text == ""
    assert detok.flush() == ""


def test_held_back_prefix_is_released_when_the_stop_string_does_not_follow(tok: Tokenizer) -> None:
    text = "Hello world. Goodbye"
    deltas, tail = run(tok, tok.encode(text), stop=("world!",))
    assert "".join(deltas) + tail == text
    assert deltas[1] == " "  # "world" could still become "world!": only the space is safe


def test_held_back_text_is_flushed_at_finish(tok: Tokenizer) -> None:
    deltas, tail = run(tok, tok.encode("The end"), stop=("end of story",))
    assert "".join(deltas) == "The " and tail == "end"


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], ("beta", "alpha"))
    out = "".join(detok.add(i) for i in tok.encode("x alpha beta gamma"))
    assert detok.stopped and detok.stop_reason == "alpha"
    assert out + detok.flush() == "x "


def test_stop_string_inside_one_multi_character_delta(tok: Tokenizer) -> None:
    ids = tok.encode(" 🤖!")  # the emoji's delta arrives whole, with the stop string inside it
    detok = IncrementalDetokenizer(tok, [], ("🤖",))
    assert "".join(detok.add(i) for i in ids) == " "
    assert detok.stopped and detok.text == " "


def test_flush_releases_an_incomplete_character_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode(" 🤖")[:2]  # generation ended mid-character
    deltas, tail = run(tok, ids)
    assert deltas == ["", ""]
    assert tail == tok.decode(ids) and tail.endswith(INCOMPLETE_CHAR)
