"""The cursor store's round-level writes (``CursorStore`` inherits them; the key layout and the
range writes are in ``cursor_store.py``): create a round (idempotently, by request key or as the
stream's chained round), restore one from the mirror, refresh its totals, close it, mark it
unrecoverable, delete it; the round counter, the watermark and the key fingerprint when they are
put back; removing a stream.

Every write that changes a round is one Lua script (``scripts.py``), safe to run twice: a call id
kept with the round answers a second run with the first outcome (``lua/create_round.lua``,
``lua/restore_round.lua``). A lost reply is never read as "nothing was written".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import redis

from ..errors import RoundStateLostError, StoreUnavailableError
from .reads import StoreReads, _s, call_id, glob_literal
from .results import CloseResult, close_result
from .scripts import (
    CLOSE_ROUND,
    CREATE_ROUND,
    DELETE_ROUND,
    FORWARD,
    MARK_UNRECOVERABLE,
    RAISE_COUNTER,
    REFRESH_TOTALS,
    RESTORE_ROUND,
)

log = logging.getLogger("airflow_keyset_provider")


class RoundWrites(StoreReads):
    """Round-level writes of one stream's store (see the module docstring)."""

    def __init__(self, client: Any, stream: str, prefix: str = "ks") -> None:
        super().__init__(client, stream, prefix)
        reg = self.script
        self._raise_counter = reg(RAISE_COUNTER)
        self._create = reg(CREATE_ROUND)
        self._close = reg(CLOSE_ROUND)
        self._restore = reg(RESTORE_ROUND)
        self._unrecoverable = reg(MARK_UNRECOVERABLE)
        self._totals = reg(REFRESH_TOTALS)
        self._delete = reg(DELETE_ROUND)
        self._forward = reg(FORWARD)

    def set_round_field(self, round_id: str, field: str, value: str) -> None:
        """Write one informational field of the round's hash (``floor``: the lowest key when
        planned), read by status only, never by a decision."""
        self.client.hset(self.round_key(round_id), field, value)

    # ---- the stream ------------------------------------------------------------------------
    def init_round_counter(self, value: int) -> bool:
        """Set the round counter if it does not exist (restore); True if set."""
        return bool(self.client.set(self.seq_key, value, nx=True))

    def restore_watermark(self, watermark: str) -> bool:
        """Put back a lost watermark; never overwrites one that exists."""
        return bool(self.client.set(self.watermark_key, watermark, nx=True))

    def forward_watermark(self, watermark: str) -> bool:
        """Move the watermark forward to ``watermark`` unless it is already there or beyond (one
        Lua script under the stream's hash tag: no WATCH, so it runs on Redis Cluster too); never
        moves it back. True if it was moved."""
        return bool(int(self._call(self._forward, [self.watermark_key], [watermark, "s"])))

    def forward_round_counter(self, value: int) -> bool:
        """Move the round counter up to ``value`` unless it is already there or beyond (the same
        script as ``forward_watermark``); never down. True if it was moved."""
        return bool(int(self._call(self._forward, [self.seq_key], [value, "n"])))

    def record_key_fingerprint(self, fingerprint: str) -> bool:
        """Record the stream's key fingerprint if none is recorded (SET NX); True if set. Only
        ``core/rounds/stream_key.py`` decides what it holds and when it may be recorded."""
        return bool(self.client.set(self.key_fingerprint_key, fingerprint, nx=True))

    def record_round_answer(self, round_id: str, name: str, doc: str) -> bool:
        """Record ``doc`` as the round's answer ``name`` if none is recorded (HSETNX of the round
        hash field ``answer:<name>``, mirrored and restored with the round's other fields); True
        if set. Never creates a round hash: a round that is gone raises as ``round_info`` does
        (WATCH/MULTI on the one key). ``core/rounds/plan_answer.py`` owns the field."""
        key = self.round_key(round_id)

        def write(pipe: Any) -> None:
            if not pipe.exists(key):
                raise self._missing_round(round_id)
            pipe.multi()
            pipe.hsetnx(key, f"answer:{name}", doc)

        replies: Any = self.client.transaction(write, key)
        return bool(replies[0])

    def delete_stream(self) -> int:
        """Remove every key of this stream (tests, ``reset``); SCAN visits every primary of a
        cluster. Returns the number of keys removed."""
        n = 0
        for k in self.client.scan_iter(match=f"{self.base}:*", count=500):
            n += int(self.client.delete(k))
        return n

    # ---- rounds ----------------------------------------------------------------------------
    def lookup(self, idempotency_key: str | None, chained: bool) -> str | None:
        """The round that a plan request with this key (or for the chained stream) already has."""
        if idempotency_key:
            known = self.client.hget(self.by_key_key, idempotency_key)
            if known is not None:
                return _s(known)
        if chained:
            open_id = self.client.get(self.chained_key)
            if open_id is not None:
                if idempotency_key:  # this request now belongs to that round, even after it closes
                    self.client.hsetnx(self.by_key_key, idempotency_key, open_id)
                return _s(open_id)
        return None

    def create_round(
        self,
        *,
        idempotency_key: str | None,
        chained: bool,
        start: str,
        end: str,
        source: str,
        arity: int,
        bounds: Sequence[tuple[str, str]],
        rebase: bool = False,
    ) -> tuple[str, bool]:
        """Save a new round atomically; returns ``(round_id, created)``. If the idempotency key or
        the stream's open chained round already has a round, returns that one unchanged.
        ``rebase`` (explicit rounds only): if the stream still has no watermark when the round
        closes, the watermark becomes its end (``core/rounds/durability.py``)."""
        call = call_id()
        for _ in range(3):
            round_id = f"r{self._next_round_number()}"
            keys = [self.round_key(round_id), self.open_key, self.chained_key, self.by_key_key]
            keys += [self.range_key(round_id, i) for i in range(len(bounds))]
            args: list[Any] = [
                round_id,
                idempotency_key or "",
                "1" if chained else "2" if rebase else "0",
                start,
                end,
                source,
                arity,
                call,
            ]
            for lo, hi in bounds:
                args += [lo, hi]
            res = self._create_call(round_id, keys, args)
            if _s(res[0]) != "taken":
                return _s(res[1]), _s(res[0]) == "created"
            top = self.highest_round_number()
            log.warning(
                "stream %s: round id %s is in use although the round counter handed it out "
                "(the counter was lost); nothing was overwritten, the counter moves to %d",
                self.stream,
                round_id,
                top,
            )
            self._call(self._raise_counter, [self.seq_key], [top])
        raise RoundStateLostError(
            f"stream {self.stream!r}: the round counter keeps handing out ids that are in use; "
            "nothing was written. Another client may be resetting it: check what writes "
            f"{self.seq_key!r}."
        )

    def _next_round_number(self) -> int:
        """INCR of the round counter (a retried INCR burns an id, never reuses one)."""
        try:
            return int(self.client.incr(self.seq_key))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(
                f"stream {self.stream!r}: Redis did not answer while a round id was taken "
                f"({exc}); no round was created yet (an id may be burnt). Plan again."
            ) from exc

    def _create_call(self, round_id: str, keys: list[str], args: list[Any]) -> Any:
        """CREATE_ROUND; when Redis does not answer, the round may exist (a lost reply after
        redis-py's retries): the error names it, for an explicit plan has no other handle."""
        try:
            return self._call(self._create, keys, args)
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                f"stream {self.stream!r}: Redis did not answer while round {round_id} was being "
                f"created ({exc.__cause__}); it may exist. Planning again with the same "
                "round_key (or a chained plan) returns it; an explicit plan without a round_key "
                f"does not: check `airflow-keyset status {self.stream}` and remove {round_id} "
                f"with `airflow-keyset reset-round {self.stream} {round_id}` if it is there."
            ) from exc.__cause__

    def highest_round_number(self) -> int:
        """The highest round number with a key in Redis (SCAN over the stream's round keys, on
        every primary of a cluster); 0 if none."""
        head = f"{self.base}:round:r"
        top = 0
        for k in self.client.scan_iter(match=glob_literal(head) + "*", count=1000):
            rest = _s(k)[len(head) :]
            number = rest.split(":", 1)[0]
            if number.isdigit():
                top = max(top, int(number))
        return top

    def restore_round(self, info: dict[str, str], ranges: list[dict[str, Any]]) -> bool:
        """Write a mirrored round back: all of it when Redis lost its hash, else only the ranges
        that are not intact (intact state is never overwritten). Returns True if anything was
        written."""
        round_id = info["id"]
        keys = [
            self.round_key(round_id),
            self.open_key,
            self.chained_key,
            self.by_key_key,
            self.seq_key,
        ]
        for r in ranges:
            keys += self._range_keys(round_id, int(r["range_id"]))
        docs = [
            json.dumps(
                {**r, "retry": r.get("retry") or {}, "dead_letters": r.get("dead_letters") or []}
            )
            for r in ranges
        ]
        # cjson turns an empty {} into an array, harmless here: pairs() over it does nothing
        whole, rewritten = self._call(self._restore, keys, [call_id(), json.dumps(info), *docs])
        return bool(int(whole) or int(rewritten))

    def refresh_totals(self, round_id: str) -> None:
        """Recompute a round's totals from its ranges in one step (after a dead-letter replay)."""
        n = int(self.round_info(round_id)["n_ranges"])
        keys = [self.round_key(round_id)] + [self.range_key(round_id, i) for i in range(n)]
        if not self._call(self._totals, keys, []):
            raise RoundStateLostError(
                f"round {round_id} of stream {self.stream!r} lost state in Redis"
            )

    # ---- closing ---------------------------------------------------------------------------
    def close_round(self, round_id: str) -> CloseResult:
        """``Closed`` (now, or before: idempotent), else ``Incomplete`` / ``Gap`` /
        ``Unrecoverable`` with nothing written; raises ``RoundStateLostError`` when state is
        missing or a range is not intact."""
        info = self.round_info(round_id)
        keys = [
            self.round_key(round_id),
            self.watermark_key,
            self.open_key,
            self.chained_key,
            self.ahead_key,
        ]
        for i in range(int(info["n_ranges"])):
            keys += self._range_keys(round_id, i)
        res = self._call(self._close, keys, [])
        return close_result(round_id, self.stream, res)

    def mark_unrecoverable(self, round_id: str, reason: str) -> bool:
        """The source lost rows the round still had to read: the round can never close. Returns
        False (nothing written) when the round is gone or already closed."""
        res = self._call(self._unrecoverable, [self.round_key(round_id)], [reason[:1000]])
        return _s(res) == "marked"

    def delete_round(self, round_id: str) -> int:
        """Remove one round's keys and its index entries in one step; never touches the watermark.
        Returns the number of keys removed."""
        info = self.round_info(round_id)
        keys = [self.open_key, self.chained_key, self.by_key_key, self.round_key(round_id)]
        for i in range(int(info["n_ranges"])):
            keys += self._range_keys(round_id, i)
        return int(self._call(self._delete, keys, [round_id, info.get("round_key") or ""]))


__all__ = ["RoundWrites"]
