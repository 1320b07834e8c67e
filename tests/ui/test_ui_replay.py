"""Replay a range's dead letters from the page, through the DAG's own traverse task, in a real
Airflow API server (its DAGs folder holds a ``@task.keyset_traverse`` DAG with a target
connection), real Redis and a real headless Chromium.

- Editors only, JSON and same-origin (as every POST); the DAG is the one whose plan planned the
  round (its round key), never one the browser names; a round planned outside Airflow or by a
  DAG the server cannot find is refused naming the CLI.
- A replay that fails (the DAG's target is down) puts the letters back as they were and says
  so; once the cause is gone the same button replays them through the decorated function and
  its ``target_conn_id``: the rows reach the target, the range has no dead letter left.
- Open rounds (issue 30, item 2): requeue says exactly which traverse try picks the letters up
  (the run's mapped task instance, the next run of a chained DAG) and the page offers the replay
  in place too.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from conftest import SOURCE_DB
from keyset_page import LAYOUT_JS, assert_layout, colour_mode, keep_screenshots, open_in_airflow

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal

DAG_ID = "ui_replay"
RUN_KEY = f"{DAG_ID}/manual__2026-01-01T00:00:00+00:00/copy_out.plan"
POISON = {7, 8, 47}

DAG_FILE = """
import datetime as dt
import pathlib
import time

import sqlalchemy as sa
from airflow.sdk import DAG, task

from airflow_keyset_provider import Chunk, ChunkResult


@task.keyset_traverse(target_conn_id="keyset_ui_sql", chunk_size=10, retry_budget_seconds=1,
                      max_chunk_attempts=2)
def copy_out(chunk: Chunk) -> ChunkResult:
    hold = pathlib.Path(__file__).with_name("ui_replay.hold")
    deadline = time.monotonic() + 300  # the test lifts the hold; never wait forever
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    c = chunk.connection
    if c.exec_driver_sql("SELECT count(*) FROM halt").scalar():
        raise RuntimeError("the outbox database refuses writes (halt)")
    poison = {k for (k,) in c.exec_driver_sql("SELECT seq FROM poison")}
    good = [{"s": k} for k in chunk.keys if k not in poison]
    if good:
        c.execute(sa.text("INSERT OR IGNORE INTO outbox VALUES (:s)"), good)
    return ChunkResult(failed={k: "poison: refused by billing" for k in chunk.keys if k in poison})


with DAG("ui_replay", schedule="@daily", start_date=dt.datetime(2026, 1, 1), catchup=False):
    copy_out.round(source_conn_id="keyset_ui_sql", table="rp", key="seq")
