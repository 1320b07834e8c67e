"""``BarrierSensor``: succeed only when a whole round is traversed, then close it.

The barrier looks at the round's state in Redis, never at Airflow task states: a traverse task
marked "success" by hand, skipped, or cleared does not move a cursor, so it cannot open the
barrier. Guarantees:

- It succeeds only when every range of the round is complete and the ranges cover
  ``(start, end]`` with no gap (the close re-checks both atomically in Redis). Then it closes the
  round, which moves the stream's watermark to ``end`` (forward only), and returns the totals
  (``round_id``, ``start_key``, ``end_key``, ``done``, ``skipped``, ``dead``, ``watermark``,
  ``stream``) as its XCom. Closing is idempotent: a retried barrier returns the same totals.
- With ``max_dead_letters`` set and more items dead-lettered than that, it fails *without*
  closing: the round stays open and the watermark does not move, so nothing downstream treats the
  round as done until a person has looked at the dead letters (then either raise the limit and
  clear the barrier, or reset the round to traverse it again). Retrying cannot fix this, so the
  task fails without retries.
- Verification: when the plan has ``verify`` (an SQL predicate), the barrier scans the round
  for rows that still match it once every range is complete and before it closes
  (``core/rounds/verification.py``). Verified: it closes as usual, with ``verification`` in its
  XCom and asset event. Failed: with ``on_verify_failure="fail"`` it fails without closing (no
  retry: the round stays open, the watermark does not move) naming the count and the first keys;
  with ``"repair"`` the matching rows go once through ``processor`` and the round is verified
  again, and a round still failing fails the same way. The predicate that runs is the plan's (from
  the DAG), compared with the one recorded in the round, never read from Redis.
- On timeout it fails with the lagging ranges: range, cursor, state, owner, last heartbeat.
- Assets: every ``Asset`` declared in ``outlets`` (``stream_asset(stream)`` is the conventional
  one) gets one event per successful barrier try, whose ``extra`` holds the closed round's
  ``round_id``, ``start_key``, ``end_key``, ``done``, ``skipped``, ``dead`` (plus ``stream`` and
  ``watermark``; keys as ``core.keys.to_json`` renders them), and its asset state store gets the
  stream's ``watermark`` and ``last_round`` (a mirror for the UI and REST API; Redis stays the
  authority). The event comes from this single task, never from the mapped traverse tasks. A
  cleared or retried barrier that succeeds again emits another event for the same round: consumers
  dedupe by ``round_id``. Outlets must be declared when the DAG is parsed (the scheduler only
  knows those), so nothing is added at run time.
- Durable record: after each close the stream's watermark (encoded) and the round id go to the
  asset state store of ``keyset://<stream>`` (``airflow_keyset_provider.durable_record``; the
  plan task declares that asset as an inlet), with or without outlets: a plan after Redis lost
  the stream restores the watermark from it instead of starting again below every key.
- Modes: ``poke``, ``reschedule``, and ``deferrable=True`` (default from Airflow's
  ``[operators] default_deferrable``), which hands the wait to ``KeysetRoundTrigger`` in the
  triggerer; the worker closes the round when the trigger fires.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk import Asset, BaseSensorOperator, Context, PokeReturnValue, conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from airflow_keyset_provider.common import (
    DEFAULT_KEY_PREFIX,
    ROUND_ID_XCOM_KEY,
    ROUND_XCOM_KEY,
    airflow_errors,
    check_names,
    key_label,
)
from airflow_keyset_provider.core.chunk import load_processor
from airflow_keyset_provider.core.keys import to_json
from airflow_keyset_provider.core.redaction import scrub
from airflow_keyset_provider.core.rounds.control import StreamControl
from airflow_keyset_provider.core.rounds.status import RoundState
from airflow_keyset_provider.core.rounds.verify_record import (
    DEFAULT_VERIFY_CHUNK,
    DEFAULT_VERIFY_KEYS,
)
from airflow_keyset_provider.durable_record import record_closed
from airflow_keyset_provider.hooks.keyset import AirflowStatsMetrics, KeysetHook
from airflow_keyset_provider.links import KeysetRoundLink
from airflow_keyset_provider.triggers.keyset import BarrierEvent, KeysetRoundTrigger

_MAX_LISTED = 20  # lagging ranges listed in one message
#: The fields of a closed round's asset event ``extra`` (and of the asset state's ``last_round``).
ROUND_EVENT_FIELDS = (
    "round_id",
    "start_key",
    "end_key",
    "done",
    "skipped",
    "dead",
    "stream",
    "watermark",
)
STREAM_ASSET_SCHEME = "keyset"


def stream_asset(stream: str, **kwargs: Any) -> Asset:
    """The conventional ``Asset`` of a stream's closed rounds, ``keyset://<stream>``.

    Declare it on the barrier (``BarrierSensor(..., outlets=[stream_asset("orders")])``) and
    schedule downstream DAGs on the same call (``schedule=[stream_asset("orders")]``): both sides
    then name the same asset. ``kwargs`` go to ``Asset`` (``group``, ``extra``, ...).
    """
    if not isinstance(stream, str) or not stream:
        raise ValueError(f"stream must be a non-empty string, got {stream!r}")
    return Asset(f"{STREAM_ASSET_SCHEME}://{stream}", **kwargs)


def _lagging_text(lines: list[str]) -> str:
    if not lines:
        return "no lagging range recorded"
    more = f"; ... and {len(lines) - _MAX_LISTED} more" if len(lines) > _MAX_LISTED else ""
    return "; ".join(lines[:_MAX_LISTED]) + more


#: The barrier's retries and retry delay when neither the task nor ``default_args`` set them: a
#: retry is always safe (the close is idempotent) and Airflow 3.3 can fail a deferred task whose
#: trigger fires within seconds of the deferral (a stale executor event from the deferring try;
#: apache/airflow#72716), which a round that finishes right after the barrier deferred hits.
BARRIER_RETRIES = 2
BARRIER_RETRY_DELAY = dt.timedelta(seconds=10)


def _retry_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the barrier's ``retries``/``retry_delay`` defaults where the author gave
    neither (on the task or in ``default_args``); ``[core] default_task_retries`` still wins when
    it is higher."""
    given = {**(kwargs.get("default_args") or {}), **kwargs}
    out = dict(kwargs)
    if "retries" not in given:
        configured = conf.getint("core", "default_task_retries", fallback=0)
        out["retries"] = max(BARRIER_RETRIES, configured)
    if "retry_delay" not in given:
        out["retry_delay"] = BARRIER_RETRY_DELAY
    return out


