"""Structured outputs: grammar constraints compiled to per-step token bitmasks (llguidance)."""

from engine.structured.constraint import GrammarKind, GuidedDecoding
from engine.structured.masks import GrammarCompiler, MaskJob, apply_token_bitmask

__all__ = ["GrammarCompiler", "GrammarKind", "GuidedDecoding", "MaskJob", "apply_token_bitmask"]
