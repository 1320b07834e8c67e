"""``airflow-keyset replay-dead-letters --dag-id``: dead letters replayed through the DAG's own task
definition, on real PostgreSQL + Redis.

- The decorator form (``@task.keyset_traverse(target_conn_id=...)``, the docs' flagship example):
  the round's letters (rows a trigger refused) are replayed through the decorated function and its
  target connection once the trigger is gone; the old CLI had no way to give the target and
  called the task object with a chunk (``TypeError: expected XComArg or list[dict]``).
- The operator form (``TraverseRangeOperator.partial(processor="mod:fn", target_conn_id=...,
  exactly_once=True)``): the replay writes through the target with the range's ledger row.
- The rows come from the DAG: a ``where`` planted in the round's Redis record is refused.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import postgres_conn
from test_decorator import REFUSE_TRIGGER, make_orders
from test_example_dags import states, xcom

from airflow_keyset_provider.cli import EXIT_OK, EXIT_USAGE, main

pytestmark = pytest.mark.airflow

FROZEN = {101, 1202, 1203, 2498}


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return main(list(argv), stdout=out, stderr=err), out.getvalue(), err.getvalue()


def test_a_decorator_round_is_replayed_through_the_dags_function_and_target(
    airflow_env, pg_url, pg_engine, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_ORDERS_DB", postgres_conn(pg_url, airflow_env["schema"]))
    make_orders(pg_engine, 2500)
    with pg_engine.begin() as c:
        c.exec_driver_sql(REFUSE_TRIGGER)
    import cancel_stale_orders as module

    dr = module.dag.test()
    assert dr.state == "success", states(dr)
    assert xcom(dr, "cancel_stale.barrier")["dead"] == 4
    round_id = xcom(dr, "cancel_stale.plan", key="keyset_round")["round_id"]
    replay = ["replay-dead-letters", "cancel_stale_orders", round_id, "--json"]
    replay += ["--dag-id", "cancel_stale_orders", "--dag-file", module.__file__]

    # the trigger still refuses: a range whose letters all fail at once reads as a failed
    # dependency, the replay fails and puts its letters back, as they were, and says so
    letters = ["dead-letters", "cancel_stale_orders", round_id, "--json"]
    letters += ["--redis-conn-id", "redis_default", "--key-prefix", airflow_env["prefix"]]
    before = json.loads(cli(*letters)[1])
    code, out, err = cli(*replay, "--item-retry-delay", "0", "--retry-budget-seconds", "2")
    assert code == 1 and "dead letters again, as they were" in err, err
    after = json.loads(cli(*letters)[1])
    assert after["dead_total"] == 4
    assert {str(d["key"]) + d["error"] for d in after["dead_letters"]} == {
        str(d["key"]) + d["error"] for d in before["dead_letters"]
    }
    with pg_engine.begin() as c:
        c.exec_driver_sql("DROP TRIGGER orders_refuse_frozen ON orders")
    code, out, err = cli(*replay, "--item-retry-delay", "0")
    assert code == EXIT_OK, err
    assert json.loads(out)["still_dead"] == 0
    with pg_engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, status, cancel_reason FROM orders WHERE id IN :ids"),
                         {"ids": tuple(FROZEN)}).all()  # fmt: skip
    assert {i for i, s, r in rows if s == "CANCELLED" and r.startswith("unpaid since")} == FROZEN
    code, out, err = cli(*replay[:-4], "--dag-id", "cancel_stale_orders", "--task-id", "nope",
                         "--dag-file", module.__file__)  # fmt: skip
    assert code == 5 and "traverse tasks: cancel_stale.traverse" in err, err


OPERATOR_DAG = """
import datetime as dt
from airflow.sdk import DAG
from airflow_keyset_provider.operators.plan import PlanRangesOperator
from airflow_keyset_provider.operators.traverse import TraverseRangeOperator

with DAG("{dag_id}", schedule=None, start_date=dt.datetime(2026, 1, 1)) as dag:
    plan = PlanRangesOperator(
        task_id="plan", source_conn_id="replay_src", table="events", key="seq",
        where="seq <= 390", key_prefix="{prefix}", max_ranges=2,
    )
    plan >> TraverseRangeOperator.partial(
        task_id="traverse", processor="{module}:copy_out", target_conn_id="replay_src",
        exactly_once=True, chunk_size=25,
    ).expand_kwargs(plan.output)
"""

PROCESSOR = """
import sqlalchemy as sa
from airflow_keyset_provider import ChunkResult

BROKEN = {broken}

def copy_out(chunk):
    bad = {{k for k in chunk.keys if BROKEN and k % 37 == 0}}
    good = [{{"s": k}} for k in chunk.keys if k not in bad]
    if good:
        chunk.connection.execute(sa.text("INSERT INTO outbox VALUES (:s) ON CONFLICT DO NOTHING"), good)
    return ChunkResult(failed={{k: "poison" for k in bad}})
