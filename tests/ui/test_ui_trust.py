"""Trust boundaries of the page, on a real Airflow API server (SimpleAuthManager, viewer and
editor), real Redis and real databases (issue 28):

- item 2: a marker value planted in every kind of failing write (type, unique, CHECK, foreign
  key, trigger RAISE/SIGNAL), on PostgreSQL (psycopg2, psycopg 3) and MariaDB (PyMySQL,
  mysqlclient), is found in none of: the log records, the dead letters, the page's JSON and
  the CLI's output (tables and ``--json``); each reason names its class and its constraint;
- item 4: a malformed name in the page's URL (``r1:range:0``, a trailing newline) gets 400 with
  the rule, never a 500;
- item 5: the state-changing routes take only JSON, from the server's own origin.
"""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.cli import main
from airflow_keyset_provider.core import ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.sql.target import make_target_engine
from airflow_keyset_provider.core.writeback import upsert

MARKER = "ssn-123-45-6789-MARKER"  # longer than the CHECK allows; never a valid integer
KINDS = {1: "type", 2: "unique", 3: "check", 4: "foreign key", 5: "trigger"}
GOOD_KEYS = [6, 7]
# per database family: what each kind's reason must name (its class and its constraint)
EXPECTED = {
    "postgresql": {
        1: ["22P02"],
        2: ["23505", "dst_email_uq"],
        3: ["23514", "dst_code_ck"],
        4: ["23503", "dst_parent_fk"],
        5: ["P0001"],
    },
    "mysql": {
        1: ["1366", "column n"],
        2: ["1062", "dst_email_uq"],
        3: ["4025", "dst_code_ck"],
        4: ["1452", "dst_parent_fk"],
        5: ["1644"],
    },
}
DATABASES = ["postgresql+psycopg2", "postgresql+psycopg", "mysql+pymysql", "mysql+mysqldb"]


@pytest.fixture
def pg_database_url(pg_url: str) -> Iterator[str]:
    """A throwaway PostgreSQL database: the plan's commit-order wait looks at every transaction
    of its database, and other suites share ``test``."""
    name = f"kstrust_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as c:
            c.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param.startswith("postgresql"):
        base: str = request.getfixturevalue("pg_database_url")
    else:
        if request.param == "mysql+mysqldb":
            pytest.importorskip("MySQLdb")
        base = request.getfixturevalue("mariadb_db_url")
    yield sa.make_url(base).set(drivername=request.param).render_as_string(hide_password=False)


def _schema(engine: sa.Engine) -> None:
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as c:

        def run(sql: str) -> None:  # text(): '%' in LIKE and RAISE is not a parameter
            c.execute(sa.text(sql))

        run("CREATE TABLE src (id INTEGER PRIMARY KEY)")
        run("INSERT INTO src VALUES (1), (2), (3), (4), (5), (6), (7)")
        run("CREATE TABLE parents (code VARCHAR(100) PRIMARY KEY)")
        run("INSERT INTO parents VALUES ('p1')")
        run(
            "CREATE TABLE dst (id INTEGER PRIMARY KEY, n INTEGER, email VARCHAR(100), "
            "code VARCHAR(100), parent VARCHAR(100), note VARCHAR(200), "
            "CONSTRAINT dst_email_uq UNIQUE (email), "
            "CONSTRAINT dst_code_ck CHECK (CHAR_LENGTH(code) < 20), "
            "CONSTRAINT dst_parent_fk FOREIGN KEY (parent) REFERENCES parents (code))"
        )
        run(  # the row the unique write collides with
            f"INSERT INTO dst VALUES (100, 0, '{MARKER}', 'c', 'p1', 'ok')"
        )
        if pg:
            run(
                "CREATE FUNCTION dst_note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.note LIKE 'ssn-%' THEN RAISE EXCEPTION 'note % is not allowed', "
                "NEW.note; END IF; RETURN NEW; END $$"
            )
            run(
                "CREATE TRIGGER dst_note BEFORE INSERT OR UPDATE ON dst "
                "FOR EACH ROW EXECUTE FUNCTION dst_note()"
            )
        else:
            run(
                "CREATE TRIGGER dst_note BEFORE INSERT ON dst FOR EACH ROW BEGIN "
                "IF NEW.note LIKE 'ssn-%' THEN "
                "SET @keyset_msg = CONCAT('note ', NEW.note, ' is not allowed'); "
                "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = @keyset_msg; END IF; END"
            )


