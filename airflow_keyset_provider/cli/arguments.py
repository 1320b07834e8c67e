"""The CLI's argument types: each name by its rule in ``core/names.py`` (a full match), each
number finite and in range, so a bad argument is a usage error (exit 2, one line), never a
traceback or a Redis key built from it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ..core import names
from ..core.errors import InvalidNameError


def _typed(label: str, check: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return check(text)
        except InvalidNameError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r:.60} is not {label}") from None

    convert.__name__ = label  # argparse names the type in its messages
    return convert


def _number(text: str, kind: type, low: float, high: float | None = None) -> Any:
    value = kind(text)
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise ValueError(text)
    return value


STREAM_ARG = _typed("a stream name", names.stream)
ROUND_ARG = _typed("a round id", names.round_id)
PREFIX_ARG = _typed("a key prefix", names.key_prefix)
RANGE_ARG = _typed("a range id", lambda t: names.range_id(int(t)))
SECONDS_ARG = _typed("a number of seconds >= 0", lambda t: _number(t, float, 0.0, 86400.0 * 7))
COUNT_ARG = _typed("a whole number >= 0", lambda t: _number(t, int, 0))
RATE_ARG = _typed("a rate > 0", lambda t: _number(t, float, 1e-9))

__all__ = [
    "COUNT_ARG",
    "PREFIX_ARG",
    "RANGE_ARG",
    "RATE_ARG",
    "ROUND_ARG",
    "SECONDS_ARG",
    "STREAM_ARG",
]
