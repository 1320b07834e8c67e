"""Durable by default: a stream whose Redis state is gone is restored or refused, never restarted.

Redis keeps a stream's watermark, round counter and open rounds. When it loses them (``FLUSHALL``,
a restart without persistence, eviction, a failover to an empty replica) a chained plan would read
"no watermark" as "start below every key" and deliver the whole table again. Every chained plan
therefore asks, after the checkpoint mirror had its say (``StreamControl.recover_stream``), what a
durable record outside Redis knows of the stream (``StreamRecord``; Airflow's operators read it
from the asset state store of ``keyset://<stream>``, ``operators/durable_record.py``):

- **Redis knows the stream** (a round counter or a watermark): the plan goes on. A record's
  watermark and round counter still move Redis's forward (never back), so a Redis that lost a close
  continues where the closed rounds end.
- **Redis knows nothing, the record holds closed rounds**: the watermark, the key fingerprint and
  the round counter are **restored** from it (forward only), logged as a warning; nothing is
  delivered again.
- **the record's newest planned chained round was open and Redis lost it** (the counter never
  reached it, the round's hash is gone): **refused** (``StreamStateLostError``): its committed
  cursors are gone, so planning it again would deliver every chunk it committed again. Nothing is
  written; every retry refuses the same way until a person chooses.
- **Redis knows nothing and there is no record** (the engine without Airflow, no mirror or a mirror
  that never saw the stream): **refused**, unless the caller says the stream is new
  (``new_stream=True``).
- **Redis knows nothing and the record is empty** (the asset never saw a plan of this stream): a
  genuinely new stream; it starts below every key, and the log says so.

- **Redis holds rounds of the stream but no watermark**, no open chained round and no checkpoint
  mirror (which would have restored a watermark it had) to say none ever existed (an explicit
  re-plan after a loss still open, a round reset): a chained plan is **refused** the same way
  unless ``new_stream=True``; it would start below every key.
- **the explicit re-plan a refusal names** (``rebases``: an explicit plan while Redis has no state
  of the stream, not ``new_stream``, no empty record) is the stream's new base: if Redis still has
  no watermark when it closes, the watermark becomes its end (``close_round.lua``), and chained
  plans continue from there.

``new_stream=True`` only decides the last two cases and the restore: it starts a stream with no
Redis state below every key, whatever a record says (the round counter still moves past the
record's rounds, so round ids stay unique). Explicit plans (``start_key`` given) are never refused:
their bounds do not depend on the watermark.

The choices a refusal names: restore Redis (or configure ``checkpoint_url`` /
``checkpoint_conn_id`` so the next loss restores itself), plan the lost range of keys again with
explicit bounds (its keys are delivered again, knowingly), or declare a new stream.

Seams for tests and the reliability model: ``CursorStore.delete_stream()`` is Redis losing the
stream (every key under its hash tag); a ``StreamRecord`` stands in for Airflow's asset state
(build it from what the model saw closed and planned); ``KeysetTraversal.plan(record=...,
new_stream=...)`` then restores, starts new, or raises ``StreamStateLostError`` with nothing
written (``tests/core/rounds/test_durable_by_default.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import StreamStateLostError
from ..keys import display_key

if TYPE_CHECKING:
    from ..store.cursor_store import CursorStore

log = logging.getLogger("airflow_keyset_provider")


@dataclass(frozen=True)
class PlannedRound:
    """A chained round as a durable record keeps it at plan time (bounds encoded)."""

    round_id: str
    start: str
    end: str

    def as_dict(self) -> dict[str, str]:
        return {"round_id": self.round_id, "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, doc: Any) -> PlannedRound | None:
        if not isinstance(doc, dict) or not all(
            isinstance(doc.get(k), str) for k in ("round_id", "start", "end")
        ):
            return None
        return cls(doc["round_id"], doc["start"], doc["end"])


@dataclass(frozen=True)
class StreamRecord:
    """What a durable store outside Redis knows of one stream.

    ``source`` names the store in logs and errors (e.g. ``Airflow asset state of
    keyset://orders``). ``watermark`` is the encoded end of the last closed round it recorded,
    ``last_round`` that round's id, ``key_fingerprint`` the key it is encoded with
    (``core/rounds/stream_key.py``), ``planned`` the newest chained round a plan recorded. A record
    with all four None saw nothing of the stream."""

    source: str
    watermark: str | None = None
    last_round: str | None = None
    key_fingerprint: str | None = None
    planned: PlannedRound | None = None

    @property
    def empty(self) -> bool:
        return (self.watermark, self.last_round, self.planned) == (None, None, None)

    def top_round(self) -> int:
        """The highest round number the record names (0: none)."""
        ids = [self.last_round, self.planned.round_id if self.planned else None]
        return max((round_number(i) for i in ids if i), default=0)


def round_number(round_id: str) -> int:
    return int(round_id[1:]) if round_id[1:].isdigit() else 0


def lost_open_round(store: CursorStore, record: StreamRecord | None) -> PlannedRound | None:
    """The record's newest planned chained round if it was open and Redis lost it: not recorded
    closed (its number is above the last closed round's), not in Redis, and Redis's round counter
    never reached it (a round removed on purpose, ``reset-round``, leaves the counter), and Redis
    has no watermark (one there now is a base a person chose after the loss: an explicit re-plan
    that closed, ``rebases``). Else None."""
    planned = record.planned if record is not None else None
    if planned is None or store.watermark() is not None:
        return None
    number = round_number(planned.round_id)
    if record is not None and record.last_round and round_number(record.last_round) >= number:
        return None
    if store.round_state(planned.round_id) is not None:
        return None
    counter = store.round_counter()
    return planned if counter is None or counter < number else None


def settle_stream(
    store: CursorStore,
    record: StreamRecord | None,
    *,
    chained: bool,
    new_stream: bool,
    arity: int,
    mirrored: bool,
    answered: bool = False,
) -> bool:
    """Restore, refuse or start the stream before a plan (the module docstring's cases). Returns
    True when the stream starts new (no Redis state: the first round starts below every key).
    ``answered``: Redis already has the round this plan returns (the open chained round, or the
    round of its idempotency key). Raises ``StreamStateLostError`` naming the choices."""
    known = store.has_state()
    if chained and not new_stream:
        lost = lost_open_round(store, record)
        if lost is not None:
            raise StreamStateLostError(_lost_round_message(store.stream, record, lost, arity))
    if record is not None and _forward_from(
        store, record, restore_watermark=known or not new_stream, arity=arity
    ):
        known = True
    if known:
        # with a mirror, Redis now holds what it knows: no watermark there means none ever was
        refusable = chained and not new_stream and not answered and not mirrored
        if refusable and store.watermark() is None:
            raise StreamStateLostError(_no_watermark_message(store.stream))
        return False
    if chained and not new_stream and (record is None or not record.empty):
        raise StreamStateLostError(_no_state_message(store.stream, record, mirrored))
    log.warning(
        "stream %s: new stream (no state in Redis%s%s)%s",
        store.stream,
        ", no checkpoint mirror of it" if not mirrored else ", none in its checkpoint mirror",
        f", no record of it in the {record.source}" if record is not None else "",
        ": its first round starts below every key" if chained else "",
    )
    return True


def rebases(
    store: CursorStore, record: StreamRecord | None, *, chained: bool, new_stream: bool
) -> bool:
    """True when an explicit plan is the re-plan a refusal names: Redis has no state of the stream
    (it lost it, or never had it) and neither the caller (``new_stream``) nor an empty record
    says the stream is new. The round closes as the stream's base: if Redis still has no
    watermark then, the watermark becomes the round's end (``close_round.lua``)."""
    if chained or new_stream or (record is not None and record.empty):
        return False
    return not store.has_state()


def _forward_from(
    store: CursorStore, record: StreamRecord, *, restore_watermark: bool, arity: int
) -> bool:
    """Move Redis's round counter, and (``restore_watermark``) its key fingerprint and watermark,
    forward to the record's. True when Redis now holds the record's watermark or one beyond."""
    top = record.top_round()
    if top:
        store.forward_round_counter(top)  # round ids stay unique (events are keyed by round_id)
    if not restore_watermark or record.watermark is None:
        return False
    if record.key_fingerprint is not None:
        store.record_key_fingerprint(record.key_fingerprint)  # SET NX: never overwrites
    if store.forward_watermark(record.watermark):
        log.warning(
            "stream %s: Redis had no watermark at or beyond the %s's; restored from it: "
            "watermark %s (the end of round %s, the last closed round it recorded). The next "
            "chained round starts there: nothing is delivered again",
            store.stream,
            record.source,
            display_key(record.watermark, arity),
            record.last_round or "?",
        )
    return True


def _choices(stream: str, start: str | None, arity: int) -> str:
    if start == "":  # the lost round started below every key: planning it again is (3)
        again = "(2) the lost round started below every key, so planning it again is (3)"
    else:
        bound = f"start_key={display_key(start, arity)}" if start else "start_key=<last key done>"
        again = (
            f"(2) plan with explicit bounds ({bound}, end_key=...): those keys are delivered "
            "again, knowingly, and chained plans continue from that round's end once it closes"
        )
    return (
        "Choose one: (1) restore the stream's Redis state (a Redis backup), or configure a "
        "checkpoint mirror (checkpoint_url / checkpoint_conn_id) so the next loss restores itself; "
        f"{again}; (3) declare a new stream (new_stream=True on the plan: PlanRangesOperator, the "
        f"decorator or KeysetTraversal.plan) to start stream {stream!r} below every key again, "
        "delivering the whole table again. Nothing was written."
    )


def _lost_round_message(
    stream: str, record: StreamRecord | None, lost: PlannedRound, arity: int
) -> str:
    where = record.source if record is not None else "durable record"
    return (
        f"stream {stream!r}: round {lost.round_id} ({display_key(lost.start, arity)}, "
        f"{display_key(lost.end, arity)}] was open when Redis lost it (the {where} recorded its "
        "plan, not its close; Redis has neither the round nor a round counter that reached it). "
        "Its committed cursors are gone: planning it again would deliver every chunk it had "
        f"committed again. {_choices(stream, lost.start, arity)}"
    )


def _no_watermark_message(stream: str) -> str:
    return (
        f"stream {stream!r} has rounds in Redis (a round counter) but no watermark and no open "
        "chained round: a chained plan would start below every key and deliver the whole table "
        "again. Redis may have lost the stream and been given rounds since (an explicit re-plan "
        "still open, a round reset), or no chained round of it ever closed. "
        f"{_choices(stream, None, 1)}"
    )


def _no_state_message(stream: str, record: StreamRecord | None, mirrored: bool) -> str:
    if record is not None:
        seen = f"the {record.source} has rounds of it but no watermark to restore"
    else:
        seen = (
            "its checkpoint mirror has no record of it"
            if mirrored
            else "no checkpoint mirror and no other durable record can tell a new stream from "
            "one Redis lost"
        )
    return (
        f"stream {stream!r} has no state in Redis (no round counter, no watermark) and {seen}. "
        "If Redis lost it, a chained plan would start below every key and deliver the whole table "
        f"again. If this is the stream's first plan, say so with new_stream=True. "
        f"{_choices(stream, None, 1)}"
    )


__all__ = [
    "PlannedRound",
    "StreamRecord",
    "lost_open_round",
    "rebases",
    "round_number",
    "settle_stream",
]
