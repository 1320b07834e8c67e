"""Operators, sensor and trigger under ``dag.test()``: retries, deferral, timeouts, bad input.

The DAGs are in ``keyset_test_dags.py``; they traverse the nightly example's ``im_events``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import keyset_test_dags as kt
import pytest
import redis
import sqlalchemy as sa
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState, TaskInstanceState
from keyset_examples_common import create_example_tables, example_metadata

from airflow_keyset_provider.core import KeysetTraversal, StreamControl
from airflow_keyset_provider.core.keys import parse_bound
from airflow_keyset_provider.core.store.cursor_store import CursorStore

pytestmark = pytest.mark.airflow


# --------------------------------------------------------------------------- helpers


def xcom(dr: Any, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id,
                dag_ids=dr.dag_id,
                task_ids=task_id,
                key=key,
                map_indexes=map_index,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def task_instances(dr: Any) -> dict[str, Any]:
    with create_session() as session:
        dr = session.merge(dr)
        return {
            (ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"): SimpleNamespace(
                state=ti.state, try_number=ti.try_number
            )
            for ti in dr.get_task_instances(session=session)
        }


def control(env: dict[str, Any], stream: str) -> StreamControl:
    return StreamControl(
        CursorStore(redis.Redis.from_url(env["redis_url"]), stream, prefix=env["prefix"])
    )


@pytest.fixture
def events(airflow_env: dict[str, Any], pg_engine: sa.Engine) -> int:
    """``im_events`` with 300 rows (and an empty outbox) in the test's schema."""
    create_example_tables(pg_engine)
    table = example_metadata().tables["im_events"]
    with pg_engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(300)],
        )
    kt.reset()
    return 300


# --------------------------------------------------------------------------- retries


def test_retries_reuse_the_round_and_resume_from_the_cursor(airflow_env, events, pg_engine):
    dr = kt.kt_retry.test()
    assert dr.state == DagRunState.SUCCESS, task_instances(dr)
    tis = task_instances(dr)

    # the plan failed once after planning; its retry returned the same round (r1, only round)
    assert tis["plan"].try_number == 2
    ranges = xcom(dr, "plan")
    assert {r["round_id"] for r in ranges} == {"r1"} and xcom(dr, "plan", key="round_id") == "r1"
    ctl = control(airflow_env, "kt_retry")
    assert (
        redis.Redis.from_url(airflow_env["redis_url"]).get(
            f"{airflow_env['prefix']}:{{kt_retry}}:seq"
        )
        == b"1"
    )

    # range 0 died after 2 committed chunks (its 3rd chunk's writes done, commit not): the retry
    # took over and resumed from the cursor, replaying exactly that one chunk
    assert tis["traverse[0]"].try_number == 2
    assert all(tis[f"traverse[{i}]"].try_number == 1 for i in range(1, len(ranges)))
    range_0 = next(r for r in ranges if r["range_id"] == 0)
    first = xcom(dr, "traverse", map_index=0)
    assert first["rows_read"] == range_0["hi"] - 2 * 20  # everything after the 2 committed chunks
    totals = xcom(dr, "barrier")
    assert (totals["done"], totals["skipped"], totals["dead"]) == (
        events - 20,
        20,
        0,
    )  # 20 = 1 chunk replayed
    assert ctl.watermark() == events
    with pg_engine.connect() as conn:
        assert (
            conn.exec_driver_sql("SELECT count(DISTINCT event_seq) FROM im_outbox").scalar()
            == events
        )

    # clearing the plan task of the same run (even after the round closed) returns the same round
    plan = kt.kt_retry.get_task("plan")
    ti = SimpleNamespace(
        dag_id=dr.dag_id,
        run_id=dr.run_id,
        task_id="plan",
        map_index=-1,
        try_number=3,
        xcom_push=lambda **_: None,
    )
    assert plan.execute({"ti": ti}) == ranges


# --------------------------------------------------------------------------- the barrier


