"""`GuardModelTier`: an optional third tier, a guard LLM served by Baton's own workers.

Off unless the operator configures it (`--guard-url`, `--guard-model`): a Baton deployment (gateway +
workers) serving a guard model such as Llama Guard 3, reached through its OpenAI-compatible
`/v1/completions`. The prompt is Llama Guard's format (a task line, the unsafe-content categories as
S1..S5 in Baton's own words, the conversation, and the instruction to answer "safe" or "unsafe" plus
the violated codes on a second line); ShieldGemma and Granite Guardian take the same content in their
own wording and would be a second `GuardPromptFormat`.

It runs only on input texts the pattern and classifier tiers allowed, within `budget_s`: an answer that
is late, fails, or does not follow the format is "no opinion" (counted in
`baton_safety_guard_calls_total{outcome}`), never a refusal, so a slow or absent guard costs at most
the budget and changes nothing. Quality: no guard weights were available to this project, so no
recall or false-positive figure exists for this tier; the plumbing is tested against the default model
(SmolLM2-135M), whose answers are mostly "no opinion".
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx
from prometheus_client import Counter

from services.safety.categories import LEARNED_CATEGORIES, Category

GUARD_CALLS = Counter("baton_safety_guard_calls", "Guard-model calls by outcome", ["outcome"])

# Baton's categories as Llama Guard codes, in the order the prompt lists them.
GUARD_CODES: dict[str, Category] = {f"S{i}": c for i, c in enumerate(LEARNED_CATEGORIES, start=1)}
_DESCRIPTIONS = {
    Category.VIOLENCE: "Violence: weapons, explosives, poisons, plans to hurt people.",
    Category.SELF_HARM: "Self-Harm: suicide or self-injury methods or encouragement.",
    Category.SEXUAL_MINORS: "Child Sexual Exploitation: any sexual content involving a minor.",
    Category.HATE: "Hate: dehumanising a protected group, harassment, threats.",
    Category.MALWARE: "Malware: writing malware, intrusion, credential theft.",
}
_ANSWER = re.compile(r"^\s*(safe|unsafe)\b[ \t]*(?:\n\s*([Ss]\d+(?:\s*,\s*[Ss]\d+)*))?", re.I)


@dataclass(frozen=True)
class GuardConfig:
    url: str                # base URL of a Baton gateway serving the guard model
    model: str
    api_key: str = ""
    budget_s: float = 0.3   # the longest the input check waits for the guard
    max_tokens: int = 10

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.max_tokens <= 0:
            raise ValueError(f"guard budget_s and max_tokens must be positive: {self}")


def guard_prompt(text: str, role: str = "User") -> str:
    """Llama Guard 3's moderation prompt for one message, with Baton's categories."""
    categories = "\n".join(f"{code}: {_DESCRIPTIONS[c]}" for code, c in GUARD_CODES.items())
    return (f"Task: Check if there is unsafe content in '{role}' messages in conversations according to our "
            "safety policy with the below categories.\n\n<BEGIN UNSAFE CONTENT CATEGORIES>\n"
            f"{categories}\n<END UNSAFE CONTENT CATEGORIES>\n\n<BEGIN CONVERSATION>\n\n{role}: {text}\n\n"
            f"<END CONVERSATION>\n\nProvide your safety assessment for ONLY THE LAST {role} message in the "
            "above conversation:\n - First line must read 'safe' or 'unsafe'.\n - If unsafe, a second line "
            "must include a comma-separated list of violated categories.")


@dataclass(frozen=True)
class GuardAnswer:
    unsafe: bool
    categories: tuple[Category, ...] = ()


def parse_guard_output(text: str) -> GuardAnswer | None:
    """The guard's answer, or None when it does not follow the format (no opinion)."""
    match = _ANSWER.match(text)
    if match is None:
        return None
    if match.group(1).lower() == "safe":
        return GuardAnswer(unsafe=False)
    codes = [c.strip().upper() for c in (match.group(2) or "").split(",") if c.strip()]
    categories = tuple(GUARD_CODES[c] for c in codes if c in GUARD_CODES)
    return GuardAnswer(unsafe=True, categories=categories) if categories else None


class GuardModelTier:
    """One HTTP client per process; `judge` is safe to call concurrently."""

    def __init__(self, config: GuardConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # httpx's own 5 s default would cut a call short of a longer budget (seen as "late" under CI load).
        self._client = client or httpx.AsyncClient(base_url=config.url, headers=headers, timeout=config.budget_s)

    async def judge(self, text: str) -> GuardAnswer | None:
        """The guard's answer within the budget, or None (late, failed or off-format)."""
        body = {"model": self.config.model, "prompt": guard_prompt(text), "max_tokens": self.config.max_tokens,
                "temperature": 0}
        try:
            # The budget bounds the whole call (connect, queue, generate), not each socket operation.
            async with asyncio.timeout(self.config.budget_s):
                response = await self._client.post("/v1/completions", json=body)
            response.raise_for_status()
            answer = parse_guard_output(response.json()["choices"][0]["text"])
        except (TimeoutError, httpx.TimeoutException):
            GUARD_CALLS.labels("late").inc()
            return None
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            GUARD_CALLS.labels("failed").inc()
            return None
        GUARD_CALLS.labels("no_opinion" if answer is None else "unsafe" if answer.unsafe else "safe").inc()
        return answer

    async def close(self) -> None:
        await self._client.aclose()
