"""Scenario 9, bad input: every mistake is refused with an error that names it and the fix, and
nothing is written to Redis or to the source.

Each row of ``CASES`` is one bad input across the engine API (constructor, ``plan``, ``traverse``,
the processor's return value, ``load_processor``): the exception class it must raise and the
fragments its message must contain (what is wrong, and what to do). Around every call the test
takes a full snapshot of the test's Redis keys and of every table of the test's schema (name,
row count, md5 of the ordered contents) and requires both unchanged. A processor that breaks its
contract is only found after the range was claimed; there the claim's own bookkeeping (owner,
epoch, lease) may change and must be released again, but no cursor, counter, retry or dead letter.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import (
    ChunkResult,
    ConfigurationError,
    KeysetError,
    KeysetTraversal,
    KeyValidationError,
    ProcessorContractError,
    RoundNotFoundError,
    StoreUnavailableError,
    UnsupportedKeyTypeError,
    load_processor,
)

# range-hash fields a claim + release may legitimately touch ("call": the call id that makes a
# second run of the claim or the release, after a lost reply, answer as the first did)
CLAIM_FIELDS = {
    "call",
    "owner",
    "lineage",
    "epoch",
    "lease_until",
    "heartbeat_ms",
    "claimed_ms",
    "state",
    "takeovers",
}


@dataclass
class Env:
    url: str
    redis_url: str
    prefix: str
    rnd: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def t(self, table: str = "good", key: Any = "id", **kw: Any) -> KeysetTraversal:
        """A traversal on a stream with no round yet (a bad ``plan`` must not create one)."""
        kw.setdefault("redis_url", self.redis_url)
        kw.setdefault("stream", "bad-plan")
        return KeysetTraversal(self.url, table=table, key=key, key_prefix=self.prefix, **kw)

    def planned(self, table: str = "good") -> KeysetTraversal:
        """A traversal on the stream whose round ``rnd`` the ``traverse`` cases point at."""
        return self.t(table, stream="bad-traverse")

    def traverse(
        self, processor: Any = None, range_id: int = 0, round_id: str | None = None, **kw: Any
    ) -> Any:
        return self.planned().traverse(
            round_id or self.rnd.round_id, range_id, processor or (lambda c: None), **kw
        )


@dataclass
class Case:
    name: str
    call: Callable[[Env], Any]
    error: type[Exception]
    says: list[
        str | tuple[str, ...]
    ]  # fragments of the message (case-insensitive; a tuple: any one of)
    claims: bool = False  # fails after the range was claimed (processor contract)


NON_C_CASE = "text key with a non-C collation"

CASES = [
    # ---- plan: sizes, bounds, types
    Case(
        "oversize plan: max_ranges=100001",
        lambda e: e.t().plan(max_ranges=100_001, new_stream=True),
        ConfigurationError,
        ["max_ranges", "from 1 to 100000", "engine's limit", "100001"],
    ),
    Case(
        "max_ranges=0",
        lambda e: e.t().plan(max_ranges=0, new_stream=True),
        ConfigurationError,
        ["max_ranges", "from 1 to 100000"],
    ),
    Case(
        "max_ranges of the wrong type ('8')",
        lambda e: e.t().plan(max_ranges="8", new_stream=True),
        ConfigurationError,
        ["max_ranges must be an integer", "'8'"],
    ),
    Case(
        "start > end",
        lambda e: e.t().plan(start_key=10, end_key=5),
        ConfigurationError,
        ["start_key 10 is above end_key 5", "start < key <= end"],
    ),
    Case(
        "bound of the wrong type (text for a bigint key)",
        lambda e: e.t().plan(start_key="ten"),
        ConfigurationError,
        ["start_key", "'ten'", "int key column"],
    ),
    Case(
        "bound with two values for a one-column key",
        lambda e: e.t().plan(end_key=(1, 2), new_stream=True),
        ConfigurationError,
        ["end_key", "2 values", "1 column"],
    ),
    Case(
        "naive datetime bound for a timestamptz key",
        lambda e: e.t("tstz", "k").plan(start_key=dt.datetime(2026, 1, 1, 5)),
        ConfigurationError,
        ["start_key", "naive", ("tzinfo", "aware datetime")],
    ),
    Case(
        "aware datetime bound for a timestamp (without time zone) key",
        lambda e: e.t("ts", "k").plan(
            end_key=dt.datetime(2026, 1, 1, 5, tzinfo=dt.UTC), new_stream=True
        ),
        ConfigurationError,
        ["end_key", "aware", "naive datetime"],
    ),
    # ---- names: injection, missing things
    Case(
        "SQL injection in the table name",
        lambda e: e.t("t; DROP TABLE x").plan(new_stream=True),
        KeyValidationError,
        ["'t; drop table x' does not exist", "check the name and schema"],
    ),
    Case(
        "SQL injection in the key name",
        lambda e: e.t(key='id"; --').plan(new_stream=True),
        KeyValidationError,
        ["column 'id\"; --' does not exist", "its columns are ['id', 'payload']"],
    ),
    Case(
        "missing table",
        lambda e: e.t("no_such_table").plan(new_stream=True),
        KeyValidationError,
        ["'no_such_table' does not exist", "schema"],
    ),
    Case(
        "missing column",
        lambda e: e.t(key="no_such_column").plan(new_stream=True),
        KeyValidationError,
        ["'no_such_column' does not exist", "its columns are"],
    ),
    Case(
        "missing extra column",
        lambda e: e.t(columns=["payload", "nope"]).plan(new_stream=True),
        KeyValidationError,
        ["'nope' does not exist"],
    ),
    Case(
        "empty table name",
        lambda e: e.t("").plan(new_stream=True),
        ConfigurationError,
        ["table must be a non-empty", "app.events"],
    ),
    Case(
        "key of the wrong type (123)",
        lambda e: e.t(key=123).plan(new_stream=True),
        ConfigurationError,
        ["key", "column name", "123"],
    ),
    Case(
        "key column listed twice",
        lambda e: e.t(key=["id", "id"]).plan(new_stream=True),
        ConfigurationError,
        ["lists a column twice"],
    ),
    # ---- keys that do not give a stable total order
    Case(
        "non-unique key",
        lambda e: e.t("dup", "k").plan(new_stream=True),
        KeyValidationError,
        ["has no unique index on", "create unique index on dup (k)"],
    ),
    Case(
        "nullable key",
        lambda e: e.t("nul", "k").plan(new_stream=True),
        KeyValidationError,
        ["'k'", "nullable", "alter column k set not null"],
    ),
    Case(
        "float key column",
        lambda e: e.t("flt", "k").plan(new_stream=True),
        UnsupportedKeyTypeError,
        [
            "'k'",
            "double precision",
            "fix: key by an integer or numeric/decimal column",
        ],
    ),
    Case(
        NON_C_CASE,
        lambda e: e.t("icu", "k").plan(new_stream=True),
        KeyValidationError,
        ["'k'", "collation '{collation}'", 'collate "c"'],
    ),
    Case(
        "key without an index to page by",
        lambda e: e.t("noidx", ["b", "a"]).plan(new_stream=True),
        KeyValidationError,
        ["no index", "create index on noidx (b, a)"],
    ),
    # ---- connections and names of the control state
    Case(
        "Redis unreachable",
        lambda e: e.t(redis_url="redis://127.0.0.1:1/0").plan(new_stream=True),
        StoreUnavailableError,
        ["redis is unreachable", "nothing was written", "check the redis connection"],
    ),
    Case(
        "Redis URL that is not one",
        lambda e: e.t(redis_url="http://127.0.0.1:6379").plan(new_stream=True),
        ConfigurationError,
        ["redis_url", "is not usable", "not shown"],
    ),
    Case(
        "source URL that is not one",
        lambda e: KeysetTraversal(
            "nosuchdb://x/y", table="good", key="id", redis_url=e.redis_url, key_prefix=e.prefix
        ).plan(new_stream=True),
        ConfigurationError,
        ["source url", "is not usable"],
    ),
    Case(
        "stream name with spaces and braces",
        lambda e: e.t(stream="my {stream}").plan(new_stream=True),
        ConfigurationError,
        ["stream name 'my {stream}' is not valid", "letters, digits"],
    ),
    # ---- traverse arguments (refused before the claim)
    Case(
        "chunk_size=0",
        lambda e: e.traverse(chunk_size=0),
        ConfigurationError,
        ["chunk_size must be a positive integer", "0"],
    ),
    Case(
        "chunk_size=True",
        lambda e: e.traverse(chunk_size=True),
        ConfigurationError,
        ["chunk_size must be a positive integer"],
    ),
    Case(
        "lease_seconds=0.5",
        lambda e: e.traverse(lease_seconds=0.5),
        ConfigurationError,
        ["lease_seconds must be at least 1"],
    ),
    Case(
        "max_item_attempts=0",
        lambda e: e.traverse(max_item_attempts=0),
        ConfigurationError,
        ["max_item_attempts must be a positive integer"],
    ),
    Case(
        "range_id out of the round",
        lambda e: e.traverse(range_id=7),
        ConfigurationError,
        ["has ranges 0..1", "range_id 7"],
    ),
    Case(
        "unknown round id",
        lambda e: e.traverse(round_id="r99"),
        RoundNotFoundError,
        ["no round 'r99'"],
    ),
    Case(
        "processor that is not callable",
        lambda e: e.traverse(processor="pkg.mod:fn"),
        ConfigurationError,
        ["processor must be callable", "chunkresult"],
    ),
    Case(
        "traverse with another table than planned",
        lambda e: e.planned("other").traverse(e.rnd.round_id, 0, print),
        ConfigurationError,
        ["was planned over", "same table, key and where"],
    ),
    # ---- processor return values (found after the claim)
    Case(
        "processor returns a dict",
        lambda e: e.traverse(lambda c: {"ok": True}),
        ProcessorContractError,
        ["returned dict", "must return chunkresult or none", "nothing", "was committed"],
        claims=True,
    ),
    Case(
        "processor returns True",
        lambda e: e.traverse(lambda c: True),
        ProcessorContractError,
        ["returned bool", "chunkresult or none"],
        claims=True,
    ),
    Case(
        "ChunkResult.failed names a key not in the chunk",
        lambda e: e.traverse(lambda c: ChunkResult(failed={10**9: "x"})),
        ProcessorContractError,
        ["chunkresult.failed names key 1000000000", "not in the chunk"],
        claims=True,
    ),
    Case(
        "ChunkResult.skipped names a key of the wrong type",
        lambda e: e.traverse(lambda c: ChunkResult(skipped=[str(c.keys[0])])),
        ProcessorContractError,
        ["chunkresult.skipped names key '1'", "not in the chunk"],
        claims=True,
    ),
    # ---- processor import paths
    Case(
        "processor module that does not exist",
        lambda e: load_processor("no_such_pkg.procs:handle"),
        ConfigurationError,
        ["cannot import module 'no_such_pkg.procs'", "no module named 'no_such_pkg'"],
    ),
    Case(
        "processor function that does not exist",
        lambda e: load_processor("os.path:no_such_function"),
        ConfigurationError,
        ["module 'os.path' has no callable 'no_such_function'"],
    ),
    Case(
        "processor path that is an attribute, not a function",
        lambda e: load_processor("os:sep"),
        ConfigurationError,
        ["has no callable 'sep'"],
    ),
    Case(
        "processor path without a module",
        lambda e: load_processor("handle"),
        ConfigurationError,
        ["'handle' is not of the form 'package.module:function'"],
    ),
    Case(
        "processor path of the wrong type",
        lambda e: load_processor(42),
        ConfigurationError,
        ["processor must be a callable or 'package.module:function'", "42"],
    ),
]


def _non_c_collation_table(engine: sa.Engine) -> str | None:
    """Create ``icu (k text COLLATE <c> PRIMARY KEY)`` with a collation that does not order by code
    point (ICU's und-x-icu first, else any other the server can use); None when the server has no
    such collation at all (a build without ICU and without OS locales), where the refusal cannot occur."""
    from airflow_keyset_provider.core.sql.source import _BYTE_ORDER_COLLATIONS

    with engine.connect() as c:
        names = (
            c.execute(
                sa.text(
                    "SELECT collname FROM pg_collation WHERE collencoding IN (-1, pg_char_to_encoding('UTF8')) "
                    "AND NOT collname = ANY(:skip) ORDER BY collname = 'und-x-icu' DESC, collname"
                ),
                {"skip": sorted(_BYTE_ORDER_COLLATIONS | {"default"})},
            )
            .scalars()
            .all()
        )
    for name in names:
        try:
            with engine.begin() as c:
                c.execute(sa.text(f'CREATE TABLE icu (k text COLLATE "{name}" PRIMARY KEY)'))
                c.execute(sa.text("INSERT INTO icu VALUES ('a'), ('B')"))
        except (
            sa.exc.DBAPIError
        ):  # listed but unusable in this build (e.g. ICU without ICU support)
            continue
        return str(name)
    return None


def _setup(engine: sa.Engine) -> None:
    with engine.begin() as c:
        for ddl in (
            "CREATE TABLE good (id bigint PRIMARY KEY, payload text NOT NULL)",
            "INSERT INTO good SELECT g, 'p' || g FROM generate_series(1, 50) g",
            "CREATE TABLE other (id bigint PRIMARY KEY)",
            "CREATE TABLE x (id int PRIMARY KEY)",
            "INSERT INTO x VALUES (1), (2)",
            "CREATE TABLE dup (k bigint NOT NULL, v text)",
            "CREATE INDEX ON dup (k)",
            "INSERT INTO dup VALUES (1, 'a'), (1, 'b')",
            "CREATE TABLE nul (k bigint, v text)",
            "CREATE UNIQUE INDEX ON nul (k)",
            "INSERT INTO nul VALUES (NULL, 'a'), (2, 'b')",
            "CREATE TABLE flt (k double precision PRIMARY KEY)",
            "INSERT INTO flt VALUES (0.1), (0.2)",
            "CREATE TABLE noidx (a int NOT NULL, b int NOT NULL, PRIMARY KEY (a, b))",
            "CREATE TABLE ts (k timestamp PRIMARY KEY)",
            "INSERT INTO ts SELECT '2026-01-01'::timestamp + g * interval '1 hour' FROM generate_series(1, 5) g",
            "CREATE TABLE tstz (k timestamptz PRIMARY KEY)",
            "INSERT INTO tstz SELECT '2026-01-01 00:00+00'::timestamptz + g * interval '1 hour' "
            "FROM generate_series(1, 20) g",
        ):
            c.execute(sa.text(ddl))


def source_snapshot(engine: sa.Engine, schema: str) -> dict[str, tuple[int, str]]:
    """Every table of the schema: row count and md5 of its rows in order."""
    with engine.connect() as c:
        tables = [
            r[0]
            for r in c.execute(
                sa.text("SELECT tablename FROM pg_tables WHERE schemaname = :s"), {"s": schema}
            )
        ]
        out = {}
        for tname in tables:
            q = f"SELECT count(*), md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM \"{tname}\" t"
            n, digest = c.execute(sa.text(q)).one()
            out[tname] = (int(n), digest)
        return out


def redis_snapshot(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Every key under ``<prefix>:`` with its full value."""
    out: dict[str, Any] = {}
    for raw in client.scan_iter(match=f"{prefix}:*", count=1000):
        k = raw.decode()
        kind = client.type(raw).decode()
        if kind == "hash":
            out[k] = {f.decode(): v.decode() for f, v in client.hgetall(raw).items()}
        elif kind == "string":
            out[k] = client.get(raw)
        elif kind == "list":
            out[k] = client.lrange(raw, 0, -1)
        elif kind == "set":
            out[k] = sorted(client.smembers(raw))
        elif kind == "zset":
            out[k] = client.zrange(raw, 0, -1, withscores=True)
        else:
            out[k] = kind
    return out


def _without_claim_fields(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot without what a claim writes: the range's lease fields, and the round's
    ``first_claim_ms`` (set once by the round's first claim, the start of its processing rate)."""
    return {
        k: (
            {f: v for f, v in val.items() if f not in CLAIM_FIELDS}
            if ":range:" in k
            else {f: v for f, v in val.items() if f != "first_claim_ms"}
            if isinstance(val, dict)
            else val
        )
        for k, val in snap.items()
    }


def test_bad_inputs_are_refused_clearly_and_write_nothing(
    pg_engine: sa.Engine,
    pg_schema: str,
    pg_schema_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    assert len(CASES) >= 15
    _setup(pg_engine)
    collation = _non_c_collation_table(pg_engine)
    cases = [c for c in CASES if c.name != NON_C_CASE or collation is not None]
    env = Env(pg_schema_url, redis_url, key_prefix)
    env.rnd = env.planned().plan(
        max_ranges=2, new_stream=True
    )  # the round the traverse cases point at
    problems: list[str] = []
    for case in cases:
        before_src = source_snapshot(pg_engine, pg_schema)
        before_redis = redis_snapshot(redis_client, key_prefix)
        try:
            case.call(env)
        except Exception as exc:
            err: Exception | None = exc
        else:
            err = None
        after_src = source_snapshot(pg_engine, pg_schema)
        after_redis = redis_snapshot(redis_client, key_prefix)
        if err is None:
            problems.append(f"{case.name}: accepted (no error)")
        else:
            msg = str(err).lower()
            if not isinstance(err, case.error):
                problems.append(
                    f"{case.name}: raised {type(err).__name__} ({err}), expected {case.error.__name__}"
                )
            elif not isinstance(err, KeysetError):
                problems.append(f"{case.name}: {type(err).__name__} is not a KeysetError")
            missing = [
                s
                for s in case.says
                if not any(
                    alt.replace("{collation}", str(collation)).lower() in msg
                    for alt in ((s,) if isinstance(s, str) else s)
                )
            ]
            if missing:
                problems.append(f"{case.name}: message {str(err)!r} lacks {missing}")
        if after_src != before_src:
            problems.append(f"{case.name}: the source changed: {before_src} -> {after_src}")
        if case.claims:
            if _without_claim_fields(after_redis) != _without_claim_fields(before_redis):
                problems.append(f"{case.name}: Redis progress state changed")
            owners = [v.get("owner") for k, v in after_redis.items() if ":range:" in k]
            if any(owners):
                problems.append(f"{case.name}: the range was not released: owners {owners}")
        elif after_redis != before_redis:
            changed = sorted(set(after_redis) ^ set(before_redis)) or [
                k for k in after_redis if after_redis[k] != before_redis.get(k)
            ]
            problems.append(f"{case.name}: Redis changed: {changed[:5]}")
    rs.record(
        "9 bad input",
        trials=len(cases),
        counter_errors=len(problems),
        note=f"{len(cases)} bad inputs; {len(problems)} not refused cleanly",
    )
    assert not problems, "\n".join(problems)
    # the injected DROP never ran and the round the traverse cases used is untouched
    assert source_snapshot(pg_engine, pg_schema)["x"][0] == 2
    for r in env.planned().range_status(env.rnd.round_id):
        assert (r["cursor_encoded"], r["done"], r["dead"], r["state"]) == (
            r["lo_encoded"],
            0,
            0,
            "pending",
        )
