"""A stream's durable record in Airflow: the asset state store of ``keyset://<stream>``.

Redis is the recovery layer and may lose a stream; Airflow's metadata database does not. The
plan task declares ``stream_asset(stream)`` as an inlet (so Airflow registers the asset when it
parses the DAG), and two keys of that asset's state store record what a plan needs to restore or
refuse a stream Redis lost (``core/rounds/durability.py``):

- ``keyset_planned`` (written by ``PlanRangesOperator`` after each chained plan, before its task
  succeeds): ``{"round_id", "start", "end"}``, bounds encoded. A write that fails fails the plan:
  a plan Airflow does not know of could be lost silently.
- ``keyset_closed`` (written by ``BarrierSensor`` after each close): ``{"round_id", "watermark",
  "key_fingerprint"}``, the watermark encoded as Redis holds it; ``round_id`` only moves up.
  Best effort: a failed write leaves the record behind, which can only make a later loss refuse.

The asset state store was chosen over the asset events: it is one read, needs no outlet (the
events of ``outlets=[stream_asset(...)]`` stay the user's choice) and the Execution API serves it
to any task. Records written before these keys existed (the barrier's ``last_round`` and
``watermark`` of an asset outlet) are read too.

``read_record`` returns None when Airflow has no asset of the stream (the plan task was built
outside a DAG, or ``stream`` is a template): the plan then refuses a stream with no Redis state
unless ``new_stream=True``. An asset with no keys is a stream Airflow never planned: a new stream.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_keyset_provider.core import KeysetTraversal, Round
from airflow_keyset_provider.core.keys import coerce_bound, encode_key
from airflow_keyset_provider.core.rounds.durability import PlannedRound, StreamRecord, round_number

log = logging.getLogger(__name__)

PLANNED_KEY = "keyset_planned"
CLOSED_KEY = "keyset_closed"
ASSET_SCHEME = "keyset"


def asset_name(stream: str) -> str:
    """The name of ``stream_asset(stream)`` (``keyset://<stream>``)."""
    return f"{ASSET_SCHEME}://{stream}"


def _accessor(stream: str) -> Any:
    from airflow.sdk.execution_time.context import AssetStateStoreAccessor

    return AssetStateStoreAccessor(name=asset_name(stream))


def _asset_known(stream: str) -> bool:
    """True when Airflow has the stream's asset (registered from a DAG that declares it)."""
    from airflow.sdk.execution_time.comms import AssetResult, GetAssetByName
    from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

    return isinstance(SUPERVISOR_COMMS.send(GetAssetByName(name=asset_name(stream))), AssetResult)


def read_record(stream: str, t: KeysetTraversal) -> StreamRecord | None:
    """What Airflow's asset state of ``stream`` knows (None: no asset, or not in a task)."""
    try:
        if not _asset_known(stream):
            log.info(
                "stream %s: Airflow has no asset %s (declare the stream statically on the plan, "
                "which adds it as an inlet): no durable record beside Redis",
                stream,
                asset_name(stream),
            )
            return None
        state = _accessor(stream)
        closed, planned, legacy = state.get(CLOSED_KEY), state.get(PLANNED_KEY), None
        if not isinstance(closed, dict):
            legacy = state.get("last_round")
    except Exception as exc:  # not inside a task runner, or the API refused: no record
        log.warning("stream %s: could not read Airflow's asset state (%s)", stream, exc)
        return None
    source = f"Airflow asset state of {asset_name(stream)}"
    if isinstance(closed, dict) and isinstance(closed.get("watermark"), str):
        return StreamRecord(
            source=source,
            watermark=closed["watermark"],
            last_round=closed.get("round_id"),
            key_fingerprint=closed.get("key_fingerprint"),
            planned=PlannedRound.from_dict(planned),
        )
    return StreamRecord(
        source=source,
        **_legacy(t, legacy),
        planned=PlannedRound.from_dict(planned),
    )


def _legacy(t: KeysetTraversal, last_round: Any) -> dict[str, Any]:
    """The barrier's ``last_round`` of older versions (keys as ``to_json`` renders them)."""
    if not isinstance(last_round, dict) or last_round.get("watermark") is None:
        return {}
    t.source.validate()
    value = last_round["watermark"]
    wm = encode_key(coerce_bound("watermark", value, t.source.key_kinds, from_text=True))
    return {"watermark": wm, "last_round": last_round.get("round_id")}


def record_planned(stream: str, rnd: Round) -> None:
    """Record a chained round's plan (raises if Airflow refused the write)."""
    doc = PlannedRound(rnd.round_id, rnd.start_encoded, rnd.end_encoded).as_dict()
    _accessor(stream).set(PLANNED_KEY, doc)


def record_closed(stream: str, round_id: str, watermark: str | None, key: str | None) -> bool:
    """Record a close (best effort; the round id only moves up). True if written."""
    if watermark is None:
        return False
    try:
        if not _asset_known(stream):
            return False
        state = _accessor(stream)
        prev = state.get(CLOSED_KEY)
        if isinstance(prev, dict) and round_number(str(prev.get("round_id") or "")) > round_number(
            round_id
        ):
            round_id = str(prev["round_id"])
        state.set(
            CLOSED_KEY, {"round_id": round_id, "watermark": watermark, "key_fingerprint": key}
        )
        return True
    except Exception as exc:  # best effort: a record left behind only makes a later loss refuse
        log.warning(
            "stream %s: could not record the close of round %s in Airflow's asset state (%s)",
            stream,
            round_id,
            exc,
        )
        return False


__all__ = ["CLOSED_KEY", "PLANNED_KEY", "read_record", "record_closed", "record_planned"]
