"""MariaDB as a source: each refusal of a key without a stable total order, and what is accepted.

Every test runs on the real MariaDB (``mariadb_db_url``: a database of its own, dropped
afterwards). A refusal names the column or index and the fix, and nothing is planned.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import KeyValidationError, UnsupportedKeyTypeError
from airflow_keyset_provider.core.sql.source import SqlSource


def _exec(url: str, *statements: str) -> None:
    eng = sa.create_engine(url, poolclass=NullPool)
    with eng.begin() as c:
        for s in statements:
            c.exec_driver_sql(s)
    eng.dispose()


def _refused(url: str, ddl: str, key: str | list[str], exc: type, match: str) -> None:
    _exec(url, ddl)
    src = SqlSource(url, "t", key)
    with pytest.raises(exc, match=match):
        src.validate()
    src.close()


def test_nullable_key_is_refused_naming_modify(mariadb_db_url):
    _refused(
        mariadb_db_url,
        "CREATE TABLE t (k bigint NULL, UNIQUE KEY uk (k))",
        "k",
        KeyValidationError,
        r"'k' of 't' is nullable.*Fix: ALTER TABLE t MODIFY k BIGINT(\(20\))? NOT NULL",
    )


def test_key_without_unique_index_is_refused(mariadb_db_url):
    _refused(
        mariadb_db_url,
        "CREATE TABLE t (id bigint PRIMARY KEY, k bigint NOT NULL, KEY ix (k))",
        "k",
        KeyValidationError,
        r"key \(k\) of 't' is not unique",
    )


def test_unique_prefix_index_is_refused(mariadb_db_url):
    """A unique index on ``k(4)`` orders by the first four characters only."""
    _refused(
        mariadb_db_url,
        "CREATE TABLE t (k varchar(40) COLLATE utf8mb4_nopad_bin NOT NULL, UNIQUE KEY up (k(4)))",
        "k",
        KeyValidationError,
        r"not unique.*'up' does not count: it indexes a prefix of a column \(SUB_PART\)",
    )


def test_unique_hash_index_proves_uniqueness_but_gives_no_order(mariadb_db_url):
    """MariaDB's long unique on a TEXT column is a HASH index: unique, but no range to page by."""
    _refused(
        mariadb_db_url,
        "CREATE TABLE t (k text COLLATE utf8mb4_nopad_bin NOT NULL, UNIQUE KEY uh (k))",
        "k",
        KeyValidationError,
        r"no index of 't' starts with the key columns \(k\)",
    )


@pytest.mark.parametrize(
    ("collation", "why"),
    [
        ("utf8mb4_general_ci", r"case-, accent- or locale-aware, and PAD SPACE"),
        ("utf8mb4_unicode_520_ci", r"case-, accent- or locale-aware"),
        ("utf8mb4_bin", r"PAD SPACE \('a' = 'a ', and 'a\\t' sorts before 'a'\)"),
    ],
)
def test_text_key_collation_not_in_code_point_order_is_refused(mariadb_db_url, collation, why):
    _refused(
        mariadb_db_url,
        f"CREATE TABLE t (k varchar(40) COLLATE {collation} NOT NULL PRIMARY KEY)",
        "k",
        KeyValidationError,
        rf"text key column 'k' of 't' uses collation '{collation}'.*{why}.*"
        r"Fix: ALTER TABLE t MODIFY k VARCHAR\(\.\.\.\) CHARACTER SET utf8mb4 COLLATE "
        r"utf8mb4_nopad_bin NOT NULL",
    )


def test_utf8mb4_bin_is_pad_space_on_this_server(mariadb_db_url):
    """Why ``utf8mb4_bin`` is refused: the server itself orders 'a\\t' before 'a' under it (a
    trailing space pad), where the key encoding (code point order) puts 'a' first."""
    eng = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    with eng.connect() as c:
        pad, nopad = c.exec_driver_sql(
            "SELECT _utf8mb4'a' < _utf8mb4'a\\t' COLLATE utf8mb4_bin, "
            "_utf8mb4'a' < _utf8mb4'a\\t' COLLATE utf8mb4_nopad_bin"
        ).one()
    eng.dispose()
    assert (pad, nopad) == (0, 1)


