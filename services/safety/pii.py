"""PII detectors for generated text: e-mail addresses, phone numbers, payment card numbers, US SSNs.

They read the `raw` view (digits and case kept). Each candidate is validated beyond its regex, which
is where precision comes from: card numbers must pass the Luhn checksum, phone numbers must hold 10
to 15 digits and must not be a dotted IP address or a date, and e-mail addresses at the reserved
documentation domains (example.com, *.test, ...) are not anybody's address.
"""

from __future__ import annotations

import re

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@((?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,})(?![\w-])")
_PHONE = re.compile(r"(?<![\w+.\-/])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]?"
                    r"\d{3,4}(?![\d/])(?![ .-]\d)")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
_SSN = re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])")
_RESERVED_DOMAINS = ("example.com", "example.org", "example.net")
_RESERVED_TLDS = (".example", ".test", ".invalid", ".localhost", ".local")


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _real_email(match: re.Match[str]) -> bool:
    domain = match.group(1).lower()
    return not (domain.endswith(_RESERVED_TLDS) or any(domain == d or domain.endswith("." + d)
                                                       for d in _RESERVED_DOMAINS))


def find_pii(raw: str) -> str | None:
    """The kind of the first PII found ("email", "phone", "card", "ssn"), or None."""
    if "@" in raw and any(_real_email(m) for m in _EMAIL.finditer(raw)):
        return "email"
    digit_count = sum(c.isdigit() for c in raw)
    if digit_count < 9:
        return None
    for m in _CARD.finditer(raw):
        digits = re.sub(r"\D", "", m.group(0))
        if 13 <= len(digits) <= 19 and _luhn_ok(digits) and len(set(digits)) > 1:
            return "card"
    if _SSN.search(raw):
        return "ssn"
    for m in _PHONE.finditer(raw):
        if 10 <= sum(c.isdigit() for c in m.group(0)) <= 15:
            return "phone"
    return None
