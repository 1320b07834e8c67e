"""``airflow-keyset`` against a live round in real Redis over real SQLite / PostgreSQL.

Each test reads like the documentation of what the command promises (docs/cli.md).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from cli_support import POISON, LiveRound, build_live_round, make_events, poison_processor

from airflow_keyset_provider.cli import (
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_LOST,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    main,
)
from airflow_keyset_provider.core import KeysetTraversal, LeaseLostError, RoundStateLostError

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ status


def test_status_without_stream_lists_streams_found_by_scan(live_round: LiveRound) -> None:
    doc = live_round.cli_json("status")
    assert doc["key_prefix"] == live_round.key_prefix
    [stream] = doc["streams"]
    assert stream["stream"] == "events-nightly"
    assert stream["open_rounds"] == ["r1"]
    assert stream["watermark"] is None
    assert stream["rounds_planned"] == 1

    code, out, _ = live_round.cli("status")
    assert code == EXIT_OK
    assert "events-nightly" in out and "r1" in out


def test_status_json_matches_the_engine_counters(live_round: LiveRound) -> None:
    doc = live_round.cli_json("status", "events-nightly")
    [rnd] = doc["rounds"]
    assert rnd["round_id"] == "r1" and rnd["state"] == "open" and rnd["chained"] is True
    assert (rnd["start_key"], rnd["end_key"]) == (None, ROWS_END)
    engine_view = live_round.traversal.range_status("r1")
    for shown, truth in zip(rnd["ranges"], engine_view, strict=True):
        for field in (
            "range_id",
            "state",
            "done",
            "skipped",
            "dead",
            "retries",
            "chunks",
            "cursor_label",
        ):
            assert shown[field] == truth[field], field
    assert [r["state"] for r in rnd["ranges"]] == ["complete", "complete", "pending", "pending"]
    assert [r["progress"] for r in rnd["ranges"]] == [1.0, 1.0, pytest.approx(0.2), 0.0]
    assert rnd["progress"] == pytest.approx((1 + 1 + 0.2 + 0) / 4)
    assert (rnd["done"], rnd["skipped"], rnd["dead"]) == (96 + 95 + 20, 4, 5)
    # the lowest unfinished cursor: keys above 220 must stay in the source
    assert doc["retention_floor"] == 220
    assert rnd["ranges"][2]["cursor"] == 220


ROWS_END = 400


def test_status_human_output_shows_bars_counters_and_floor(live_round: LiveRound) -> None:
    code, out, _ = live_round.cli("status", "events-nightly")
    assert code == EXIT_OK
    assert "stream events-nightly" in out
    assert "retention floor 220" in out
    assert "round r1 (-inf, 400]  open  chained" in out
    assert "2/4 ranges complete, 55.0% of key space; done 211, skipped 4, dead 5" in out
    assert "━" in out  # progress bars
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert "100%" in lines["0"] and "complete" in lines["0"]
    assert " 20%" in lines["2"] and "pending" in lines["2"]


def test_status_check_exits_3_while_ranges_are_unfinished(sqlite_round: LiveRound) -> None:
    code, _, _ = sqlite_round.cli("status", "events-nightly", "--check")
    assert code == EXIT_INCOMPLETE
    code, _, _ = sqlite_round.cli("ranges", "events-nightly", "r1", "--check")
    assert code == EXIT_INCOMPLETE
    t = sqlite_round.traversal
    for i in (2, 3):
        t.traverse(
            "r1", i, poison_processor, chunk_size=50, item_retry_delay=0.0, backoff_base=0.01
        )
    assert sqlite_round.cli("ranges", "events-nightly", "r1", "--check")[0] == EXIT_OK
    totals = t.close_round("r1")
    code, out, _ = sqlite_round.cli("status", "events-nightly", "--check")
    assert code == EXIT_OK and "no open rounds" in out and "watermark 400" in out
    doc = sqlite_round.cli_json("status", "events-nightly", "--round", "r1")
    [rnd] = doc["rounds"]
    assert rnd["state"] == "closed" and rnd["progress"] == 1.0
    assert (rnd["done"], rnd["skipped"], rnd["dead"]) == (totals.done, totals.skipped, totals.dead)
    assert rnd["done"] + rnd["skipped"] + rnd["dead"] == ROWS_END
    assert (
        doc["retention_floor"] == 400 and doc["watermark"] == 400
    )  # the next chained round starts there


def test_status_shows_a_live_owner_and_reset_refuses_while_it_holds(
    sqlite_round: LiveRound,
) -> None:
    t = KeysetTraversal(
        sqlite_round.source_url,
        "events",
        "seq",
        redis_url=sqlite_round.redis_url,
        stream="events-nightly",
        key_prefix=sqlite_round.key_prefix,
    )
    inside, release = threading.Event(), threading.Event()

    def blocking(chunk: object) -> None:
        inside.set()
        assert release.wait(60)

    worker = threading.Thread(
        target=t.traverse,
        args=("r1", 3, blocking),
        kwargs={"chunk_size": 10, "lease_seconds": 30, "owner_lineage": "nightly/run1/traverse/3"},
    )
    worker.start()
    try:
        assert inside.wait(30)
        doc = sqlite_round.cli_json("ranges", "events-nightly", "r1")
        r3 = doc["ranges"][3]
        assert r3["state"] == "running" and r3["owner"].startswith("nightly/run1/traverse/3#")
        assert r3["lease_left_s"] > 0 and r3["heartbeat_age_s"] is not None
        code, out, _ = sqlite_round.cli("status", "events-nightly")
        row3 = next(line for line in out.splitlines() if line.split()[:1] == ["3"])
        assert "running" in row3 and "traverse/3#" in row3  # task/map index of the owner, short
        code, out, _ = sqlite_round.cli("ranges", "events-nightly", "r1")
        assert "nightly/run1/traverse/3#" in out  # the full owner token in the ownership table
        code, _, err = sqlite_round.cli("reset-round", "events-nightly", "r1", "--yes")
        assert code == EXIT_REFUSED and "held by a live owner" in err
        assert (
            sqlite_round.cli_json("ranges", "events-nightly", "r1")["n_ranges"] == 4
        )  # nothing deleted
    finally:
        release.set()
        worker.join(60)
        t.close()


def test_reset_round_force_fences_the_live_owner(sqlite_round: LiveRound) -> None:
    t = KeysetTraversal(
        sqlite_round.source_url,
        "events",
        "seq",
        redis_url=sqlite_round.redis_url,
        stream="events-nightly",
        key_prefix=sqlite_round.key_prefix,
    )
    inside, release = threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def blocking(chunk: object) -> None:
        inside.set()
        assert release.wait(60)

    def work() -> None:
        try:
            t.traverse("r1", 3, blocking, chunk_size=10, lease_seconds=30)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        assert inside.wait(30)
        code, out, err = sqlite_round.cli("reset-round", "events-nightly", "r1", "--yes", "--force")
        assert code == EXIT_OK, err
        assert "round r1 (open) reset" in out and "watermark unchanged at -" in out
    finally:
        release.set()
        worker.join(60)
        t.close()
    [exc] = outcome  # the fenced worker's chunk was refused; it did not report the range done
    assert isinstance(exc, (LeaseLostError, RoundStateLostError)), exc


def test_sampled_rates_and_eta_come_from_two_readings(sqlite_round: LiveRound) -> None:
    t = sqlite_round.traversal
    from airflow_keyset_provider.core import StreamControl

    ctl = StreamControl(t.store)
    before = ctl.round_status("r1")
    calls = []

    def two_chunks(chunk: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            t.request_stop()

    t.traverse("r1", 2, two_chunks, chunk_size=20, prefetch=False)
    t._stop.clear()
    after = ctl.round_status("r1").sampled(before, 4.0).as_dict()
    r2 = after["ranges"][2]
    assert r2["items"] - before.ranges[2].items == 40
    assert r2["rate"] == pytest.approx(10.0)  # 40 items in 4 s
    # cursor went 220 -> 260 in 4 s (10 keys/s); 40 keys left to 300
    assert r2["eta_s"] == pytest.approx(4.0)
    assert after["ranges"][3]["eta_s"] is None  # not moving: no ETA
    assert after["eta_s"] is None and after["rate"] == pytest.approx(10.0)


def test_watch_redraws_with_rates_and_stops_after_count(sqlite_round: LiveRound) -> None:
    code, out, _ = sqlite_round.cli("status", "events-nightly", "--watch", "0.05", "--count", "2")
    assert code == EXIT_OK
    assert "(every 0.05 s, Ctrl-C to stop)" in out and "round r1 (-inf, 400] open  55.0%" in out
    code, out, _ = sqlite_round.cli(
        "status", "events-nightly", "--watch", "0.05", "--count", "3", "--json"
    )
    docs = [json.loads(line) for line in out.splitlines()]
    assert code == EXIT_OK and len(docs) == 3
    assert (
        docs[0]["rounds"][0]["rate"] is None
        or docs[0]["rounds"][0]["rate_basis"] == "average while processing"
    )
    assert all(
        d["rounds"][0]["rate_basis"].startswith("sampled over") for d in docs[1:]
    )  # from the previous one


# ------------------------------------------------------------------------------------ ranges, dead letters


def test_ranges_lists_bounds_cursor_owner_and_lagging(live_round: LiveRound) -> None:
    code, out, _ = live_round.cli("ranges", "events-nightly", "r1")
    assert code == EXIT_OK
    for bounds in ("(-inf, 100]", "(100, 200]", "(200, 300]", "(300, 400]"):
        assert bounds in out
    assert "lagging:" in out
    assert "range 2 at 220 of 300 (pending, no owner" in out
    assert "range 3 at 300 of 400 (pending, no owner, never claimed" in out


def test_dead_letters_lists_the_poison_keys_with_their_errors(live_round: LiveRound) -> None:
    doc = live_round.cli_json("dead-letters", "events-nightly", "r1")
    assert doc["dead_total"] == 5 and doc["shown"] == 5
    assert sorted(d["key"] for d in doc["dead_letters"]) == [37, 74, 111, 148, 185]
    assert all(
        d["attempts"] == 3 and d["error"] == f"poison: payload {d['key']} is not JSON"
        for d in doc["dead_letters"]
    )
    one = live_round.cli_json("dead-letters", "events-nightly", "r1", "--range", "1")
    assert {d["range_id"] for d in one["dead_letters"]} == {1} and one["dead_total"] == 3
    code, out, _ = live_round.cli("dead-letters", "events-nightly", "r1", "--range", "0")
    assert (
        code == EXIT_OK
        and "poison: payload 74 is not JSON" in out
        and "2 shown, 2 dead in total" in out
    )
    code, _, err = live_round.cli("dead-letters", "events-nightly", "r1", "--range", "9")
    assert code == EXIT_USAGE and "ranges 0..3" in err


# ------------------------------------------------------------------------------------ reset-round


def test_reset_round_needs_yes_and_never_moves_the_watermark(sqlite_round: LiveRound) -> None:
    t = sqlite_round.traversal
    for i in (2, 3):
        t.traverse(
            "r1", i, poison_processor, chunk_size=50, item_retry_delay=0.0, backoff_base=0.01
        )
    t.close_round("r1")
    make_more = t.source.engine
    with make_more.begin() as c:
        c.exec_driver_sql("INSERT INTO events SELECT seq + 400, payload FROM events")
    r2 = t.plan(max_ranges=2, new_stream=True)
    assert r2.round_id == "r2" and r2.start_key == 400
    t.traverse("r2", 0, lambda chunk: None, chunk_size=50)

    code, _, err = sqlite_round.cli("reset-round", "events-nightly", "r2")
    assert code == EXIT_USAGE and "Pass --yes" in err and "watermark (400) is not moved" in err
    assert t.store.round_info("r2")["state"] == "open"

    doc = sqlite_round.cli_json("reset-round", "events-nightly", "r2", "--yes")
    assert doc["keys_removed"] >= 3 and doc["watermark"] == 400
    assert t.watermark() == 400
    code, _, err = sqlite_round.cli("ranges", "events-nightly", "r2")
    assert code == EXIT_LOST and "r2" in err  # its state is gone, and the CLI says so
    r3 = t.plan(
        max_ranges=2, new_stream=True
    )  # the next chained plan starts again at the watermark
    assert r3.round_id == "r3" and r3.start_key == 400 and r3.end_key == 800


# ------------------------------------------------------------------------------------ replay


def test_replay_dead_letters_reprocesses_them_fenced(
    sqlite_round: LiveRound, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fixed_processor.py").write_text(
        textwrap.dedent("""
        def process(chunk):
            return None  # the bug is fixed: every item succeeds now
    """)
    )
    (tmp_path / "still_broken.py").write_text(
        textwrap.dedent(f"""
        from airflow_keyset_provider import ChunkResult

        def process(chunk):
            return ChunkResult(failed={{k: "still broken" for k in chunk.keys if k % {POISON} == 0}})
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = [
        "replay-dead-letters",
        "events-nightly",
        "r1",
        "--source-url",
        sqlite_round.source_url,
        "--table",
        "events",
        "--key",
        "seq",
        "--item-retry-delay",
        "0",
    ]

    code, out, err = sqlite_round.cli(*base, "--range", "1", "--processor", "still_broken:process")
    assert code == EXIT_INCOMPLETE, err
    assert "range 1: replayed" in out and "dead 3" in out

    doc = sqlite_round.cli_json(*base, "--processor", "fixed_processor:process")
    assert doc["still_dead"] == 0
    assert [(r["range_id"], r["dead"], r["complete"]) for r in doc["ranges"]] == [
        (0, 0, True),
        (1, 0, True),
    ]
    assert sqlite_round.cli_json("dead-letters", "events-nightly", "r1")["dead_total"] == 0
    ranges = sqlite_round.cli_json("ranges", "events-nightly", "r1")["ranges"]
    assert [(r["done"], r["skipped"], r["dead"]) for r in ranges[:2]] == [(98, 2, 0), (98, 2, 0)]

    code, out, _ = sqlite_round.cli(*base, "--processor", "fixed_processor:process")
    assert code == EXIT_OK and "no dead letters to replay" in out


