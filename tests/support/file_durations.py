"""`--file-durations=N`: the N test files and directories that took longest, set-up and teardown included (a pytest
plugin; tests/conftest.py loads it). `--durations` names single test phases, but most of `make test` goes to
files of many small tests and to module fixtures (a `baton serve`, a model) charged to whichever test came
first; per-file totals say where the suite's time goes. Under xdist the controller adds up every worker's
reports, so the totals are test time summed over workers, not wall time.

`--file-durations-record=PATH` writes the same per-file totals as JSON: refreshed into
tests/support/file_seconds.json, they order xdist's hand-out longest first (tests/support/xdist_order.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path, PurePosixPath

import pytest

_seconds_by_file: defaultdict[str, float] = defaultdict(float)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-durations", type=int, default=0, metavar="N",
                     help="show the N slowest test files and directories (set-up, call and teardown summed)")
    parser.addoption("--file-durations-record", default=None, metavar="PATH",
                     help="write every test file's seconds to PATH as JSON (tests/support/file_seconds.json is "
                          "the record xdist's hand-out order reads: tests/support/xdist_order.py)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_by_file[report.nodeid.split("::", 1)[0]] += report.duration


def seconds_by_directory(seconds_by_file: dict[str, float]) -> dict[str, float]:
    """Each directory's total, its subdirectories' files included (`tests/unit` holds `tests/unit/engine`)."""
    totals: defaultdict[str, float] = defaultdict(float)
    for path, seconds in seconds_by_file.items():
        for parent in PurePosixPath(path).parents:
            if parent != PurePosixPath("."):
                totals[parent.as_posix()] += seconds
    return dict(totals)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the record in the process that saw every report: the controller under xdist, not a worker."""
    path = session.config.getoption("file_durations_record")
    if path and not hasattr(session.config, "workerinput"):
        record = {file: round(seconds, 1) for file, seconds in sorted(_seconds_by_file.items())}
        Path(path).write_text(json.dumps(record, indent=0) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    shown = config.getoption("file_durations")
    if not shown or not _seconds_by_file:
        return
    total = sum(_seconds_by_file.values())
    for title, seconds in (("files", dict(_seconds_by_file)), ("directories", seconds_by_directory(_seconds_by_file))):
        terminalreporter.section(f"slowest {shown} test {title} (of {total:.0f} s of test time)")
        for path, spent in sorted(seconds.items(), key=lambda kv: -kv[1])[:shown]:
            terminalreporter.line(f"{spent:9.1f}s {100 * spent / total:5.1f}%  {path}")
