"""Short and long test modes.

Short mode (default) keeps the suites quick on two cores; long mode
(``KEYSET_RELIABILITY_LONG=1``) runs thousands of trials or examples where one is cheap. Used by
the reliability suite and the property tests in ``tests/core``.
"""

from __future__ import annotations

import os

LONG = os.environ.get("KEYSET_RELIABILITY_LONG", "").strip().lower() in {"1", "true", "yes", "on"}
MODE = "long" if LONG else "short"


#: ``KEYSET_RELIABILITY_TRIALS=N`` replaces the long mode's count (not the short mode's): a long
#: run split over several processes, each with its own seed (docs/reliability.md says where).
LONG_TRIALS = os.environ.get("KEYSET_RELIABILITY_TRIALS", "").strip()


def trials(short: int, long: int) -> int:
    """The number of trials (or hypothesis examples) of a scenario in the current mode."""
    if not LONG:
        return short
    return int(LONG_TRIALS) if LONG_TRIALS else long
