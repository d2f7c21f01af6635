"""The suite's skip rule, as pytest hooks (tests/conftest.py imports them): a run that skipped a test
for any reason but the hardware it lacks fails, and its summary lists the offending skips.

A skip is only for a GPU test on a machine without the GPU(s) it needs, or for a CPU-only test on a
GPU machine (the Triton interpreter tests). Anything else a test needs, `make test` installs or starts:
a missing package is `require_module`'s ERROR (tests/support/required.py), a missing server the
infrastructure fixtures' ERROR (tests/conftest.py). A skip would let a broken set-up pass green.
"""

from __future__ import annotations

import re

import pytest

# Skip messages that name the hardware a test lacks: "needs a CUDA GPU", "tensor parallelism needs 2
# GPUs", "needs 2 CUDA GPUs", and the Triton interpreter tests' skip on a machine with CUDA.
HARDWARE_SKIP_REASON = re.compile(r"\bneeds (a|\d+) (CUDA )?GPUs?\b|^interpreter tests run on CPU-only machines")
_SECTION = "skips the suite does not allow"
_forbidden: list[str] = []


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The message of a skip report (pytest stores `(path, line, "Skipped: <reason>")`)."""
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


def is_allowed(reason: str) -> bool:
    return HARDWARE_SKIP_REASON.search(reason) is not None


def _record(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and not is_allowed(reason := skip_reason(report)):
        _forbidden.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _forbidden:
        terminalreporter.section(_SECTION, red=True)
        terminalreporter.line("Only missing hardware may skip a test; install or start what these need, or make "
                              "the test require it (tests/support/required.py):")
        for line in _forbidden:
            terminalreporter.line(f"  {line}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _forbidden and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
