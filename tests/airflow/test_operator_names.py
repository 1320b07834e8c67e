"""The operators' names are checked when the DAG is parsed, by the rules of ``core/names.py``
(a full match; issue 28, item 4): a stream, key prefix or round id with a trailing newline, a
key separator or a brace fails the DAG file with the rule, instead of reaching Redis keys at run
time. A Jinja template or an ``XComArg`` is checked when rendered (by the store)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_keyset_provider.core.errors import InvalidNameError
from airflow_keyset_provider.operators.plan import PlanRangesOperator
from airflow_keyset_provider.operators.traverse import TraverseRangeOperator
from airflow_keyset_provider.sensors.keyset import BarrierSensor

SOURCE = {"source_conn_id": "db", "table": "events", "key": "seq"}


def plan(**names: Any) -> Any:
    return PlanRangesOperator(task_id="plan", **SOURCE, **names)


def traverse(**names: Any) -> Any:
    names.setdefault("round_id", "r1")
    return TraverseRangeOperator(
        task_id="traverse", range_id=0, processor="mod:fn", **SOURCE, **names
    )


def barrier(**names: Any) -> Any:
    return BarrierSensor(task_id="barrier", **names)


BUILDERS = {"plan": plan, "traverse": traverse, "barrier": barrier}
BAD = {
    "stream": ["events\n", "ev:ents", "{events}", " events", "events*"],
    "key_prefix": ["ks\n", "k s", "ks{x}"],
    "round_id": ["r1\n", "r1:range:0", "1", "r1*"],
}
TAKES = {
    "plan": ("stream", "key_prefix"),
    "traverse": ("stream", "key_prefix", "round_id"),
    "barrier": ("stream", "key_prefix", "round_id"),
}


@pytest.mark.parametrize("operator", sorted(BUILDERS))
def test_a_malformed_literal_name_fails_the_dag_file(operator: str) -> None:
    build = BUILDERS[operator]
    for kind in TAKES[operator]:
        for bad in BAD[kind]:
            with pytest.raises(InvalidNameError, match=kind.replace("_", " ").split()[0]):
                build(**{kind: bad})


@pytest.mark.parametrize("operator", sorted(BUILDERS))
def test_good_names_and_templates_pass(operator: str) -> None:
    build = BUILDERS[operator]
    good = {"stream": "events-nightly", "key_prefix": "team:etl", "round_id": "r12"}
    templated = {kind: "{{ params.name }}" for kind in TAKES[operator]}
    build(**{kind: good[kind] for kind in TAKES[operator]})
    build(**templated)
