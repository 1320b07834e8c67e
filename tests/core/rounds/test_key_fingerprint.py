"""A stream's watermark is only meaningful for the key it was encoded with (issue #18, item 1).

The stream records its key's fingerprint (column names and the key codec's kinds); ``plan``
refuses, before writing anything, a stream whose key columns or kinds changed, naming the stream,
the old key, the new key and the fix. Without it, a watermark encoded under the old key reads as
"above every new key" and every later round is planned as ``(w, w]``: empty, closed at once, new
rows never delivered and nothing saying why.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import Recorder, run_all

from airflow_keyset_provider.core import ConfigurationError, KeysetTraversal

T0 = dt.datetime(2026, 11, 1, 12, 0, 0)


def _traversal(url: str, redis_url: str, key_prefix: str, key: str, **kw: Any) -> KeysetTraversal:
    return KeysetTraversal(
        url,
        table="items",
        key=key,
        redis_url=redis_url,
        stream="items",
        key_prefix=key_prefix,
        **kw,
    )


def _first_round(t: KeysetTraversal) -> None:
    rnd = t.plan(max_ranges=2, new_stream=True)
    run_all(t, rnd, Recorder())
    t.close_round(rnd.round_id)


def _refused(t: KeysetTraversal, redis_client: Any, key_prefix: str, *fragments: str) -> None:
    """``plan`` raises naming every fragment, and writes nothing: no round id is handed out."""
    before = sorted(redis_client.scan_iter(f"{key_prefix}:*"))
    counter = redis_client.get(f"{key_prefix}:{{items}}:seq")
    with pytest.raises(ConfigurationError) as err:
        t.plan(max_ranges=2, new_stream=True)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert sorted(redis_client.scan_iter(f"{key_prefix}:*")) == before
    assert redis_client.get(f"{key_prefix}:{{items}}:seq") == counter


def test_alter_type_timestamp_to_timestamptz_is_refused(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: stream over ``created_at timestamp``; one round closes (watermark encoded as a
    naive timestamp); ``ALTER COLUMN created_at TYPE timestamptz``; new rows arrive. The next plan
    must refuse (old code: planned ``(w, w]``, done=0, the new rows never delivered)."""
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (created_at timestamp PRIMARY KEY, v int NOT NULL)"))
        c.execute(
            sa.text("INSERT INTO items VALUES (:t, 1)"),
            [{"t": T0 + dt.timedelta(minutes=i)} for i in range(50)],
        )
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "created_at"))
    with pg_engine.begin() as c:
        c.execute(sa.text("SET LOCAL TIME ZONE 'UTC'"))
        c.execute(sa.text("ALTER TABLE items ALTER COLUMN created_at TYPE timestamptz"))
        c.execute(sa.text("INSERT INTO items VALUES (now() + interval '1 day', 2)"))
    t = _traversal(pg_schema_url, redis_url, key_prefix, "created_at")
    _refused(
        t,
        redis_client,
        key_prefix,
        "'items'",
        "created_at (timestamp)",
        "created_at (timestamptz)",
        "new stream name",
    )


