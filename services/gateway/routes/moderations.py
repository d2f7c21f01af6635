"""`POST /v1/moderations`: OpenAI's moderation endpoint, answered by Baton's safety service.

Each input goes through the same input check as a chat prompt (`SafetyGate.check_input`: the
organisation's policy, the pattern tier, then the sentence-embedding classifier; cached by text), so
what this endpoint flags is what chat refuses or flags. Baton's categories map onto OpenAI's names:

    violence -> violence          self_harm -> self-harm           sexual_minors -> sexual/minors, sexual
    hate -> hate, harassment      malware -> illicit               (pii is output-only: not reported)

Scores are the classifier's probabilities; a pattern-tier hit scores 1.0. The other OpenAI categories
(the "/threatening", "/intent", "/instructions", "/graphic" refinements, "illicit/violent") are
reported false with score 0: Baton does not detect them separately. `flagged` is true when a
category crossed the organisation's threshold, whether its policy blocks or only flags it.
503 with Retry-After when the safety service is down; 400 `feature_disabled` on a gateway run
without one. Inputs may be as long as the safety service judges (`limits.MAX_INPUT_CHARS`, 64,000
characters, ~10,000 words, for all the inputs of one request together): a longer request is a 400
`input_too_long`. The check's time is in the `Server-Timing: safety;dur=<ms>` header and in
`baton_gateway_safety_check_seconds{size}`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.completions.safety_gate import InputDecision, SafetyVerdict, check_length_or_400
from services.gateway.deps import CurrentPrincipal, Deps
from services.gateway.errors import BadRequestError

router = APIRouter(tags=["moderations"])

MODEL = "baton-safety-minilm"
MAX_INPUTS = 32
OPENAI_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
                     "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions", "sexual",
                     "sexual/minors", "violence", "violence/graphic")
TO_OPENAI: dict[str, tuple[str, ...]] = {
    "violence": ("violence",), "self_harm": ("self-harm",), "sexual_minors": ("sexual/minors", "sexual"),
    "hate": ("hate", "harassment"), "malware": ("illicit",),
}


class ModerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # as the other bodies (schemas.py)

    # Length is checked on all inputs together (`check_length_or_400`: 400 `input_too_long`).
    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str | None = None  # accepted and echoed as Baton's one moderation model


def moderation_result(verdict: SafetyVerdict) -> dict[str, object]:
    scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0)
    baton_scores = dict(verdict.category_scores)
    if verdict.category is not None:
        baton_scores[verdict.category] = max(baton_scores.get(verdict.category, 0.0), verdict.score)
    for category, score in baton_scores.items():
        for name in TO_OPENAI.get(category, ()):
            scores[name] = max(scores[name], float(score))
    flagged_names = set(TO_OPENAI.get(verdict.category or "", ()))
    return {"flagged": bool(flagged_names),
            "categories": {name: name in flagged_names for name in OPENAI_CATEGORIES},
            "category_scores": scores,
            "category_applied_input_types": {name: ["text"] for name in OPENAI_CATEGORIES}}


@router.post("/v1/moderations")
async def create_moderation(body: ModerationRequest, principal: CurrentPrincipal, deps: Deps,
                            response: Response) -> dict[str, object]:
    if deps.safety is None:
        raise BadRequestError("moderation needs the safety service (BATON_SAFETY_ADDRESS) on this gateway",
                              "input", "feature_disabled")
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_length_or_400("".join(texts), "input")  # all inputs together: one request's judging time is bounded
    request_id = "modr-" + secrets.token_urlsafe(18)
    start = time.perf_counter()
    verdicts = await asyncio.gather(*(deps.safety.check_input(principal.org_id, t, request_id, "input")
                                      for t in texts))
    seconds = time.perf_counter() - start
    response.headers.update(InputDecision(None, seconds=seconds).timing_headers())
    deps.metrics.observe_safety_check(seconds, sum(len(t) for t in texts))
    results = [moderation_result(v) for v in verdicts]
    return {"id": request_id, "model": MODEL, "results": results}
