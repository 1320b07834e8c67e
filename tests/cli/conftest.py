"""Fixtures for the CLI, test-helper and docs tests (helpers in ``cli_support.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cli_support import LiveRound, build_live_round


@pytest.fixture(params=["sqlite", "postgresql"])
def live_round(
    request: pytest.FixtureRequest, redis_url: str, key_prefix: str
) -> Iterator[LiveRound]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_schema_url")
    lr = build_live_round(url, redis_url, key_prefix)
    yield lr
    lr.traversal.close()


@pytest.fixture
def sqlite_round(sqlite_url: str, redis_url: str, key_prefix: str) -> Iterator[LiveRound]:
    lr = build_live_round(sqlite_url, redis_url, key_prefix)
    yield lr
    lr.traversal.close()
