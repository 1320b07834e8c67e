"""Health throttling on real PostgreSQL and Redis: one shared verdict stops every task."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider.core import ConfigurationError, TraverseOptions
from airflow_keyset_provider.core.pace.health import (
    ActiveBackends,
    CallableCheck,
    HealthGate,
    ReplicationLag,
    SqlThreshold,
)


def test_a_flipped_lag_stops_every_task_within_one_chunk_and_recovery_resumes(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: two tasks traverse two ranges of 6,000 keys in chunks of 100 (20 ms each) with a
    health check that reads a synthetic "lag" from a table (healthy while <= 10) and a counting
    callable check, polled every 0.3 s. The test sets the lag to 100: once the shared verdict in
    Redis says unhealthy, each task starts at most one more chunk (the one it had already decided
    on), then nothing moves for 2 s; the status shows the reason. The test sets the lag back to 0:
    both tasks resume and finish, every key delivered exactly once. The probes are shared: far
    fewer probes than chunks, whatever the number of tasks."""
    make_events(pg_engine, list(range(1, 6001)))
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE synthetic_lag (seconds float NOT NULL)"))
        c.execute(sa.text("INSERT INTO synthetic_lag VALUES (0)"))
    probes = []
    checks = (
        SqlThreshold("SELECT seconds FROM synthetic_lag", 10, "synthetic lag", " s"),
        CallableCheck(lambda: probes.append(1) or True, "counter"),
    )
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=2, new_stream=True)
    opts = TraverseOptions(
        chunk_size=100, health_checks=checks, health_poll_seconds=0.3, prefetch=False
    )
    starts: dict[int, list[float]] = {0: [], 1: []}
    seen: list[int] = []
    lock = threading.Lock()

    def proc(chunk):
        with lock:
            starts[chunk.range_id].append(time.monotonic())
            seen.extend(chunk.keys)
        time.sleep(0.02)

    results = {}

    def run(i: int) -> None:
        w = traversal(pg_schema_url, redis_url, key_prefix)
        results[i] = w.traverse(rnd.round_id, i, proc, options=opts)
        w.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for th in threads:
        th.start()
    while min(len(s) for s in starts.values()) < 5:
        time.sleep(0.01)
    with pg_engine.begin() as c:
        c.execute(sa.text("UPDATE synthetic_lag SET seconds = 100"))
    flipped = time.monotonic()
    while t.control.control_state().healthy is not False:
        time.sleep(0.01)
    bad_at = time.monotonic()
    state = t.control.control_state()
    assert "synthetic lag 100 s > 10 s" in state.health_reason
    assert t.control.stream_status().as_dict()["control"]["healthy"] is False
    time.sleep(2.0)
    after_bad = {i: sum(1 for s in starts[i] if s > bad_at) for i in (0, 1)}
    assert all(n <= 1 for n in after_bad.values()), after_bad  # at most the chunk in hand
    held = {i: len(starts[i]) for i in (0, 1)}
    time.sleep(0.5)
    assert {i: len(starts[i]) for i in (0, 1)} == held  # nothing moves while unhealthy
    assert all(not r.complete for r in t.range_status(rnd.round_id))
    with pg_engine.begin() as c:
        c.execute(sa.text("UPDATE synthetic_lag SET seconds = 0"))
    healed = time.monotonic()
    for th in threads:
        th.join(60)
    first_after = min(s for i in (0, 1) for s in starts[i] if s > healed)
    assert all(results[i].complete for i in (0, 1))
    assert sorted(seen) == list(range(1, 6001))  # every key, none twice
    assert t.control.control_state().healthy is True
    chunks = sum(len(s) for s in starts.values())
    print(
        f"\nhealth: verdict unhealthy {bad_at - flipped:.2f} s after the flip (poll 0.3 s); "
        f"chunks started after it per task {after_bad}; first chunk {first_after - healed:.2f} s "
        f"after recovery; {len(probes)} probes for {chunks} chunks of 2 tasks"
    )


def test_a_failing_probe_is_unhealthy_and_builtins_read_postgres(
    pg_engine, redis_client, key_prefix
):
    """A probe that raises is an unhealthy verdict naming the error (an outage never reads as
    healthy); the PostgreSQL built-ins run against a real server (no replica here: lag 0)."""
    from airflow_keyset_provider.core.store.cursor_store import CursorStore

    store = CursorStore(redis_client, "h1", prefix=key_prefix)

    def boom() -> bool:
        raise RuntimeError("metrics endpoint down")

    gate = HealthGate(store, [CallableCheck(boom, "probe")], pg_engine, poll_seconds=60)
    assert "probe: probe failed: metrics endpoint down" in (gate.check() or "")
    ok = HealthGate(
        CursorStore(redis_client, "h2", prefix=key_prefix),
        [ReplicationLag(30), ActiveBackends(1000)],
        pg_engine,
    )
    assert ok.check() is None
    verdict = ok.probe()
    assert verdict.ok and "replication lag 0 s" in verdict.reason
    with pytest.raises(ConfigurationError, match="health_checks"):
        TraverseOptions(health_checks=["not a check"])