"""


def _setup(srv: Any, redis_url: str) -> tuple[KeysetTraversal, sa.Engine]:
    """The DAG in the server's DAGs folder; ``r1`` (keys 1-40, 2 ranges, closed; range 0 has the
    dead letters 7 and 8) and ``r2`` (keys 41-60, 1 range, open, chained; dead letter 47), both
    planned under the DAG's round key, traversed with a processor that refuses the poison."""
    (srv.home / "dags" / "ui_replay_dag.py").write_text(DAG_FILE)
    _hold(srv).unlink(missing_ok=True)
    db = srv.home / SOURCE_DB
    db.unlink(missing_ok=True)
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE rp (seq INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        c.execute(sa.text("INSERT INTO rp VALUES (:s, 'x')"), [{"s": i} for i in range(1, 61)])
        c.exec_driver_sql("CREATE TABLE outbox (seq INTEGER PRIMARY KEY)")
        c.exec_driver_sql("CREATE TABLE poison (seq INTEGER PRIMARY KEY)")
        c.execute(sa.text("INSERT INTO poison VALUES (:s)"), [{"s": k} for k in POISON])
        c.exec_driver_sql("CREATE TABLE halt (why TEXT)")
    t = KeysetTraversal(
        f"sqlite:///{db}", "rp", "seq", redis_url=redis_url, stream=DAG_ID,
        key_prefix=srv.key_prefix,
    )  # fmt: skip

    def refuse(chunk: Any) -> ChunkResult:
        return ChunkResult(
            failed={k: "poison: refused by billing" for k in chunk.keys if k in POISON}
        )

    r1 = t.plan(max_ranges=2, end_key=40, round_key=RUN_KEY, new_stream=True)
    for spec in r1.ranges:
        t.traverse("r1", spec.range_id, refuse, max_item_attempts=1, item_retry_delay=0)
    t.close_round("r1")
    r2 = t.plan(max_ranges=1, end_key=60, round_key=RUN_KEY.replace("01T", "02T"))
    assert (r2.round_id, len(r2.ranges)) == ("r2", 1), r2
    t.traverse("r2", 0, refuse, max_item_attempts=1, item_retry_delay=0)
    return t, engine


def _hold(srv: Any) -> Path:
    """While this file exists, the DAG's processor waits (a replay that outlasts the request)."""
    return Path(srv.home / "dags" / "ui_replay.hold")


def _range(t: KeysetTraversal, round_id: str, range_id: int) -> dict[str, Any]:
    return next(r for r in t.store.ranges(round_id) if int(r["range_id"]) == range_id)


def _outbox(engine: sa.Engine) -> set[int]:
    with engine.connect() as c:
        return {k for (k,) in c.exec_driver_sql("SELECT seq FROM outbox")}


def _halt(engine: sa.Engine, on: bool) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("INSERT INTO halt VALUES ('down')" if on else "DELETE FROM halt")


def test_replay_route_runs_the_dags_task_puts_letters_back_on_failure_and_feeds_open_rounds(
    airflow_api_server: Any, redis_url: str
) -> None:
    srv = airflow_api_server
    t, engine = _setup(srv, redis_url)
    viewer = {"Authorization": f"Bearer {srv.token()}"}
    editor = {"Authorization": f"Bearer {srv.token('editor', srv.editor_password)}"}
    url = f"/keyset/api/streams/{DAG_ID}/rounds/r1/ranges/0/replay-dead"

    def post(path: str, headers: dict[str, str]) -> tuple[int, Any]:
        status, _, raw = srv.http("POST", path, headers=headers, body={})
        return status, json.loads(raw or b"null")

    # Nobody without a token, no viewer, no form post, no other site: nothing runs.
    assert post(url, {})[0] == 401
    assert post(url, viewer)[0] == 403
    form = {**editor, "Content-Type": "application/x-www-form-urlencoded"}
    assert srv.http("POST", url, headers=form, body=None)[0] == 415
    assert post(url, {**editor, "Origin": "https://evil.example"})[0] == 403
    assert post(f"/keyset/api/streams/{DAG_ID}/rounds/r1/ranges/9/replay-dead", editor)[0] == 404
    assert int(_range(t, "r1", 0)["dead"]) == 2 and _outbox(engine) == set()

    # The target refuses every write: the replay fails, puts both letters back, says so.
    _halt(engine, True)
    status, doc = post(url, editor)
    assert status == 200 and doc["state"] == "failed", doc
    assert "dead letters again, as they were" in doc["message"], doc
    assert doc["dag_id"] == DAG_ID and doc["round_state"] == "closed"
    assert [d["key"] for d in t.dead_letters("r1", 0)] in ([8, 7], [7, 8], ["8", "7"], ["7", "8"])
    assert int(_range(t, "r1", 0)["dead"]) == 2

    # The cause is gone: the same request replays them through the decorated function and its
    # target connection (the rows reach the outbox); the closed round's totals follow.
    _halt(engine, False)
    with engine.begin() as c:
        c.exec_driver_sql("DELETE FROM poison WHERE seq IN (7, 8)")
    status, doc = post(url, editor)
    assert status == 200 and doc["state"] == "succeeded", doc
    assert doc["task_id"] == "copy_out.traverse" and "dead 0" in doc["message"], doc
    assert _outbox(engine) == {7, 8}
    assert int(_range(t, "r1", 0)["dead"]) == 0
    assert int(t.store.round_info("r1").get("dead") or 0) == 0
    status, doc = post(url, editor)
    assert status == 200 and doc["state"] == "nothing", doc

    # An open round: requeue says which traverse try takes the letters (the run's mapped task
    # instance; the chained DAG's next run) and that nothing runs them now ...
    requeue = f"/keyset/api/streams/{DAG_ID}/rounds/r2/ranges/0/requeue-dead"
    status, doc = post(requeue, editor)
    assert status == 200 and doc["moved"] == 1, doc
    said = doc["message"]
    assert "Nothing runs them now" in said, said
    assert f"run manual__2026-01-02T00:00:00+00:00 of DAG {DAG_ID}" in said, said
    assert "map index 0" in said and f"the next run of DAG {DAG_ID}" in said, said
    assert "Replay on this page" in said, said
    # ... and the replay runs them in place (the requeued letter is pending: replayed too).
    with engine.begin() as c:
        c.exec_driver_sql("DELETE FROM poison")
    status, doc = post(f"/keyset/api/streams/{DAG_ID}/rounds/r2/ranges/0/replay-dead", editor)
    assert status == 200 and doc["state"] == "succeeded" and doc["round_state"] == "open", doc
    assert 47 in _outbox(engine)
    r0 = _range(t, "r2", 0)
    assert (int(r0["dead"]), int(r0["retries"]), r0["state"]) == (0, 0, "complete"), r0

    # Redis names the DAG, the server parses it: a DAG it cannot find is a 404 naming it, a
    # round planned outside Airflow a 409 naming the CLI's --processor.
    t.store.client.hset(t.store.round_key("r1"), "round_key", "no_such_dag/run/plan")
    t.store.client.rpush(t.store.dead_key("r1", 1), json.dumps({"key": 9, "error": "x"}))
    t.store.client.hincrby(t.store.range_key("r1", 1), "dead", 1)
    status, doc = post(f"/keyset/api/streams/{DAG_ID}/rounds/r1/ranges/1/replay-dead", editor)
    assert status == 404 and "no DAG 'no_such_dag'" in doc["detail"], doc
    t.store.client.hdel(t.store.round_key("r1"), "round_key")
    status, doc = post(f"/keyset/api/streams/{DAG_ID}/rounds/r1/ranges/1/replay-dead", editor)
    assert status == 409 and "--processor" in doc["detail"], doc
    t.close()
    engine.dispose()


def test_page_replay_button_with_confirmation_failure_notice_and_layout(
    airflow_api_server: Any, chromium: Any, redis_url: str, tmp_path: Path
) -> None:
    srv = airflow_api_server
    t, engine = _setup(srv, redis_url)
    button = 'document.querySelector(\'section.round[data-round="r1"] button.replay-dead[data-range="0"]\')'
    page = f"plugin/keyset?refresh=0&stream={DAG_ID}&round=r1"
    open_in_airflow(chromium, srv.base_url, page, srv.token())
    chromium.wait("document.querySelector('section.round[data-round=\"r1\"] .dead-letters')")
    assert chromium.evaluate(f"!{button}"), "a viewer sees the replay button"

    open_in_airflow(chromium, srv.base_url, page, srv.token("editor", srv.editor_password))
    chromium.wait(button)
    assert "Replay range 0's 2 dead letter(s)" in chromium.evaluate(f"{button}.innerText")
    # a closed round offers no requeue (no traverse try is left to take the letters)
    assert chromium.evaluate(
        "!document.querySelector('section.round[data-round=\"r1\"] button.requeue-dead')"
    )
    shots = []
    for scheme in ("light", "dark"):
        colour_mode(chromium, scheme)
        for width in (1280, 1024):
            chromium.resize(width, 560)  # one round only: shorter than the window at 800 px
            chromium.wait(f"document.scrollingElement.clientWidth <= {width}")
            assert_layout(chromium.evaluate(LAYOUT_JS), f"replay, {scheme} at {width} px")
            chromium.evaluate(f"{button}.scrollIntoView({{block: 'center'}}) || true")
            shots.append(chromium.screenshot(tmp_path / f"keyset-replay-{scheme}-{width}.png"))
    keep_screenshots(*shots)
    chromium.resize(1280, 800)

    # Cancel the confirmation: nothing runs.
    chromium.evaluate(f"{button}.click() || true")
    alert = chromium.driver.switch_to.alert
    assert "Replay the 2 dead letter(s) of round r1 range 0" in alert.text
    assert f"DAG {DAG_ID}'s own traverse task" in alert.text
    alert.dismiss()
    assert int(_range(t, "r1", 0)["dead"]) == 2

    # The target is down: the page says the replay failed and the letters are back.
    _halt(engine, True)
    chromium.evaluate(f"{button}.click() || true")
    chromium.driver.switch_to.alert.accept()
    chromium.wait("document.querySelector('#action-error')", timeout=120)
    said = chromium.evaluate("document.querySelector('#action-error').innerText")
    assert "Replay of range 0 failed" in said and "as they were" in said, said
    assert int(_range(t, "r1", 0)["dead"]) == 2
    chromium.wait(button)  # the letters are still there, so is the button
    chromium.evaluate("document.querySelector('#action-error').scrollIntoView() || true")
    keep_screenshots(chromium.screenshot(tmp_path / "keyset-replay-failed.png"))

    # Fixed: the replay succeeds, the page says so and the button goes (no letter left).
    _halt(engine, False)
    with engine.begin() as c:
        c.exec_driver_sql("DELETE FROM poison")
    chromium.evaluate(f"{button}.click() || true")
    chromium.driver.switch_to.alert.accept()
    chromium.wait("document.querySelector('#notice')", timeout=120)
    said = chromium.evaluate("document.querySelector('#notice').innerText")
    assert "round r1 range 0 replayed through DAG ui_replay" in said, said
    assert chromium.evaluate("!document.querySelector('#action-error')")
    chromium.wait(f"!{button}")
    assert _outbox(engine) == {7, 8}
    t.close()
    engine.dispose()


def test_a_replay_longer_than_the_request_goes_on_in_the_background_one_per_range(
    airflow_api_server: Any, redis_url: str
) -> None:
    """The request answers 202 ``running`` (the processor is held, so the replay cannot end
    within the request's wait); a second request for the same range is refused while it runs,
    a third replay while both slots are taken (429); once the hold is lifted the replays end on
    their own and the ranges have no dead letter."""
    srv = airflow_api_server
    t, engine = _setup(srv, redis_url)
    editor = {"Authorization": f"Bearer {srv.token('editor', srv.editor_password)}"}
    url = f"/keyset/api/streams/{DAG_ID}/rounds/r1/ranges/0/replay-dead"
    with engine.begin() as c:
        c.exec_driver_sql("DELETE FROM poison")
    _hold(srv).touch()
    try:
        status, _, raw = srv.http("POST", url, headers=editor, body={})
        doc = json.loads(raw)
        assert status == 202 and doc["state"] == "running", (doc["state"], doc["message"])
        assert f"owner keyset-page-replay:{doc['job']}" in doc["message"], doc
        # the range is the replay's now: a second request is refused, nothing moves twice
        status, _, raw = srv.http("POST", url, headers=editor, body={})
        assert status == 409 and "being replayed already" in json.loads(raw)["detail"], raw
        owner = _range(t, "r1", 0).get("owner") or ""
        assert owner.startswith(f"keyset-page-replay:{doc['job']}"), owner
        # a second slot: r2's range, in a thread (its request waits too); then every slot of
        # this API server process is taken and a third replay is refused with 429
        second: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: second.update(
                answer=srv.http("POST", url.replace("/r1/", "/r2/"), headers=editor, body={})
            )
        )
        thread.start()
        deadline = time.monotonic() + 120
        while not (_range(t, "r2", 0).get("owner") or "").startswith("keyset-page-replay:"):
            assert time.monotonic() < deadline, _range(t, "r2", 0)
            time.sleep(0.3)
        status, _, raw = srv.http("POST", url.replace("/0/", "/1/"), headers=editor, body={})
        assert status == 429 and "2 replays at once" in json.loads(raw)["detail"], raw
    finally:
        _hold(srv).unlink(missing_ok=True)
    deadline = time.monotonic() + 120
    for round_id in ("r1", "r2"):
        while int(_range(t, round_id, 0)["dead"]) or _range(t, round_id, 0).get("owner"):
            assert time.monotonic() < deadline, _range(t, round_id, 0)
            time.sleep(0.3)
    thread.join(120)
    assert second["answer"][0] in (200, 202), second
    assert _outbox(engine) >= {7, 8, 47}
    # the slot is free again: the next request answers at once (nothing left to replay)
    status, _, raw = srv.http("POST", url, headers=editor, body={})
    assert status == 200 and json.loads(raw)["state"] == "nothing", raw
    t.close()
    engine.dispose()