"""


def test_an_operator_round_is_replayed_with_the_dags_target_and_exactly_once(
    airflow_env, pg_url, pg_engine, pg_schema_url, redis_url, tmp_path: Path, monkeypatch
):
    schema, prefix = airflow_env["schema"], airflow_env["prefix"]
    monkeypatch.setenv("AIRFLOW_CONN_REPLAY_SRC", postgres_conn(pg_url, schema))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)")
        c.exec_driver_sql("INSERT INTO events SELECT g, 'e' || g FROM generate_series(1, 400) g")
        c.exec_driver_sql("CREATE TABLE outbox (seq bigint PRIMARY KEY)")
    module = f"replay_proc_{prefix}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROCESSOR.format(broken="True")))
    dag_file = tmp_path / "replay_operator_dag.py"
    dag_file.write_text(OPERATOR_DAG.format(dag_id="replay_operator", prefix=prefix, module=module))

    # the round as the DAG plans it, traversed with the broken processor: 10 letters
    from airflow_keyset_provider.hooks.keyset import KeysetHook

    hook = KeysetHook("replay_src", "redis_default", target_conn_id="replay_src")
    t = hook.traversal(table="events", key="seq", stream="replay_operator", where="seq <= 390",
                       key_prefix=prefix)  # fmt: skip
    rnd = t.plan(max_ranges=2, new_stream=True)
    proc = __import__(module).copy_out
    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, proc, chunk_size=25, item_retry_delay=0)
    assert sum(len(t.dead_letters(rnd.round_id, s.range_id)) for s in rnd.ranges) == 10
    assert not sa.inspect(pg_engine).has_table("keyset_ledger", schema=schema)

    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROCESSOR.format(broken="False")))
    import importlib

    importlib.reload(__import__(module))
    replay = ["replay-dead-letters", "replay_operator", rnd.round_id, "--json"]
    replay += ["--dag-id", "replay_operator", "--dag-file", str(dag_file)]
    # Redis is not a source of SQL: a where planted in the round's record is refused
    store = t.store
    doc = json.loads(store.client.hget(store.round_key(rnd.round_id), "source"))
    store.client.hset(store.round_key(rnd.round_id), "source",
                      json.dumps({**doc, "where": "seq <= 400"}, sort_keys=True))  # fmt: skip
    code, _, err = cli(*replay)
    assert code == EXIT_USAGE and "planned over" in err, err
    store.client.hset(store.round_key(rnd.round_id), "source", json.dumps(doc, sort_keys=True))

    code, out, err = cli(*replay, "--item-retry-delay", "0")
    assert code == EXIT_OK and json.loads(out)["still_dead"] == 0, err
    with pg_engine.connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM outbox").scalar() == 390
        ledger = c.exec_driver_sql("SELECT count(*) FROM keyset_ledger").scalar()
    assert ledger >= 1  # no ledger before: the DAG's exactly_once reached the replay
    t.close()


def test_the_pages_replay_finds_the_dag_by_its_recorded_file_and_runs_its_task(
    airflow_env, pg_url, pg_engine, monkeypatch
):
    """What the Keyset page's Replay button runs (``plugins/replays.replay_range``), outside the
    API server: the DAG is the one the round's key names, found through the file Airflow's
    metadata database records for it; the decorated function and its target connection replay
    the letters on PostgreSQL."""
    from airflow_keyset_provider.hooks.keyset import KeysetHook
    from airflow_keyset_provider.plugins import replays

    monkeypatch.setenv("AIRFLOW_CONN_ORDERS_DB", postgres_conn(pg_url, airflow_env["schema"]))
    make_orders(pg_engine, 2500)
    with pg_engine.begin() as c:
        c.exec_driver_sql(REFUSE_TRIGGER)
    import cancel_stale_orders as module

    dr = module.dag.test()
    assert dr.state == "success", states(dr)
    round_id = xcom(dr, "cancel_stale.plan", key="keyset_round")["round_id"]
    n_ranges = xcom(dr, "cancel_stale.plan", key="keyset_round")["ranges"]
    recorded = replays._dag_file("cancel_stale_orders")
    assert recorded is not None and Path(recorded).name == "cancel_stale_orders.py", recorded
    assert replays._dag_file("no_such_dag") is None

    client = KeysetHook(redis_conn_id="redis_default").redis_client()
    asked: list[str] = []

    def replay(range_id: int) -> dict:
        return replays.replay_range(
            client, airflow_env["prefix"], "cancel_stale_orders", round_id, range_id,
            conn_id="redis_default", who="test", authorize=asked.append, wait_s=300,
        )  # fmt: skip

    def dead() -> int:
        return sum(len(t.dead_letters(round_id, i)) for i in range(n_ranges))

    hook = KeysetHook("orders_db", "redis_default")
    t = hook.traversal(
        table="orders", key=["created_at", "id"], stream="cancel_stale_orders",
        key_prefix=airflow_env["prefix"],
    )  # fmt: skip
    # (a failing replay puts the letters back: tests/ui/test_ui_replay.py, through the API server)
    assert dead() == 4
    with pg_engine.begin() as c:
        c.exec_driver_sql("DROP TRIGGER orders_refuse_frozen ON orders")
    answers = {i: replay(i) for i in range(n_ranges)}
    with_letters = [i for i, a in answers.items() if a["state"] != "nothing"]
    again = [answers[i] for i in with_letters]
    assert with_letters and [a["state"] for a in again] == ["succeeded"] * len(again), answers
    assert dead() == 0
    t.close()
    assert all(a["task_id"] == "cancel_stale.traverse" for a in again), again
    assert set(asked) == {"cancel_stale_orders"}  # the planning DAG's edit right was asked
    with pg_engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, status FROM orders WHERE id IN :ids"),
                         {"ids": tuple(FROZEN)}).all()  # fmt: skip
    assert {i for i, s in rows if s == "CANCELLED"} == FROZEN
