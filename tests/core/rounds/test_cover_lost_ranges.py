"""``cover_lost_ranges``: the records a restore writes are a partition of the round's
``(start, end]`` with a record for every id the round counts, whatever records the mirror lost
(``docs/reliability.md``, defect ``split-range-state-lost``)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.rounds.mirror import split_range_doc
from airflow_keyset_provider.core.rounds.regressions import cover_lost_ranges, end_overlaps


def _k(v: int) -> str:
    return encode_key((v,))


def _range(i: int, lo: int, hi: int, cursor: int | None = None) -> dict[str, Any]:
    doc = split_range_doc({"range_id": ""}, i, _k(lo), _k(hi))
    return {**doc, "cursor": _k(lo if cursor is None else cursor)}


def _is_partition(info: dict[str, str], ranges: list[dict[str, Any]], n: int) -> bool:
    """The close's walk (``close_round.lua``): in (lo, hi, id) order, each range starts where
    the previous ended, and the last ends at the round's end; ids 0..n-1 each once."""
    if sorted(int(r["range_id"]) for r in ranges) != list(range(n)):
        return False
    expect = info["start"]
    for r in sorted(ranges, key=lambda r: (r["lo"], r["hi"], int(r["range_id"]))):
        if r["lo"] != expect or r["hi"] < r["lo"]:
            return False
        expect = r["hi"]
    return expect == info["end"]


INFO = {"start": _k(0), "end": _k(300), "arity": "1"}


@pytest.mark.parametrize(
    ("held", "n", "rebuilt_ids"),
    [
        # the split's range (100, 300] lost, the parent's record already ends at 100
        ([(0, 0, 100)], 2, [1]),
        # a lost range inside the round, a gap between two held ones
        ([(0, 0, 100), (2, 200, 300)], 3, [1]),
        # a lost id whose keys the parent's older record still covers: an empty range
        ([(0, 0, 300)], 2, [1]),
        # a gap with no lost id (a split's record whose parent record moved on): a new id
        ([(0, 0, 100), (1, 200, 300)], 2, [2]),
        # nothing lost: nothing rebuilt
        ([(0, 0, 100), (1, 100, 300)], 2, []),
    ],
)
def test_a_restore_covers_every_key_and_counts_every_range(
    held: list[tuple[int, int, int]], n: int, rebuilt_ids: list[int]
) -> None:
    ranges = [_range(i, lo, hi) for i, lo, hi in held]
    n, rebuilt = cover_lost_ranges("r1", INFO, ranges, n)
    assert sorted(int(r["range_id"]) for r in rebuilt) == rebuilt_ids
    assert _is_partition(INFO, ranges, n)
    for r in rebuilt:  # nothing committed: a rebuilt range's keys are delivered again
        assert r["cursor"] == r["lo"] and r["done"] == "0"
        assert r["state"] == ("complete" if r["lo"] == r["hi"] else "pending")


def _merged(i: int, at: int, into: int) -> dict[str, Any]:
    doc = split_range_doc({"range_id": ""}, i, _k(at), _k(at))
    return {**doc, "state": "complete", "merged_into": str(into)}


@pytest.mark.parametrize(
    ("low", "expect_hi", "absorbed"),
    [
        # range 0 coalesced 1-3 ((0, 300]) and committed nothing: it ends where range 1 starts
        ({"cursor": 0, "state": "pending"}, 75, False),
        # range 0 committed past range 1's lo: range 1 is absorbed again, as the claim made it
        ({"cursor": 120, "state": "pending"}, 300, True),
        ({"cursor": 300, "state": "complete"}, 300, True),
    ],
    ids=["cut", "absorb-running", "absorb-complete"],
)
def test_overlapping_records_of_two_timelines_become_a_partition(
    low: dict[str, Any], expect_hi: int, absorbed: bool
) -> None:
    """``end_overlaps`` (defect ``coalescing-lost-overlap``): the mirror holds range 0 as a
    coalescing claim made it ``(0, 300]`` (ranges 2 and 3 empty at 300) beside range 1
    ``(75, 150]`` as another Redis timeline ran it (cursor 100, counts and a dead letter).
    After the repair and ``cover_lost_ranges`` the records are a partition, with every count
    kept exact: a cut range keeps its counts; an absorbed range has none."""
    r0 = {**_range(0, 0, 300, low["cursor"]), "state": low["state"], "done": "7"}
    r1 = {**_range(1, 75, 150, 100), "done": "19", "dead": "1", "dead_letters": ["x"]}
    ranges = [r0, r1, _merged(2, 300, 0), _merged(3, 300, 0)]
    info = {**INFO, "skip:0": "4"}
    changed = end_overlaps("r1", info, ranges)
    n, _ = cover_lost_ranges("r1", info, ranges, 4)
    assert _is_partition(info, ranges, n)
    assert r0["hi"] == _k(expect_hi) and r0["done"] == "7"
    if absorbed:
        assert changed == [r1] and "skip:0" in info
        assert (r1["lo"], r1["hi"], r1["merged_into"]) == (_k(300), _k(300), "0")
        assert (r1["done"], r1["dead"], r1["dead_letters"]) == ("0", "0", [])
    else:
        assert changed == [r0] and "skip:0" not in info
        assert (r1["lo"], r1["hi"], r1["cursor"], r1["done"]) == (_k(75), _k(150), _k(100), "19")
        assert n == 5  # the keys (150, 300] range 0 gave back: a pending range again


def test_records_that_do_not_overlap_are_left_as_they_are() -> None:
    ranges = [_range(0, 0, 100, 50), _range(1, 100, 300), _merged(2, 300, 1)]
    info = {**INFO, "skip:1": "3"}
    assert end_overlaps("r1", info, ranges) == []
    assert info == {**INFO, "skip:1": "3"}
