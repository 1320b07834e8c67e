"""DAGs that only the Airflow tests run (linked into the throwaway DAGs folder by conftest.py).

They reuse the nightly example's table and processor and add the faults the tests need: a plan
task that fails its first try after planning, a range that dies in the middle of its first try,
a range that never finishes, and tasks configured with bad input. Failures are recorded in
``FAILURES`` (task id -> exception text) by ``on_failure_callback``; tests read it back, since
``dag.test()`` runs every task in the test's own process.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from airflow.sdk import DAG, Context
from keyset_examples_common import (
    EVENTS_TABLE,
    KEY_PREFIX,
    REDIS_CONN_ID,
    SOURCE_CONN_ID,
    redispatch,
)

from airflow_keyset_provider import (
    BarrierSensor,
    Chunk,
    ChunkResult,
    PlanRangesOperator,
    TraverseRangeOperator,
    stream_asset,
)
from airflow_keyset_provider.core import RetryableError

START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
NO_DELAY = dt.timedelta(0)

FAILURES: dict[str, str] = {}
DELIVERIES: Counter[tuple[str, int]] = Counter()  # (round, range) -> chunks handed to a processor
CRASHED: set[tuple[str, int]] = set()


def reset() -> None:
    RESUMED.clear()
    FAILURES.clear()
    DELIVERIES.clear()
    CRASHED.clear()


def record_failure(context: Context) -> None:
    ti = context["ti"]
    name = ti.task_id if ti.map_index in (-1, None) else f"{ti.task_id}[{ti.map_index}]"
    FAILURES[name] = f"{type(context.get('exception')).__name__}: {context.get('exception')}"


def crash_once_in_range_0(chunk: Chunk) -> ChunkResult:
    """The first time range 0 gets its third chunk, write it and then die before the commit."""
    where = (chunk.round_id, chunk.range_id)
    DELIVERIES[where] += 1
    result = redispatch(chunk)
    if chunk.range_id == 0 and DELIVERIES[where] == 3 and where not in CRASHED:
        CRASHED.add(where)
        # an outage (not an unexpected error: that one would be isolated, and its halves succeed)
        raise RetryableError("simulated worker crash after the chunk's side effects")
    return result


def range_1_never_finishes(chunk: Chunk) -> ChunkResult:
    """Range 1 processes one chunk, then its dependency stays down."""
    where = (chunk.round_id, chunk.range_id)
    DELIVERIES[where] += 1
    if chunk.range_id == 1 and DELIVERIES[where] > 1:
        raise RetryableError("downstream service unavailable")
    return redispatch(chunk)


class PlanFailingFirstTry(PlanRangesOperator):
    """Plans, then fails its first try (as if the worker died before reporting success)."""

    def execute(self, context: Context) -> list[dict[str, Any]]:
        ranges = super().execute(context)
        if context["ti"].try_number == 1:
            raise RuntimeError("simulated failure after planning")
        return ranges


def _plan(cls: type[PlanRangesOperator] = PlanRangesOperator, **kwargs: Any) -> PlanRangesOperator:
    params: dict[str, Any] = {
        "task_id": "plan",
        "source_conn_id": SOURCE_CONN_ID,
        "table": EVENTS_TABLE,
        "key": "seq",
        "columns": ["user_id", "kind", "payload"],
        "redis_conn_id": REDIS_CONN_ID,
        "key_prefix": KEY_PREFIX,
        "max_ranges": 4,
        "on_failure_callback": record_failure,
    }
    return cls(**{**params, **kwargs})


# Retries: the plan fails once after planning, range 0 dies after 2 committed chunks; the retries
# must reuse the round and resume from the cursor; the deferrable barrier then closes the round.
with DAG("kt_retry", schedule=None, start_date=START, catchup=False) as kt_retry:
    plan = _plan(PlanFailingFirstTry, retries=1, retry_delay=NO_DELAY)
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=crash_once_in_range_0,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=20,
        max_chunk_attempts=1,
        retries=1,
        retry_delay=NO_DELAY,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> traverse >> barrier

# Barriers that must not open: range 1 never finishes (or every traverse task is marked success
# without running). The barriers run whatever the traverse tasks' states are (all_done), once
# deferred to the trigger, poking, rescheduled; each must time out listing the lagging ranges.
with DAG("kt_barrier", schedule=None, start_date=START, catchup=False) as kt_barrier:
    plan = _plan()
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=range_1_never_finishes,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=10,
        max_chunk_attempts=1,
        retries=0,
    ).expand_kwargs(plan.output)
    barriers = [
        BarrierSensor(
            task_id=f"barrier_{mode}",
            plan_task_id="plan",
            redis_conn_id=REDIS_CONN_ID,
            deferrable=mode == "deferred",
            mode="reschedule" if mode == "reschedule" else "poke",
            poke_interval=0.5,
            timeout=2,
            trigger_rule="all_done",
            on_failure_callback=record_failure,
        )
        for mode in ("deferred", "poke", "reschedule")
    ]
    plan >> traverse >> barriers

# Bad input: each plan task must fail at once with the engine's (or the hook's) clear error.
with DAG("kt_bad_input", schedule=None, start_date=START, catchup=False) as kt_bad_input:
    _plan(task_id="non_unique_key", key="user_id")
    _plan(task_id="missing_connection", source_conn_id="keyset_no_such_conn")
    _plan(task_id="wrong_connection_type", source_conn_id="keyset_http_conn")
    _plan(task_id="wrong_store_type", redis_conn_id=SOURCE_CONN_ID)
    _plan(task_id="missing_table", table="no_such_table", retries=2)

# A deferrable barrier that must wait in the trigger: nothing in this DAG traverses the round; the
# test traverses it from another thread once the trigger listens, as workers elsewhere would.
with DAG("kt_defer", schedule=None, start_date=START, catchup=False) as kt_defer:
    _plan() >> BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=2,
        timeout=60,
        on_failure_callback=record_failure,
    )


def flush_redis_once(chunk: Chunk) -> ChunkResult:
    """Redis restarts without persistence while range 0 is mid-way: every key of the stream is gone."""
    where = (chunk.round_id, chunk.range_id)
    DELIVERIES[where] += 1
    result = redispatch(chunk)
    if chunk.range_id == 0 and DELIVERIES[where] == 3 and where not in CRASHED:
        CRASHED.add(where)
        import redis as redis_py
        from airflow.providers.redis.hooks.redis import RedisHook

        client: redis_py.Redis = RedisHook(redis_conn_id=REDIS_CONN_ID).get_conn()
        for k in list(client.scan_iter(f"{KEY_PREFIX}:{{kt_state_loss}}:*")):
            client.delete(k)
    return result


# Redis loses the stream mid-round; with a checkpoint mirror (here in the source database) the
# round is restored with bounded replay and the barrier still proves exact coverage.
with DAG("kt_state_loss", schedule=None, start_date=START, catchup=False) as kt_state_loss:
    plan = _plan(checkpoint_conn_id=SOURCE_CONN_ID, max_ranges=2)
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=flush_redis_once,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=20,
        retries=1,
        retry_delay=NO_DELAY,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> traverse >> barrier

# The deferrable path with an asset outlet: the barrier waits in its trigger while the round is
# traversed elsewhere, then closes it in execute_complete and must still put it on the asset.
with DAG("kt_defer_asset", schedule=None, start_date=START, catchup=False) as kt_defer_asset:
    _plan(stream="kt_defer_asset") >> BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        deferrable=True,
        poke_interval=2,
        timeout=60,
        outlets=[stream_asset("kt_defer_asset")],
        on_failure_callback=record_failure,
    )


# Pressure control: a traverse task that must not wait in its worker slot. ``RESUMED`` records
# each return from ``KeysetResumeTrigger`` (what the task waited for).
RESUMED: list[str] = []


class TraverseRecordingResumes(TraverseRangeOperator):
    def execute_resume(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        RESUMED.append((event or {}).get("wait_for", "?"))
        return super().execute_resume(context, event)


def _store() -> Any:
    import redis as redis_py
    from airflow.providers.redis.hooks.redis import RedisHook

    from airflow_keyset_provider.core.store.cursor_store import CursorStore

    client: redis_py.Redis = RedisHook(redis_conn_id=REDIS_CONN_ID).get_conn()
    return lambda stream: CursorStore(client, stream, prefix=KEY_PREFIX)


class PlanThenHoldRange0(PlanRangesOperator):
    """Plans, then a stray worker elsewhere claims range 0 with an 8 s lease it never renews."""

    def execute(self, context: Context) -> list[dict[str, Any]]:
        ranges = super().execute(context)
        _store()(ranges[0]["stream"]).claim(ranges[0]["round_id"], 0, "stray#1", "elsewhere", 8000)
        return ranges


def pause_after_second_chunk(chunk: Chunk) -> ChunkResult:
    """Range 0's second chunk pauses the stream; an operator resumes it 2 s later."""
    import threading
    import time

    from airflow_keyset_provider.core.pace.stream_control import StreamSwitch

    where = (chunk.round_id, chunk.range_id)
    DELIVERIES[where] += 1
    if DELIVERIES[where] == 2 and where not in CRASHED:
        CRASHED.add(where)
        switch = StreamSwitch(_store()("kt_pause"))
        switch.pause("test: pause mid-range", by="kt_pause")
        threading.Timer(2.0, switch.resume).start()
    time.sleep(0.1)  # slower than the 0.2 s control poll: the pause is noticed mid-range
    return redispatch(chunk)