def _row(k: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": k,
        "n": k,
        "email": f"u{k}@example.com",
        "code": "c",
        "parent": "p1",
        "note": "ok",
    }
    field = {1: "n", 2: "email", 3: "code", 4: "parent", 5: "note"}.get(k)
    if field:
        row[field] = MARKER
    return row


def _texts(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter()
    out = []
    for record in caplog.records:
        out.append(record.getMessage())
        if record.exc_info:
            out.append(formatter.formatException(record.exc_info))
    return "\n".join(out)


def _cli(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    assert code in (0, 3), err.getvalue()
    return out.getvalue() + err.getvalue()


def test_no_row_value_reaches_logs_dead_letters_page_or_cli(
    airflow_api_server: Any, db_url: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    srv = airflow_api_server
    family = "postgresql" if db_url.startswith("postgresql") else "mysql"
    stream = "trust-" + db_url.split("://")[0].replace("+", "-")
    setup = sa.create_engine(db_url)
    _schema(setup)
    setup.dispose()
    writer = make_target_engine(db_url)  # hide_parameters, as the provider's engines

    def processor(chunk: Any) -> ChunkResult:
        outcome = upsert(writer, "dst", [_row(k) for k in chunk.keys], conflict="id")
        return ChunkResult(failed=outcome.failed)

    t = KeysetTraversal(
        db_url, "src", "id", redis_url=redis_url, stream=stream, key_prefix=srv.key_prefix
    )
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        res = t.traverse(
            rnd.round_id, 0, processor, chunk_size=10, max_item_attempts=1, item_retry_delay=0
        )
        assert res.complete and res.done == len(GOOD_KEYS) and res.dead == len(KINDS)
        letters = {d["key"]: d["error"] for d in t.control.dead_letters(rnd.round_id, 0, 50)}
    finally:
        t.close()
        writer.dispose()
    assert sorted(letters) == sorted(KINDS), letters
    for key, needles in EXPECTED[family].items():
        for needle in needles:  # each reason names its class and constraint: not vacuous
            assert needle in letters[key], (KINDS[key], letters[key])

    viewer = {"Authorization": f"Bearer {srv.token()}"}
    page = []
    for path in (
        "/keyset/api/streams",
        f"/keyset/api/streams/{stream}",
        f"/keyset/api/streams/{stream}/rounds/{rnd.round_id}?dead=50",
    ):
        status, _, body = srv.http("GET", path, headers=viewer)
        assert status == 200, body
        page.append(body.decode())
    assert "dst_email_uq" in page[2]  # the dead letters are on the page
    where = ["--redis-url", redis_url, "--key-prefix", srv.key_prefix]
    cli = [
        _cli("dead-letters", stream, rnd.round_id, *where),
        _cli("dead-letters", stream, rnd.round_id, "--json", *where),
        _cli("ranges", stream, rnd.round_id, *where),
        _cli("status", stream, "--round", rnd.round_id, "--json", *where),
    ]
    assert "dst_email_uq" in cli[1]
    everything = {"logs": _texts(caplog), "dead letters": json.dumps(letters)}
    everything |= {f"page {i}": p for i, p in enumerate(page)}
    everything |= {f"cli {i}": c for i, c in enumerate(cli)}
    leaked = {where: text for where, text in everything.items() if MARKER in text}
    assert not leaked, leaked


def test_the_row_data_opt_in_shows_the_server_s_message(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AIRFLOW_KEYSET_LOG_ROW_DATA=1`` (the existing opt-in) gives the database's message."""
    monkeypatch.setenv("AIRFLOW_KEYSET_LOG_ROW_DATA", "1")
    engine = sa.create_engine(db_url)
    _schema(engine)
    try:
        outcome = upsert(engine, "dst", [_row(k) for k in (2, 5)], conflict="id")
    finally:
        engine.dispose()
    assert sorted(outcome.failed) == [2, 5]
    assert MARKER in outcome.failed[5]  # the trigger's own text, as the user asked


# ----------------------------------------------------------------------------- names (item 4)


def _raw(srv: Any, method: str, path: str, headers: dict[str, str], data: bytes | None = None):
    req = urllib.request.Request(srv.base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _plan(srv: Any, sqlite_url: str, redis_url: str, stream: str) -> KeysetTraversal:
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE ev (seq INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO ev VALUES (1), (2), (3)")
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, "ev", "seq", redis_url=redis_url, stream=stream, key_prefix=srv.key_prefix
    )
    t.plan(max_ranges=2, new_stream=True)
    return t


def test_a_malformed_name_in_the_page_url_gets_400_with_the_rule(
    airflow_api_server: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    t = _plan(srv, sqlite_url, redis_url, "trust-names")
    viewer = {"Authorization": f"Bearer {srv.token()}", "Accept": "application/json"}
    try:
        base = "/keyset/api/streams/trust-names"
        assert _raw(srv, "GET", f"{base}/rounds/r1", viewer)[0] == 200
        for path, rule in [
            (f"{base}/rounds/r1:range:0", "round id"),  # range 0's hash, read as a round: 500
            (f"{base}/rounds/r1%0A", "round id"),
            (f"{base}/rounds/r1%3Aretry%3A0", "round id"),
            ("/keyset/api/streams/trust-names%0A", "stream name"),
            ("/keyset/api/streams/trust-names%0A/rounds/r1", "stream name"),
            ("/keyset/api/streams/%7Bx%7D", "stream name"),
            ("/keyset/api/runs/dag%0A/run", "DAG id"),
            ("/keyset/api/runs/dag/run%0A", "run id"),
        ]:
            status, body = _raw(srv, "GET", path, viewer)
            detail = json.loads(body)["detail"]
            if status == 404 and "%0A" in path:  # Starlette's router matches no route at all
                assert detail == "Not Found", (path, body)
                continue
            assert status == 400, (path, status, body)
            assert rule in detail, (path, body)
    finally:
        t.close()


# ----------------------------------------------------------------------- JSON, same origin (5)


def test_state_changing_routes_take_only_same_origin_json(
    airflow_api_server: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    t = _plan(srv, sqlite_url, redis_url, "trust-csrf")
    editor = {"Authorization": f"Bearer {srv.token('editor', srv.editor_password)}"}
    own = srv.base_url
    try:
        t.control.pause("maintenance", by="test")
        for action in ("resume", "pause"):
            path = f"/keyset/api/streams/trust-csrf/{action}"
            refused = [
                ({"Content-Type": "application/x-www-form-urlencoded"}, b"reason=x", 415),
                ({"Content-Type": "text/plain"}, b'{"reason": "x"}', 415),
                ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--", 415),
                ({}, b"", 415),
                (
                    {"Content-Type": "application/json", "Origin": "https://evil.example"},
                    b"{}",
                    403,
                ),
                ({"Content-Type": "application/json", "Origin": "null"}, b"{}", 403),
                ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, b"{}", 403),
                ({"Content-Type": "application/json", "Sec-Fetch-Site": "same-site"}, b"{}", 403),
            ]
            before = t.control.control_state().paused
            for headers, data, expected in refused:
                status, body = _raw(srv, "POST", path, {**editor, **headers}, data)
                assert status == expected, (action, headers, status, body)
                assert t.control.control_state().paused == before, (action, headers)
            # the page's own request: same origin, JSON
            page = {
                **editor,
                "Content-Type": "application/json; charset=utf-8",
                "Origin": own,
                "Sec-Fetch-Site": "same-origin",
            }
            status, body = _raw(srv, "POST", path, page, b"{}")
            assert status == 200, body
            assert t.control.control_state().paused == (action == "pause")
    finally:
        t.close()
