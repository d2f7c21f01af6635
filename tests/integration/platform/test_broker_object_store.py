"""The broker's S3-compatible store: the conditional writes Tansu's `s3://` engine relies on.

Tansu creates objects with `If-None-Match: *` and updates watermarks and group state with
`If-Match: "<etag>"` (compare-and-swap); both must be enforced, also when writers race.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.launcher.object_store import EmbeddedObjectStore, ObjectStoreConfig


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedObjectStore]:
    store = EmbeddedObjectStore(ObjectStoreConfig(work_dir=tmp_path_factory.mktemp("object-store")))
    store.start()
    yield store
    store.close()


@pytest.fixture
def client(store: EmbeddedObjectStore) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{store.url}/{store.bucket}", timeout=10) as client:
        yield client


def test_objects_are_plain_files_in_the_data_dir(store: EmbeddedObjectStore, client: httpx.Client) -> None:
    assert client.put("/topics/t/watermark.json", content=b'{"hw": 3}').status_code == 200
    assert (store.data_dir / store.bucket / "topics" / "t" / "watermark.json").read_bytes() == b'{"hw": 3}'
    assert client.get("/topics/t/watermark.json").content == b'{"hw": 3}'


def test_if_none_match_creates_only_once(client: httpx.Client) -> None:
    create = {"If-None-Match": "*"}
    assert client.put("/records/0.batch", content=b"first", headers=create).status_code == 200
    second = client.put("/records/0.batch", content=b"second", headers=create)
    assert second.status_code == 412 and b"PreconditionFailed" in second.content
    assert client.get("/records/0.batch").content == b"first"


def test_if_match_swaps_only_the_version_read(client: httpx.Client) -> None:
    etag = client.put("/groups/g.json", content=b"v1").headers["ETag"]
    updated = client.put("/groups/g.json", content=b"v2", headers={"If-Match": etag})
    assert updated.status_code == 200 and updated.headers["ETag"] != etag
    stale = client.put("/groups/g.json", content=b"v3", headers={"If-Match": etag})
    assert stale.status_code == 412
    assert client.get("/groups/g.json").content == b"v2"


def test_if_match_on_a_missing_key_is_no_such_key(client: httpx.Client) -> None:
    response = client.put("/groups/never-written.json", content=b"x", headers={"If-Match": '"0123"'})
    assert response.status_code == 404 and b"NoSuchKey" in response.content


def test_delete_removes_the_object(client: httpx.Client) -> None:
    assert client.put("/groups/gone.json", content=b"x").status_code == 200
    assert client.delete("/groups/gone.json").status_code == 204
    assert client.get("/groups/gone.json").status_code == 404


def test_racing_compare_and_swaps_have_exactly_one_winner(store: EmbeddedObjectStore, client: httpx.Client) -> None:
    etag = client.put("/topics/race/watermark.json", content=b"start").headers["ETag"]

    def swap(i: int) -> int:
        with httpx.Client(base_url=f"{store.url}/{store.bucket}", timeout=10) as own:
            return own.put("/topics/race/watermark.json", content=f"writer-{i}".encode(),
                           headers={"If-Match": etag}).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(swap, range(16)))
    assert sorted(statuses) == [200] + [412] * 15
    winner = statuses.index(200)
    assert client.get("/topics/race/watermark.json").content == f"writer-{winner}".encode()


def test_a_restarted_store_serves_what_it_stored(tmp_path: Path) -> None:
    store = EmbeddedObjectStore(ObjectStoreConfig(work_dir=tmp_path))
    store.start()
    try:
        assert httpx.put(f"{store.url}/{store.bucket}/k", content=b"kept").status_code == 200
        store.kill()
        store.start()
        assert httpx.get(f"{store.url}/{store.bucket}/k").content == b"kept"
    finally:
        store.close()
