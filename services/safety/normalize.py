"""Text normalisation that defeats cheap obfuscation before any detector looks at a text.

`normalize(text)` returns two views:

* `raw`: NFKC with invisible characters removed, case and digits kept. The PII detectors read this
  one: folding "0" into "o" would destroy the phone number they look for.
* `words`: what the harm patterns and the classifier read: NFKC, case-folded, diacritics stripped,
  Cyrillic/Greek look-alikes folded to Latin, leetspeak folded inside words ("k1ll" -> "kill",
  "$ex" -> "sex", but "13" and "5pm" stay), every run of punctuation/whitespace squashed to one
  space, and spelled-out words joined ("b o m b", "b.o.m.b" -> "bomb").

Why these steps and no more: each one maps an obfuscation that a human reads straight through to the
plain spelling, so one pattern covers all spellings. Leet folding is limited to tokens that mix
letters with leet symbols, because folding every digit would turn "13 year old" into "ie year old"
and break the patterns that need the number. Homoglyphs are folded only when the text has some
ASCII letters (a mixed-script text is the obfuscation signal; an all-Cyrillic text is Russian).

Fast path: an ASCII text skips the Unicode steps entirely, so a typical prompt normalises in a few
microseconds per hundred characters.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# Zero-width and other invisible format characters that split a word without showing.
_INVISIBLE = dict.fromkeys(
    map(ord, "\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b\u200c\u200d\u200e\u200f"
             "\u202a\u202b\u202c\u202d\u202e\u2060\u2061\u2062\u2063\u2064\u2066\u2067\u2068\u2069"
             "\u3164\ufeff\uffa0"),
    None,
)

# Lower-case look-alikes (after casefold) from Cyrillic, Greek and Latin extensions.
_HOMOGLYPHS = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p",
    "с": "c", "т": "t", "у": "y", "х": "x", "і": "i", "ї": "i", "ј": "j", "ѕ": "s", "ԁ": "d",
    "ԛ": "q", "ԝ": "w", "ɡ": "g", "һ": "h", "ӏ": "l", "ɩ": "i",
    "α": "a", "β": "b", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t",
    "υ": "u", "χ": "x", "ω": "w", "η": "n", "μ": "u", "ς": "s", "σ": "o",
    "ı": "i", "ł": "l", "ø": "o", "đ": "d", "ħ": "h", "ŀ": "l", "ſ": "s", "æ": "ae", "œ": "oe",
})

_LEET = str.maketrans({"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s",
                       "!": "i", "|": "l", "+": "t"})
_LEET_CHARS = "013457@$!|+"
# A token holding at least one leet character; the callback decides whether it is a word.
_LEET_TOKEN = re.compile(r"[a-z0-9@$!|+]*[013457@$!|+][a-z0-9@$!|+]*")
_NUMBERISH = re.compile(r"\d+[a-z]{0,3}")  # "13", "13yo", "5pm", "2nd", "3d": leave alone
_SEPARATORS = re.compile(r"[\W_]+")
_SPELLED_OUT = re.compile(r"(?<!\S)\w(?: \w){2,}(?!\S)")  # three or more single characters


@dataclass(frozen=True)
class NormalizedText:
    raw: str    # NFKC, invisible characters removed; case, digits and punctuation kept
    words: str  # folded, squashed to lower-case words separated by single spaces


def _fold_leet_token(match: re.Match[str]) -> str:
    token = match.group(0)
    core = token.strip("!|+")
    if not core or _NUMBERISH.fullmatch(core) or not any(c.isalpha() for c in core):
        return token
    start = token.index(core)
    return token[:start] + core.translate(_LEET) + token[start + len(core):]


def _strip_marks(text: str) -> str:
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def _join_spelled_out(match: re.Match[str]) -> str:
    return match.group(0).replace(" ", "")


def normalize(text: str) -> NormalizedText:
    """Both views of `text` (see the module docstring)."""
    if text.isascii():
        raw = text
        folded = text.lower()
    else:
        raw = unicodedata.normalize("NFKC", text).translate(_INVISIBLE)
        folded = _strip_marks(raw.casefold())
        if any("a" <= c <= "z" for c in folded):
            folded = folded.translate(_HOMOGLYPHS)
    if any(c in _LEET_CHARS for c in folded):
        folded = _LEET_TOKEN.sub(_fold_leet_token, folded)
    words = _SEPARATORS.sub(" ", folded).strip()
    if " " in words:
        words = _SPELLED_OUT.sub(_join_spelled_out, words)
    return NormalizedText(raw=raw, words=words)
