"""A nightly round whose ranges share one Airflow pool with every other writer of the same database."""

import datetime as dt

from airflow.sdk import DAG

from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator

with DAG(
    dag_id="coupons_expiry",
    schedule="@daily",
    start_date=dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,  # rounds chain by watermark: one night at a time
) as dag:
    plan = PlanRangesOperator(
        task_id="plan",
        source_conn_id="coupons_db",
        table="coupons",
        key="id",
        columns=["currency"],
        redis_conn_id="keyset_redis",
        max_ranges=16,
    )
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor="coupon_processors:expire_coupons",
        redis_conn_id="keyset_redis",
        chunk_size=1000,
        pool="coupons_db_writers",  # the global gate: a slot is taken before the range is claimed
        max_active_tis_per_dagrun=4,  # and at most 4 ranges of this run at once
        retries=3,
        retry_delay=dt.timedelta(minutes=2),
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id="keyset_redis",
        deferrable=True,  # waits in the triggerer, not in a worker slot or a pool slot
        max_dead_letters=100,  # more than that: fail without closing; the watermark stays
        poke_interval=60,
        timeout=6 * 3600,
    )
    plan >> traverse >> barrier
