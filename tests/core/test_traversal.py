"""The engine's guarantees, each against real PostgreSQL (or SQLite) and real Redis."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter

import pytest
import sqlalchemy as sa
from core_support import Recorder, make_events, run_all, traversal

from airflow_keyset_provider import ChunkResult, RetryableError
from airflow_keyset_provider.core import (
    ConfigurationError,
    DependencyFailedError,
    KeysetTraversal,
    KeyValidationError,
    LeaseHeldError,
    LeaseLostError,
    RoundIncompleteError,
    StoreUnavailableError,
    TraverseOptions,
)


class Crash(BaseException):
    """Escapes every handler, like a process dying mid-chunk."""


def test_exact_cover_with_gaps_while_rows_change(pg_engine, pg_schema_url, redis_url, key_prefix):
    keys = [k for k in range(1, 30_000) if k % 7 and k % 11]  # sequence gaps
    make_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=5, new_stream=True)
    assert rnd.end_key == keys[-1] and rnd.start_key is None
    assert len(rnd.ranges) == 5
    deleted = set(keys[5000:5100])
    rec = Recorder()

    def proc(chunk):
        rec(chunk)
        if len(rec.chunks) == 2:  # rows change under the traversal
            with pg_engine.begin() as c:
                c.execute(sa.text("INSERT INTO events VALUES (40000, 'late'), (40001, 'late')"))
                c.execute(sa.text("DELETE FROM events WHERE seq = ANY(:d)"), {"d": sorted(deleted)})

    run_all(t, rnd, proc, chunk_size=997)
    expected = set(keys) - deleted
    assert (
        set(rec.seen) == expected
    )  # inserted after the plan: next round; deleted: simply not seen
    assert max(rec.seen.values()) == 1
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(expected), 0, 0)
    assert t.watermark() == keys[-1]

    nxt = t.plan(max_ranges=3, new_stream=True)  # the next round continues at the watermark
    rec2 = Recorder()
    run_all(t, nxt, rec2)
    assert sorted(rec2.seen) == [40000, 40001]
    assert t.close_round(nxt.round_id).done == 2


def test_plan_is_idempotent_while_round_open(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, list(range(1, 1000)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    first = t.plan(max_ranges=4, new_stream=True)
    with pg_engine.begin() as c:
        c.execute(sa.text("INSERT INTO events VALUES (5000, 'x')"))
    again = t.plan(max_ranges=2, new_stream=True)
    assert again.round_id == first.round_id and again.ranges == first.ranges and not again.created
    keyed = t.plan(max_ranges=2, start_key=10, end_key=20, round_key="run-1")
    assert (
        t.plan(max_ranges=2, start_key=10, end_key=20, round_key="run-1").round_id == keyed.round_id
    )


def test_composite_timestamptz_bigint_key(pg_engine, pg_schema_url, redis_url, key_prefix):
    base = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE orders (created_at timestamptz NOT NULL, id bigint NOT NULL, "
                "status text NOT NULL, PRIMARY KEY (created_at, id))"
            )
        )
        rows = [
            {"t": base + dt.timedelta(seconds=i // 3), "i": i, "s": "PENDING"} for i in range(6000)
        ]
        c.execute(sa.text("INSERT INTO orders VALUES (:t, :i, :s)"), rows)
    t = KeysetTraversal(
        pg_schema_url,
        table="orders",
        key=["created_at", "id"],
        columns=["status"],
        redis_url=redis_url,
        stream="orders",
        key_prefix=key_prefix,
    )
    start = (base + dt.timedelta(seconds=100), 0)
    end = (base + dt.timedelta(seconds=1500), 0)
    rnd = t.plan(max_ranges=4, start_key=start, end_key=end)
    assert rnd.start_key == start and rnd.end_key == end
    rec = Recorder()
    statuses = set()

    def proc(chunk):
        rec(chunk)
        statuses.update(r["status"] for r in chunk.rows)

    run_all(t, rnd, proc, chunk_size=333)
    expected = {(r["t"], r["i"]) for r in rows if start < (r["t"], r["i"]) <= end}
    assert set(rec.seen) == expected and max(rec.seen.values()) == 1
    assert statuses == {"PENDING"}
    assert t.close_round(rnd.round_id).done == len(expected)


def test_crash_mid_range_replays_at_most_one_chunk(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, list(range(1, 5001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()

    def crashing(chunk):
        rec(chunk)  # the side effect happens...
        if len(rec.chunks) == 4:
            raise Crash("process died between side effect and cursor commit")

    with pytest.raises(Crash):
        t.traverse(rnd.round_id, 0, crashing, chunk_size=500, owner_lineage="task-a")
    state = t.range_status(rnd.round_id)[0]
    assert (
        state["cursor"] == 1500 and state["done"] == 1500
    )  # three chunks committed, the fourth not
    res = t.traverse(rnd.round_id, 0, rec, chunk_size=500, owner_lineage="task-a")
    replayed = [k for k, n in rec.seen.items() if n > 1]
    assert len(replayed) <= 500 and replayed == list(range(1501, 2001))
    assert set(rec.seen) == set(range(1, 5001))
    assert (res.done, res.skipped, res.dead, res.complete) == (5000, 0, 0, True)  # counters exact


def test_new_owner_waits_for_lease_then_takes_over_and_stale_owner_is_fenced(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 3001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    store = t.store
    # worker A claims and commits one chunk, then stalls past its lease (no heartbeats)
    claim_a = store.claim(rnd.round_id, 0, "A#1", "", 1000)
    store.advance(
        rnd.round_id,
        0,
        "A#1",
        claim_a.cursor,
        t.source.encode((100,)),
        done=100,
        skipped=0,
        lease_ms=1000,
        max_item_attempts=3,
    )
    started = time.monotonic()
    res = t.traverse(
        rnd.round_id, 0, Recorder(), chunk_size=1000, lease_seconds=2
    )  # B waits, then takes over
    assert time.monotonic() - started >= 0.5
    assert res.complete and res.takeover and res.done == 3000
    # A wakes up and tries to commit its in-flight chunk: refused, nothing moves
    with pytest.raises(LeaseLostError):
        store.advance(
            rnd.round_id,
            0,
            "A#1",
            t.source.encode((100,)),
            t.source.encode((200,)),
            done=100,
            skipped=0,
            lease_ms=1000,
            max_item_attempts=3,
        )
    state = t.range_status(rnd.round_id)[0]
    assert state["cursor"] == 3000 and state["done"] == 3000


def test_dependency_failure_keeps_cursor_and_deadletters_nothing(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 2001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    cursors = []
    calls = {"n": 0}

    def flaky(chunk):
        calls["n"] += 1
        if chunk.keys[0] == 1001 and calls["n"] < 6:  # the dependency is down for a while
            cursors.append(t.range_status(rnd.round_id)[0]["cursor"])
            raise RetryableError("payments API 503")

    res = t.traverse(
        rnd.round_id, 0, flaky, chunk_size=500, backoff_base=0.01, max_chunk_attempts=10
    )
    assert cursors == [1000] * 3  # cursor stayed while the dependency was down
    assert (res.done, res.dead, res.complete) == (2000, 0, True)


def test_outage_budget_exhausted_raises_and_never_completes(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 1001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)

    def down(chunk):
        return ChunkResult(
            failed={k: "connection refused" for k in chunk.keys}
        )  # every item "fails"

    with pytest.raises(DependencyFailedError, match="cursor stays"):
        t.traverse(rnd.round_id, 0, down, chunk_size=100, backoff_base=0.01, max_chunk_attempts=3)
    state = t.range_status(rnd.round_id)[0]
    assert (state["cursor"], state["dead"], state["state"]) == (None, 0, "pending")
    with pytest.raises(RoundIncompleteError, match="range 0"):
        t.close_round(rnd.round_id)
    assert (
        t.traverse(rnd.round_id, 0, Recorder(), chunk_size=100).done == 1000
    )  # recovery finishes it


def test_poison_item_dead_lettered_while_neighbours_complete(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 1001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    attempts = Counter()

    def proc(chunk):
        attempts.update(k for k in chunk.keys if k in (13, 700))
        return ChunkResult(
            failed={k: f"bad payload in event {k}" for k in chunk.keys if k in (13, 700)},
            skipped=[k for k in chunk.keys if k == 500],
        )

    res = t.traverse(
        rnd.round_id, 0, proc, chunk_size=100, max_item_attempts=3, item_retry_delay=0.01
    )
    assert (res.done, res.skipped, res.dead, res.complete) == (997, 1, 2, True)
    assert attempts == {13: 3, 700: 3}
    dead = t.dead_letters(rnd.round_id, 0)
    assert {(d["key"], d["error"], d["attempts"]) for d in dead} == {
        (13, "bad payload in event 13", 3),
        (700, "bad payload in event 700", 3),
    }
    assert t.close_round(rnd.round_id).dead == 2


def test_sqlite_source_end_to_end(sqlite_url, redis_url, key_prefix):
    eng = sa.create_engine(sqlite_url)
    with eng.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq INTEGER PRIMARY KEY, payload TEXT NOT NULL)"))
        c.execute(
            sa.text("INSERT INTO events VALUES (:s, 'x')"), [{"s": s} for s in range(1, 20001, 2)]
        )
    t = traversal(sqlite_url, redis_url, key_prefix, columns=["payload"])
    rnd = t.plan(max_ranges=4, new_stream=True)
    sizes = []
    for r in rnd.ranges:
        sizes.append(t.traverse(rnd.round_id, r.range_id, Recorder(), chunk_size=400).done)
    assert sum(sizes) == 10000 and max(sizes) - min(sizes) <= 10  # exact quantiles on a small table
    assert t.close_round(rnd.round_id).done == 10000


# ---- bad input: a clear error, nothing written ------------------------------------------------


def _bad_inputs():
    ok = {"table": "events", "key": "seq"}
    return [
        ("non-unique key", "dup", {**ok, "key": "payload"}, {}, KeyValidationError, "not unique"),
        ("nullable key", "nullable", {**ok, "key": "maybe"}, {}, KeyValidationError, "nullable"),
        ("missing table", "", {**ok, "table": "nope"}, {}, KeyValidationError, "does not exist"),
        (
            "missing column",
            "",
            {**ok, "key": "nope"},
            {},
            KeyValidationError,
            "'nope' does not exist",
        ),
        (
            "start > end",
            "",
            ok,
            {"start_key": 50, "end_key": 10},
            ConfigurationError,
            "above end_key",
        ),
        (
            "bound of wrong type",
            "",
            ok,
            {"start_key": "ten"},
            ConfigurationError,
            "does not fit a int",
        ),
        ("max_ranges <= 0", "", ok, {"max_ranges": 0}, ConfigurationError, "max_ranges"),
        (
            "max_ranges too large",
            "",
            ok,
            {"max_ranges": 100_001},
            ConfigurationError,
            "engine's limit on ranges per round",
        ),
        ("float key", "floaty", {**ok, "key": "f"}, {}, KeyValidationError, "not exact"),
        ("no index on key", "noindex", {**ok, "key": "seq2"}, {}, KeyValidationError, "CREATE"),
    ]


@pytest.mark.parametrize(
    ("case", "setup", "init", "plan_kw", "exc", "message"),
    _bad_inputs(),
    ids=[c[0] for c in _bad_inputs()],
)
def test_bad_input_is_refused_and_writes_nothing(
    pg_engine,
    pg_schema_url,
    redis_url,
    key_prefix,
    redis_client,
    case,
    setup,
    init,
    plan_kw,
    exc,
    message,
):
    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL, "
                "maybe bigint UNIQUE, f double precision UNIQUE NOT NULL, seq2 bigint NOT NULL)"
            )
        )
        c.execute(sa.text("CREATE UNIQUE INDEX ON events (seq2, seq)"))
        c.execute(
            sa.text("INSERT INTO events SELECT g, 'p', g, g, g FROM generate_series(1, 100) g")
        )
    t = KeysetTraversal(
        pg_schema_url, redis_url=redis_url, stream="bad", key_prefix=key_prefix, **init
    )
    with pytest.raises(exc, match=message):
        t.plan(**{"max_ranges": 2, **plan_kw})
    assert list(redis_client.scan_iter(f"{key_prefix}:*")) == []
    with pg_engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM events")).scalar() == 100


def test_chunk_size_must_be_positive(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, [1, 2, 3])
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    before = t.range_status(rnd.round_id)
    for bad in (0, -5, 1.5, "10"):
        with pytest.raises(ConfigurationError, match="chunk_size"):
            t.traverse(rnd.round_id, 0, Recorder(), chunk_size=bad)
    assert t.range_status(rnd.round_id) == before


def test_redis_unreachable_is_a_clear_error(pg_engine, pg_schema_url):
    make_events(pg_engine, [1, 2, 3])
    t = KeysetTraversal(
        pg_schema_url, table="events", key="seq", redis_url="redis://127.0.0.1:1/0", stream="x"
    )
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        t.plan(new_stream=True)


def test_dead_letters_can_be_replayed_fenced(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    make_events(pg_engine, list(range(1, 301)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    broken = {7, 250}

    def proc(chunk):
        return ChunkResult(failed={k: "downstream rejected" for k in chunk.keys if k in broken})

    t.traverse(rnd.round_id, 0, proc, chunk_size=50, max_item_attempts=2, item_retry_delay=0.01)
    assert t.close_round(rnd.round_id).dead == 2
    range_key = t.store.range_key(rnd.round_id, 0)
    redis_client.hset(
        range_key, mapping={"owner": "replayer#1", "lease_until": 2**50}
    )  # another live replay
    with pytest.raises(LeaseHeldError, match="replayer#1"):
        t.replay_dead_letters(rnd.round_id, proc)
    assert len(t.dead_letters(rnd.round_id, 0)) == 2  # refused: nothing moved
    redis_client.hset(range_key, mapping={"owner": "", "lease_until": 0})
    broken.clear()  # the downstream is fixed
    results = t.replay_dead_letters(rnd.round_id, proc, item_retry_delay=0.01)
    assert [(r.done, r.dead, r.complete) for r in results] == [(300, 0, True)]
    assert t.dead_letters(rnd.round_id, 0) == []
    assert t.close_round(rnd.round_id).done == 300


def test_group_commit_widens_replay_to_one_group(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    make_events(pg_engine, list(range(1, 2001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    advances = []
    original = t.store.advance
    dead: list[bool] = []  # the process died: nothing of it runs any more

    def counting_advance(*args, **kwargs):
        if dead:  # (a BaseException through the loop commits the processed group; a death not)
            raise Crash("the process is gone")
        advances.append(args[4])
        return original(*args, **kwargs)

    t.store.advance = counting_advance  # type: ignore[method-assign]

    def crashing(chunk):
        rec(chunk)
        if len(rec.chunks) == 7:
            dead.append(True)
            raise Crash("died inside the second group")

    with pytest.raises(Crash):
        t.traverse(
            rnd.round_id, 0, crashing, chunk_size=100, group_commit_chunks=4, owner_lineage="w"
        )
    assert (
        len(advances) == 1 and t.range_status(rnd.round_id)[0]["cursor"] == 400
    )  # one group committed
    dead.clear()  # a new process
    res = t.traverse(rnd.round_id, 0, rec, chunk_size=100, group_commit_chunks=4, owner_lineage="w")
    replayed = sorted(k for k, n in rec.seen.items() if n > 1)
    assert replayed == list(range(401, 701))  # up to one group (here 3 of its 4 chunks) replayed
    assert (res.done, res.complete) == (2000, True)
    assert len(advances) == 1 + 4  # 1600 rows in groups of 4 chunks


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_both_postgres_drivers_and_lazy_rows(
    pg_engine, pg_schema_url, redis_url, key_prefix, driver
):
    make_events(pg_engine, list(range(1, 3001)))
    url = pg_schema_url.replace("postgresql+psycopg2://", f"postgresql+{driver}://")
    t = traversal(url, redis_url, key_prefix, columns=["payload"])
    rnd = t.plan(max_ranges=2, new_stream=True)
    counted, payloads = [], set()

    def proc(chunk):
        counted.append(len(chunk))  # length alone does not convert the rows
        if chunk.range_id == 1:
            payloads.update(r["payload"] for r in chunk.rows)

    run_all(t, rnd, proc, chunk_size=700)
    assert sum(counted) == 3000
    assert payloads == {f"e{k}" for k in range(rnd.ranges[1].lo + 1, 3001)}
    assert t.close_round(rnd.round_id).done == 3000


def test_numeric_columns_and_keys_on_postgres(pg_engine, pg_schema_url, redis_url, key_prefix):
    from decimal import Decimal

    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE prices (sku numeric(12,2) PRIMARY KEY, amount numeric(12,2) NOT NULL)"
            )
        )
        c.execute(
            sa.text(
                "INSERT INTO prices SELECT g / 100.0, g * 2 / 100.0 FROM generate_series(1, 500) g"
            )
        )
    t = KeysetTraversal(
        pg_schema_url,
        table="prices",
        key="sku",
        columns=["amount"],
        redis_url=redis_url,
        stream="p",
        key_prefix=key_prefix,
    )
    rnd = t.plan(max_ranges=2, start_key=Decimal("0.50"))
    amounts = []
    run_all(t, rnd, lambda ch: amounts.extend(r["amount"] for r in ch.rows), chunk_size=90)
    assert len(amounts) == 450 and amounts[0] == Decimal("1.02") and isinstance(amounts[0], Decimal)


def test_plan_joining_the_open_round_remembers_its_round_key(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    r1 = t.plan(2, round_key="run-1/plan", new_stream=True)
    assert (
        t.plan(2, round_key="run-2/plan", new_stream=True).round_id == r1.round_id
    )  # night 2 finishes night 1's round
    run_all(t, r1, Recorder())
    t.close_round(r1.round_id)
    assert (
        t.plan(2, round_key="run-2/plan", new_stream=True).round_id == r1.round_id
    )  # a retry of night 2's plan: same round


def test_group_commit_by_time_alone(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, list(range(1, 1001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    advances = []
    original = t.store.advance

    def counting_advance(*args, **kwargs):
        advances.append(args[4])
        return original(*args, **kwargs)

    t.store.advance = counting_advance  # type: ignore[method-assign]
    res = t.traverse(rnd.round_id, 0, lambda ch: None, chunk_size=100, group_commit_seconds=3600)
    assert res.done == 1000 and len(advances) == 1  # one group: flushed once, at the end


def test_traverse_takes_one_options_object(pg_engine, pg_schema_url, redis_url, key_prefix):
    """``options=`` carries the same settings as the keywords; giving both is refused."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    with pytest.raises(ConfigurationError, match="not both"):
        t.traverse(rnd.round_id, 0, rec, chunk_size=10, options=TraverseOptions(chunk_size=20))
    res = t.traverse(rnd.round_id, 0, rec, options=TraverseOptions(chunk_size=30, prefetch=False))
    assert (res.done, res.complete, res.chunks) == (100, True, 4)
    assert [len(c) for c in rec.chunks] == [30, 30, 30, 10]
