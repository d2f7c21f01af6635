"""Protobuf <-> dataclass conversion for the Safety service (the only place the stubs meet the domain)."""

from __future__ import annotations

from rpcgen.baton.v1 import safety_pb2
from services.safety.categories import Detector, SafetyVerdict

_TIER_TO_PB = {
    Detector.NONE: safety_pb2.SAFETY_TIER_NONE,
    Detector.PATTERN: safety_pb2.SAFETY_TIER_PATTERN,
    Detector.CLASSIFIER: safety_pb2.SAFETY_TIER_CLASSIFIER,
    Detector.GUARD: safety_pb2.SAFETY_TIER_GUARD,
}
_PB_TO_TIER = {v: k for k, v in _TIER_TO_PB.items()}


def verdict_to_pb(verdict: SafetyVerdict) -> safety_pb2.Verdict:
    return safety_pb2.Verdict(allowed=verdict.allowed, category=verdict.category or "", score=verdict.score,
                              tier=_TIER_TO_PB[Detector(verdict.tier)], watch=verdict.watch,
                              category_scores=dict(verdict.category_scores))


def verdict_from_pb(pb: safety_pb2.Verdict) -> SafetyVerdict:
    return SafetyVerdict(allowed=pb.allowed, category=pb.category or None, score=pb.score,
                         tier=_PB_TO_TIER.get(pb.tier, Detector.NONE), watch=pb.watch,
                         category_scores=tuple(sorted(pb.category_scores.items())))
