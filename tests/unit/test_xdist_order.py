"""The longest-first hand-out of xdist groups (tests/support/xdist_order.py): estimates from a per-file record."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.support.xdist_order import (
    FILE_SECONDS_ENV,
    UNKNOWN_TEST_S,
    estimated_seconds,
    order_longest_first,
    recorded_file_seconds,
)


def _unit(*nodeids: str) -> dict[str, bool]:
    return dict.fromkeys(nodeids, False)


def test_a_group_is_estimated_by_its_tests_shares_of_their_files() -> None:
    groups = {"session-cluster": ["a.py::t1", "b.py::t1"], "a.py": ["a.py::t2", "a.py::t3"], "new.py": ["new.py::t"]}
    estimates = estimated_seconds(groups, {"a.py": 30.0, "b.py": 5.0})
    assert estimates == {"session-cluster": 10.0 + 5.0, "a.py": 20.0, "new.py": UNKNOWN_TEST_S}


def test_the_longest_group_is_handed_out_first_and_ties_keep_their_order() -> None:
    queue = OrderedDict([("many_quick.py", _unit(*(f"many_quick.py::t{i}" for i in range(20)))),
                         ("tie_1.py", _unit("tie_1.py::t")), ("tie_2.py", _unit("tie_2.py::t")),
                         ("soak.py", _unit("soak.py::t1", "soak.py::t2"))])
    order_longest_first(queue, {"many_quick.py": 4.0, "tie_1.py": 1.0, "tie_2.py": 1.0, "soak.py": 80.0})
    assert list(queue) == ["soak.py", "many_quick.py", "tie_1.py", "tie_2.py"]
    assert queue["soak.py"] == _unit("soak.py::t1", "soak.py::t2")  # the groups' tests move with them


def test_the_record_is_read_from_the_environment_and_none_is_no_estimate(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "seconds.json"
    record.write_text(json.dumps({"tests/a.py": 3}))
    monkeypatch.setenv(FILE_SECONDS_ENV, str(record))
    assert recorded_file_seconds() == {"tests/a.py": 3.0}
    monkeypatch.setenv(FILE_SECONDS_ENV, str(tmp_path / "absent.json"))
    assert recorded_file_seconds() == {}


def test_the_checked_in_record_holds_seconds_of_test_files() -> None:
    """A file renamed or removed since only loses its estimate (0.5 s a test until the record is refreshed)."""
    recorded = recorded_file_seconds()
    assert recorded and all(file.startswith("tests/") and file.endswith(".py") and seconds > 0
                            for file, seconds in recorded.items())
