"""The checkpoint mirror (``core/rounds/mirror.py``) on MariaDB: upserts overwrite, stream and
round names compare byte for byte (the server's default collation is case-insensitive), and a
range document larger than TEXT's 64 KB is kept whole."""

from __future__ import annotations

from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror


def test_mirror_on_mariadb_upserts_and_reads_back(mariadb_db_url):
    m = CheckpointMirror(mariadb_db_url)
    try:
        m.save_round("events", "r1", {"start": "a"}, [{"range_id": 0, "cursor": "x"}])
        m.save_range("events", "r1", 0, {"range_id": 0, "cursor": "y"})  # overwrites
        m.save_watermark("events", "w1")
        m.save_watermark("events", "w2")
        m.save_key_fingerprint("events", "fp")
        assert m.load_round("events", "r1") == ({"start": "a"}, [{"range_id": 0, "cursor": "y"}])
        assert m.load_watermark("events") == "w2"
        assert m.load_key_fingerprint("events") == "fp"
        assert m.max_round_number("events") == 1
        assert m.rounds("events") == [{"start": "a"}]
    finally:
        m.engine.dispose()


def test_mirror_on_mariadb_keeps_case_distinct_streams_and_large_documents(mariadb_db_url):
    m = CheckpointMirror(mariadb_db_url)
    try:
        m.save_watermark("Events", "upper")
        m.save_watermark("events", "lower")
        assert (m.load_watermark("Events"), m.load_watermark("events")) == ("upper", "lower")
        dead = [{"key": i, "error": "e" * 200} for i in range(500)]  # ~110 KB of JSON
        m.save_range("events", "r1", 0, {"range_id": 0, "dead": dead})
        m.save_round("events", "r1", {"start": "a"}, [])
        loaded = m.load_round("events", "r1")
        assert loaded is not None and loaded[1][0]["dead"] == dead
    finally:
        m.engine.dispose()


def test_mirror_statements_on_mariadb_are_bounded_and_the_session_restored(mariadb_db_url):
    """Inside a bounded block the lock waits and statements are limited to the mirror's bound;
    the pooled connection gets the server's defaults back afterwards."""
    m = CheckpointMirror(mariadb_db_url, timeout_seconds=30.0).bounded(2.5)
    query = (
        "SELECT @@session.innodb_lock_wait_timeout, @@session.lock_wait_timeout, "
        "@@session.max_statement_time"
    )
    try:
        with m.engine.connect() as c:
            defaults = c.exec_driver_sql(query).one()
        with m._connect() as c:
            assert tuple(c.exec_driver_sql(query).one()) == (3, 3, 2.5)
        with m.engine.connect() as c:  # the same pooled connection
            assert c.exec_driver_sql(query).one() == defaults
        m.save_watermark("events", "w")  # a bounded write still works
        assert m.load_watermark("events") == "w"
    finally:
        m.engine.dispose()
