"""The page's preview panel: a stream's latest preview (``PreviewRoundOperator``'s XCom
``keyset_preview``), through the plugin's API and in the page in the Airflow UI.

A ``kt_preview`` run (``tests/airflow/keyset_native_dags.py``: preview, then the plan it
previewed) is made with ``dag.test()`` against the real API server's metadata database and Redis
(``test_ui_native.run_native_dag``); then ``/keyset/api/streams/kt_preview/preview`` returns the
preview with the run it came from, and the page shows it above the stream's rounds.
"""

from __future__ import annotations

import json
from typing import Any

from keyset_page import open_in_airflow
from test_ui_native import run_native_dag


def test_the_page_shows_a_streams_latest_preview(
    airflow_api_server: Any, chromium: Any, pg_url: str, pg_schema: str, redis_url: str
) -> None:
    srv = airflow_api_server
    run_id = run_native_dag(srv, pg_url, pg_schema, redis_url, dag="kt_preview")
    token = srv.token()
    auth = {"Authorization": f"Bearer {token}"}

    code, _, body = srv.http("GET", "/keyset/api/streams/kt_preview/preview", headers=auth)
    assert code == 200, body
    p = json.loads(body)["preview"]
    assert (p["dag_id"], p["run_id"], p["task_id"]) == ("kt_preview", run_id, "preview")
    assert p["stream"] == "kt_preview" and p["start_key"] is None and p["estimated_rows"] > 0
    assert p["chunk_plan"]["scan"] == "index range", p["chunk_plan"]
    assert p["processor"]["ran"] and p["processor"]["applied"] == p["processor"]["keys"] > 0
    code, _, body = srv.http("GET", "/keyset/api/streams/no-such-stream/preview", headers=auth)
    assert code == 200 and json.loads(body)["preview"] is None, body
    assert srv.http("GET", "/keyset/api/streams/kt_preview/preview")[0] == 401

    open_in_airflow(chromium, srv.base_url, "plugin/keyset?stream=kt_preview&refresh=0", token)
    chromium.wait("document.querySelector('#keyset-app .preview')")
    shown = chromium.evaluate(
        "(() => { const p = document.querySelector('#keyset-app .preview');"
        " return {run: p.dataset.run, scan: p.querySelector('.preview-scan').innerText,"
        " processor: p.querySelector('.preview-processor').innerText}; })()"
    )
    assert shown["run"] == run_id, shown
    assert shown["scan"].startswith("index range"), shown
    assert "rolled back" in shown["processor"] and "failed" in shown["processor"], shown
