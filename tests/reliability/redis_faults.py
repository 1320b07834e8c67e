"""A fault layer under any store call against the real Redis, at redis-py's connection level.

``faulty_client(url, plan)`` is a ``redis.Redis`` whose connections are ``FaultyConnection``: each
command a connection sends is matched against ``plan`` (``FaultPlan``), by command name
(``"INCRBY"``: redis-py sends INCR as INCRBY) or by script SHA (an ``EVALSHA`` of that script), counting matching calls, and the
chosen call fails in one of these ways:

- ``LOST_REPLY``: the command is sent, the server runs it, its reply is read and dropped, and the
  caller gets ``ConnectionError`` (``LOST_REPLY_TIMEOUT``: ``TimeoutError``; ``RESET``:
  ``ConnectionError`` "Connection reset by peer"). The connection is closed.
- ``TIMEOUT_BEFORE_SEND`` / ``RESET_BEFORE_SEND``: nothing is sent, the caller gets
  ``TimeoutError`` / ``ConnectionError``.

The reply is read before the error is raised, so "the server ran it" is certain and the replay
that redis-py's ``Retry`` sends next (on a new connection) runs after it: no test depends on
timing. redis-py's own retry runs on top (``Redis._execute_command`` -> ``Retry.call_with_retry``
-> disconnect, reconnect, send again), with the client's ``Retry`` (``NoBackoff`` here, so a test
never sleeps; the default is exponential with jitter, the same number of attempts logic).

Pipelines (``send_packed_command`` of several commands) are not faulted: the store pipelines
reads only.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.connection import Connection, ConnectionPool
from redis.retry import Retry

LOST_REPLY = "lost_reply"
LOST_REPLY_TIMEOUT = "lost_reply_timeout"
RESET = "reset"
TIMEOUT_BEFORE_SEND = "timeout_before_send"
RESET_BEFORE_SEND = "reset_before_send"
AFTER_SEND = frozenset({LOST_REPLY, LOST_REPLY_TIMEOUT, RESET})
BEFORE_SEND = frozenset({TIMEOUT_BEFORE_SEND, RESET_BEFORE_SEND})


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def call_name(args: tuple[Any, ...]) -> tuple[str, str]:
    """``(command, sha)`` of a command's arguments (``sha`` is '' unless it is an EVALSHA)."""
    name = _s(args[0]).upper()
    return name, (_s(args[1]) if name == "EVALSHA" and len(args) > 1 else "")


def script_argv(args: tuple[Any, ...]) -> list[str]:
    """The ARGV of an EVALSHA's arguments (``EVALSHA sha numkeys key... arg...``)."""
    return [_s(a) for a in args[3 + int(args[2]) :]]


@dataclass
class Rule:
    """Fail the ``nth`` .. ``nth + times - 1``-th calls that match ``command`` or ``sha`` (and
    ``where(args)`` when given: the command's full argument tuple, e.g. an EVALSHA's ARGV).
    ``between`` (after-send kinds): called once the server ran the command and before the caller
    gets the error, i.e. before redis-py sends it again: what another client does in between."""

    kind: str
    command: str = ""
    sha: str = ""
    nth: int = 1
    times: int = 1
    where: Callable[[tuple[Any, ...]], bool] | None = None
    between: Callable[[], None] | None = None  # runs after the server ran it, before the error
    seen: int = 0

    def matches(self, name: str, sha: str, args: tuple[Any, ...]) -> bool:
        hit = (bool(self.sha) and sha == self.sha) or (
            bool(self.command) and name == self.command.upper()
        )
        return hit and (self.where is None or self.where(args))


