"""The streaming post-filter halts on harm split across deltas, and only on harm."""

from __future__ import annotations

from services.safety.categories import Detector
from services.safety.checker import SafetyChecker
from services.safety.policy import PolicyBook
from services.safety.stream_filter import OutputStreamFilter, StreamFilterConfig


def _feed_all(f: OutputStreamFilter, deltas: list[str]) -> list[bool]:
    return [f.feed(d).allowed for d in deltas]


def test_phrase_split_across_deltas_halts_on_its_last_piece(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    allowed = _feed_all(f, ["Sure. ", "Here is how to bu", "ild a pi", "pe bo", "mb: first"])
    assert allowed == [True, True, True, True, False]
    assert f.halted is not None and f.halted.category == "violence" and f.halted.tier == Detector.PATTERN


def test_pii_split_across_deltas_halts(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    assert _feed_all(f, ["You can email him at mark.", "hollis@", "northwind", "traders.com today"])[-1] is False
    assert f.halted is not None and f.halted.category == "pii"


def test_after_a_halt_every_feed_repeats_it(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    halt = f.feed("Sure, here is how to make a pipe bomb. ")
    assert not halt.allowed
    assert f.feed("Nothing harmful here.") == halt


def test_a_word_still_growing_is_not_matched_early(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    assert f.feed("and then you make a bomb").allowed  # "bomb" may become "bombay"
    assert f.feed("ay sapphire martini.").allowed


def test_an_open_word_is_matched_on_the_final_chunk(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    assert f.feed("step one: make a pipe bomb").allowed
    assert not f.feed("", final=True).allowed


def test_window_cut_never_creates_a_match(checker: SafetyChecker) -> None:
    config = StreamFilterConfig(pattern_overlap_chars=8, classifier_window_chars=400)
    f = OutputStreamFilter(checker, checker.policies.default, config)
    # With an 8-character overlap a naive cut of "...skill myself" would read "kill myself".
    assert _feed_all(f, ["I would have to teach the skill", " myself"]) == [True, True]


def test_classifier_runs_at_sentence_boundaries(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    first = f.feed("Sure, I can help you ")
    assert first.tier == Detector.PATTERN  # too little text yet for the classifier
    verdict = f.feed("with planning the trip to the coast next weekend.")
    assert verdict.allowed and verdict.tier == Detector.CLASSIFIER


def test_benign_answer_about_killing_a_process_streams_to_the_end(checker: SafetyChecker) -> None:
    f = OutputStreamFilter(checker, checker.policies.default)
    text = ("To stop it, find the process id with ps aux. Then run kill with that id, or kill -9 if it "
            "ignores the signal. Child processes exit with their parent unless they were detached.")
    deltas = [text[i:i + 7] for i in range(0, len(text), 7)]
    assert all(_feed_all(f, deltas)) and f.feed("", final=True).allowed


def test_flag_policy_reports_a_category_once_and_keeps_streaming(checker: SafetyChecker) -> None:
    only_pii = {c: {"enabled": False} for c in ("violence", "self_harm", "sexual_minors", "hate", "malware")}
    policy = PolicyBook.from_mapping({"default": {"action": "flag", "categories": only_pii}}).default
    f = OutputStreamFilter(checker, policy)
    first = f.feed("Write to jane.roe@acme.io for details. ")
    second = f.feed("Again: jane.roe@acme.io. ")
    assert first.flagged and first.category == "pii"
    assert second.allowed and second.category is None and f.flagged == ["pii"]


def test_output_switched_off_runs_nothing(checker: SafetyChecker) -> None:
    policy = PolicyBook.from_mapping({"default": {"output": False}}).default
    verdict = OutputStreamFilter(checker, policy).feed("here is how to make a pipe bomb. ")
    assert verdict.allowed and verdict.tier == Detector.NONE
