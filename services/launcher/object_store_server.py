"""The S3-compatible server that holds the local broker's data on disk (`python -m` entry point).

It is pip `localbucket` (each object a plain file under the data root, written to a temp file and
renamed into place) with the two things Tansu's `s3://` engine relies on and localbucket lacks:

- `If-Match` on PutObject. Tansu updates a partition's watermark, its group state and its producer
  state with compare-and-swap writes (object_store's `PutMode::Update`, sent as `If-Match: "<etag>"`);
  localbucket ignores that header, so a lost race would silently overwrite.
- Atomic conditional writes: the precondition check and the write happen under one lock, so two
  writers racing on a key cannot both pass the check. All writes and deletes take it, so an
  unconditional overwrite cannot slip between another request's check and its write either.

Each object is fsync'ed before it is renamed into place: a written object survives a crash of this
server, of the broker and of the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import IO

import localbucket

_WRITE_LOCK = threading.Lock()

Writer = Callable[[IO[bytes]], str]  # writes the object's bytes into the file, returns its ETag


def _fsynced(write: Writer) -> Writer:
    def durable_write(file: IO[bytes]) -> str:
        etag = write(file)
        file.flush()
        os.fsync(file.fileno())
        return etag
    return durable_write


class DurableS3Handler(localbucket.S3Handler):
    """localbucket's handler with `If-Match` on writes, atomic preconditions and fsync'ed objects."""

    def _write_object(self, bucket: str, key: str, write: Writer) -> str:
        with _WRITE_LOCK:
            if_match = self.headers.get("If-Match")
            if if_match is not None:
                self._check_if_match(self._object_path(bucket, key), if_match)
            etag: str = super()._write_object(bucket, key, _fsynced(write))
            return etag

    def _delete_object(self, bucket: str, key: str) -> None:
        with _WRITE_LOCK:  # nor can a delete slip between a conditional write's check and its write
            super()._delete_object(bucket, key)

    def _check_if_match(self, target: Path, if_match: str) -> None:
        if not target.is_file():  # as S3 answers a conditional write to a missing key
            raise localbucket.S3Error(HTTPStatus.NOT_FOUND, "NoSuchKey", "The specified key does not exist.")
        if not localbucket.etag_matches(if_match, localbucket.object_etag(target)):
            raise self._precondition_failed_error()


def serve(data_root: Path, port: int, host: str = "127.0.0.1") -> None:
    data_root.mkdir(parents=True, exist_ok=True)
    DurableS3Handler.data_root = data_root.resolve()
    server = ThreadingHTTPServer((host, port), DurableS3Handler)
    logging.getLogger(__name__).warning("serving %s on http://%s:%d", data_root, host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("data_root", type=Path)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    # localbucket logs every request at INFO: only warnings and errors reach the service log.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args.data_root, args.port)


if __name__ == "__main__":
    main()
