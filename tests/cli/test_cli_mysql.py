"""``airflow-keyset`` commands that take a source, on MariaDB: ``replay-dead-letters`` reads the
round's dead letters back from a MariaDB table named by an Airflow ``mysql`` connection
(``--source-conn-id``; its URL is built from the connection's fields, so no mysql provider is
needed) or by ``--source-url``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from cli_support import build_live_round
from sqlalchemy.engine import make_url

from airflow_keyset_provider.cli.exits import EXIT_OK


def _mysql_conn(url: str) -> str:
    u = make_url(url)
    return json.dumps(
        {
            "conn_type": "mysql",
            "host": u.host,
            "port": u.port,
            "login": u.username,
            "password": u.password,
            "schema": u.database,
            "extra": {"driver": "pymysql"},
        }
    )


@pytest.mark.parametrize("how", ["conn_id", "url"])
def test_replay_dead_letters_from_a_mariadb_source(
    mariadb_db_url, redis_url, key_prefix, tmp_path: Path, monkeypatch, how
):
    lr = build_live_round(mariadb_db_url, redis_url, key_prefix)
    try:
        (tmp_path / "fixed_processor_m.py").write_text(
            textwrap.dedent("""
            def process(chunk):
                return None  # the bug is fixed: every item succeeds now
        """)
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("AIRFLOW_CONN_KT_MYSQL_CLI", _mysql_conn(mariadb_db_url))
        source = (
            ["--source-conn-id", "kt_mysql_cli"]
            if how == "conn_id"
            else ["--source-url", mariadb_db_url]
        )
        assert lr.cli_json("dead-letters", "events-nightly", "r1")["dead_total"] > 0
        doc = lr.cli_json(
            "replay-dead-letters",
            "events-nightly",
            "r1",
            *source,
            "--table",
            "events",
            "--key",
            "seq",
            "--item-retry-delay",
            "0",
            "--processor",
            "fixed_processor_m:process",
        )
        assert doc["still_dead"] == 0
        assert lr.cli_json("dead-letters", "events-nightly", "r1")["dead_total"] == 0
        code, out, _ = lr.cli(
            "replay-dead-letters",
            "events-nightly",
            "r1",
            *source,
            "--table",
            "events",
            "--key",
            "seq",
            "--processor",
            "fixed_processor_m:process",
        )
        assert code == EXIT_OK and "no dead letters to replay" in out
    finally:
        lr.traversal.close()
