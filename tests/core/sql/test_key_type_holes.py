"""Issue 27 items 7-9: three key types that lost rows or stalled a round, now refused at plan time
with the column, the type and the fix (the catalog walk in ``test_key_type_matrix`` covers every
other type). Each test failed on the code before ``core/sql/key_types.py``."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from core_support import Recorder, run_all

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import UnsupportedKeyTypeError


def _traversal(url: str, table: str, redis_url: str, key_prefix: str) -> KeysetTraversal:
    return KeysetTraversal(url, table, "k", redis_url=redis_url, stream="s", key_prefix=key_prefix)


def test_postgresql_enum_key_is_refused_naming_the_fix(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Item 7: PostgreSQL orders an enum by declaration ('paid' < 'archived' when 'archived' was
    added later), the engine by label; the old plan accepted it as text, and after a round up to
    'paid' a row 'archived' (below 'paid' as text, above it for PostgreSQL) was never delivered."""
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TYPE status AS ENUM ('open', 'paid')")
        c.exec_driver_sql("ALTER TYPE status ADD VALUE 'archived'")
        c.exec_driver_sql("CREATE TABLE orders (k status PRIMARY KEY)")
        c.exec_driver_sql("INSERT INTO orders VALUES ('open'), ('paid')")
    t = _traversal(pg_schema_url, "orders", redis_url, key_prefix)
    try:
        with pytest.raises(UnsupportedKeyTypeError) as info:
            rnd = t.plan(
                max_ranges=1, new_stream=True
            )  # the old code: accepted; the row below is then lost
            run_all(t, rnd, Recorder())
            t.close_round(rnd.round_id)
            with pg_engine.begin() as c:
                c.exec_driver_sql("INSERT INTO orders VALUES ('archived')")
            rec = Recorder()
            nxt = t.plan(max_ranges=1, new_stream=True)
            run_all(t, nxt, rec)
            assert list(rec.seen) == ["archived"], "the row added later was never delivered"
    finally:
        t.close()
    msg = str(info.value)
    assert "key column 'k'" in msg and "status" in msg and "enumsortorder" in msg, msg
    assert "Fix: key by another column" in msg and 'TYPE text COLLATE "C"' in msg, msg


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize(
    ("column", "bad"),
    [
        ("timestamptz", "infinity"),
        ("timestamp", "infinity"),
        ("date", "infinity"),
        ("date", "-infinity"),
        ("timestamptz", "10000-01-01 00:00:00+00"),
        ("date", "0044-03-15 BC"),
        ("numeric", "NaN"),
        ("numeric", "Infinity"),
    ],
)
def test_postgresql_values_python_cannot_hold_are_refused_at_plan(
    pg_engine, pg_schema_url, redis_url, key_prefix, driver, column, bad
):
    """Item 8: with psycopg2 an 'infinity' key was read as 9999-12-31, the round ended there and
    the row was never delivered; psycopg 3 failed the plan with a DataError naming no fix.
    Now both drivers refuse the plan naming the column and the fix, and a ``where`` that excludes
    the value lets the plan through."""
    with pg_engine.begin() as c:
        c.exec_driver_sql(f"CREATE TABLE ev (k {column} PRIMARY KEY)")
        c.exec_driver_sql(
            "INSERT INTO ev VALUES ('2024-01-01')"
            if column != "numeric"
            else "INSERT INTO ev VALUES (1)"
        )
        c.exec_driver_sql(f"INSERT INTO ev VALUES ('{bad}')")
    url = pg_schema_url.replace("postgresql+psycopg2://", f"postgresql+{driver}://")
    t = _traversal(url, "ev", redis_url, key_prefix)
    try:
        with pytest.raises(UnsupportedKeyTypeError) as info:
            rnd = t.plan(max_ranges=1, new_stream=True)
            rec = Recorder()
            run_all(t, rnd, rec)
            assert len(rec.seen) == 2, "a row was never delivered"
    finally:
        t.close()
    msg = str(info.value)
    assert "key column 'k' of 'ev' holds" in msg and "Fix:" in msg and "CHECK" in msg, msg
    where = (
        "k <> 'NaN' AND k < 'Infinity'"
        if column == "numeric"
        else "isfinite(k) AND k < '10000-01-01' AND k > '0001-01-01'"
    )
    t = KeysetTraversal(
        url, "ev", "k", where=where, redis_url=redis_url, stream="w", key_prefix=key_prefix
    )
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        rec = Recorder()
        run_all(t, rnd, rec)
        assert len(rec.seen) == 1
    finally:
        t.close()


def test_mariadb_uuid_key_is_refused_naming_the_fix(mariadb_db_url, redis_url, key_prefix):
    """Item 9: MariaDB's UUID sorts by swapped segments, not bytes: the old plan accepted it and
    the traversal stopped mid-round with CursorConflictError for ever."""
    engine = sa.create_engine(mariadb_db_url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE u (k uuid NOT NULL PRIMARY KEY)")
        c.exec_driver_sql(
            "INSERT INTO u VALUES ('00000000-0000-0000-0000-000000000002'), "
            "('00000001-0000-0000-0000-000000000001'), ('00000000-0000-0000-0001-000000000000')"
        )
    engine.dispose()
    t = _traversal(mariadb_db_url, "u", redis_url, key_prefix)
    try:
        with pytest.raises(UnsupportedKeyTypeError) as info:
            rnd = t.plan(max_ranges=1, new_stream=True)
            rec = Recorder()
            run_all(t, rnd, rec, chunk_size=1)
            assert len(rec.seen) == 3
    finally:
        t.close()
    msg = str(info.value)
    assert "key column 'k' of 'u' has type uuid" in msg and "swapped segments" in msg, msg
    assert "Fix: store UUIDs as VARCHAR(36)" in msg and "utf8mb4_nopad_bin" in msg, msg
