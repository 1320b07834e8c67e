"""What the UI page's JSON says about ranges, read from real Redis (no Airflow, no browser).

The page marks a range *lagging* when it is not complete and nobody owns it, or its owner stopped
heartbeating (last beat older than twice the expected interval, a third of the lease). Progress
is a key-space fraction where one exists (a range from ``-inf`` is measured from the round's
lowest key when planned), else the page shows counts only.
"""

from __future__ import annotations

import time
from typing import Any

import redis
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.plugins import status
from airflow_keyset_provider.plugins.status import lag_reason


def _range(**kw: Any) -> dict[str, Any]:
    return {"state": "running", "owner": "worker#1", "heartbeat_age_s": 1.0, **kw}


def test_lag_rules() -> None:
    assert lag_reason("closed", _range(owner=""), None) is None  # a closed round never lags
    assert lag_reason("open", _range(state="complete", owner=""), None) is None
    assert lag_reason("open", _range(), expected_heartbeat_s=20) is None  # fresh owner
    assert lag_reason("open", _range(heartbeat_age_s=39.0), 20) is None  # within 2x the interval
    assert "stale owner" in (lag_reason("open", _range(heartbeat_age_s=41.0), 20) or "")
    assert (
        lag_reason("open", _range(owner="", heartbeat_age_s=None), None)
        == "no owner: never claimed"
    )
    assert "released unfinished" in (
        lag_reason("open", _range(state="pending", owner=""), None) or ""
    )


def test_round_view_from_redis(
    sqlite_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        conn.execute(sa.text("INSERT INTO t VALUES (:k)"), [{"k": i} for i in range(1, 201)])
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, table="t", key="k", redis_url=redis_url, stream="s", key_prefix=key_prefix
    )
    try:
        rnd = t.plan(max_ranges=3, new_stream=True)
        # Range 0 starts at -inf: measured from the round's lowest key when planned (its floor).
        t.traverse(rnd.round_id, 0, lambda chunk: t.request_stop(), chunk_size=10)
        # Range 1: an owner whose 300 ms lease (100 ms heartbeats) went silent.
        claim = t.store.claim(rnd.round_id, 1, "worker#silent", "", 300)
        assert not isinstance(claim, tuple), claim
        view = status.round_view(redis_client, key_prefix, "s", rnd.round_id)
        while not view["ranges"][1][
            "lagging"
        ]:  # wait (no timing assertion) for 2 intervals to pass
            time.sleep(0.05)
            view = status.round_view(redis_client, key_prefix, "s", rnd.round_id)
    finally:
        t.close()

    r0, r1, r2 = view["ranges"]
    assert r0["progress_basis"] == "key space" and r0["done"] == 10
    in_r0 = int(r0["hi"])  # keys 1..hi: the figure is the page's, checked against the rows done
    assert abs(r0["progress"] - 10 / in_r0) < 0.05, (r0["progress"], in_r0)
    assert r0["lagging"] and r0["lag_reason"].startswith("no owner: released unfinished")
    assert r1["owner"] == "worker#silent" and r1["expected_heartbeat_s"] == 0.1
    assert r1["lag_reason"].startswith("stale owner: last heartbeat")
    assert r2["lag_reason"] == "no owner: never claimed" and r2["progress"] == 0.0
    assert view["lagging"] == 3 and all(r["dead_letters"] == [] for r in view["ranges"])
    # Outside Airflow no lineage is recorded: what stopped them is only the lag rule.
    assert all(r["stopped"] == {"last_task": None, "retry_errors": []} for r in view["ranges"])

    summary = status.stream_view(redis_client, key_prefix, "s")
    assert [(r["round_id"], r["state"], r["lagging"]) for r in summary["rounds"]] == [
        (rnd.round_id, "open", 3)
    ]
    assert [s["stream"] for s in status.streams(redis_client, key_prefix)] == ["s"]


def test_owner_lineages_parse_into_task_instances() -> None:
    """``<dag_id>/<run_id>/<task_id>[/<map_index>]`` (``common.run_key``), '' outside Airflow."""
    assert status.parse_lineage("d/manual__2026-01-01T00:00:00+00:00/traverse/7") == {
        "dag_id": "d",
        "run_id": "manual__2026-01-01T00:00:00+00:00",
        "task_id": "traverse",
        "map_index": 7,
    }
    assert status.parse_lineage("d/r/plan") == {
        "dag_id": "d",
        "run_id": "r",
        "task_id": "plan",
        "map_index": None,
    }
    assert status.parse_lineage("") is None and status.parse_lineage("d//t") is None
    # a replay's owner is no task instance: the CLI's, and the page's (no "/")
    assert status.parse_lineage("airflow-keyset/replay/orders/r3") is None
    assert status.parse_lineage("keyset-page-replay:0123456789ab") is None


