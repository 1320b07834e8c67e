"""The status model (``core/rounds/status.py``): states, key-space fractions, rate and ETA from two
readings, the one duration wording, and the JSON keys ``--json`` and the page's API promise.

Pure records: nothing here needs Redis (the records are built the way ``StreamControl`` builds
them, from the store's hashes).
"""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.rounds.progress import key_fraction
from airflow_keyset_provider.core.rounds.status import (
    RangeState,
    RangeStatus,
    RoundState,
    RoundStatus,
    StreamStatus,
    format_duration,
    format_rate,
    range_state,
    value_label,
)

RANGE_KEYS = {
    "range_id",
    "state",
    "lo",
    "hi",
    "cursor",
    "lo_label",
    "hi_label",
    "cursor_label",
    "lo_encoded",
    "hi_encoded",
    "cursor_encoded",
    "owner",
    "lease_left_s",
    "heartbeat_age_s",
    "claimed_at",
    "completed_at",
    "done",
    "skipped",
    "dead",
    "items",
    "retries",
    "takeovers",
    "chunks",
    "progress",
    "rate",
    "eta_s",
    "merged_into",
}
ROUND_KEYS = {
    "stream",
    "round_id",
    "state",
    "chained",
    "round_key",
    "created_at",
    "closed_at",
    "start_key",
    "end_key",
    "start_label",
    "end_label",
    "start_encoded",
    "verification",
    "end_encoded",
    "source",
    "n_ranges",
    "ranges_complete",
    "ranges_merged",
    "done",
    "skipped",
    "dead",
    "retries",
    "items",
    "progress",
    "rate",
    "eta_s",
    "rate_basis",
    "ranges",
}
STREAM_KEYS = {
    "stream",
    "key_prefix",
    "watermark",
    "watermark_label",
    "retention_floor",
    "retention_floor_label",
    "rounds_planned",
    "open_rounds",
    "control",
    "rounds",
}


def k(n: int) -> str:
    return encode_key([n])


def rng(
    i: int, lo: int | None, hi: int, cursor: int | None, state: str = "pending", **kw: object
) -> RangeStatus:
    h = {
        "range_id": str(i),
        "state": state,
        "lo": MIN_KEY if lo is None else k(lo),
        "hi": k(hi),
        "cursor": MIN_KEY if cursor is None else k(cursor),
        "done": "0",
        "skipped": "0",
        "dead": "0",
        "owner": "",
        **{key: str(v) for key, v in kw.items()},
    }
    return RangeStatus.from_hash(h, 1, now_ms=1_000_000)


def test_states_are_the_stored_strings() -> None:
    assert [s.value for s in RangeState] == ["pending", "running", "complete"]
    assert [s.value for s in RoundState] == ["open", "closed", "unrecoverable"]
    assert RangeState.COMPLETE == "complete" and f"{RoundState.CLOSED}" == "closed"
    assert range_state("complete") is RangeState.COMPLETE
    assert range_state("from-the-future") == "from-the-future"  # shown, never hidden


def test_key_space_fraction() -> None:
    assert key_fraction(k(100), k(200), k(150)) == pytest.approx(0.5)
    assert key_fraction(k(100), k(200), k(100)) == 0.0
    assert key_fraction(k(100), k(200), k(200)) == 1.0
    assert key_fraction(k(100), k(200), k(199)) == pytest.approx(0.99)
    assert key_fraction(MIN_KEY, k(200), k(150)) is None  # no lower bound: counts only
    assert key_fraction(MIN_KEY, k(200), k(150), complete=True) == 1.0
    t0, t1 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC), dt.datetime(2024, 1, 3, tzinfo=dt.UTC)
    mid = dt.datetime(2024, 1, 2, tzinfo=dt.UTC)
    assert key_fraction(
        encode_key([t0, 5]), encode_key([t1, 0]), encode_key([mid, 9])
    ) == pytest.approx(0.5)


