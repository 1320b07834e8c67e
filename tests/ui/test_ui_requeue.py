"""Requeue a range's dead letters from the page: for DAG editors only (as pause), a JSON POST
under the same cross-site checks, on an open round only; the letters go back to the range's
retry set through the engine's fenced script, and the next traverse try (here the engine's own
``traverse``, as the DAG's traverse task runs it) processes them with its own processor. Against
a real Airflow API server, real Redis and a real headless Chromium (with the confirmation, and
the layout with the buttons at 1280 and 1024 px in both themes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from keyset_page import LAYOUT_JS, assert_layout, colour_mode, keep_screenshots, open_in_airflow

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal

STREAM = "ui-requeue"
POISON = {7, 8, 12, 13}  # two in r1, two in r2 range 0
ERROR = "poison: the billing API refused the amount (HTTP 422)"


def _round_with_dead_letters(sqlite_url: str, redis_url: str, prefix: str) -> KeysetTraversal:
    """``r1`` (keys 1-10, closed, 2 dead letters) and ``r2`` (keys 11-40, open, 2 ranges:
    range 0 complete with 2 dead letters, range 1 never claimed)."""
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE rq (seq INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        conn.execute(sa.text("INSERT INTO rq VALUES (:s, 'x')"), [{"s": i} for i in range(1, 41)])
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, "rq", "seq", redis_url=redis_url, stream=STREAM, key_prefix=prefix
    )

    def poison(chunk: Any) -> ChunkResult:
        bad = {k: ERROR for k in chunk.keys if k in POISON}
        return ChunkResult(failed=bad)

    r1 = t.plan(max_ranges=1, end_key=10, new_stream=True)
    res = t.traverse(r1.round_id, 0, poison, max_item_attempts=2, item_retry_delay=0)
    assert res.complete and res.dead == 2, res
    t.close_round(r1.round_id)
    r2 = t.plan(max_ranges=2, end_key=40, new_stream=True)
    assert r2.round_id == "r2" and len(r2.ranges) == 2, r2
    res = t.traverse("r2", 0, poison, max_item_attempts=2, item_retry_delay=0)
    assert res.complete and res.dead == 2, res
    return t


def _range(t: KeysetTraversal, round_id: str, range_id: int) -> dict[str, Any]:
    return next(r for r in t.store.ranges(round_id) if int(r["range_id"]) == range_id)


def test_requeue_dead_letters_needs_edit_rights_and_feeds_the_next_traverse(
    airflow_api_server: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    t = _round_with_dead_letters(sqlite_url, redis_url, srv.key_prefix)
    viewer = {"Authorization": f"Bearer {srv.token()}"}
    editor = {"Authorization": f"Bearer {srv.token('editor', srv.editor_password)}"}
    url = f"/keyset/api/streams/{STREAM}/rounds/r2/ranges/0/requeue-dead"

    def post(path: str, headers: dict[str, str], body: Any = None) -> tuple[int, Any]:
        status, _, raw = srv.http("POST", path, headers=headers, body=body)
        return status, json.loads(raw or b"null")

    # Nobody without a token, no viewer, no form post, no other site: nothing moves.
    assert post(url, {}, {})[0] == 401
    assert post(url, viewer, {})[0] == 403
    form = {**editor, "Content-Type": "application/x-www-form-urlencoded"}
    assert srv.http("POST", url, headers=form, body=None)[0] == 415
    assert post(url, {**editor, "Origin": "https://evil.example"}, {})[0] == 403
    assert post(url, {**editor, "Sec-Fetch-Site": "cross-site"}, {})[0] == 403
    assert int(_range(t, "r2", 0)["dead"]) == 2
    # Bad path parameters are refused by their rule; an unknown range or round is a 404.
    assert post(f"/keyset/api/streams/{STREAM}/rounds/r2/ranges/x/requeue-dead", editor, {})[0] in (
        400,
        422,
    )
    assert post(f"/keyset/api/streams/{STREAM}/rounds/r2/ranges/-1/requeue-dead", editor, {})[
        0
    ] in (400, 422)
    assert (
        post(f"/keyset/api/streams/{STREAM}/rounds/r2/ranges/5/requeue-dead", editor, {})[0] == 404
    )
    assert (
        post(f"/keyset/api/streams/{STREAM}/rounds/r9/ranges/0/requeue-dead", editor, {})[0] == 404
    )
    # A closed round: no traverse try is left to take them; 409 says to replay through the DAG.
    status, doc = post(f"/keyset/api/streams/{STREAM}/rounds/r1/ranges/0/requeue-dead", editor, {})
    assert status == 409 and "replay-dead-letters ui-requeue r1 --range 0" in doc["detail"], doc
    assert int(_range(t, "r1", 0)["dead"]) == 2

    # The editor: both letters go back to the retry set; the range is pending again.
    status, doc = post(url, editor, {})
    assert status == 200 and doc["moved"] == 2, doc
    # nothing runs them now; the answer says what will (no DAG planned this round: a traverse)
    assert "Nothing runs them now: the next traverse of this range" in doc["message"], doc
    r0 = _range(t, "r2", 0)
    assert (int(r0["dead"]), int(r0["retries"]), r0["state"]) == (0, 2, "pending"), r0
    status, doc = post(url, editor, {})
    assert status == 200 and doc["moved"] == 0, doc  # nothing left: a second click moves nothing

    # The next traverse try processes exactly those two keys with its own processor.
    seen: list[int] = []

    def fixed(chunk: Any) -> None:
        seen.extend(chunk.keys)

    res = t.traverse("r2", 0, fixed, item_retry_delay=0)
    assert res.complete and res.dead == 0, res
    assert sorted(seen) == [12, 13], seen
    t.close()


def test_page_requeue_button_for_editors_with_confirmation_and_layout(
    airflow_api_server: Any, chromium: Any, sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    srv = airflow_api_server
    t = _round_with_dead_letters(sqlite_url, redis_url, srv.key_prefix)
    button = "document.querySelector('button.requeue-dead[data-range=\"0\"]')"
    round_sel = 'section.round[data-round="r2"]'
    open_in_airflow(chromium, srv.base_url, "plugin/keyset?refresh=0", srv.token())
    chromium.wait(f"document.querySelector('{round_sel} .dead-letters')")
    assert chromium.evaluate(f"!{button}"), "a viewer sees the requeue button"

    open_in_airflow(
        chromium,
        srv.base_url,
        "plugin/keyset?refresh=0",
        srv.token("editor", srv.editor_password),
    )
    chromium.wait(button)
    assert "2 dead letter(s)" in chromium.evaluate(f"{button}.innerText")
    # Layout with the buttons and the selector: no clipped column, both themes, both widths.
    shots = []
    for scheme in ("light", "dark"):
        colour_mode(chromium, scheme)
        for width in (1280, 1024):
            chromium.resize(width, 800)
            chromium.wait(f"document.scrollingElement.clientWidth <= {width}")
            assert_layout(chromium.evaluate(LAYOUT_JS), f"editor, {scheme} at {width} px")
            shots.append(chromium.screenshot(tmp_path / f"keyset-requeue-{scheme}-{width}.png"))
    keep_screenshots(*shots)
    chromium.resize(1280, 800)

    # Cancel the confirmation: nothing moves.
    chromium.evaluate(f"{button}.click() || true")
    alert = chromium.driver.switch_to.alert
    assert "Requeue the 2 dead letter(s) of round r2 range 0" in alert.text
    alert.dismiss()
    assert int(_range(t, "r2", 0)["dead"]) == 2
    # Accept it: the letters are back in the retry set, and the page says what happens next.
    chromium.evaluate(f"{button}.click() || true")
    chromium.driver.switch_to.alert.accept()
    chromium.wait("document.querySelector('#notice')")
    assert "2 dead letter(s) of round r2 range 0" in chromium.evaluate(
        "document.querySelector('#notice').innerText"
    )
    r0 = _range(t, "r2", 0)
    assert (int(r0["dead"]), int(r0["retries"])) == (0, 2), r0
    chromium.wait(f"!{button}")  # reloaded: no dead letters left on the range
    t.close()
