"""Fixtures of the safety unit tests: one loaded classifier per session (encoder + committed head)."""

from __future__ import annotations

import pytest

from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook


@pytest.fixture(scope="session")
def classifier() -> EmbeddingClassifier:
    return EmbeddingClassifier.load()


@pytest.fixture(scope="session")
def patterns() -> PatternTier:
    return PatternTier()


@pytest.fixture
def checker(classifier: EmbeddingClassifier, patterns: PatternTier) -> SafetyChecker:
    return SafetyChecker(PolicyBook(), patterns, classifier)
