"""The "Keyset traversals" Airflow UI page, end to end: a real Airflow API server, real Redis, a live
round made by the real engine, and a real headless Chromium.

The round (stream ``ui-nightly``, source: a 400-row SQLite table keyed by ``seq``):

- ``r1`` = ``(-inf, 100]``, traversed and closed, so the watermark is 100;
- ``r2`` = ``(100, 400]`` in 4 ranges:
  range 0 complete, with key 142 dead-lettered ("poison: ..."),
  range 1 stopped after one chunk and released (no owner: lagging) by the task instance
  ``ui_dag / manual__1 / traverse [1]`` (its owner lineage), one item of it waiting for a retry
  with the error ``RETRY_ERROR``,
  range 2 held by a live worker (a thread inside ``traverse``, heartbeating: not lagging),
  range 3 never claimed (lagging).

Stream ``ui-readings`` (PostgreSQL, composite key ``(ts timestamptz, id)``): one open round of 2
ranges, never claimed, whose bounds are ``(timestamp, id)`` pairs.

Authentication: the browser gets the JWT from the server's own ``POST /auth/token`` (the call
Airflow's login page makes) and carries it in the ``_token`` cookie, as the Airflow UI does.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from keyset_page import (
    COLOURS_JS,
    LAYOUT_JS,
    assert_layout,
    colour_mode,
    contrast,
    keep_screenshots,
    luminance,
    mean_brightness,
    open_in_airflow,
    severe,
)
from test_ui_native import get_no_redirect

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal

STREAM = "ui-nightly"
POISON_KEY = 142
POISON_ERROR = "poison: payload is not valid JSON"
RETRY_ERROR = "timeout calling the billing API"
LINEAGE = "ui_dag/manual__1/traverse/1"
COMPOSITE = "ui-readings"


# --------------------------------------------------------------------------- a live round


@contextmanager
def live_round(sqlite_url: str, redis_url: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Build the round described in the module docstring; the range-2 worker lives until exit."""
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (seq INTEGER PRIMARY KEY, payload TEXT NOT NULL)")
        conn.execute(
            sa.text("INSERT INTO events VALUES (:seq, :payload)"),
            [{"seq": i, "payload": f'{{"n": {i}}}'} for i in range(1, 401)],
        )
    engine.dispose()

    def traversal() -> KeysetTraversal:
        return KeysetTraversal(
            sqlite_url,
            table="events",
            key="seq",
            redis_url=redis_url,
            stream=STREAM,
            key_prefix=prefix,
        )

    t = traversal()
    r1 = t.plan(max_ranges=2, end_key=100, new_stream=True)
    for spec in r1.ranges:
        t.traverse(r1.round_id, spec.range_id, lambda chunk: None)
    t.close_round(r1.round_id)

    r2 = t.plan(max_ranges=4, new_stream=True)
    assert r2.round_id == "r2" and len(r2.ranges) == 4, r2

    def poison(chunk: Any) -> ChunkResult:
        return ChunkResult(failed={k: POISON_ERROR for k in chunk.keys if k == POISON_KEY})

    done0 = t.traverse("r2", 0, poison, chunk_size=20, max_item_attempts=2, item_retry_delay=0)
    assert done0.complete and done0.dead == 1, done0

    def fail_one_then_stop(chunk: Any) -> ChunkResult:
        t.request_stop()
        return ChunkResult(failed={chunk.keys[0]: RETRY_ERROR})

    part1 = t.traverse(
        "r2", 1, fail_one_then_stop, chunk_size=20, owner_lineage=LINEAGE, item_retry_delay=60
    )
    assert part1.stopped and not part1.complete, part1

    # Range 2: a real worker that processes one chunk, then holds the range (heartbeating) until
    # the test lets it go.
    worker = traversal()
    release = threading.Event()
    calls = []

    def hold_after_first_chunk(chunk: Any) -> None:
        calls.append(len(chunk.rows))
        if len(calls) > 1:
            release.wait(120)

    results: list[Any] = []
    thread = threading.Thread(
        target=lambda: results.append(
            worker.traverse(
                "r2", 2, hold_after_first_chunk, chunk_size=20, lease_seconds=60, prefetch=False
            )
        ),
        name="ui-test-range-2-owner",
        daemon=True,
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 2:  # the first chunk is committed once the second one is in hand
            assert thread.is_alive() or results, "range 2 worker ended early"
            assert time.monotonic() < deadline, "range 2 worker did not take its first chunk"
            time.sleep(0.05)
        yield {"round": r2, "traversal": t}
    finally:
        worker.request_stop()
        release.set()
        thread.join(30)
        worker.close()
        t.close()


def composite_round(pg_schema_url: str, redis_url: str, prefix: str) -> None:
    """Stream ``COMPOSITE``: an open round of 2 ranges over ``(ts timestamptz, id)``."""
    engine = sa.create_engine(pg_schema_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE readings (ts timestamptz NOT NULL, id integer NOT NULL, "
            "PRIMARY KEY (ts, id))"
        )
        conn.exec_driver_sql(
            "INSERT INTO readings SELECT timestamptz '2024-05-01 10:00:00+00' "
            "+ (i / 10) * interval '1 hour', 41230 + i FROM generate_series(1, 40) AS i"
        )
    engine.dispose()
    t = KeysetTraversal(
        pg_schema_url,
        table="readings",
        key=["ts", "id"],
        redis_url=redis_url,
        stream=COMPOSITE,
        key_prefix=prefix,
    )
    try:
        rnd = t.plan(max_ranges=2, new_stream=True)
        assert len(rnd.ranges) == 2, rnd
    finally:
        t.close()


# --------------------------------------------------------------------------- tests


def test_plugin_api_requires_airflow_login(airflow_api_server: Any) -> None:
    srv = airflow_api_server
    # No credential at all: 401, for the JSON API and for the page (which links to Airflow's login).
    assert srv.http("GET", "/keyset/api/streams")[0] == 401
    assert srv.http("GET", f"/keyset/api/streams/{STREAM}")[0] == 401
    status, _, body = srv.http("GET", "/keyset/", headers={"Accept": "text/html"})
    assert status == 401 and b"/auth/login" in body and b"Sign in to Airflow" in body
    # A forged or garbage token: refused.
    for headers in ({"Authorization": "Bearer not-a-jwt"}, {"Cookie": "_token=not-a-jwt"}):
        assert srv.http("GET", "/keyset/api/streams", headers=headers)[0] in (401, 403)
    # A wrong password gets no token.
    wrong = {"username": srv.username, "password": "wrong"}
    assert srv.http("POST", "/auth/token", body=wrong)[0] == 401

    token = srv.token()
    auth = {"Authorization": f"Bearer {token}"}
    for headers in (auth, {"Cookie": f"_token={token}"}):
        status, _, body = srv.http("GET", "/keyset/api/streams", headers=headers)
        assert status == 200, body
        listing = json.loads(body)
        assert (listing["redis_conn_id"], listing["key_prefix"]) == (
            srv.redis_conn_id,
            srv.key_prefix,
        )
    # Read-only: no write method on the listing; unknown stream: 404 with a message, not a 500.
    assert srv.http("POST", "/keyset/api/streams", headers=auth, body={})[0] == 405
    assert srv.http("GET", "/keyset/api/streams/no-such-stream", headers=auth)[0] == 404

    # The page is the React app in the Airflow UI: /keyset/ leads there, query kept.
    code, headers, _ = get_no_redirect(srv, "/keyset/?stream=s&round=r2", token)
    assert code == 307 and headers["location"] == "/plugin/keyset?stream=s&round=r2", headers

    # The plugin is registered with the API server: the FastAPI app and three React apps on
    # one bundle, which is served (public, static) as JavaScript.
    status, _, body = srv.http("GET", "/api/v2/plugins", headers=auth)
    assert status == 200, body
    plugin = next(p for p in json.loads(body)["plugins"] if p["name"] == "keyset")
    assert [a["url_prefix"] for a in plugin["fastapi_apps"]] == ["/keyset"]
    assert plugin["external_views"] == []
    apps = {a["destination"]: a for a in plugin["react_apps"]}
    assert {d: (a["name"], a["url_route"]) for d, a in apps.items()} == {
        "nav": ("Keyset traversals", "keyset"),
        "dag_run": ("Keyset round", "keyset-run"),
        "task_instance": ("Keyset range", "keyset-range"),
    }
    assert len({a["bundle_url"] for a in apps.values()}) == 1
    bundle = apps["nav"]["bundle_url"]
    assert bundle.startswith("keyset/static/keyset-ui.js?v="), bundle
    status, headers, js = srv.http("GET", "/" + bundle)
    assert status == 200 and headers["content-type"].startswith("text/javascript"), headers
    assert b"AirflowPlugin" in js and b"Keyset round" in js


def _page_dom(chromium: Any) -> dict[str, Any]:
    return chromium.evaluate(f"""(() => {{
        const s = document.querySelector('section.stream[data-stream="{STREAM}"]');
        const r = s && s.querySelector('section.round[data-round="r2"]');
        const all = (root, sel) => root ? [...root.querySelectorAll(sel)] : [];
        const c = document.querySelector('section.stream[data-stream="{COMPOSITE}"]');
        return {{
          error: (document.getElementById('error') || {{innerText: ''}}).innerText,
          stream: s && s.querySelector('.stream-name').textContent,
          watermark: s && s.querySelector('.watermark').textContent,
          rounds: all(s, 'table.rounds tr.round-row').map(tr => [tr.dataset.round, tr.children[1].textContent]),
          roundHead: r && r.querySelector('.round-head').innerText,
          ranges: all(r, 'tr.range-row').map(tr => {{
            const note = r.querySelector(`tr.range-note[data-range="${{tr.dataset.range}}"]`);
            return {{id: tr.dataset.range, state: tr.dataset.state, lagging: tr.classList.contains('lagging'),
                    text: tr.innerText + ' ' + (note ? note.innerText : ''),
                    link: note && note.querySelector('a.ti-link') ? note.querySelector('a.ti-link').href : null}};
          }}),
          bars: all(r, 'svg.range-chart rect.chart-bar').map(b => [b.dataset.range, b.classList.contains('lagging')]),
          dead: all(r, 'tr.dead-letter').map(tr => tr.innerText),
          deadCount: r && r.querySelector('.dead-letters').dataset.dead,
          composite: all(c, 'tr.range-row td.bounds .keyset-clip').map(e => e.textContent),
        }};
    }})()""")


def test_page_in_the_airflow_ui_light_and_dark_at_1280_and_1024(
    airflow_api_server: Any,
    chromium: Any,
    sqlite_url: str,
    pg_schema_url: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The page renders the live round inside Airflow's own layout (no frame), logs no console
    error, and at 1280 and 1024 px, light and dark: reads without sideways scrolling, each table
    inside its panel, one scrollbar, composite bounds on one line with a tooltip; its text
    colours follow Airflow's colour mode. A stopped range says what the store knows of why, with
    a link to the task instance that held it last."""
    srv = airflow_api_server
    composite_round(pg_schema_url, redis_url, srv.key_prefix)
    with live_round(sqlite_url, redis_url, srv.key_prefix):
        chromium.resize(1280, 800)
        open_in_airflow(chromium, srv.base_url, "plugin/keyset?refresh=0", srv.token())
        chromium.wait(f"document.querySelector('section.stream[data-stream=\"{STREAM}\"]')")
        dom = _page_dom(chromium)
        console = chromium.console()
        seen: dict[tuple[str, int], dict[str, Any]] = {}
        shots = []
        for scheme in ("light", "dark"):
            colour_mode(chromium, scheme)
            for width in (1280, 1024):
                chromium.resize(width, 800)
                chromium.wait(f"document.scrollingElement.clientWidth <= {width}")
                layout = chromium.evaluate(LAYOUT_JS)
                shot = chromium.screenshot(tmp_path / f"keyset-ui-{scheme}-{width}.png")
                shots.append(shot)
                seen[(scheme, width)] = {
                    "layout": layout,
                    "colours": chromium.evaluate(COLOURS_JS),
                    "brightness": mean_brightness(shot),
                }
                # The composite-key stream on its own (scrolled into view: after the page's shot).
                part = tmp_path / f"keyset-ui-composite-{scheme}-{width}.png"
                chromium.driver.find_element(
                    "css selector", f'section.stream[data-stream="{COMPOSITE}"]'
                ).screenshot(str(part))
                shots.append(part)
    measures = tmp_path / "keyset-ui-measures.json"
    measures.write_text(json.dumps({f"{k[0]}-{k[1]}": v for k, v in seen.items()}, indent=1))
    keep_screenshots(*shots, measures)

    assert dom["error"] == "", dom["error"]
    assert dom["stream"] == STREAM and dom["watermark"] == "100"
    assert dom["rounds"] == [["r2", "open"], ["r1", "closed"]]  # open rounds first
    assert "(100, 400]" in dom["roundHead"] and "1/4 ranges complete" in dom["roundHead"]
    ranges = {r["id"]: r for r in dom["ranges"]}
    assert sorted(ranges) == ["0", "1", "2", "3"]
    assert ranges["0"]["state"] == "complete" and not ranges["0"]["lagging"]
    assert ranges["1"]["state"] == "pending" and ranges["1"]["lagging"]
    assert "released unfinished" in ranges["1"]["text"]
    # Why range 1 stopped: the store's record of it (the last task, the item's last error).
    assert "last held by traverse [1]" in ranges["1"]["text"], ranges["1"]["text"]
    assert (
        RETRY_ERROR in ranges["1"]["text"]
        and "1 item(s) waiting for a retry" in ranges["1"]["text"]
    )
    assert (
        ranges["1"]["link"] == f"{srv.base_url}/dags/ui_dag/runs/manual__1/tasks/traverse/mapped/1"
    )
    assert ranges["2"]["state"] == "running" and not ranges["2"]["lagging"]
    assert ranges["2"]["link"] is None
    assert ranges["3"]["state"] == "pending" and ranges["3"]["lagging"]
    assert "never claimed" in ranges["3"]["text"]
    assert dom["bars"] == [["0", False], ["1", True], ["2", False], ["3", True]]
    assert dom["deadCount"] == "1"
    assert (
        len(dom["dead"]) == 1
        and str(POISON_KEY) in dom["dead"][0]
        and POISON_ERROR in dom["dead"][0]
    )
    # Composite bounds: one line, "timestamp · id", UTC as Z.
    stamp = r"2024-05-01T\d\d:00:00Z · 412\d\d"
    assert re.fullmatch(rf"\(-inf, {stamp}\]", dom["composite"][0]), dom["composite"]
    assert re.fullmatch(rf"\({stamp}, 2024-05-01T14:00:00Z · 41270\]", dom["composite"][1])
    assert severe(console) == [], console
    # No frame, so no "can escape its sandboxing" warning (nor any other about a sandbox).
    assert not [e for e in console if "sandbox" in e.get("message", "")], console

    for (scheme, width), got in seen.items():
        assert_layout(got["layout"], f"{scheme} at {width} px")
        assert scheme in got["colours"]["mode"]
        assert contrast(got["colours"]["text"], got["colours"]["bg"]) >= 4.5, got["colours"]
    light, dark = seen[("light", 1280)], seen[("dark", 1280)]
    assert luminance(light["colours"]["text"]) < 0.2 < luminance(dark["colours"]["text"]), (
        light["colours"],
        dark["colours"],
    )
    assert luminance(light["colours"]["bg"]) > 0.6 > 0.2 > luminance(dark["colours"]["bg"])
    assert dark["brightness"] < light["brightness"] - 60, (light["brightness"], dark["brightness"])
