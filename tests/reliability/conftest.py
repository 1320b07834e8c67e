"""Reliability suite: prints the summary table at the end of the session.

Each test records its figures with ``reliability_support.record`` (before it asserts, so a failed
run still reports what it measured). ``KEYSET_RELIABILITY_REPORT=<path>`` also writes the table
to that file (used to paste the long run into docs/reliability.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import reliability_support as rs


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not rs.RESULTS:
        return
    terminalreporter.section(f"keyset reliability summary ({rs.MODE} mode)")
    lines = rs.summary_lines()
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("KEYSET_RELIABILITY_REPORT")
    if target:
        Path(target).write_text(f"mode: {rs.MODE}\n\n" + "\n".join(lines) + "\n")
