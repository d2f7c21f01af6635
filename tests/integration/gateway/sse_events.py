"""Reading raw SSE in tests: events with their ids, and the keep-alive comments between them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    id: str
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)


def events(lines: Iterable[str], comments: list[str] | None = None) -> Iterator[Event]:
    """Events as they complete; comment lines go to `comments` when given."""
    event_id, data = "", []
    for line in lines:
        if line.startswith(":"):
            if comments is not None:
                comments.append(line)
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield Event(event_id, "\n".join(data))
            data = []


def text_of(evs: Iterable[Event]) -> str:
    out = []
    for e in evs:
        if e.data != "[DONE]":
            out += [c["delta"].get("content") or "" for c in e.json.get("choices", [])]
    return "".join(out)