with DAG("kt_held", schedule=None, start_date=START, catchup=False) as kt_held:
    plan = _plan(PlanThenHoldRange0, max_ranges=1)
    plan >> TraverseRecordingResumes.partial(
        task_id="traverse",
        processor=redispatch,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=50,
        defer_after_seconds=0.5,
        resume_poll_seconds=0.5,
        on_failure_callback=record_failure,
    ).expand_kwargs(plan.output)

with DAG("kt_pause", schedule=None, start_date=START, catchup=False) as kt_pause:
    plan = _plan(max_ranges=1)
    plan >> TraverseRecordingResumes.partial(
        task_id="traverse",
        processor=pause_after_second_chunk,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=20,
        control_poll_seconds=0.2,
        resume_poll_seconds=0.5,
        prefetch=False,
        on_failure_callback=record_failure,
    ).expand_kwargs(plan.output)


# Durable by default (core/rounds/durability.py): no checkpoint mirror; the plan reads the stream's
# record in Airflow's asset state (keyset://kt_durable, an inlet it declares itself) when Redis lost
# the stream. SEEN counts every key delivered; LOSE_AT set by a test makes Redis lose the stream's
# keys after that many chunks of range 0 (mid-round).
SEEN: Counter[int] = Counter()
LOSE_AT: dict[str, int] = {}