def test_a_run_whose_round_redis_lost_is_lost_not_unplanned(
    sqlite_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """``runs.run_view``: a round Redis holds is shown; once Redis lost the stream, the run's
    XCom record makes it *lost* (with what to do), and without any record of it the words say
    it was not planned, or that nothing can tell (no XCom readable)."""
    from airflow_keyset_provider.plugins.runs import run_view

    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        conn.execute(sa.text("INSERT INTO t VALUES (:k)"), [{"k": i} for i in range(1, 21)])
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, table="t", key="k", redis_url=redis_url, stream="d", key_prefix=key_prefix
    )
    try:
        t.plan(max_ranges=1, round_key="d/run1/plan", new_stream=True)
    finally:
        t.close()
    xcom = [
        {
            "stream": "d",
            "round_id": "r1",
            "key_prefix": key_prefix,
            "task_id": "plan",
            "map_index": None,
        }
    ]
    held = run_view(redis_client, key_prefix, "d", "run1", xcom)
    assert [(r["round_id"], r["known_from"], r["in_redis"]) for r in held["rounds"]] == [
        ("r1", "redis", True)
    ]
    assert held["absent_reason"] is None

    for key in redis_client.scan_iter(f"{key_prefix}:*"):  # Redis loses the stream
        redis_client.delete(key)
    lost = run_view(redis_client, key_prefix, "d", "run1", xcom)
    [r] = lost["rounds"]
    assert (r["known_from"], r["in_redis"]) == ("airflow", False)
    assert r["lost_message"].startswith(
        "Redis has lost round r1 of stream d, which task plan of this run planned"
    )
    assert "re-plan the round or restore it from its checkpoint mirror" in r["lost_message"]

    never = run_view(redis_client, key_prefix, "d", "run1", [])
    assert never["rounds"] == [] and never["absent_reason"] == "never-planned"
    assert "planned no keyset round" in never["absent_message"]
    unknown = run_view(redis_client, key_prefix, "d", "run1", None)
    assert unknown["absent_reason"] == "unknown"
    assert "Redis lost the stream's state" in unknown["absent_message"]
    other = run_view(
        redis_client, key_prefix, "d", "run1", [{**xcom[0], "key_prefix": "elsewhere"}]
    )
    assert (
        other["absent_reason"] == "other-prefix"
        and "key prefix elsewhere" in other["absent_message"]
    )


def test_keys_on_one_line_as_the_map_index_column_writes_them() -> None:
    """``compact_key`` (traverse tasks' Map Index label; the page's ``compactKey`` applies the
    same rule): composite columns joined by `` · ``, UTC timestamps with ``Z``."""
    import datetime as dt

    from airflow_keyset_provider.common import compact_key

    ten = dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)
    assert compact_key((ten, 41235)) == "2024-05-01T10:00:00Z · 41235"
    assert (
        compact_key(["2024-05-01T10:00:00.250000+00:00", "eu"])
        == "2024-05-01T10:00:00.250000Z · eu"
    )
    assert compact_key(None) == "-inf" and compact_key(42) == "42"
    other_zone = dt.datetime(2024, 5, 1, 10, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert compact_key(other_zone) == "2024-05-01T10:00:00+02:00"  # only UTC is shortened


def test_the_page_api_carries_the_round_verification(
    pg_schema_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The page reads the verification from the one status model: the round's view and the
    stream's round list both carry it (state, count, first keys; never row data)."""
    engine = sa.create_engine(pg_schema_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k bigint PRIMARY KEY, v text NOT NULL)")
        conn.execute(sa.text("INSERT INTO t VALUES (:k, 'ok')"), [{"k": i} for i in range(1, 51)])
    t = KeysetTraversal(
        pg_schema_url, table="t", key="k", redis_url=redis_url, stream="s", key_prefix=key_prefix
    )
    try:
        rnd = t.plan(max_ranges=2, new_stream=True, verify="v = 'bad'")
        for spec in rnd.ranges:
            t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=20)
        view = status.round_view(redis_client, key_prefix, "s", rnd.round_id)
        assert view["verification"] == {"state": "pending"}
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE t SET v = 'bad' WHERE k IN (3, 40)")
        t.verify_round(rnd.round_id, "v = 'bad'")
    finally:
        t.close()
        engine.dispose()
    view = status.round_view(redis_client, key_prefix, "s", rnd.round_id)
    v = view["verification"]
    assert (v["state"], v["matching"], v["first_keys"]) == ("failed", 2, ["3", "40"])
    [summary] = status.stream_view(redis_client, key_prefix, "s")["rounds"]
    assert summary["verification"] == v


def test_requeue_names_the_try_that_will_process_the_letters(
    sqlite_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Requeue runs nothing: its answer names who will, from what the store records."""
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE q (seq INTEGER PRIMARY KEY)")
        c.execute(sa.text("INSERT INTO q VALUES (:s)"), [{"s": i} for i in range(1, 21)])
    t = KeysetTraversal(
        sqlite_url, "q", "seq", redis_url=redis_url, stream="s", key_prefix=key_prefix
    )
    rnd = t.plan(max_ranges=1, round_key="d/manual__1/plan", new_stream=True)

    def poison(chunk: Any) -> Any:
        from airflow_keyset_provider import ChunkResult

        return ChunkResult(failed={k: "bad" for k in chunk.keys if k in (3, 4)})

    def requeue() -> dict[str, Any]:
        t.traverse(rnd.round_id, 0, poison, max_item_attempts=1, item_retry_delay=0)
        return status.requeue_dead(redis_client, key_prefix, "s", rnd.round_id, 0)

    # a complete range keeps no holder: the planning run's mapped task instance, the chained
    # DAG's next run, a replay
    said = requeue()
    assert said["moved"] == 2, said
    first, chained, replay = said["picked_up_by"]
    assert "run manual__1 of DAG d" in first and "map index 0" in first, first
    assert chained.startswith("the next run of DAG d"), chained
    assert "replay-dead-letters s r1 --range 0 --dag-id d" in replay, replay
    # a task that died holding the range leaves its lineage in the range: that task's next try
    store = t.store
    t.traverse(rnd.round_id, 0, poison, max_item_attempts=1, item_retry_delay=0)
    store.client.hset(store.range_key(rnd.round_id, 0), "lineage", "d/manual__1/traverse/0")
    said = status.requeue_dead(redis_client, key_prefix, "s", rnd.round_id, 0)
    assert said["picked_up_by"][0].startswith(
        "the next try of task traverse [0] of DAG d run manual__1"
    ), said
    t.close()
    engine.dispose()
