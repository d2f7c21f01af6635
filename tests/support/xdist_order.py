"""The order in which `make test`'s xdist workers are handed their groups of tests: longest first.

xdist's scope scheduling hands out groups in order of how many tests they hold, so a module of a few
long tests (a `baton serve` under load, a soak, the lab's benchmark smokes) came last, and one worker
ran it alone while the other sat idle at the end of the run. Handing out the longest group first and
each next one to whichever worker frees up keeps the two busy until the end (the longest-processing-
time-first rule). How long a group takes is estimated from the per-file times of an earlier serial run
(FILE_SECONDS, written by `--file-durations-record`), shared evenly among a file's tests.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")  # {test file: seconds}, from a serial run
FILE_SECONDS_ENV = "BATON_TEST_FILE_SECONDS"  # another record in its place (a scratch suite's, in a test)
UNKNOWN_TEST_S = 0.5  # a test of a file the record does not know yet (a new file): about a typical test


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded_file_seconds() -> dict[str, float]:
    """The recorded per-file times; none (every group estimated by its test count) when there is no record."""
    path = Path(os.environ.get(FILE_SECONDS_ENV) or FILE_SECONDS)
    if not path.exists():
        return {}
    return {file: float(seconds) for file, seconds in json.loads(path.read_text()).items()}


def estimated_seconds(groups: Mapping[str, Iterable[str]], file_seconds: Mapping[str, float]) -> dict[str, float]:
    """Each group's estimated time: its tests' shares of their files' recorded times."""
    members = {group: list(nodeids) for group, nodeids in groups.items()}
    tests_per_file = Counter(file_of(nodeid) for nodeids in members.values() for nodeid in nodeids)

    def test_seconds(nodeid: str) -> float:
        file = file_of(nodeid)
        if file not in file_seconds:
            return UNKNOWN_TEST_S
        return file_seconds[file] / tests_per_file[file]

    return {group: sum(map(test_seconds, nodeids)) for group, nodeids in members.items()}


def order_longest_first(workqueue: MutableMapping[str, dict[str, bool]], file_seconds: Mapping[str, float]) -> None:
    """Reorder xdist's work queue (group -> its tests, in hand-out order) in place, longest group first;
    groups of equal estimates keep their order."""
    estimates = estimated_seconds(workqueue, file_seconds)
    ordered = sorted(workqueue, key=lambda group: -estimates[group])
    for group in ordered:
        workqueue[group] = workqueue.pop(group)
