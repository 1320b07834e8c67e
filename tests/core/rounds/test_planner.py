"""Planner (``core/rounds/planner.py``): ``split`` covers ``(start, end]`` exactly with at most
``max_ranges`` disjoint half-open ranges whose inner boundaries are cut keys (hypothesis; short
mode a few hundred examples, long mode ``KEYSET_RELIABILITY_LONG=1`` thousands)."""

from __future__ import annotations

import itertools

import modes
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.rounds.planner import split

EXAMPLES = modes.trials(300, 5000)


@st.composite
def split_inputs(draw: st.DrawFn) -> tuple[str, str, list[str], int, list[str]]:
    universe = sorted(
        {
            encode_key((n,))
            for n in draw(st.lists(st.integers(-1000, 1000), min_size=1, max_size=60))
        }
    )
    start = draw(st.sampled_from([MIN_KEY, *universe]))
    end = draw(st.sampled_from([u for u in universe if u >= start] or [start]))
    cuts = draw(st.lists(st.sampled_from(universe), max_size=80))  # may repeat, may fall outside
    return start, end, cuts, draw(st.integers(1, 40)), universe


@settings(max_examples=EXAMPLES, deadline=None)
@given(split_inputs())
def test_planner_split_is_an_exact_disjoint_cover(
    inp: tuple[str, str, list[str], int, list[str]],
) -> None:
    start, end, cuts, max_ranges, universe = inp
    ranges = split(start, end, cuts, max_ranges)
    assert 1 <= len(ranges) <= max_ranges
    assert ranges[0][0] == start and ranges[-1][1] == end
    for (_lo1, hi1), (lo2, _hi2) in itertools.pairwise(ranges):
        assert hi1 == lo2  # adjacent: no gap, no overlap (half-open)
    inner = [hi for _, hi in ranges[:-1]]
    assert all(c in cuts and start < c < end for c in inner)
    assert inner == sorted(set(inner))
    if start != end:
        assert all(lo < hi for lo, hi in ranges)
    # every key of the universe in (start, end] lies in exactly one range, none outside does
    for k in universe:
        owners = [i for i, (lo, hi) in enumerate(ranges) if lo < k <= hi]
        assert len(owners) == (1 if start < k <= end else 0), (k, ranges)
    # as many ranges as the distinct usable cuts allow, up to max_ranges
    usable = {c for c in cuts if start < c < end}
    assert len(ranges) == min(max_ranges, len(usable) + 1)


@pytest.mark.parametrize(
    ("start", "end", "max_ranges", "message"),
    [("a", "b", 0, "max_ranges must be >= 1"), ("b", "a", 1, "end < start")],
)
def test_split_refuses_impossible_requests(
    start: str, end: str, max_ranges: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        split(start, end, [], max_ranges)
