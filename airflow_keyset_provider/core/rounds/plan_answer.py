"""What a plan first answered for a round, recorded so that every retry or clear answers the same.

Pull mode hands each task a first range, chosen from the round's ranges (``PlanRangesOperator``
with ``max_tasks``). As the round runs, claims coalesce the ranges that follow into the claimed one
(its ``hi`` moves up, theirs become empty) and splits cut ranges (a ``hi`` moves down, a range is
appended): choosing again later gives other ranges and other bounds. So the first choice is
recorded in the round's hash (field ``answer:<name>``, set only if absent), with each chosen
range's id and bounds as they were then; the checkpoint mirror's copy of the round definition gets
it too, so a round restored after a Redis loss answers the same.

Guarantee (``tests/airflow/test_plan_replay.py``): for one round and one ``name``, every call
returns the ranges, with the bounds, that the first call returned, whatever ran since. A round
planned by a version without this record gets its answer recorded from its ranges at the first
call after the upgrade.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..keys import decode_user_key, display_key
from .control import RangeSpec, Round, StreamControl


def spec(range_id: int, lo: str, hi: str, arity: int) -> RangeSpec:
    """A ``RangeSpec`` from encoded bounds (the label as ``StreamControl.round`` writes it)."""
    return RangeSpec(
        range_id=range_id,
        lo=decode_user_key(lo, arity),
        hi=decode_user_key(hi, arity),
        lo_encoded=lo,
        hi_encoded=hi,
        label=f"range {range_id} ({display_key(lo, arity)}, {display_key(hi, arity)}]",
    )


def first_answer(
    control: StreamControl,
    round_id: str,
    name: str,
    choose: Callable[[Round], list[RangeSpec]],
) -> list[RangeSpec]:
    """The ranges ``choose`` picked from the round the first time this was called with ``name``
    (recorded now if this is that first time; a concurrent first call's record wins)."""
    store = control.store
    info = store.round_info(round_id)
    arity = int(info.get("arity") or 1)
    doc = info.get(f"answer:{name}")
    if doc is None:
        chosen = choose(control.round(round_id))
        doc = json.dumps([[s.range_id, s.lo_encoded, s.hi_encoded] for s in chosen])
        if store.record_round_answer(round_id, name, doc):
            if control.mirror is not None:  # the round's definition row only
                control.mirror.save_round(control.stream, round_id, store.round_info(round_id), [])
        else:
            doc = store.round_info(round_id)[f"answer:{name}"]
    return [spec(int(i), lo, hi, arity) for i, lo, hi in json.loads(doc)]