@dataclass
class FaultPlan:
    """Which calls fail, and the record of what was faulted (``faulted``: (command or sha, kind)
    per fault; ``calls``: matching calls seen per command/sha). ``chooser`` (optional) decides
    for any call not taken by a rule: return a kind or None (random faults)."""

    rules: list[Rule] = field(default_factory=list)
    chooser: Callable[[str, str], str | None] | None = None
    enabled: bool = True
    faulted: list[tuple[str, str]] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(
        self,
        kind: str,
        *,
        command: str = "",
        sha: str = "",
        nth: int = 1,
        times: int = 1,
        where: Callable[[tuple[Any, ...]], bool] | None = None,
        between: Callable[[], None] | None = None,
    ) -> FaultPlan:
        """Add a rule; returns the plan (chainable)."""
        self.rules.append(Rule(kind, command, sha, nth, times, where, between))
        return self

    def decide(self, args: tuple[Any, ...]) -> tuple[str | None, Callable[[], None] | None]:
        """The fault for this call (None: none) and what runs in between (``Rule.between``)."""
        name, sha = call_name(args)
        if name in ("PING", "SCRIPT", "HELLO", "AUTH", "SELECT", "CLIENT"):
            return None, None
        with self.lock:
            if not self.enabled:
                return None, None
            self.calls[sha or name] += 1
            for rule in self.rules:
                if rule.matches(name, sha, args):
                    rule.seen += 1
                    if rule.nth <= rule.seen < rule.nth + rule.times:
                        self.faulted.append((sha or name, rule.kind))
                        return rule.kind, rule.between
            kind = self.chooser(name, sha) if self.chooser else None
            if kind:
                self.faulted.append((sha or name, kind))
            return kind, None

    def count(self, what: str = "") -> int:
        """Faults injected (for one command or sha when given)."""
        return sum(1 for w, _ in self.faulted if not what or w == what)


def random_chooser(
    rng: random.Random,
    p: float,
    kinds: tuple[str, ...] = (LOST_REPLY,),
    spare: frozenset[str] = frozenset(),
) -> Callable[[str, str], str | None]:
    """A ``FaultPlan.chooser``: each EVALSHA (and each INCRBY / HSETNX) fails with probability
    ``p``, with a kind drawn from ``kinds``; the scripts whose SHA is in ``spare`` never fail."""

    def choose(name: str, sha: str) -> str | None:
        if name not in ("EVALSHA", "INCRBY", "HSETNX") or sha in spare:
            return None
        return rng.choice(kinds) if rng.random() < p else None

    return choose


class FaultyConnection(Connection):
    """A redis-py ``Connection`` that consults a ``FaultPlan`` per command it sends."""

    def __init__(self, *args: Any, fault_plan: FaultPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault_plan = fault_plan
        self._fault: str | None = None
        self._between: Callable[[], None] | None = None

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is None:
            # connect first: the handshake (HELLO, CLIENT SETINFO, SELECT) goes through
            # send_command and read_response too, and must not take this call's fault
            self.connect()
        self._fault, self._between = (
            self.fault_plan.decide(args) if self.fault_plan else (None, None)
        )
        if self._fault in BEFORE_SEND:
            kind, self._fault = self._fault, None
            self.disconnect()
            if kind == TIMEOUT_BEFORE_SEND:
                raise redis.TimeoutError("injected: timeout before sending")
            raise redis.ConnectionError("injected: connection reset before sending")
        super().send_command(*args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kind, self._fault = self._fault, None
        between, self._between = self._between, None
        reply = super().read_response(*args, **kwargs)  # the server ran the command
        if kind in AFTER_SEND:
            self.disconnect()
            if between is not None:
                between()
            if kind == LOST_REPLY_TIMEOUT:
                raise redis.TimeoutError("injected: reply lost (timeout reading from socket)")
            if kind == RESET:
                raise redis.ConnectionError("injected: Connection reset by peer")
            raise redis.ConnectionError("injected: reply lost after the server ran the command")
        return reply


def faulty_client(url: str, plan: FaultPlan, retries: int = 3) -> redis.Redis:
    """A client on ``url`` whose connections fail as ``plan`` says, with redis-py's ``Retry``
    (``retries`` attempts after the first, no backoff; ``retries=0``: no retry)."""
    pool = ConnectionPool.from_url(
        url,
        connection_class=FaultyConnection,
        fault_plan=plan,
        retry=Retry(NoBackoff(), retries),
    )
    return redis.Redis(connection_pool=pool)


def sha_of(store: Any, attr: str) -> str:
    """The SHA of one of a store's registered scripts (``"_advance"``, ``"_create"``, ...)."""
    return str(getattr(store, attr).sha)


def load_scripts(store: Any) -> None:
    """SCRIPT LOAD every script the store registered, so no call of a test meets NOSCRIPT (which
    would send its EVALSHA twice and shift the call counts the rules match)."""
    for value in vars(store).values():
        if isinstance(value, Script):
            store.client.script_load(value.script)


__all__ = [
    "AFTER_SEND",
    "BEFORE_SEND",
    "LOST_REPLY",
    "LOST_REPLY_TIMEOUT",
    "RESET",
    "RESET_BEFORE_SEND",
    "TIMEOUT_BEFORE_SEND",
    "FaultPlan",
    "FaultyConnection",
    "Rule",
    "faulty_client",
    "load_scripts",
    "random_chooser",
    "script_argv",
    "sha_of",
]