@pytest.mark.parametrize(
    ("ddl", "match"),
    [
        ("k enum('b','a') NOT NULL PRIMARY KEY", r"sorts by the members' ordinal"),
        ("k set('b','a') NOT NULL PRIMARY KEY", r"sorts by the members' ordinal"),
        (
            "k char(8) COLLATE utf8mb4_nopad_bin NOT NULL PRIMARY KEY",
            r"fixed-width CHAR\(8\).*Fix: ALTER TABLE t MODIFY k VARCHAR\(8\)",
        ),
        ("k varbinary(16) NOT NULL PRIMARY KEY", r"binary string type VARBINARY\(16\)"),
        ("k binary(16) NOT NULL PRIMARY KEY", r"binary string type BINARY\(16\)"),
        ("k double NOT NULL PRIMARY KEY", r"not exact or not unique enough"),
        ("k time NOT NULL PRIMARY KEY", r"no exact order-preserving encoding"),
        ("k year NOT NULL PRIMARY KEY", r"no exact order-preserving encoding"),
        ("k bit(8) NOT NULL PRIMARY KEY", r"no exact order-preserving encoding"),
        (
            "k timestamp(6) NOT NULL PRIMARY KEY",
            r"TIMESTAMP, read in the session time zone 'SYSTEM'.*time_zone",
        ),
    ],
)
def test_key_types_the_codec_cannot_order_are_refused(mariadb_db_url, ddl, match):
    _refused(mariadb_db_url, f"CREATE TABLE t ({ddl})", "k", UnsupportedKeyTypeError, match)


def test_timestamp_key_is_accepted_with_a_fixed_offset_session_zone(mariadb_db_url):
    _exec(mariadb_db_url, "CREATE TABLE t (k timestamp(6) NOT NULL PRIMARY KEY)")
    url = sa.engine.make_url(mariadb_db_url).update_query_dict(
        {"init_command": "SET time_zone = '+00:00'"}
    )
    src = SqlSource(url.render_as_string(hide_password=False), "t", "k")
    src.validate()
    assert src.key_kinds == ["timestamp"]
    src.close()


def test_accepted_key_types_and_composite_keys(mariadb_db_url):
    _exec(
        mariadb_db_url,
        "CREATE TABLE t (a int unsigned NOT NULL, d date NOT NULL, ts datetime(6) NOT NULL, "
        "n decimal(20, 4) NOT NULL, s varchar(20) COLLATE utf8mb4_nopad_bin NOT NULL, "
        "PRIMARY KEY (d, ts, n, s, a))",
    )
    src = SqlSource(mariadb_db_url, "t", ["d", "ts", "n", "s", "a"])
    src.validate()
    assert src.key_kinds == ["date", "timestamp", "decimal", "text", "int"]
    src.close()


def test_text_keys_in_code_point_order_are_delivered_once_in_order(
    mariadb_db_url, redis_url, key_prefix
):
    """Keys a collation would fold or pad ('a', 'a ', 'a\\t', 'A', 'é', an emoji) are distinct
    under utf8mb4_nopad_bin and delivered once each, in code point order, across chunks."""
    values = ["a", "a ", "a\t", "A", "b", "é", "e", "\U0001f600", "z", "ab"]
    _exec(
        mariadb_db_url,
        "CREATE TABLE t (k varchar(20) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin "
        "NOT NULL PRIMARY KEY)",
    )
    eng = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    with eng.begin() as c:
        c.execute(sa.text("INSERT INTO t VALUES (:k)"), [{"k": v} for v in values])
    eng.dispose()
    t = KeysetTraversal(
        mariadb_db_url, table="t", key="k", redis_url=redis_url, stream="s", key_prefix=key_prefix
    )
    rnd = t.plan(max_ranges=3, new_stream=True)
    seen: list[str] = []
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, lambda ch: seen.extend(ch.keys), chunk_size=3)
    assert seen == sorted(values)  # Python's str order is code point order
    assert t.close_round(rnd.round_id).done == len(values)
    t.close()


def test_a_table_of_another_database_is_checked_there(mariadb_url, mariadb_db_url):
    """``table="otherdb.t"`` on a connection to another database: the catalog reads (STATISTICS,
    COLUMNS, TABLES) and the chunks go to ``otherdb``."""
    db = sa.engine.make_url(mariadb_db_url).database
    _exec(
        mariadb_db_url,
        "CREATE TABLE t (k varchar(20) COLLATE utf8mb4_nopad_bin NOT NULL PRIMARY KEY)",
        "INSERT INTO t VALUES ('b'), ('a')",
    )
    src = SqlSource(mariadb_url, f"{db}.t", "k")
    src.validate()
    assert list(src.fetch("", src.encode(("z",)), 10)) == [("a",), ("b",)]
    src.close()
    _exec(mariadb_db_url, "ALTER TABLE t MODIFY k varchar(20) COLLATE utf8mb4_general_ci NOT NULL")
    refused = SqlSource(mariadb_url, f"{db}.t", "k")
    with pytest.raises(KeyValidationError, match=rf"'k' of '{db}.t' uses collation"):
        refused.validate()
    refused.close()
