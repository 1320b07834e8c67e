"""``KeysetRoundTrigger``: the deferrable half of ``BarrierSensor``.

It polls the round's state in Redis every ``poll_interval`` seconds (the same read-only
``StreamControl.check_round`` the sensor pokes with) and fires once when every range is complete,
or once when ``deadline`` passes (with the lagging ranges), or once with an error when the round
cannot be found. Between polls it listens to the stream's pub/sub events channel, where the
engine announces completed ranges, to re-check early; messages are a hint only: a lost or missing
message only delays the answer to the next poll, and a broken subscription falls back to polling.
The trigger never closes the round: ``BarrierSensor.execute_complete`` does, in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

import redis
from airflow.triggers.base import BaseTrigger, TriggerEvent
from asgiref.sync import sync_to_async

from airflow_keyset_provider.common import DEFAULT_KEY_PREFIX
from airflow_keyset_provider.core.errors import (
    ConfigurationError,
    KeysetError,
    RoundNotFoundError,
    RoundStateLostError,
)
from airflow_keyset_provider.core.redaction import scrub
from airflow_keyset_provider.core.rounds.control import RoundCheck, StreamControl
from airflow_keyset_provider.core.rounds.status import RangeState

# How often the pub/sub channel is checked (non-blocking) between two polls of the round.
_HINT_CHECK_SECONDS = 0.5


class BarrierEvent(StrEnum):
    """The ``status`` of the one event a ``KeysetRoundTrigger`` fires."""

    COMPLETE = "complete"  #: every range is complete: the sensor closes the round
    TIMEOUT = "timeout"  #: the deadline passed; ``lagging`` lists the unfinished ranges
    ERROR = (
        "error"  #: the round cannot be read (lost, unknown, misconfigured); ``message`` says why
    )


class KeysetRoundTrigger(BaseTrigger):
    """Fires ``{"status": "complete" | "timeout" | "error", "round_id", ...}`` for one round.

    :param round_id: the round to watch.
    :param stream: the round's stream.
    :param redis_conn_id: Airflow ``redis`` connection of the cursor store.
    :param key_prefix: the engine's Redis key prefix.
    :param poll_interval: seconds between two reads of the round's state.
    :param deadline: UNIX time after which the trigger fires ``timeout`` with the lagging ranges
        (``lagging``: one description per range: cursor, owner, last heartbeat); None waits forever.
    :param checkpoint_conn_id: the checkpoint mirror's connection: a round Redis lost (wholly or
        in part) is restored from it before the check, as the sensor's poke and close do.
    """

    def __init__(
        self,
        round_id: str,
        stream: str,
        redis_conn_id: str = "redis_default",
        key_prefix: str = DEFAULT_KEY_PREFIX,
        poll_interval: float = 30.0,
        deadline: float | None = None,
        checkpoint_conn_id: str | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_conn_id = checkpoint_conn_id
        self.round_id = round_id
        self.stream = stream
        self.redis_conn_id = redis_conn_id
        self.key_prefix = key_prefix
        self.poll_interval = poll_interval
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "round_id": self.round_id,
                "stream": self.stream,
                "redis_conn_id": self.redis_conn_id,
                "key_prefix": self.key_prefix,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "checkpoint_conn_id": self.checkpoint_conn_id,
            },
        )

    def _connect(self) -> tuple[StreamControl, Any]:
        from airflow_keyset_provider.hooks.keyset import KeysetHook

        ctl = KeysetHook(
            redis_conn_id=self.redis_conn_id, checkpoint_conn_id=self.checkpoint_conn_id
        ).control(self.stream, self.key_prefix)
        pubsub = None
        try:
            pubsub = ctl.store.subscribe_events()
        except Exception as exc:  # pub/sub is an optimisation only
            self.log.info(
                "round %s: no pub/sub wake-ups (%s); polling every %.0f s",
                self.round_id,
                exc,
                self.poll_interval,
            )
            pubsub = None
        return ctl, pubsub

    def _hint(self, pubsub: Any) -> bool:
        """True if a 'range complete' message for this round arrived (non-blocking)."""
        message = pubsub.get_message(timeout=0)
        while message is not None:
            data = message.get("data")
            text = data.decode() if isinstance(data, bytes) else str(data)
            if text.startswith(f"{self.round_id}:"):
                return True
            message = pubsub.get_message(timeout=0)
        return False

    async def _wait(self, pubsub: Any, seconds: float) -> Any:
        """Sleep up to ``seconds``, returning early on a pub/sub hint. Returns the pubsub to keep
        using (None once it broke)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if pubsub is not None:
                try:
                    if await sync_to_async(self._hint)(pubsub):
                        return pubsub
                except Exception as exc:
                    self.log.info(
                        "round %s: pub/sub stopped (%s); falling back to polling",
                        self.round_id,
                        exc,
                    )
                    await sync_to_async(_close_quietly)(pubsub)
                    pubsub = None
            await asyncio.sleep(min(left, _HINT_CHECK_SECONDS) if pubsub is not None else left)
        return pubsub

    async def _read_round(
        self, ctl: StreamControl
    ) -> tuple[RoundCheck | None, TriggerEvent | None]:
        """One read of the round's state: ``(check, None)``; ``(None, None)`` on a transient
        error (keep polling until the deadline); ``(None, error event)`` when the round is lost,
        missing or misconfigured."""
        try:
            return await sync_to_async(ctl.check_round)(self.round_id), None
        except (RoundStateLostError, RoundNotFoundError, ConfigurationError) as exc:
            return None, TriggerEvent(
                {
                    "status": BarrierEvent.ERROR.value,
                    "round_id": self.round_id,
                    "message": f"{type(exc).__name__}: {scrub(str(exc))}",
                }
            )
        except (KeysetError, redis.RedisError) as exc:  # transient: keep polling until the deadline
            self.log.warning("round %s: could not read the round's state: %s", self.round_id, exc)
            return None, None

    def _outcome(self, check: RoundCheck | None, now: float) -> TriggerEvent | None:
        """The event to fire: the round is complete, or the deadline passed; else None."""
        if check is not None and check.complete:
            self.log.info("round %s: every range is complete", self.round_id)
            return TriggerEvent({"status": BarrierEvent.COMPLETE.value, "round_id": self.round_id})
        if self.deadline is not None and now >= self.deadline:
            lagging = (
                [r.describe() for r in check.lagging]
                if check is not None
                else ["(the round's state could not be read from Redis at the deadline)"]
            )
            return TriggerEvent(
                {
                    "status": BarrierEvent.TIMEOUT.value,
                    "round_id": self.round_id,
                    "lagging": lagging,
                }
            )
        return None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            ctl, pubsub = await sync_to_async(self._connect)()
        except ConfigurationError as exc:
            yield TriggerEvent(
                {"status": BarrierEvent.ERROR.value, "round_id": self.round_id, "message": str(exc)}
            )
            return
        try:
            while True:
                check, event = await self._read_round(ctl)
                if event is not None:
                    yield event
                    return
                now = time.time()
                event = self._outcome(check, now)
                if event is not None:
                    yield event
                    return
                if check is not None:
                    self.log.info(
                        "round %s: %d range(s) not complete yet", self.round_id, len(check.lagging)
                    )
                wait = (
                    self.poll_interval
                    if self.deadline is None
                    else min(self.poll_interval, self.deadline - now)
                )
                pubsub = await self._wait(pubsub, max(wait, 0.0))
        finally:
            if pubsub is not None:
                await sync_to_async(_close_quietly)(pubsub)
            await sync_to_async(ctl.store.close)()


