"""``airflow-keyset pause`` / ``resume`` / ``throttle``: they write the stream's control hash only,
``status`` shows it, and a traverse of the paused stream returns ``paused=True`` at once."""

from __future__ import annotations

from cli_support import LiveRound, poison_processor

from airflow_keyset_provider.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE


def test_pause_status_traverse_resume(sqlite_round: LiveRound) -> None:
    lr = sqlite_round

    def cursors() -> list:
        return [
            (r.cursor_encoded, r.done, r.skipped, r.dead)
            for r in lr.traversal.range_status(lr.round_id)
        ]

    before = cursors()
    code, out, err = lr.cli("pause", "events-nightly", "--reason", "replica lag", "--by", "ana")
    assert code == EXIT_OK, err
    assert "paused" in out
    doc = lr.cli_json("status", "events-nightly")
    assert doc["control"]["paused"] is True
    assert doc["control"]["reason"] == "replica lag" and doc["control"]["paused_by"] == "cli:ana"
    code, out, _ = lr.cli("status", "events-nightly")
    assert "PAUSED" in out and "replica lag" in out
    # the cursors and counters were not touched by the pause
    assert cursors() == before

    res = lr.traversal.traverse(lr.round_id, 3, poison_processor, chunk_size=25)
    assert res.paused and not res.complete and res.rows_read == 0

    assert lr.cli_json("resume", "events-nightly")["control"]["paused"] is False
    code, out, _ = lr.cli("resume", "events-nightly")
    assert code == EXIT_OK and "was not paused" in out
    res = lr.traversal.traverse(
        lr.round_id, 3, poison_processor, chunk_size=25, item_retry_delay=0.0
    )
    assert res.complete and not res.paused


def test_throttle_on_off_and_usage(sqlite_round: LiveRound) -> None:
    lr = sqlite_round
    doc = lr.cli_json("throttle", "events-nightly", "--max-rows-per-second", "2500")
    assert doc["control"]["max_rows_per_second"] == 2500.0
    _, out, _ = lr.cli("status", "events-nightly")
    assert "throttled to 2,500 rows/s" in out
    assert (
        lr.cli_json("throttle", "events-nightly", "--off")["control"]["max_rows_per_second"] is None
    )
    assert lr.cli("throttle", "events-nightly")[0] == EXIT_USAGE
    assert (
        lr.cli("throttle", "events-nightly", "--off", "--max-rows-per-second", "5")[0] == EXIT_USAGE
    )
    assert lr.cli("throttle", "events-nightly", "--max-rows-per-second", "0")[0] == EXIT_USAGE
    assert lr.cli("pause", "no-such-stream")[0] == EXIT_NOT_FOUND
