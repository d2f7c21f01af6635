"""Fixtures of the safety unit tests: one trained classifier per session (about a second)."""

from __future__ import annotations

import pytest

from services.safety.checker import SafetyChecker
from services.safety.classifier import LinearClassifier
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook


@pytest.fixture(scope="session")
def classifier() -> LinearClassifier:
    return LinearClassifier.from_training_file()


@pytest.fixture(scope="session")
def patterns() -> PatternTier:
    return PatternTier()


@pytest.fixture
def checker(classifier: LinearClassifier, patterns: PatternTier) -> SafetyChecker:
    return SafetyChecker(PolicyBook(), patterns, classifier)