class BarrierSensor(BaseSensorOperator):
    """Wait until every range of a round is complete, close the round, return its totals.

    :param plan_task_id: the ``PlanRangesOperator`` of this DAG run whose round to wait for.
    :param round_id: wait for this round instead (e.g. from another DAG); then give ``stream``
        (default: this DAG's id) and ``key_prefix`` if they are not the defaults.
    :param stream: the round's stream (default: the plan's stream, else this DAG's id).
    :param redis_conn_id: Airflow ``redis`` connection of the cursor store.
    :param key_prefix: the engine's Redis key prefix (default: the plan's, else ``ks``).
    :param max_dead_letters: fail (without closing) when more items than this were dead-lettered.
    :param checkpoint_conn_id: the durable checkpoint mirror's connection (default: the plan's), so a
        round Redis lost is restored and the closed round's watermark is mirrored.
    :param deferrable: wait in the triggerer instead of a worker slot.
    :param poke_interval: seconds between checks (also the trigger's poll interval).
    :param processor: the round's processor (a callable or ``"package.module:function"``), run
        by the repair pass of a plan with ``on_verify_failure="repair"``.
    :param target_conn_id: the processor's database for the repair pass (as the traverse task's).
    :param verify_chunk_size: rows per statement of the verification scan (default 10,000).
    :param max_item_attempts: the repair pass's attempts per item the processor names failed.

    ``retries`` and ``retry_delay`` default to ``BARRIER_RETRIES`` (2) and
    ``BARRIER_RETRY_DELAY`` (10 s) when neither the task nor ``default_args`` gives them: a
    retried barrier closes the same round and returns the same totals.
    """

    template_fields: Sequence[str] = ("round_id", "stream", "plan_task_id", "key_prefix")
    operator_extra_links = (KeysetRoundLink(),)
    ui_color = "#f3e3d8"

    def __init__(
        self,
        *,
        plan_task_id: str | None = "plan",
        round_id: str | None = None,
        stream: str | None = None,
        redis_conn_id: str = "redis_default",
        key_prefix: str | None = None,
        max_dead_letters: int | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        checkpoint_conn_id: str | None = None,
        processor: Callable[..., Any] | str | None = None,
        target_conn_id: str | None = None,
        verify_chunk_size: int = DEFAULT_VERIFY_CHUNK,
        max_item_attempts: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**_retry_defaults(kwargs))
        self.processor, self.target_conn_id = processor, target_conn_id
        self.verify_chunk_size, self.max_item_attempts = verify_chunk_size, max_item_attempts
        if not plan_task_id and not round_id:
            raise ValueError(
                "BarrierSensor needs plan_task_id (a PlanRangesOperator of this DAG) or round_id"
            )
        if max_dead_letters is not None and (
            isinstance(max_dead_letters, bool) or max_dead_letters < 0
        ):
            raise ValueError(
                f"max_dead_letters must be None or a non-negative integer, got {max_dead_letters!r}"
            )
        self.plan_task_id = plan_task_id
        self.round_id = round_id
        self.stream = stream
        self.redis_conn_id = redis_conn_id
        self.key_prefix = key_prefix
        check_names(stream=stream, key_prefix=key_prefix, round_id=round_id)
        self.max_dead_letters = max_dead_letters
        self.deferrable = deferrable
        self.checkpoint_conn_id = checkpoint_conn_id

    # ---- which round ---------------------------------------------------------------------
    def _target(self, context: Context) -> tuple[str, str, str]:
        """-> (round_id, stream, key_prefix)."""
        if self.round_id:
            return (
                str(self.round_id),
                self.stream or self.dag_id,
                self.key_prefix or DEFAULT_KEY_PREFIX,
            )
        ti = context["ti"]
        info = ti.xcom_pull(task_ids=self.plan_task_id, key=ROUND_XCOM_KEY) or {}
        round_id = info.get("round_id") or ti.xcom_pull(
            task_ids=self.plan_task_id, key=ROUND_ID_XCOM_KEY
        )
        if not round_id:
            raise AirflowFailException(
                f"task {self.plan_task_id!r} pushed no round id in this DAG run: the barrier must run "
                "after its PlanRangesOperator (or pass round_id=)"
            )
        return (
            str(round_id),
            self.stream or info.get("stream") or self.dag_id,
            self.key_prefix or info.get("key_prefix") or DEFAULT_KEY_PREFIX,
        )

    def _checkpoint_conn_id(self, context: Context) -> str | None:
        if self.checkpoint_conn_id or self.round_id:
            return self.checkpoint_conn_id
        info = context["ti"].xcom_pull(task_ids=self.plan_task_id, key=ROUND_XCOM_KEY) or {}
        return info.get("checkpoint_conn_id")

    def _control(self, context: Context) -> tuple[str, StreamControl]:
        """The round and a control on its stream; one Redis client per task try, not per poke."""
        round_id, stream, prefix = self._target(context)
        cached = getattr(self, "_cached_control", None)
        if cached is None or cached[0] != (stream, prefix):
            with airflow_errors():
                hook = KeysetHook(
                    redis_conn_id=self.redis_conn_id,
                    checkpoint_conn_id=self._checkpoint_conn_id(context),
                )
                cached = ((stream, prefix), hook.control(stream, prefix))
            self._cached_control = cached
        return round_id, cached[1]

    # ---- the check and the close -----------------------------------------------------------
    def poke(self, context: Context) -> bool | PokeReturnValue:
        round_id, ctl = self._control(context)
        with airflow_errors():
            check = ctl.check_round(round_id)
        if not check.complete:
            self.log.info(
                "round %s: %d range(s) not complete: %s",
                round_id,
                len(check.lagging),
                _lagging_text([r.describe() for r in check.lagging]),
            )
            return False
        return PokeReturnValue(
            is_done=True, xcom_value=self._close_and_publish(context, ctl, round_id)
        )

    def _close(self, context: Context, ctl: StreamControl, round_id: str) -> dict[str, Any]:
        with airflow_errors():
            if (
                self.max_dead_letters is not None
                and ctl.store.round_state(round_id) != RoundState.CLOSED
            ):
                rnd = ctl.round_status(round_id)
                if rnd.dead > self.max_dead_letters:
                    where = ", ".join(f"range {r.range_id}: {r.dead}" for r in rnd.ranges if r.dead)
                    raise AirflowFailException(
                        f"round {round_id}: {rnd.dead} item(s) dead-lettered ({where}), more than "
                        f"max_dead_letters={self.max_dead_letters}. The round stays open and the "
                        "watermark did not move. Inspect the dead letters (StreamControl.dead_letters), "
                        "then raise the limit and clear this task, or reset the round to traverse it again."
                    )
            verification = self._verify(context, ctl, round_id)
            totals = ctl.close_round(round_id)
            created_ms = int(ctl.store.round_info(round_id).get("created_ms") or 0)
        metrics, tags = AirflowStatsMetrics(), {"stream": ctl.stream}
        metrics.incr("barrier.closed", tags=tags)
        if created_ms:  # plan -> closed: how long the barrier's round took to finish
            metrics.timing("round.duration", time.time() * 1000 - created_ms, tags=tags)
        out = totals.as_dict()
        out["watermark"] = to_json(totals.watermark)
        out["stream"] = ctl.stream
        if verification is not None:
            out["verification"] = verification
        self.log.info(
            "round %s (%s, %s] closed: done %d, skipped %d, dead %d; stream %s watermark now %s",
            round_id,
            key_label(out["start_key"]),
            key_label(out["end_key"]),
            totals.done,
            totals.skipped,
            totals.dead,
            ctl.stream,
            key_label(out["watermark"]),
        )
        return out

    # ---- verification: after every range is complete, before the close ---------------------
    def _verify(self, context: Context, ctl: StreamControl, round_id: str) -> dict[str, Any] | None:
        """The round's verification (None when its plan has no ``verify``): run now while the
        round is open; a closed round's (a retried barrier) as recorded. A failed one raises
        ``AirflowFailException`` naming the count and the first keys; the round stays open."""
        if ctl.store.round_state(round_id) == RoundState.CLOSED:
            return ctl.round_status(round_id).verification_dict
        info = {} if self.round_id else self._plan_info(context)
        predicate = info.get("verify")
        if not predicate:
            return None
        src = info.get("source") or {}
        hook = KeysetHook(
            src.get("source_conn_id"),
            self.redis_conn_id,
            src.get("checkpoint_conn_id"),
            self.target_conn_id,
        )
        t = hook.traversal(
            table=src["table"],
            key=src["key"],
            stream=ctl.stream,
            where=src.get("where"),
            where_params=src.get("where_params"),
            columns=src.get("columns"),
            key_prefix=src["key_prefix"],
        )
        try:
            result = t.verify_round(
                round_id,
                predicate,
                on_failure=info.get("on_verify_failure") or "fail",
                processor=None if self.processor is None else load_processor(self.processor),
                max_keys=int(info.get("verify_keys") or DEFAULT_VERIFY_KEYS),
                chunk_size=self.verify_chunk_size,
                max_item_attempts=self.max_item_attempts,
            )
        finally:
            t.close()
        self.log.info("round %s: %s", round_id, result.describe())
        if not result.verified:
            raise AirflowFailException(
                f"round {round_id}: verification {result.describe()}. The round stays open and "
                "the watermark did not move. Fix the rows (or the processor), then clear this "
                "task to verify again; with on_verify_failure='repair' the barrier sends them "
                "through the processor once."
            )
        return result.as_dict()

    def _plan_info(self, context: Context) -> dict[str, Any]:
        return context["ti"].xcom_pull(task_ids=self.plan_task_id, key=ROUND_XCOM_KEY) or {}

    # ---- assets: one event per closed round, the watermark in the asset state store ----------
    def _close_and_publish(
        self, context: Context, ctl: StreamControl, round_id: str
    ) -> dict[str, Any]:
        out = self._close(context, ctl, round_id)
        record_closed(ctl.stream, round_id, ctl.store.watermark(), ctl.store.key_fingerprint())
        self._publish_round(context, out)
        return out

    def _stream_assets(self) -> list[Asset]:
        return [o for o in self.outlets if isinstance(o, Asset)]

    def _publish_round(self, context: Context, out: dict[str, Any]) -> None:
        """Put the closed round on each ``Asset`` outlet: the event's ``extra`` (Airflow emits the
        event when this try succeeds) and the asset state store's ``watermark``/``last_round``."""
        assets = self._stream_assets()
        if not assets:
            return
        extra = {k: out.get(k) for k in ROUND_EVENT_FIELDS}
        if out.get("verification") is not None:  # only a verified round closes with one
            extra["verification"] = out["verification"]
        expected = stream_asset(out["stream"]).name
        states = context.get("asset_state_store")
        for asset in assets:
            if asset.name.startswith(f"{STREAM_ASSET_SCHEME}://") and asset.name != expected:
                self.log.warning(
                    "outlet %s names another stream than the round's (%s); its event still carries "
                    "stream %s in extra",
                    asset.name,
                    expected,
                    out["stream"],
                )
            context["outlet_events"][asset].extra = extra
            if states is not None:
                state = states[asset]
                if out.get("watermark") is not None:
                    state.set("watermark", out["watermark"])
                state.set("last_round", extra)
        self.log.info(
            "round %s: asset event (round_id, bounds, counters) on %s; watermark %s mirrored to "
            "their asset state store",
            out["round_id"],
            ", ".join(a.name for a in assets),
            key_label(out.get("watermark")),
        )

    def _lagging_now(self, context: Context) -> str:
        try:
            round_id, ctl = self._control(context)
            return _lagging_text([r.describe() for r in ctl.check_round(round_id).lagging])
        except Exception as exc:  # the timeout is the error; the listing is a best effort
            return f"(could not list the lagging ranges: {scrub(str(exc))})"

    # ---- execution paths -------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            try:
                return super().execute(context)
            except AirflowSensorTimeout as exc:
                raise AirflowSensorTimeout(
                    f"{exc} Lagging ranges: {self._lagging_now(context)}"
                ) from exc
        round_id, ctl = self._control(context)
        with airflow_errors():
            check = ctl.check_round(round_id)
        if check.complete:
            return self._close_and_publish(context, ctl, round_id)
        _, stream, prefix = self._target(context)
        self.log.info(
            "round %s: %d range(s) not complete; deferring (timeout %.0f s)",
            round_id,
            len(check.lagging),
            self.timeout,
        )
        self.defer(
            trigger=KeysetRoundTrigger(
                round_id=round_id,
                stream=stream,
                redis_conn_id=self.redis_conn_id,
                key_prefix=prefix,
                poll_interval=self.poke_interval,
                deadline=time.time() + self.timeout,
                checkpoint_conn_id=self._checkpoint_conn_id(context),
            ),
            method_name="execute_complete",
            # a backstop only: the trigger fires its own timeout event, with the lagging ranges
            timeout=dt.timedelta(seconds=self.timeout + max(60.0, self.poke_interval * 2)),
        )

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        event = event or {}
        status = event.get("status")
        round_id = event.get("round_id")
        if status == BarrierEvent.COMPLETE:
            _, ctl = self._control(context)
            return self._close_and_publish(context, ctl, str(round_id))
        if status == BarrierEvent.TIMEOUT:
            raise AirflowSensorTimeout(
                f"round {round_id} is not complete after {self.timeout:.0f} s. Lagging ranges: "
                f"{_lagging_text(list(event.get('lagging') or []))}"
            )
        if status == BarrierEvent.ERROR:
            raise AirflowFailException(f"round {round_id}: {event.get('message')}")
        raise AirflowException(f"unexpected event from KeysetRoundTrigger: {event!r}")


__all__ = [
    "BARRIER_RETRIES",
    "BARRIER_RETRY_DELAY",
    "ROUND_EVENT_FIELDS",
    "BarrierSensor",
    "stream_asset",
]
