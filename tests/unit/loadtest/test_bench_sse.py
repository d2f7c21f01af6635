"""The SSE parser: events split across network reads, comments, multi-line data, CRLF."""

from __future__ import annotations

from loadtest.sse import SSEParser


def test_events_split_across_reads_are_delivered_once_complete() -> None:
    p = SSEParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b": 1}\n") == []
    assert p.feed(b"\ndata: [DO") == ['{"a": 1}']
    assert p.feed(b"NE]\n\n") == ["[DONE]"]


def test_several_events_in_one_read() -> None:
    assert SSEParser().feed(b"data: 1\n\ndata: 2\n\ndata: 3\n\n") == ["1", "2", "3"]


def test_comments_and_other_fields_are_ignored() -> None:
    assert SSEParser().feed(b": keep-alive\n\nevent: message\nid: 7\nretry: 10\ndata: x\n\n") == ["x"]


def test_multi_line_data_is_joined_with_newlines() -> None:
    assert SSEParser().feed(b"data: first\ndata:second\n\n") == ["first\nsecond"]


def test_crlf_line_endings() -> None:
    assert SSEParser().feed(b"data: a\r\n\r\ndata: b\r\n\r\n") == ["a", "b"]


def test_multibyte_characters_split_across_reads() -> None:
    p = SSEParser()
    raw = 'data: "héllo ✓"\n\n'.encode()
    cut = raw.index("✓".encode()) + 1
    assert p.feed(raw[:cut]) == []
    assert p.feed(raw[cut:]) == ['"héllo ✓"']


def test_close_delivers_an_event_missing_its_blank_line() -> None:
    p = SSEParser()
    assert p.feed(b"data: tail") == []
    assert p.close() == ["tail"]