def _close_quietly(obj: Any) -> None:
    with contextlib.suppress(Exception):  # closing is best effort
        obj.close()


class ResumeEvent(StrEnum):
    """The ``status`` of the one event a ``KeysetResumeTrigger`` fires."""

    READY = "ready"  #: the reason to wait is gone: the task traverses again from its cursor
    ERROR = "error"  #: the stream or range cannot be read; ``message`` says why


class KeysetResumeTrigger(BaseTrigger):
    """Waits, in the triggerer, for a traverse task that gave back its worker slot.

    ``wait_for`` says what for:

    - ``"paused"``: until the stream's control hash is no longer paused (``airflow-keyset resume``);
    - ``"lease"``: until the range's lease is free (released or expired) or the range is complete;
    - ``"throttled"``: until ``until`` (UNIX time), when the stream's budget allows a chunk again;
    - ``"unhealthy"``: until ``until`` (one health poll later); the task then reads the verdict.
    - ``"budget"``: until ``until`` (a moment): the task ran ``max_task_seconds`` and continues in a
      fresh process.

    It polls every ``poll_interval`` seconds (one small Redis read) and fires
    ``{"status": "ready" | "error", "wait_for", ...}`` once. It never writes to Redis.

    :param stream: the traversed stream.
    :param round_id: the task's round.
    :param range_id: the task's range.
    :param wait_for: ``"paused"``, ``"lease"`` or ``"throttled"``.
    :param redis_conn_id: Airflow ``redis`` connection of the cursor store.
    :param key_prefix: the engine's Redis key prefix.
    :param poll_interval: seconds between two reads.
    :param until: with ``"throttled"``/``"unhealthy"``/``"budget"``: UNIX time to fire at.
    """

    def __init__(
        self,
        stream: str,
        round_id: str,
        range_id: int,
        wait_for: str,
        redis_conn_id: str = "redis_default",
        key_prefix: str = DEFAULT_KEY_PREFIX,
        poll_interval: float = 5.0,
        until: float | None = None,
    ) -> None:
        super().__init__()
        self.stream, self.round_id, self.range_id = stream, round_id, range_id
        self.wait_for, self.redis_conn_id, self.key_prefix = wait_for, redis_conn_id, key_prefix
        self.poll_interval, self.until = poll_interval, until

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "stream": self.stream,
                "round_id": self.round_id,
                "range_id": self.range_id,
                "wait_for": self.wait_for,
                "redis_conn_id": self.redis_conn_id,
                "key_prefix": self.key_prefix,
                "poll_interval": self.poll_interval,
                "until": self.until,
            },
        )

    def _connect(self) -> StreamControl:
        from airflow_keyset_provider.hooks.keyset import KeysetHook

        return KeysetHook(redis_conn_id=self.redis_conn_id).control(self.stream, self.key_prefix)

    def _ready(self, ctl: StreamControl) -> bool:
        if self.wait_for == "paused":
            return not ctl.control_state().paused
        if self.wait_for == "lease":
            rng = ctl.store.range(self.round_id, self.range_id)
            lease_until = int(rng.get("lease_until") or 0)
            return (
                rng.get("state") == RangeState.COMPLETE
                or not rng.get("owner")
                or lease_until <= ctl.store.server_time_ms()
            )
        return self.until is None or time.time() >= self.until

    async def run(self) -> AsyncIterator[TriggerEvent]:
        base = {"wait_for": self.wait_for, "round_id": self.round_id, "range_id": self.range_id}
        try:
            ctl = await sync_to_async(self._connect)()
        except ConfigurationError as exc:
            yield TriggerEvent({"status": ResumeEvent.ERROR.value, "message": str(exc), **base})
            return
        try:
            while True:
                try:
                    if await sync_to_async(self._ready)(ctl):
                        self.log.info(
                            "stream %s round %s range %s: no longer %s; resuming the task",
                            self.stream,
                            self.round_id,
                            self.range_id,
                            self.wait_for,
                        )
                        yield TriggerEvent({"status": ResumeEvent.READY.value, **base})
                        return
                except (RoundStateLostError, RoundNotFoundError) as exc:
                    message = f"{type(exc).__name__}: {scrub(str(exc))}"
                    yield TriggerEvent(
                        {"status": ResumeEvent.ERROR.value, "message": message, **base}
                    )
                    return
                except (KeysetError, redis.RedisError) as exc:  # transient: keep polling
                    self.log.warning("stream %s: could not read its state: %s", self.stream, exc)
                wait = self.poll_interval
                if self.wait_for in ("throttled", "unhealthy", "budget") and self.until is not None:
                    wait = min(wait, max(self.until - time.time(), 0.0))
                await asyncio.sleep(wait)
        finally:
            await sync_to_async(ctl.store.close)()


__all__ = ["KeysetResumeTrigger", "KeysetRoundTrigger", "ResumeEvent"]
