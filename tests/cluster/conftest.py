"""A real 3-primary Redis Cluster for the session's cluster tests (``tests/redis_servers.py``):
``redis-server --cluster-enabled yes`` on three free loopback ports, joined with
``redis-cli --cluster create``, stopped by PID at teardown. Skipped (with the reason printed)
only when redis-server is absent and KEYSET_REQUIRE_SERVICES is not set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_servers import start_cluster


@pytest.fixture(scope="session")
def cluster_ports() -> Iterator[list[int]]:
    ports, stop = start_cluster(3)
    yield ports
    stop()


@pytest.fixture
def cluster_url(cluster_ports: list[int]) -> str:
    """``redis+cluster://`` URL of one node; the client discovers the others."""
    return f"redis+cluster://127.0.0.1:{cluster_ports[0]}"