def forget_stream(stream: str) -> int:
    """Redis loses every key of ``stream`` under the examples' prefix (not the shared db)."""
    from airflow.providers.redis.hooks.redis import RedisHook

    client = RedisHook(redis_conn_id=REDIS_CONN_ID).get_conn()
    keys = list(client.scan_iter(f"{KEY_PREFIX}:{{{stream}}}:*"))
    return int(client.delete(*keys)) if keys else 0


def count_and_maybe_lose(chunk: Chunk) -> None:
    if chunk.range_id == 0 and "chunks" in LOSE_AT:
        LOSE_AT["chunks"] -= 1
        if LOSE_AT["chunks"] < 0:
            LOSE_AT.clear()
            forget_stream("kt_durable")  # this chunk's commit then finds no state
    SEEN.update(chunk.keys)


with DAG("kt_durable", schedule=None, start_date=START, catchup=False) as kt_durable:
    plan = _plan(max_ranges=2, columns=None)
    traverse = TraverseRangeOperator.partial(
        task_id="traverse",
        processor=count_and_maybe_lose,
        redis_conn_id=REDIS_CONN_ID,
        chunk_size=20,
        retries=0,
        on_failure_callback=record_failure,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(
        task_id="barrier",
        plan_task_id="plan",
        redis_conn_id=REDIS_CONN_ID,
        poke_interval=0.5,
        timeout=60,
    )
    plan >> traverse >> barrier
