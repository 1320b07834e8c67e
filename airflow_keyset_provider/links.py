"""Operator extra link: the task's round on the "Keyset traversals" page.

``KeysetRoundLink`` ("Keyset round") is attached to ``PlanRangesOperator``,
``TraverseRangeOperator`` and ``BarrierSensor``. Airflow 3 resolves extra links on the worker when
a task instance finishes (success or failure) and stores the URL as an XCom
(``_link_KeysetRoundLink``); the UI and ``GET /api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/
{task_id}/links`` read it from there. The URL is the plugin page filtered to one round::

    <[api] base_url>/keyset/?stream=<stream>&round=<round_id>

(relative, ``/keyset/?...``, when ``[api] base_url`` is not set). Where the round comes from:

- a traverse task (and a barrier given ``round_id``): its own ``round_id`` and ``stream``;
- a plan task: the ``keyset_round`` XCom it pushed (stream, round id);
- a barrier given ``plan_task_id``: that plan task's ``keyset_round`` XCom.

No round known (the plan failed before planning): no link (an empty URL, which Airflow shows as
none). The page reads the key prefix configured in ``[keyset] key_prefix``; a task using another
prefix links to a page that does not list its stream.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from airflow.sdk import BaseOperatorLink, conf

from .common import ROUND_XCOM_KEY

#: Path of the plugin's page under the API server (``plugins.keyset.URL_PREFIX``).
PAGE_PATH = "/keyset/"


def round_url(stream: str, round_id: str) -> str:
    """The Keyset page showing one round, under Airflow's ``[api] base_url``."""
    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return f"{base}{PAGE_PATH}?{urlencode({'stream': stream, 'round': round_id}, quote_via=quote)}"


def _rendered(value: Any) -> str | None:
    return value if isinstance(value, str) and value and "{{" not in value else None


def round_ref(operator: Any, ti: Any) -> tuple[str, str] | None:
    """``(stream, round_id)`` of the round ``operator`` (a plan, traverse or barrier task) works
    on, for the task instance ``ti``; None when no round is known."""
    round_id = _rendered(getattr(operator, "round_id", None))
    if round_id is not None:
        stream = _rendered(getattr(operator, "stream", None)) or operator.dag_id
        return stream, round_id
    plan_task_id = _rendered(getattr(operator, "plan_task_id", None)) or operator.task_id
    pull = getattr(ti, "xcom_pull", None)
    if pull is None:
        return None
    if plan_task_id == getattr(ti, "task_id", None):
        info = pull(task_ids=plan_task_id, key=ROUND_XCOM_KEY, map_indexes=ti.map_index)
    else:
        info = pull(task_ids=plan_task_id, key=ROUND_XCOM_KEY)
    if isinstance(info, list):  # a mapped plan task pulled without a map index
        info = info[0] if len(info) == 1 else None
    if not isinstance(info, dict) or not info.get("round_id") or not info.get("stream"):
        return None
    return str(info["stream"]), str(info["round_id"])


class KeysetRoundLink(BaseOperatorLink):
    """ "Keyset round": the task's round on the Keyset traversals page (see the module doc)."""

    name = "Keyset round"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        ref = round_ref(operator, ti_key)
        return "" if ref is None else round_url(*ref)