def test_deferred_barrier_fires_when_the_round_completes_elsewhere(
    airflow_env, events, pg_schema_url
):
    stream, prefix = "kt_defer", airflow_env["prefix"]
    client = redis.Redis.from_url(airflow_env["redis_url"])
    channel = CursorStore(client, stream, prefix=prefix).events_channel
    errors: list[BaseException] = []

    def workers_elsewhere() -> None:
        try:
            deadline = time.monotonic() + 60
            while client.pubsub_numsub(channel)[0][1] == 0:  # until the trigger listens
                assert time.monotonic() < deadline, "the barrier never deferred to its trigger"
                time.sleep(0.05)
            t = KeysetTraversal(
                pg_schema_url,
                "im_events",
                "seq",
                airflow_env["redis_url"],
                stream=stream,
                key_prefix=prefix,
            )
            for spec in t.round("r1").ranges:
                t.traverse("r1", spec.range_id, lambda chunk: None, chunk_size=100)
            t.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=workers_elsewhere, daemon=True)
    thread.start()
    dr = kt.kt_defer.test()
    thread.join(30)
    assert not errors, errors
    assert dr.state == DagRunState.SUCCESS, (task_instances(dr), kt.FAILURES)
    totals = xcom(dr, "barrier")
    assert (totals["round_id"], totals["done"], totals["skipped"], totals["dead"]) == (
        "r1",
        events,
        0,
        0,
    )
    assert control(airflow_env, stream).watermark() == events


def test_a_range_held_elsewhere_defers_until_its_lease_is_free(airflow_env, events, pg_engine):
    """Scenario: right after planning, a stray worker elsewhere claims the only range with a long
    lease (8 s) and never renews it. The traverse task waits ``defer_after_seconds`` (0.5 s) in its
    slot, then defers to ``KeysetResumeTrigger`` (``wait_for="lease"``); once the lease has
    expired the task resumes in the same try, takes the range over and finishes it."""
    dr = kt.kt_held.test()
    assert dr.state == DagRunState.SUCCESS, (task_instances(dr), kt.FAILURES)
    assert kt.RESUMED == ["lease"]
    assert task_instances(dr)["traverse[0]"].try_number == 1
    result = xcom(dr, "traverse", map_index=0)
    assert (result["done"], result["complete"]) == (events, True)
    with pg_engine.connect() as conn:
        assert (
            conn.exec_driver_sql("SELECT count(DISTINCT event_seq) FROM im_outbox").scalar()
            == events
        )


def test_a_paused_stream_defers_the_task_and_resume_finishes_it(airflow_env, events, pg_engine):
    """Scenario: the range's second chunk pauses the stream (and a timer resumes it 2 s later).
    The task commits that chunk, releases its lease and defers (``wait_for="paused"``); after the
    resume it continues from the cursor in the same try: every key once, counters exact."""
    dr = kt.kt_pause.test()
    assert dr.state == DagRunState.SUCCESS, (task_instances(dr), kt.FAILURES)
    assert kt.RESUMED == ["paused"]
    assert task_instances(dr)["traverse[0]"].try_number == 1
    result = xcom(dr, "traverse", map_index=0)
    assert (result["done"], result["skipped"], result["complete"]) == (events, 0, True)
    with pg_engine.connect() as conn:
        assert conn.exec_driver_sql(
            "SELECT count(*), count(DISTINCT event_seq) FROM im_outbox"
        ).one() == (events, events)


def test_barrier_times_out_listing_the_straggler(airflow_env, events):
    dr = kt.kt_barrier.test()
    assert dr.state == DagRunState.FAILED
    tis = task_instances(dr)
    assert tis["traverse[1]"].state == TaskInstanceState.FAILED
    assert all(tis[f"traverse[{i}]"].state == TaskInstanceState.SUCCESS for i in (0, 2, 3))
    ranges = xcom(dr, "plan")
    straggler = ranges[1]
    cursor = straggler["lo"] + 10  # one chunk of 10 committed, then the dependency stayed down
    for mode in ("deferred", "poke", "reschedule"):
        assert tis[f"barrier_{mode}"].state == TaskInstanceState.FAILED
        message = kt.FAILURES[f"barrier_{mode}"]
        assert message.startswith("AirflowSensorTimeout"), message
        assert (
            f"range 1 at {cursor} of {straggler['hi']} (pending, no owner, last heartbeat"
            in message
        ), message
        assert "range 0 " not in message, message
    ctl = control(airflow_env, "kt_barrier")
    assert ctl.watermark() is None and ctl.round("r1").state != "closed"


def test_marking_traverse_tasks_success_does_not_open_the_barrier(airflow_env, events):
    dr = kt.kt_barrier.test(mark_success_pattern="traverse")
    assert dr.state == DagRunState.FAILED
    tis = task_instances(dr)
    assert all(
        s.state == TaskInstanceState.SUCCESS
        for name, s in tis.items()
        if name.startswith("traverse")
    )
    for mode in ("deferred", "poke", "reschedule"):
        message = kt.FAILURES[f"barrier_{mode}"]
        assert message.startswith("AirflowSensorTimeout"), message
        assert all(
            f"range {i} at -inf" in message or f"range {i} at {r['lo']} " in message
            for i, r in enumerate(xcom(dr, "plan"))
        ), message
        assert "never claimed" in message
    assert control(airflow_env, "kt_barrier").watermark() is None