def test_alter_type_numeric_to_bigint_is_refused(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: stream over ``n numeric``; one round closes; ``ALTER COLUMN n TYPE bigint``; a
    new row arrives. The next plan must refuse (old code: ``(w, w]``, the row never delivered)."""
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (n numeric PRIMARY KEY, v int NOT NULL)"))
        c.execute(sa.text("INSERT INTO items SELECT g, 1 FROM generate_series(1, 100) g"))
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "n"))
    with pg_engine.begin() as c:
        c.execute(sa.text("ALTER TABLE items ALTER COLUMN n TYPE bigint"))
        c.execute(sa.text("INSERT INTO items VALUES (101, 2)"))
    t = _traversal(pg_schema_url, redis_url, key_prefix, "n")
    _refused(t, redis_client, key_prefix, "n (decimal)", "n (int)", "new stream name")


def _two_keys(pg_engine: sa.Engine) -> None:
    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE items (id bigint PRIMARY KEY, created_at timestamptz NOT NULL UNIQUE)"
            )
        )
        c.execute(
            sa.text("INSERT INTO items VALUES (:i, :t)"),
            [{"i": i, "t": T0.replace(tzinfo=dt.UTC) + dt.timedelta(minutes=i)} for i in range(40)],
        )


def test_key_change_on_the_same_stream_is_refused(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: a DAG traverses stream ``items`` with ``key="created_at"``, a round closes, then
    the DAG changes to ``key="id"`` on the same stream; a new row arrives. The next plan must
    refuse (old code: the int keys encode below the timestamp watermark: ``(w, w]``, done=0)."""
    _two_keys(pg_engine)
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "created_at"))
    with pg_engine.begin() as c:
        c.execute(sa.text("INSERT INTO items VALUES (1000, now() + interval '1 day')"))
    t = _traversal(pg_schema_url, redis_url, key_prefix, "id")
    _refused(
        t,
        redis_client,
        key_prefix,
        "created_at (timestamptz)",
        "id (int)",
        "new stream name",
    )
    # the fix the error names: a new stream delivers every row under the new key
    fresh = KeysetTraversal(
        pg_schema_url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream="items-by-id",
        key_prefix=key_prefix,
    )
    rnd = fresh.plan(max_ranges=2, new_stream=True)
    rec = Recorder()
    run_all(fresh, rnd, rec)
    assert fresh.close_round(rnd.round_id).done == 41 and 1000 in rec.seen


def test_key_change_is_refused_after_redis_loss_through_the_mirror(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: as above with a checkpoint mirror, and Redis loses every key of the stream
    between the rounds: the watermark comes back from the mirror, and so does the key it was
    encoded with, so the plan still refuses."""
    _two_keys(pg_engine)
    kw = {"checkpoint_url": pg_schema_url}
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "created_at", **kw))
    for k in list(redis_client.scan_iter(f"{key_prefix}:*")):
        redis_client.delete(k)
    t = _traversal(pg_schema_url, redis_url, key_prefix, "id", **kw)
    with pytest.raises(ConfigurationError, match=r"created_at \(timestamptz\)"):
        t.plan(max_ranges=2, new_stream=True)
    same = _traversal(pg_schema_url, redis_url, key_prefix, "created_at", **kw)
    with pg_engine.begin() as c:
        c.execute(sa.text("INSERT INTO items VALUES (1000, now() + interval '1 day')"))
        new = c.execute(sa.text("SELECT created_at FROM items WHERE id = 1000")).scalar()
    rnd = same.plan(
        max_ranges=1, new_stream=True
    )  # the unchanged key continues from the restored watermark
    rec = Recorder()
    run_all(same, rnd, rec)
    assert list(rec.seen) == [new]


def test_stream_without_fingerprint_adopts_the_current_key(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """A stream planned before fingerprints existed (no fingerprint stored) keeps working: the
    plan adopts the current key, and a later key change is refused."""
    _two_keys(pg_engine)
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "id"))
    for k in redis_client.scan_iter(f"{key_prefix}:*:key"):
        redis_client.delete(k)  # what an older version left: a watermark, no fingerprint
    with pg_engine.begin() as c:
        c.execute(sa.text("INSERT INTO items VALUES (1000, now() + interval '1 day')"))
    t = _traversal(pg_schema_url, redis_url, key_prefix, "id")
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    run_all(t, rnd, rec)
    assert sorted(rec.seen) == [1000]
    t.close_round(rnd.round_id)
    with pytest.raises(ConfigurationError, match=r"id \(int\)"):
        _traversal(pg_schema_url, redis_url, key_prefix, "created_at").plan(
            max_ranges=1, new_stream=True
        )


def test_foreign_watermark_without_fingerprint_is_refused(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """A stream with no fingerprint whose watermark does not fit the current key (the key
    changed before the upgrade) is refused too: never an empty round from a foreign watermark."""
    _two_keys(pg_engine)
    _first_round(_traversal(pg_schema_url, redis_url, key_prefix, "created_at"))
    for k in redis_client.scan_iter(f"{key_prefix}:*:key"):
        redis_client.delete(k)
    with pytest.raises(ConfigurationError, match="watermark"):
        _traversal(pg_schema_url, redis_url, key_prefix, "id").plan(max_ranges=1, new_stream=True)
