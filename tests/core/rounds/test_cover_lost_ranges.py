"""``cover_lost_ranges``: the records a restore writes are a partition of the round's
``(start, end]`` with a record for every id the round counts, whatever records the mirror lost
(``docs/reliability.md``, defect ``split-range-state-lost``)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.rounds.mirror import split_range_doc
from airflow_keyset_provider.core.rounds.regressions import cover_lost_ranges


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