# ------------------------------------------------------------------------------------ errors and exit codes


def test_exit_codes_for_missing_lost_and_unreachable_state(sqlite_round: LiveRound) -> None:
    code, _, err = sqlite_round.cli("status", "no-such-stream")
    assert code == EXIT_NOT_FOUND and "has no state under key prefix" in err
    code, _, err = sqlite_round.cli("ranges", "events-nightly", "r9")
    assert code == EXIT_NOT_FOUND and "no round 'r9'" in err
    sqlite_round.traversal.store.client.delete(sqlite_round.traversal.store.round_key("r1"))
    code, _, err = sqlite_round.cli("ranges", "events-nightly", "r1")
    assert code == EXIT_LOST and "round state lost" in err
    code, _, err = sqlite_round.cli("status", "bad stream name!")
    assert code == EXIT_USAGE and "not valid" in err
    out, errs = io.StringIO(), io.StringIO()
    code = main(["status", "--redis-url", "redis://127.0.0.1:1/0"], stdout=out, stderr=errs)
    assert code == EXIT_ERROR and "Redis is unreachable (redis://127.0.0.1:1/0)" in errs.getvalue()
    assert main(["no-such-command"], stdout=out, stderr=errs) == EXIT_USAGE


def test_help_documents_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == EXIT_OK
    out = capsys.readouterr().out
    for code, text in EXIT_CODES.items():
        assert f"  {code}  {text}" in out
    assert main(["status", "--help"]) == EXIT_OK
    assert "exit codes:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ as installed


