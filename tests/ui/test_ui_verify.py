"""The page shows a round's verification (``verify=``) in the round's head, from the one status
model: a failed one with its count and first keys, in the error colour; never row data. Real
Airflow API server, real Redis, real PostgreSQL, a real browser (see ``test_ui_page.py``)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from keyset_page import open_in_airflow

from airflow_keyset_provider.core import KeysetTraversal

STREAM = "ui-verify"
VERIFY = "v LIKE 'stale%'"


def test_the_page_shows_a_failed_verification_with_count_and_keys(
    airflow_api_server: Any, chromium: Any, pg_schema_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    engine = sa.create_engine(pg_schema_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE vt (k bigint PRIMARY KEY, v text NOT NULL)")
        conn.execute(sa.text("INSERT INTO vt VALUES (:k, 'ok')"), [{"k": i} for i in range(1, 61)])
    t = KeysetTraversal(
        pg_schema_url, "vt", "k", redis_url, stream=STREAM, key_prefix=srv.key_prefix
    )
    try:
        rnd = t.plan(2, new_stream=True, verify=VERIFY)
        for spec in rnd.ranges:
            t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=25)
        with engine.begin() as conn:  # 'stale-secret' is row data: never on the page
            conn.exec_driver_sql("UPDATE vt SET v = 'stale-secret-' || k WHERE k IN (3, 7, 44)")
        assert not t.verify_round(rnd.round_id, VERIFY, max_keys=2).verified
        open_in_airflow(
            chromium, srv.base_url, f"plugin/keyset?stream={STREAM}&refresh=0", srv.token()
        )
        chromium.wait("document.querySelector('.round .verification')")
        shown = chromium.evaluate(
            "(e => [e.dataset.verify, e.textContent])(document.querySelector('.round .verification'))"
        )
        page_text = chromium.evaluate("document.querySelector('#keyset-app').textContent")
    finally:
        t.close()
        engine.dispose()
    assert shown == ["failed", "verify failed: 3 row(s) still match (first keys: 3, 7, …)"]
    assert "secret" not in page_text
