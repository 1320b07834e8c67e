"""The cursor store's key layout and its reads (``CursorStore`` adds the scripted writes).

One stream's keys all share the hash tag ``{<stream>}`` (the layout is in ``cursor_store.py``'s
docstring). Reads never write; a missing hash raises ``RoundStateLostError`` (or
``RoundUnknownError``, a ``RoundNotFoundError``, for an id never handed out), never reads as "nothing left to do".
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script

from .. import names
from ..errors import (
    RoundStateLostError,
    RoundUnknownError,
    StoreUnavailableError,
)
from .layout import range_fields
from .scripts import SNAPSHOT_RANGES

#: Ranges one status script reads (``ranges``): its work is bounded whatever the round's size
#: (10-13 us of server CPU per range measured on a loaded 2-core machine: ~1.5 ms a call), so
#: a status read of thousands of ranges never holds Redis for long. The batches of a read go in
#: one pipelined round trip; other clients' commands run between them.
READ_BATCH = 128
#: Script calls sent in one pipeline (a read of many ranges' letters for the mirror).
PIPELINE_CALLS = 256


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: list[Any]) -> dict[str, str]:
    """A flat HGETALL reply from a script (``[k1, v1, k2, v2, ...]``) as a dict."""
    return {_s(flat[i]): _s(flat[i + 1]) for i in range(0, len(flat), 2)}


def call_id() -> str:
    """A fresh id for one script call (64 random bits, hex): the scripts that keep it answer a
    second run of the same call (redis-py's retry after a lost reply) with the first outcome."""
    return secrets.token_hex(8)


def glob_literal(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``MATCH``)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def stream_names(client: redis.Redis, prefix: str) -> list[str]:
    """Every stream with a watermark, an open set or a round counter under ``prefix``, found with
    SCAN (never KEYS), sorted."""
    names: set[str] = set()
    for suffix in ("watermark", "open", "seq"):
        for k in client.scan_iter(match=f"{prefix}:{{*}}:{suffix}", count=1000):
            key = _s(k)
            inner = key[len(prefix) + 2 : -(len(suffix) + 2)]
            if key.startswith(f"{prefix}:{{") and key.endswith(f"}}:{suffix}") and inner:
                names.add(inner)
    return sorted(names)


class StoreReads:
    """Key names and read-only access to one stream's state. Callers use these names and
    methods, never the client."""

    def __init__(self, client: redis.Redis, stream: str, prefix: str = "ks") -> None:
        names.stream(stream)
        names.key_prefix(prefix)
        self.client = client
        self.stream = stream
        self.key_prefix = prefix
        self.base = f"{prefix}:{{{stream}}}"
        self._snapshot = self.script(SNAPSHOT_RANGES)

    def script(self, source: str) -> Script:
        """``source`` (a Lua script headed by its KEYS/ARGV/returns) registered on this store's
        client: calling it runs EVALSHA and loads the script again when the server answers
        NOSCRIPT (after a restart or ``SCRIPT FLUSH``). The caller passes keys named by this
        store's properties; what the script writes is the caller's contract."""
        return self.client.register_script(source)

    def _call(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a registered script; an unreachable Redis raises ``StoreUnavailableError``.

        A ``ConnectionError`` or ``TimeoutError`` does not say whether the script ran: the reply
        may have been lost after the server ran it (redis-py's ``Retry`` then sends the call
        again, on the client's connection, before it gives up). Every state-changing script of
        the store is safe to run twice (each header says why: most carry a call id, ``call_id``,
        and answer a second run of the same call with its first outcome), so neither redis-py's
        retry nor a caller repeating the step can count or write anything twice."""
        try:
            return script(keys=list(keys), args=list(args))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(
                f"Redis did not answer ({exc}); the step may or may not have been written (a "
                "lost reply). Every store step is safe to repeat: check the Redis connection "
                "and run it again."
            ) from exc

    @property
    def stream_prefix(self) -> str:
        """The key prefix (``P``) this store was opened with; ``base`` is ``P:{S}``."""
        return self.key_prefix

    @property
    def watermark_key(self) -> str:
        return f"{self.base}:watermark"

    @property
    def key_fingerprint_key(self) -> str:
        """The fingerprint of the key the stream's watermark is encoded with
        (``core/rounds/stream_key.py``)."""
        return f"{self.base}:key"

    @property
    def seq_key(self) -> str:
        return f"{self.base}:seq"

    @property
    def open_key(self) -> str:
        return f"{self.base}:open"

    @property
    def chained_key(self) -> str:
        return f"{self.base}:chained"

    @property
    def by_key_key(self) -> str:
        return f"{self.base}:by_key"

    @property
    def ahead_key(self) -> str:
        return f"{self.base}:ahead"

    @property
    def released_key(self) -> str:
        """The call ids of the stream's last steps that released a complete range (capped list,
        ``lua/includes/released.lua``): how a second run of such a step is recognised."""
        return f"{self.base}:released"

    @property
    def control_key(self) -> str:
        """The stream's control hash (pause, rate); ``core/pace/stream_control.py`` owns it and the
        keys named after it (``<control_key>:bucket``, ``:health``, ``:health_lock``)."""
        return f"{self.base}:control"

    @property
    def bucket_key(self) -> str:
        """The stream's shared token bucket (``core/pace/governor.py``)."""
        return f"{self.control_key}:bucket"

    @property
    def health_key(self) -> str:
        """The stream's shared health verdict (``core/pace/health.py``)."""
        return f"{self.control_key}:health"

    @property
    def health_lock_key(self) -> str:
        """The lock of the task that probes health for the stream (``core/pace/health.py``)."""
        return f"{self.control_key}:health_lock"

    @property
    def events_channel(self) -> str:
        return f"{self.base}:events"

    def round_key(self, round_id: str) -> str:
        """The round's hash; every round-scoped key starts with it. ``round_id`` is checked in
        full (``core/names.py``): ``r1:range:0`` would name a range's hash."""
        return f"{self.base}:round:{names.round_id(round_id)}"

    def range_key(self, round_id: str, range_id: int) -> str:
        return f"{self.round_key(round_id)}:range:{int(range_id)}"

    def retry_key(self, round_id: str, range_id: int) -> str:
        return f"{self.round_key(round_id)}:retry:{int(range_id)}"

    def dead_key(self, round_id: str, range_id: int) -> str:
        return f"{self.round_key(round_id)}:dead:{int(range_id)}"

    def _range_keys(self, round_id: str, range_id: int) -> list[str]:
        return [
            self.range_key(round_id, range_id),
            self.retry_key(round_id, range_id),
            self.dead_key(round_id, range_id),
        ]

    def _where(self, round_id: str, range_id: int) -> str:
        return f"range {range_id} of round {round_id} (stream {self.stream!r})"

    def ping(self) -> None:
        try:
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(
                f"Redis is unreachable ({exc}); nothing was written. Check the Redis connection "
                "(host, port, password, TLS) and that the server is running."
            ) from exc

    def server_time_ms(self) -> int:
        """The Redis server's clock (the one leases are measured on), in milliseconds."""
        secs, micros = self.client.time()
        return int(secs) * 1000 + int(micros) // 1000

    def subscribe_events(self) -> Any:
        """A pub/sub connection subscribed to the stream's events channel (``R:I:complete``
        messages: hints that a range completed, never truth). The caller closes it."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.events_channel)
        return pubsub

    def close(self) -> None:
        """Close the client's connections (best effort)."""
        with contextlib.suppress(Exception):
            self.client.close()

    def has_state(self) -> bool:
        """True when the stream has a round counter or a watermark (it was ever planned)."""
        return bool(self.client.exists(self.seq_key, self.watermark_key))

    def round_counter(self) -> int | None:
        """How many round ids were handed out (None: the stream has no counter)."""
        v = self.client.get(self.seq_key)
        return None if v is None else int(_s(v))

    def watermark(self) -> str | None:
        v = self.client.get(self.watermark_key)
        return None if v is None else _s(v)

    def peek(self, idempotency_key: str | None, chained: bool) -> str | None:
        """``lookup`` without its write: the round a plan request with this key (or for the
        chained stream) would get now, reading only (a preview writes nothing)."""
        if idempotency_key:
            known = self.client.hget(self.by_key_key, idempotency_key)
            if known is not None:
                return _s(known)
        if chained:
            open_id = self.client.get(self.chained_key)
            if open_id is not None:
                return _s(open_id)
        return None

    def key_fingerprint(self) -> str | None:
        """The stream's recorded key fingerprint (None: never recorded)."""
        v = self.client.get(self.key_fingerprint_key)
        return None if v is None else _s(v)

    def round_info(self, round_id: str) -> dict[str, str]:
        raw = self.client.hgetall(self.round_key(round_id))
        if not raw:
            raise self._missing_round(round_id)
        return {_s(k): _s(v) for k, v in raw.items()}

    def round_state(self, round_id: str) -> str | None:
        """The round's state alone (None when the round has no hash)."""
        v = self.client.hget(self.round_key(round_id), "state")
        return None if v is None else _s(v)

    def _missing_round(self, round_id: str) -> Exception:
        # A round id that the counter has handed out but whose hash is gone was lost, not unknown.
        seq = self.round_counter()
        number = round_id[1:] if round_id.startswith("r") else ""
        if seq is None or (number.isdigit() and int(number) <= seq):
            return RoundStateLostError(
                f"round {round_id} of stream {self.stream!r} has no state in Redis (flushed, "
                "evicted or restarted without persistence). Nothing was read as complete. Re-plan "
                "the round or restore it from its checkpoint mirror (see docs/reliability.md)."
            )
        return RoundUnknownError(f"stream {self.stream!r} has no round {round_id!r}")

    def ranges(self, round_id: str, n_ranges: int | None = None) -> list[dict[str, str]]:
        """Every range hash of the round (with ``range_id`` and ``retries`` added), in id order.

        Consistency: each range is read atomically with the sizes of its retry hash and dead
        list, and raises ``RoundStateLostError`` when it is not intact (its hash, retry hash or
        dead list lost: the counts it keeps disagree with what they count). Ranges are *not*
        read at one instant: one script reads ``READ_BATCH`` ranges, the batches go in one
        pipelined round trip and other clients' commands run between them, so no read holds
        Redis for longer than one batch. ``n_ranges`` is read again afterwards and the ranges a
        split created meanwhile are read too, so the ranges returned cover the round's
        ``(start, end]`` (a range read before its split overlaps its new sibling). After a split
        ids are not in key order: sort by ``lo`` where order matters. Deciding from this read is
        for hints and status only; what must hold across ranges (closing) is re-checked in one
        script (``close_round``)."""
        n = int(self.round_info(round_id)["n_ranges"]) if n_ranges is None else n_ranges
        out = self._read_ranges(round_id, 0, n)
        while (grown := self._n_ranges(round_id)) > n:
            out += self._read_ranges(round_id, n, grown)
            n = grown
        return out

    def _n_ranges(self, round_id: str) -> int:
        v = self.client.hget(self.round_key(round_id), "n_ranges")
        if v is None:
            raise self._missing_round(round_id)
        return int(_s(v))

    def _read_ranges(self, round_id: str, first: int, stop: int) -> list[dict[str, str]]:
        """Ranges ``first .. stop - 1``: one script call per ``READ_BATCH`` ranges, pipelined."""
        batches = [range(b, min(b + READ_BATCH, stop)) for b in range(first, stop, READ_BATCH)]
        calls = [[k for i in b for k in self._range_keys(round_id, i)] for b in batches]
        result = []
        for ids, reply in zip(batches, self._pipelined(self._snapshot, calls, ["0"]), strict=True):
            for i, (raw, retries, dead) in zip(ids, reply, strict=True):
                d = self._intact(round_id, i, _pairs(raw), int(retries), int(dead))
                d["range_id"] = str(i)
                d["retries"] = str(retries)
                result.append(d)
        return result

    def _pipelined(self, script: Script, calls: list[list[str]], args: list[str]) -> list[Any]:
        """``script`` once per key list, each call atomic on its own: in one pipelined round trip
        (a pipeline per ``PIPELINE_CALLS`` calls) on a Redis server; one call at a time on a
        Redis Cluster (all of a stream's keys are on one node; calls are not sent together)."""
        if not isinstance(self.client, redis.Redis):
            return [script(keys=keys, args=args) for keys in calls]
        out: list[Any] = []
        for at in range(0, len(calls), PIPELINE_CALLS):
            pipe = self.client.pipeline(transaction=False)
            for keys in calls[at : at + PIPELINE_CALLS]:
                script(keys=keys, args=args, client=pipe)
            out += pipe.execute()
        return out

    def _intact(
        self, round_id: str, range_id: int, d: dict[str, str], retries: int, dead: int
    ) -> dict[str, str]:
        """``d`` with its defaults filled in (``range_fields``) when the range is intact (the
        same check as the scripts' ``intact``)."""
        if not d:
            raise RoundStateLostError(f"{self._where(round_id, range_id)} has no state in Redis")
        if "retries" in d and (int(d["retries"]) != retries or int(d["dead"]) != dead):
            raise RoundStateLostError(
                f"{self._where(round_id, range_id)} lost part of its state in Redis: it counts "
                f"{d['retries']} pending retries and {d['dead']} dead letters but holds {retries} "
                f"and {dead} (evicted or deleted). Nothing was read as complete; restore it from "
                "the checkpoint mirror or re-plan the round."
            )
        return range_fields(d)

    def range(self, round_id: str, range_id: int) -> dict[str, str]:
        """One range's hash, defaults filled in (a single read, whatever the number of ranges)."""
        raw = self.client.hgetall(self.range_key(round_id, range_id))
        if not raw:
            raise RoundStateLostError(f"{self._where(round_id, range_id)} has no state in Redis")
        return range_fields({_s(k): _s(v) for k, v in raw.items()})

    def rounds_by_key_prefix(self, head: str) -> list[tuple[str, str]]:
        """``(idempotency key, round id)`` of every round whose idempotency key starts with
        ``head`` (e.g. ``"<dag_id>/<run_id>/"``), read with HSCAN (glob characters escaped)."""
        match = glob_literal(head) + "*"
        return [
            (_s(k), _s(v))
            for k, v in self.client.hscan_iter(self.by_key_key, match=match, count=500)
        ]

    def open_rounds(self) -> list[str]:
        return sorted(
            (_s(x) for x in self.client.smembers(self.open_key)),
            key=lambda r: int(r[1:]) if r[1:].isdigit() else 0,
        )

    def control_hashes(self) -> tuple[dict[str, str], dict[str, str]]:
        """The control hash and the health verdict hash, read in one pipelined round trip
        (not atomic together; each hash is read whole). Empty dicts for absent hashes."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.control_key)
        pipe.hgetall(self.health_key)
        control, health = pipe.execute()
        return (
            {_s(k): _s(v) for k, v in control.items()},
            {_s(k): _s(v) for k, v in health.items()},
        )

    def retry_states(self, round_id: str, range_id: int, keys: Sequence[str]) -> list[str | None]:
        """For each encoded key, its pending retry (``"attempts|last error"``) or None when the
        key does not wait for a retry; one HMGET of the range's retry hash."""
        if not keys:
            return []
        return [
            None if v is None else _s(v)
            for v in self.client.hmget(self.retry_key(round_id, range_id), list(keys))
        ]

    def retry_entries(self, round_id: str, range_id: int, limit: int) -> list[tuple[str, int, str]]:
        """Up to ``limit`` pending item retries: ``(encoded key, attempts, last error)``."""
        out = []
        for k, v in self.client.hscan_iter(self.retry_key(round_id, range_id), count=limit):
            attempts, _, err = _s(v).partition("|")
            out.append((_s(k), int(attempts), err))
            if len(out) >= limit:
                break
        out.sort()
        return out

    def snapshot_range(self, round_id: str, range_id: int) -> dict[str, Any]:
        """One atomic read (a script) of a range, its retries and dead letters, for the mirror;
        ``RoundStateLostError`` when the range is not intact."""
        reply = self._snapshot(keys=self._range_keys(round_id, range_id), args=["1"])
        return self._snapshot_doc(round_id, range_id, reply[0])

    def snapshot_ranges(self, round_id: str, range_ids: Sequence[int]) -> list[dict[str, Any]]:
        """``snapshot_range`` of each range: each range atomic on its own (one script call per
        range, so one range's letters bound a call), not across ranges; the calls pipelined."""
        calls = [self._range_keys(round_id, i) for i in range_ids]
        replies = self._pipelined(self._snapshot, calls, ["1"])
        return [
            self._snapshot_doc(round_id, i, reply[0])
            for i, reply in zip(range_ids, replies, strict=True)
        ]

    def _snapshot_doc(self, round_id: str, range_id: int, reply: Any) -> dict[str, Any]:
        raw, retry, dead = reply
        retry_map = _pairs(retry)
        doc: dict[str, Any] = self._intact(
            round_id, range_id, _pairs(raw), len(retry_map), len(dead)
        )
        doc.update(
            range_id=str(range_id),
            retry=retry_map,
            dead_letters=[_s(x) for x in dead],
        )
        return doc

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        """Up to ``limit`` dead letters, newest first (the list is never trimmed: ``dead`` letters
        are all here)."""
        raw = self.client.lrange(self.dead_key(round_id, range_id), 0, limit - 1)
        return [json.loads(_s(x)) for x in raw]
