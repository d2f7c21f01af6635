"""Incremental Server-Sent Events parser: bytes from the network in, `data` payloads out.

Why not iterate the response by lines: an event's `data:` may span reads and lines, servers send
`:` comments as keep-alives, and line readers have size limits (aiohttp's `readline` raises on lines
over 64 KiB, which a long final chunk can exceed). This parser follows the WHATWG rules that matter
for OpenAI-style streams: lines end in `\\n` or `\\r\\n`, `data:` lines of one event are joined with
`\\n`, a blank line dispatches the event, comment lines and other fields (`event:`, `id:`, `retry:`)
are ignored. A lone `\\r` line ending (allowed by the spec, unused by any LLM server) is not handled.
"""

from __future__ import annotations


class SSEParser:
    """Feed bytes with `feed`; it returns the events completed by them, as their data strings."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1 :]
            if event := self._line(line):
                events.append(event)
        return events

    def close(self) -> list[str]:
        """End of stream: an event missing its final blank line is still delivered (lenient)."""
        events = self.feed(b"\n") if self._buf else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None