def _script() -> str:
    path = Path(sys.executable).parent / "airflow-keyset"
    found = str(path) if path.exists() else shutil.which("airflow-keyset")
    assert found, "console script airflow-keyset is not installed (pip install -e .)"
    return found


def test_console_script_runs_and_never_imports_airflow(sqlite_round: LiveRound) -> None:
    env = {
        **os.environ,
        "KEYSET_REDIS_URL": sqlite_round.redis_url,
        "KEYSET_KEY_PREFIX": sqlite_round.key_prefix,
    }
    proc = subprocess.run(
        [_script(), "status", "events-nightly", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert json.loads(proc.stdout)["rounds"][0]["round_id"] == "r1"
    probe = textwrap.dedent("""
        import io, sys
        from airflow_keyset_provider.cli import main
        for argv in (["status"], ["status", "events-nightly"], ["ranges", "events-nightly", "r1"],
                     ["dead-letters", "events-nightly", "r1"], ["status", "events-nightly", "--json"]):
            assert main(argv, stdout=io.StringIO()) == 0, argv
        loaded = sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))
        assert not loaded, loaded
        print("no airflow")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        cwd=str(REPO),
    )
    assert proc.returncode == 0 and "no airflow" in proc.stdout, proc.stderr


def test_redis_conn_id_reads_an_airflow_connection(sqlite_round: LiveRound, tmp_path: Path) -> None:
    from urllib.parse import urlsplit

    u = urlsplit(sqlite_round.redis_url)
    conn = {
        "conn_type": "redis",
        "host": u.hostname,
        "port": u.port or 6379,
        "extra": {"db": int((u.path or "/0").strip("/") or 0)},
    }
    if u.password:
        conn["password"] = u.password
    env = {
        **os.environ,
        "AIRFLOW_CONN_KEYSET_REDIS": json.dumps(conn),
        "AIRFLOW_HOME": str(tmp_path),
        "KEYSET_REDIS_URL": "redis://127.0.0.1:1/0",
    }  # would fail if it were used
    proc = subprocess.run(
        [
            _script(),
            "status",
            "events-nightly",
            "--redis-conn-id",
            "keyset_redis",
            "--key-prefix",
            sqlite_round.key_prefix,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == EXIT_OK, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["open_rounds"] == ["r1"]


def test_composite_timestamp_keys_show_key_space_progress(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    import datetime as dt

    import sqlalchemy as sa

    engine = sa.create_engine(pg_schema_url)
    base = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE clicks (created_at timestamptz NOT NULL, id bigint NOT NULL, "
            "PRIMARY KEY (created_at, id))"
        )
        c.execute(
            sa.text("INSERT INTO clicks VALUES (:t, :i)"),
            [{"t": base + dt.timedelta(hours=i), "i": i} for i in range(1, 201)],
        )
    engine.dispose()
    t = KeysetTraversal(
        pg_schema_url,
        "clicks",
        ["created_at", "id"],
        redis_url=redis_url,
        stream="clicks",
        key_prefix=key_prefix,
    )
    try:
        rnd = t.plan(max_ranges=2, start_key=(base, 0))
        calls = []

        def stop_after_two(chunk: object) -> None:
            calls.append(1)
            if len(calls) == 2:
                t.request_stop()

        t.traverse(rnd.round_id, 0, stop_after_two, chunk_size=25, prefetch=False)
        out = io.StringIO()
        code = main(
            ["status", "clicks", "--json", "--redis-url", redis_url, "--key-prefix", key_prefix],
            stdout=out,
        )
        assert code == EXIT_OK
        [r] = json.loads(out.getvalue())["rounds"]
        assert r["start_key"] == [base.isoformat(), 0]
        assert r["ranges"][0]["progress"] == pytest.approx(0.5)  # 50 of 100 hours
        assert r["ranges"][1]["progress"] == 0.0
    finally:
        t.close()


def test_live_round_fixture_builds_on_a_fresh_table(
    sqlite_url: str, redis_url: str, key_prefix: str
) -> None:
    lr = build_live_round(sqlite_url, redis_url, key_prefix)
    try:
        assert lr.cli("ranges", "events-nightly", "r1")[0] == EXIT_OK
    finally:
        lr.traversal.close()
    with pytest.raises(Exception, match="already exists"):
        make_events(sqlite_url)
