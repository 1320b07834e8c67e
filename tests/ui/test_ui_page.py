"""The "Keyset traversals" Airflow UI page, end to end: a real Airflow API server, real Redis, a live
round made by the real engine, and a real headless Chromium.

The round (stream ``ui-nightly``, source: a 400-row SQLite table keyed by ``seq``):

- ``r1`` = ``(-inf, 100]``, traversed and closed, so the watermark is 100;
- ``r2`` = ``(100, 400]`` in 4 ranges:
  range 0 complete, with key 142 dead-lettered ("poison: ..."),
  range 1 stopped after one chunk and released (no owner: lagging),
  range 2 held by a live worker (a thread inside ``traverse``, heartbeating: not lagging),
  range 3 never claimed (lagging).

Authentication: the browser gets the JWT from the server's own ``POST /auth/token`` (the call
Airflow's login page makes) and carries it in the ``_token`` cookie, as the Airflow UI does.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from PIL import Image

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal

STREAM = "ui-nightly"
POISON_KEY = 142
POISON_ERROR = "poison: payload is not valid JSON"
RED, GREEN, BLUE, LAG_ROW = (224, 49, 49), (47, 158, 68), (28, 126, 214), (255, 240, 240)


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
    r1 = t.plan(max_ranges=2, end_key=100)
    for spec in r1.ranges:
        t.traverse(r1.round_id, spec.range_id, lambda chunk: None)
    t.close_round(r1.round_id)

    r2 = t.plan(max_ranges=4)
    assert r2.round_id == "r2" and len(r2.ranges) == 4, r2

    def poison(chunk: Any) -> ChunkResult:
        return ChunkResult(failed={k: POISON_ERROR for k in chunk.keys if k == POISON_KEY})

    done0 = t.traverse("r2", 0, poison, chunk_size=20, max_item_attempts=2, item_retry_delay=0)
    assert done0.complete and done0.dead == 1, done0

    def stop_after_first_chunk(chunk: Any) -> None:
        t.request_stop()

    part1 = t.traverse("r2", 1, stop_after_first_chunk, chunk_size=20)
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


# --------------------------------------------------------------------------- page checks


def colours(png: Path) -> tuple[tuple[int, int], Counter[tuple[int, int, int]]]:
    """``(size, pixel count per RGB colour)`` of a screenshot, read with Pillow."""
    with Image.open(png) as img:
        rgb = img.convert("RGB")
        pairs = rgb.getcolors(maxcolors=rgb.width * rgb.height) or []
        return rgb.size, Counter({colour: n for n, colour in pairs})


# Geometry of the ranges tables in a document (``doc``: the top document or the frame's).
LAYOUT_JS = """(doc => {
  const view = doc.documentElement.clientWidth;
  const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right}; };
  return {
    view, page: doc.documentElement.scrollWidth,
    containers: [...doc.querySelectorAll('div.scroll')].map(c => ({scroll: c.scrollWidth, client: c.clientWidth})),
    cells: [...doc.querySelectorAll('table.ranges td')].map(td => ({...box(td), scroll: td.scrollWidth,
             client: td.clientWidth, cls: td.className, text: td.textContent})),
  };
})(%s)"""
FRAME_DOC = "document.querySelector('iframe').contentDocument"


def assert_reads_fully(layout: dict[str, Any], where: str) -> None:
    """No horizontal scrolling anywhere, every ranges-table cell (the note column last) inside the
    viewport, and no cell whose text runs past its own box."""
    view = layout["view"]
    assert layout["page"] <= view, f"{where}: the page scrolls sideways ({layout['page']} > {view})"
    assert layout["containers"], f"{where}: no ranges table"
    for c in layout["containers"]:
        assert c["scroll"] <= c["client"], f"{where}: the ranges table is clipped ({c})"
    notes = [c for c in layout["cells"] if "note" in c["cls"].split()]
    assert notes and any(n["text"] for n in notes), f"{where}: no note text"
    for cell in layout["cells"]:
        assert cell["left"] >= 0 and cell["right"] <= view + 0.5, (
            f"{where}: cell outside the view {cell}"
        )
        assert cell["scroll"] <= cell["client"], f"{where}: text cut in its cell {cell}"


def severe(entries: list[dict[str, Any]]) -> list[str]:
    return [e["message"] for e in entries if e.get("level") == "SEVERE"]


# --------------------------------------------------------------------------- tests


def test_plugin_api_requires_airflow_login(airflow_api_server: Any) -> None:
    srv = airflow_api_server
    # No credential at all: 401, for the JSON API and for the page (which links to Airflow's login).
    assert srv.http("GET", "/keyset/api/streams")[0] == 401
    assert srv.http("GET", f"/keyset/api/streams/{STREAM}")[0] == 401
    status, _, body = srv.http("GET", "/keyset/", headers={"Accept": "text/html"})
    assert status == 401 and b"/auth/login" in body and b"Sign in to Airflow" in body
    # A forged or garbage token: refused.
    assert srv.http("GET", "/keyset/api/streams", headers={"Authorization": "Bearer not-a-jwt"})[
        0
    ] in (401, 403)
    assert srv.http("GET", "/keyset/api/streams", headers={"Cookie": "_token=not-a-jwt"})[0] in (
        401,
        403,
    )
    # A wrong password gets no token.
    assert (
        srv.http("POST", "/auth/token", body={"username": srv.username, "password": "wrong"})[0]
        == 401
    )

    token = srv.token()
    for headers in ({"Authorization": f"Bearer {token}"}, {"Cookie": f"_token={token}"}):
        status, _, body = srv.http("GET", "/keyset/api/streams", headers=headers)
        assert status == 200, body
        listing = json.loads(body)
        assert (
            listing["redis_conn_id"] == srv.redis_conn_id
            and listing["key_prefix"] == srv.key_prefix
        )
    # Read-only: no write method exists.
    assert (
        srv.http(
            "POST", "/keyset/api/streams", headers={"Authorization": f"Bearer {token}"}, body={}
        )[0]
        == 405
    )
    # Unknown stream / round: 404 with a message, not a 500.
    assert (
        srv.http(
            "GET",
            "/keyset/api/streams/no-such-stream",
            headers={"Authorization": f"Bearer {token}"},
        )[0]
        == 404
    )

    # The plugin is registered with the API server: the FastAPI app and the navigation entry.
    status, _, body = srv.http(
        "GET", "/api/v2/plugins", headers={"Authorization": f"Bearer {token}"}
    )
    assert status == 200, body
    plugin = next(p for p in json.loads(body)["plugins"] if p["name"] == "keyset")
    assert [a["url_prefix"] for a in plugin["fastapi_apps"]] == ["/keyset"]
    view = next(v for v in plugin["external_views"] if v["destination"] == "nav")
    assert (
        view["destination"] == "nav" and view["href"] == "keyset/" and view["url_route"] == "keyset"
    )


def test_page_shows_a_live_round_in_headless_chromium(
    airflow_api_server: Any, chromium: Any, sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    """The page renders the live round (DOM, colours), logs no console error, and inside Airflow's
    frame reads fully at 1280 px and 1024 px wide: before the fix, the ranges table scrolled inside
    the frame and the per-range note column was cut at the right edge."""
    srv = airflow_api_server
    page = f"{srv.base_url}/keyset/?refresh=0"

    # Without Airflow's cookie the browser gets the 401 page that links to Airflow's login.
    chromium.open(page, "document.body && document.body.innerText.includes('Sign in to Airflow')")
    assert "/auth/login" in chromium.evaluate("document.querySelector('a').getAttribute('href')")

    with live_round(sqlite_url, redis_url, srv.key_prefix):
        chromium.set_cookie("_token", srv.token())
        chromium.console()  # drop the 401 page's "failed to load resource"
        chromium.open(page, "document.body && document.body.dataset.ready === '1'")
        dom = chromium.evaluate(f"""(() => {{
            const s = document.querySelector('section.stream[data-stream="{STREAM}"]');
            const r = s && s.querySelector('section.round[data-round="r2"]');
            const all = (root, sel) => root ? [...root.querySelectorAll(sel)] : [];
            return {{
              error: document.getElementById('error').innerText,
              stream: s && s.querySelector('.stream-name').textContent,
              watermark: s && s.querySelector('.watermark').textContent,
              rounds: all(s, 'table.rounds tr.round-row').map(tr => [tr.dataset.round, tr.children[1].textContent]),
              roundHead: r && r.querySelector('.round-head').innerText,
              ranges: all(r, 'tr.range-row').map(tr => ({{id: tr.dataset.range, state: tr.dataset.state,
                        lagging: tr.classList.contains('lagging'), text: tr.innerText}})),
              bars: all(r, 'svg.range-chart rect.chart-bar').map(b => [b.dataset.range, b.classList.contains('lagging')]),
              dead: all(r, 'tr.dead-letter').map(tr => tr.innerText),
              deadCount: r && r.querySelector('.dead-letters').dataset.dead,
            }};
        }})()""")
        page_console = chromium.console()
        standalone = {1280: chromium.evaluate(LAYOUT_JS % "document")}
        shot = chromium.screenshot(tmp_path / "keyset-ui.png")
        chromium.resize(1024, 900)
        standalone[1024] = chromium.evaluate(LAYOUT_JS % "document")

        # The same page inside the Airflow UI, through the plugin's navigation entry.
        chromium.resize(1280, 900)
        chromium.open(
            f"{srv.base_url}/plugin/keyset",
            "(f => f && f.contentDocument && f.contentDocument.body"
            " && f.contentDocument.body.dataset.ready === '1')(document.querySelector('iframe'))",
            timeout=60,
        )
        embedded = chromium.evaluate("""(() => { const f = document.querySelector('iframe');
            return {src: f.src, streams: [...f.contentDocument.querySelectorAll('section.stream')]
                    .map(s => s.dataset.stream)}; })()""")
        framed = {1280: chromium.evaluate(LAYOUT_JS % FRAME_DOC)}
        nav_shot = chromium.screenshot(tmp_path / "keyset-ui-in-airflow.png")
        chromium.resize(1024, 900)
        chromium.wait(f"{FRAME_DOC}.documentElement.clientWidth < {framed[1280]['view']}")
        framed[1024] = chromium.evaluate(LAYOUT_JS % FRAME_DOC)
        nav_shot_1024 = chromium.screenshot(tmp_path / "keyset-ui-in-airflow-1024.png")
        frame_console = [e for e in chromium.console() if "/keyset/" in e.get("message", "")]

    if os.environ.get("KEYSET_UI_SCREENSHOT_DIR"):
        for png in (shot, nav_shot, nav_shot_1024):
            shutil.copy(png, Path(os.environ["KEYSET_UI_SCREENSHOT_DIR"]) / png.name)

    assert dom["error"] == "", dom["error"]
    assert dom["stream"] == STREAM
    assert dom["watermark"] == "100"
    assert dom["rounds"] == [["r2", "open"], ["r1", "closed"]]  # open rounds first
    assert "(100, 400]" in dom["roundHead"] and "1/4 ranges complete" in dom["roundHead"]
    ranges = {r["id"]: r for r in dom["ranges"]}
    assert sorted(ranges) == ["0", "1", "2", "3"]
    assert ranges["0"]["state"] == "complete" and not ranges["0"]["lagging"]
    assert ranges["1"]["state"] == "pending" and ranges["1"]["lagging"]
    assert "released unfinished" in ranges["1"]["text"]
    assert ranges["2"]["state"] == "running" and not ranges["2"]["lagging"]
    assert ranges["3"]["state"] == "pending" and ranges["3"]["lagging"]
    assert "never claimed" in ranges["3"]["text"]
    assert dom["bars"] == [["0", False], ["1", True], ["2", False], ["3", True]]
    assert dom["deadCount"] == "1"
    assert (
        len(dom["dead"]) == 1
        and str(POISON_KEY) in dom["dead"][0]
        and POISON_ERROR in dom["dead"][0]
    )
    assert embedded == {"src": f"{srv.base_url}/keyset/", "streams": [STREAM]}, embedded

    # No console error from the page, alone or inside Airflow's frame.
    assert severe(page_console) == [], page_console
    assert severe(frame_console) == [], frame_console

    # Layout: the whole ranges table, note column included, reads without sideways scrolling.
    for width in (1280, 1024):
        assert_reads_fully(standalone[width], f"page at {width} px")
        assert_reads_fully(framed[width], f"page in Airflow's frame at {width} px")

    # The screenshot is a real rendering of that page: full size, many colours, not one flat
    # fill, and the chart's colours are there (complete green, in-progress blue, lagging red,
    # lagging rows' pink background).
    assert shot.stat().st_size > 20_000
    (width, height), counts = colours(shot)
    assert (width, height) == (1280, 900)
    assert len(counts) > 50, f"only {len(counts)} colours"
    assert counts.most_common(1)[0][1] < 0.9 * width * height, "the page is one flat colour"
    for name, rgb, minimum in (
        ("green", GREEN, 300),
        ("blue", BLUE, 300),
        ("red", RED, 300),
        ("lagging row", LAG_ROW, 2000),
    ):
        assert counts[rgb] >= minimum, f"{name} {rgb}: {counts[rgb]} pixels"
