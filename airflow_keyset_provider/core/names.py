"""Every name that reaches a Redis key, a query or a message, validated by one rule per kind.

A name enters from an operator's argument, a CLI argument, the page's URL (path and query) or
a DAG run's XCom; whatever the door, it is checked here, by a *full* match
(``re.fullmatch``: ``$`` would accept a trailing newline), before it is pasted into a key
name. A refused name raises :class:`~airflow_keyset_provider.core.errors.InvalidNameError`
(a ``ConfigurationError``) that says which kind of name it is and what it must look like; the
value is echoed only as a short ``repr``.

====================  =========================================  ==========================
kind                  rule                                       example
====================  =========================================  ==========================
stream                1-200 of ``A-Z a-z 0-9 _ . -``, the first   ``events-nightly``
                      a letter or digit
key prefix            1-64 of ``A-Z a-z 0-9 _ . - :``             ``ks``, ``team:etl``
round id              ``r`` and 1-18 digits                       ``r12``
range id              an ``int`` from 0 to 10**9 (not a bool)     ``0``
DAG id                1-250 of letters, digits, ``_ . -``         ``nightly_orders``
                      (Airflow's ``KEY_REGEX``, Unicode letters)
run id                1-250 of ``A-Z a-z 0-9 _ . ~ : + -``        ``manual__2026-01-01T00:00:00+00:00``
                      (Airflow's default ``allowed_run_id_pattern``)
====================  =========================================  ==========================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import InvalidNameError

MAX_RANGE_ID = 10**9


@dataclass(frozen=True)
class NameRule:
    """One kind of name: what it is called, its pattern (matched in full) and the rule in words."""

    kind: str
    pattern: re.Pattern[str]
    rule: str

    def check(self, value: Any) -> str:
        """``value`` if it is a ``str`` that matches in full; else ``InvalidNameError``."""
        if isinstance(value, str) and self.pattern.fullmatch(value):
            return value
        raise InvalidNameError(f"{self.kind} {_shown(value)} is not valid: use {self.rule}")

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and self.pattern.fullmatch(value) is not None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


STREAM = NameRule(
    "stream name",
    re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}"),
    "1-200 characters of letters, digits, '_', '.', '-', starting with a letter or digit "
    "(e.g. 'events-nightly')",
)
KEY_PREFIX = NameRule(
    "key prefix",
    re.compile(r"[A-Za-z0-9_.\-:]{1,64}"),
    "1-64 characters of letters, digits, '_', '.', '-', ':' (e.g. 'ks')",
)
ROUND_ID = NameRule(
    "round id", re.compile(r"r[0-9]{1,18}"), "'r' and the round's number (e.g. 'r12')"
)
DAG_ID = NameRule(  # Airflow's own rule (``KEY_REGEX``): \w is any Unicode letter or digit
    "DAG id", re.compile(r"[\w.\-]{1,250}"), "1-250 characters of letters, digits, '_', '.', '-'"
)
RUN_ID = NameRule(
    "run id",
    re.compile(r"[A-Za-z0-9_.~:+\-]{1,250}"),
    "1-250 characters of letters, digits, '_', '.', '~', ':', '+', '-'",
)
CONN_ID = NameRule(  # an Airflow connection id as the page's selector sends it (never a URL)
    "connection id",
    re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,249}"),
    "1-250 characters of letters, digits, '_', '.', '-', starting with a letter or digit "
    "(e.g. 'redis_default')",
)


def stream(value: Any) -> str:
    return STREAM.check(value)


def key_prefix(value: Any) -> str:
    return KEY_PREFIX.check(value)


def round_id(value: Any) -> str:
    return ROUND_ID.check(value)


def dag_id(value: Any) -> str:
    return DAG_ID.check(value)


def run_id(value: Any) -> str:
    return RUN_ID.check(value)


def conn_id(value: Any) -> str:
    return CONN_ID.check(value)


def range_id(value: Any) -> int:
    """A range id: an ``int`` (not a bool) from 0 to ``MAX_RANGE_ID``."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RANGE_ID:
        return value
    raise InvalidNameError(
        f"range id {_shown(value)} is not valid: use a whole number from 0 to {MAX_RANGE_ID}"
    )


__all__ = [
    "DAG_ID",
    "KEY_PREFIX",
    "ROUND_ID",
    "RUN_ID",
    "STREAM",
    "NameRule",
    "dag_id",
    "key_prefix",
    "range_id",
    "round_id",
    "run_id",
    "stream",
]