# --------------------------------------------------------------------------- bad input


def test_bad_input_fails_the_task_at_once_with_a_clear_error(airflow_env, events, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_KEYSET_HTTP_CONN", json.dumps({"conn_type": "http", "host": "example.com"})
    )
    dr = kt.kt_bad_input.test()
    assert dr.state == DagRunState.FAILED
    tis = task_instances(dr)
    assert all(
        ti.state == TaskInstanceState.FAILED and ti.try_number == 1 for ti in tis.values()
    ), tis
    failures = kt.FAILURES
    assert "KeyValidationError" in failures["non_unique_key"]
    assert "key (user_id) of 'im_events' is not unique" in failures["non_unique_key"]
    assert (
        "source connection 'keyset_no_such_conn' is not defined" in failures["missing_connection"]
    )
    assert "AIRFLOW_CONN_KEYSET_NO_SUCH_CONN" in failures["missing_connection"]
    assert (
        "source connection 'keyset_http_conn' has type 'http'" in failures["wrong_connection_type"]
    )
    assert (
        "connection 'keyset_examples_db' has type 'postgres'; it must be of type 'redis'"
        in failures["wrong_store_type"]
    )
    assert "table 'no_such_table' does not exist" in failures["missing_table"]
    for text in failures.values():
        assert "password" not in text.lower()
    # nothing was planned
    assert control(airflow_env, "kt_bad_input").open_rounds() == []


# --------------------------------------------------------------------------- small pieces


@pytest.mark.parametrize(
    ("rendered", "expected"),
    [
        ("None", None),
        ("", None),
        ("1000", "1000"),
        ('["2024-01-01T00:00:00+00:00", 0]', ["2024-01-01T00:00:00+00:00", 0]),
        ("2024-01-01 00:00:00+00:00", "2024-01-01 00:00:00+00:00"),
        (("a", 1), ["a", 1]),
        (7, 7),
    ],
)
def test_rendered_bounds_are_decoded(rendered, expected):
    assert parse_bound(rendered) == expected