def test_round_progress_rate_and_eta_from_two_readings() -> None:
    info = {
        "state": "open",
        "start": k(0),
        "end": k(300),
        "n_ranges": "3",
        "chained": "1",
        "created_ms": "1000",
    }
    before = RoundStatus.from_info(
        "s",
        "r1",
        info,
        [
            rng(0, 0, 100, 100, "complete", done=100, completed_ms=3000),
            rng(1, 100, 200, 120, "running", owner="w#1", done=20, heartbeat_ms=3000),
            rng(2, 200, 300, 200),
        ],
    )
    assert before.progress == pytest.approx((1 + 0.2 + 0) / 3)
    assert before.rate == pytest.approx(120 / 2.0) and before.rate_basis == "average since planned"
    assert before.eta_s is None  # never from an average
    after = RoundStatus.from_info(
        "s",
        "r1",
        info,
        [
            rng(0, 0, 100, 100, "complete", done=100),
            rng(1, 100, 200, 160, "running", owner="w#1", done=60),
            rng(2, 200, 300, 200),
        ],
    ).sampled(before, 4.0)
    r1 = after.ranges[1]
    assert r1.rate == pytest.approx(10.0) and r1.eta_s == pytest.approx(4.0)  # 40 keys left at 10/s
    assert after.ranges[0].eta_s == 0.0 and after.ranges[2].eta_s is None  # not moving: no ETA
    assert after.rate == pytest.approx(10.0) and after.eta_s is None
    assert after.rate_basis == "sampled over 4 s"
    other = RoundStatus.from_info("s", "r2", info, list(after.ranges))
    assert other.sampled(before, 4.0) is other  # another round: unchanged


def test_closed_round_is_whole_and_counts_terminal_items() -> None:
    info = {
        "state": "closed",
        "start": k(0),
        "end": k(100),
        "created_ms": "1000",
        "closed_ms": "5000",
    }
    rnd = RoundStatus.from_info(
        "s", "r1", info, [rng(0, 0, 100, 100, "complete", done=7, skipped=2, dead=1)]
    )
    assert rnd.closed and rnd.progress == 1.0 and not rnd.unfinished
    assert (rnd.items, rnd.ranges_complete, rnd.n_ranges) == (10, 1, 1)
    assert rnd.rate == pytest.approx(10 / 4.0)


def test_one_duration_wording() -> None:
    assert [format_duration(s) for s in (None, 0.4, 45, 65, 3599.4, 7380)] == [
        "-",
        "0s",
        "45s",
        "1m05s",
        "59m59s",
        "2h03m",
    ]
    assert format_duration(2.5) == "3s"  # half up, as the page's Math.round
    assert [format_rate(r) for r in (None, 2.5, 340, 12_000)] == ["-", "2.5/s", "340/s", "12k/s"]
    assert (
        value_label(None) == "-inf" and value_label([1, "a"]) == "(1, a)" and value_label(7) == "7"
    )


def test_as_dict_keys_are_the_json_contract() -> None:
    r = rng(0, None, 100, 40, "running", owner="w#1", lease_until=1_030_000, heartbeat_ms=999_000)
    assert set(r.as_dict()) == RANGE_KEYS
    assert r.lease_left_s == 30.0 and r.heartbeat_age_s == 1.0 and r.lease_s == 31.0
    assert r["cursor"] == 40 and r.get("owner") == "w#1"  # record["field"], as the dicts had
    info = {"state": "open", "start": MIN_KEY, "end": k(100), "source": '{"table": "t"}'}
    rnd = RoundStatus.from_info("s", "r1", info, [r])
    d = rnd.as_dict()
    assert set(d) == ROUND_KEYS and d["source"] == {"table": "t"} and d["start_key"] is None
    stream = StreamStatus(
        "s",
        "ks",
        k(100),
        1,
        retention_floor=40,
        rounds_planned=1,
        open_rounds=("r1",),
        rounds=(rnd,),
    )
    assert set(stream.as_dict()) == STREAM_KEYS
    assert set(stream.as_dict(with_rounds=False)) == STREAM_KEYS - {"rounds"}
    assert stream.as_dict()["watermark"] == 100 and stream.retention_floor_label == "40"
