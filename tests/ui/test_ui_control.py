"""The UI page's pause/resume: allowed only to users who may edit DAGs, through Airflow's auth
manager, against a real Airflow API server and real Redis. The stream JSON carries the governor,
health and pause state (``control``) and whether the signed-in user may act (``can_edit``)."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from keyset_page import open_in_airflow

from airflow_keyset_provider.core import KeysetTraversal

STREAM = "ui-control"


def test_pause_resume_need_dag_edit_rights(
    airflow_api_server: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE ctl_events (seq INTEGER PRIMARY KEY, payload TEXT NOT NULL)"
        )
        conn.exec_driver_sql("INSERT INTO ctl_events VALUES (1, 'a'), (2, 'b')")
    t = KeysetTraversal(
        sqlite_url,
        "ctl_events",
        "seq",
        redis_url=redis_url,
        stream=STREAM,
        key_prefix=srv.key_prefix,
    )
    t.plan(max_ranges=1, new_stream=True)
    t.throttle(5000)
    viewer = {"Authorization": f"Bearer {srv.token()}"}
    editor = {"Authorization": f"Bearer {srv.token('editor', srv.editor_password)}"}
    base = f"/keyset/api/streams/{STREAM}"

    def get(headers: dict[str, str]) -> dict[str, Any]:
        status, _, body = srv.http("GET", base, headers=headers)
        assert status == 200, body
        return json.loads(body)

    doc = get(viewer)
    assert doc["can_edit"] is False and doc["control"]["paused"] is False
    assert doc["control"]["max_rows_per_second"] == 5000.0
    # A viewer may look but not act; nobody acts without a token.
    assert srv.http("POST", f"{base}/pause", headers=viewer, body={"reason": "x"})[0] == 403
    assert srv.http("POST", f"{base}/pause", body={"reason": "x"})[0] == 401
    assert t.control.control_state().paused is False
    # An editor may; the pause lands in Redis and every reader sees it.
    assert get(editor)["can_edit"] is True
    status, _, body = srv.http("POST", f"{base}/pause", headers=editor, body={"reason": "deploy"})
    assert status == 200, body
    assert json.loads(body)["control"]["paused"] is True
    state = t.control.control_state()
    assert state.paused and state.reason == "deploy" and state.paused_by == "ui:editor"
    assert get(viewer)["control"]["reason"] == "deploy"
    assert srv.http("POST", f"{base}/resume", headers=viewer, body={})[0] == 403
    status, _, body = srv.http("POST", f"{base}/resume", headers=editor, body={})
    assert status == 200 and json.loads(body)["control"]["paused"] is False
    assert t.control.control_state().paused is False
    # Unknown stream: 404, nothing written; a form post (not JSON) is refused.
    assert (
        srv.http("POST", "/keyset/api/streams/no-such-stream/pause", headers=editor, body={})[0]
        == 404
    )
    form = {**editor, "Content-Type": "application/x-www-form-urlencoded"}
    status, _, _ = srv.http("POST", f"{base}/pause", headers=form, body=None)
    assert status == 422 and t.control.control_state().paused is False
    t.close()


def test_page_shows_pause_governor_and_health_with_buttons_for_editors(
    airflow_api_server: Any, chromium: Any, sqlite_url: str, redis_url: str
) -> None:
    """In the browser: a paused, throttled, unhealthy stream shows the three badges with the
    reasons; the editor sees a Resume button, the viewer none."""
    srv = airflow_api_server
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE ctl_events2 (seq INTEGER PRIMARY KEY, payload TEXT NOT NULL)"
        )
        conn.exec_driver_sql("INSERT INTO ctl_events2 VALUES (1, 'a')")
    stream = "ui-control-page"
    t = KeysetTraversal(
        sqlite_url,
        "ctl_events2",
        "seq",
        redis_url=redis_url,
        stream=stream,
        key_prefix=srv.key_prefix,
    )
    t.plan(max_ranges=1, new_stream=True)
    t.throttle(1200)
    t.pause("nightly deploy", by="ana")
    health_key = f"{t.store.control_key}:health"
    t.store.client.hset(
        health_key,
        mapping={"healthy": "0", "reason": "replication lag 42 s > 30 s", "checked_at": "1"},
    )
    page = f"plugin/keyset?refresh=0&stream={stream}"
    js = f"""(() => {{
        const s = document.querySelector('section.stream[data-stream="{stream}"]');
        const c = s && s.querySelector('.control');
        return c ? {{ badges: [...c.querySelectorAll('[data-control]')].map(b => b.dataset.control),
                      text: c.innerText, resume: !!c.querySelector('button.resume'),
                      pause: !!c.querySelector('button.pause') }} : null; }})()"""
    try:
        for user, password, buttons in (
            ("viewer", None, False),
            ("editor", srv.editor_password, True),
        ):
            open_in_airflow(chromium, srv.base_url, page, srv.token(user, password))
            shown = chromium.evaluate(js)
            assert shown is not None, f"{user}: no control bar"
            assert shown["badges"] == ["paused", "throttled", "unhealthy"], shown
            assert "nightly deploy" in shown["text"] and "by ana" in shown["text"]
            assert (
                "1,200 rows/s" in shown["text"] and "replication lag 42 s > 30 s" in shown["text"]
            )
            assert (shown["resume"], shown["pause"]) == (buttons, False), (user, shown)
    finally:
        t.store.client.delete(health_key)
        t.close()