def test_airflow_lists_the_provider(airflow_env):
    airflow_bin = os.path.join(os.path.dirname(sys.executable), "airflow")
    proc = subprocess.run(
        [airflow_bin, "providers", "list", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert any(p["package_name"] == "airflow-keyset-provider" for p in listed), listed


# --------------------------------------------------------------------------- outside dag.test


def _round_with_dead_letters(env: dict[str, Any], schema_url: str, stream: str) -> KeysetTraversal:
    """A round over im_events whose every range is traversed; keys divisible by 50 dead-lettered."""
    t = KeysetTraversal(
        schema_url, "im_events", "seq", env["redis_url"], stream=stream, key_prefix=env["prefix"]
    )
    rnd = t.plan(max_ranges=3, new_stream=True)

    def poison(chunk: Any) -> Any:
        from airflow_keyset_provider import ChunkResult

        return ChunkResult(failed={k: "poison" for k in chunk.keys if k % 50 == 0})

    for spec in rnd.ranges:
        t.traverse(
            rnd.round_id,
            spec.range_id,
            poison,
            chunk_size=40,
            max_item_attempts=1,
            item_retry_delay=0.01,
        )
    return t


def test_too_many_dead_letters_fail_the_barrier_without_moving_the_watermark(
    airflow_env, events, pg_schema_url
):
    from airflow.sdk import PokeReturnValue
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_keyset_provider import BarrierSensor

    t = _round_with_dead_letters(airflow_env, pg_schema_url, "kt_dead")
    common = {"round_id": "r1", "stream": "kt_dead", "key_prefix": airflow_env["prefix"]}
    with pytest.raises(
        AirflowFailException, match=r"6 item\(s\) dead-lettered .* more than max_dead_letters=5"
    ):
        BarrierSensor(task_id="barrier", max_dead_letters=5, **common).poke({})
    assert t.watermark() is None and t.round("r1").state != "closed"

    done = BarrierSensor(task_id="barrier", max_dead_letters=6, **common).poke({})
    assert isinstance(done, PokeReturnValue) and done.is_done
    assert {k: done.xcom_value[k] for k in ("done", "skipped", "dead", "watermark")} == {
        "done": events - 6,
        "skipped": 0,
        "dead": 6,
        "watermark": events,
    }
    t.close()


def test_on_kill_commits_the_chunk_in_hand_and_the_next_try_resumes(
    airflow_env, events, pg_schema_url
):
    from airflow.sdk.exceptions import AirflowException

    from airflow_keyset_provider import TraverseRangeOperator

    t = KeysetTraversal(
        pg_schema_url,
        "im_events",
        "seq",
        airflow_env["redis_url"],
        stream="kt_kill",
        key_prefix=airflow_env["prefix"],
    )
    t.plan(max_ranges=1, new_stream=True)
    seen: list[int] = []
    third_chunk = threading.Event()

    def slow(chunk: Any) -> None:
        seen.extend(chunk.keys)
        if len(seen) >= 30:
            third_chunk.set()
        time.sleep(0.05)

    op = TraverseRangeOperator(
        task_id="traverse",
        round_id="r1",
        range_id=0,
        lo=None,
        hi=events,
        processor=slow,
        source_conn_id="keyset_examples_db",
        table="im_events",
        key="seq",
        stream="kt_kill",
        key_prefix=airflow_env["prefix"],
        chunk_size=10,
    )

    def context(try_number: int) -> dict[str, Any]:
        ti = SimpleNamespace(
            dag_id="kt_kill",
            run_id="manual_1",
            task_id="traverse",
            map_index=0,
            try_number=try_number,
        )
        return {"ti": ti}

    outcome: list[BaseException | dict[str, Any]] = []

    def first_try() -> None:
        try:
            outcome.append(op.execute(context(1)))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=first_try)
    worker.start()
    assert third_chunk.wait(30)
    op.on_kill()
    worker.join(30)
    [stopped] = outcome
    assert isinstance(stopped, AirflowException) and "stopped on request" in str(stopped)
    [status] = t.range_status("r1")
    assert status["owner"] == "" and status["state"] != "complete"
    assert status["cursor"] == len(seen)  # the chunk in hand was committed, nothing after it

    seen.clear()
    result = op.execute(context(2))
    assert result["complete"] and result["done"] == events
    assert seen[0] == status["cursor"] + 1  # resumed right after the committed cursor
    t.close()


# --------------------------------------------------------------------------- Redis state loss


def test_redis_state_loss_is_restored_from_the_checkpoint_mirror(airflow_env, events, pg_engine):
    dr = kt.kt_state_loss.test()
    assert dr.state == DagRunState.SUCCESS, (task_instances(dr), kt.FAILURES)
    totals = xcom(dr, "barrier")
    # every key reached a terminal state exactly once in the counters; the chunks committed after
    # the last checkpoint were delivered again (redispatch counts a repeat as skipped)
    assert totals["done"] + totals["skipped"] == events and totals["dead"] == 0
    with pg_engine.connect() as conn:
        assert (
            conn.exec_driver_sql("SELECT count(DISTINCT event_seq) FROM im_outbox").scalar()
            == events
        )
        mirrored = conn.exec_driver_sql(
            "SELECT count(*) FROM keyset_checkpoints WHERE stream = 'kt_state_loss'"
        )
        assert mirrored.scalar() >= 3  # the round, its ranges, the watermark
    ctl = control(airflow_env, "kt_state_loss")
    assert ctl.watermark() == events
    restored = ctl.store.client.hget(ctl.store.range_key(totals["round_id"], 0), "restored")
    assert restored == b"1", "range 0 should have been rebuilt from the mirror after the flush"


def test_the_barrier_retries_by_default_and_a_retry_returns_the_same_totals(
    airflow_env, events, pg_schema_url
):
    """Without ``retries``/``retry_delay`` (on the task or in ``default_args``) the barrier gets
    2 retries 10 s apart: Airflow 3.3 can fail a deferred try whose trigger fired within seconds
    (apache/airflow#72716), and a retry closes the same round with the same totals."""
    import datetime as dt

    from airflow.sdk import DAG

    from airflow_keyset_provider import BarrierSensor

    b = BarrierSensor(task_id="b", round_id="r1")
    assert (b.retries, b.retry_delay) == (2, dt.timedelta(seconds=10))
    assert BarrierSensor(task_id="b", round_id="r1", retries=0).retries == 0
    with DAG("kt_barrier_defaults", schedule=None, default_args={"retries": 5}):
        assert BarrierSensor(task_id="b", round_id="r1").retries == 5

    t = _round_with_dead_letters(airflow_env, pg_schema_url, "kt_retry")
    common = {"round_id": "r1", "stream": "kt_retry", "key_prefix": airflow_env["prefix"]}
    first = BarrierSensor(task_id="barrier", **common).poke({})
    again = BarrierSensor(task_id="barrier", **common).poke({})  # the retried try
    assert first.xcom_value == again.xcom_value and first.xcom_value["done"] == events - 6
    t.close()
