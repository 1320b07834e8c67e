"""A fault layer under the checkpoint mirror, and the random world the mirror-outage property test
runs (``test_reliability_mirror_outage.py``).

``FaultyMirror`` is the real ``CheckpointMirror`` on the real PostgreSQL table; it fails chosen
writes before they reach the database, as an outage of the mirror would (a refused connection,
the table gone): the n-th write of a kind, where the kind is read off the engine's call that
writes (``KINDS``). Every other write goes through unchanged.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror

#: The kinds of mirror write, by the engine's function that makes them.
KINDS = ("plan", "coalescing", "split", "checkpoint", "completion", "close")
_CALLERS = {
    "mirror_coalesced": "coalescing",  # core/run/claim.py: a claim that coalesced ranges
    "_mirror": "split",  # core/run/split.py: the owner's split record
    "checkpoint": "checkpoint",  # core/run/commits.py (completion when the range is complete)
    "close_round": "close",  # core/rounds/control.py: the closed round and its watermark
    "plan": "plan",  # core/traversal.py: the round as planned
}


class MirrorOutage(ConnectionError):
    """The injected outage of one mirror write."""


class FaultyMirror(CheckpointMirror):
    """``CheckpointMirror`` whose ``n``-th write of a kind fails when ``(kind, n)`` is planned."""

    def __init__(self, url: str, outages: set[tuple[str, int]]) -> None:
        super().__init__(url)
        self.outages = outages
        self.writes: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _kind(self, doc: dict[str, Any] | None = None) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            kind = _CALLERS.get(frame.f_code.co_name)
            if kind is not None:
                if kind == "checkpoint" and doc is not None and doc.get("state") == "complete":
                    return "completion"
                return kind
            frame = frame.f_back  # type: ignore[assignment]
        return "other"  # a restore writing back what it fixed: never failed

    def _maybe_fail(self, kind: str) -> None:
        with self._lock:
            self.writes[kind] += 1
            if (kind, self.writes[kind]) in self.outages:
                self.failed[kind] += 1
                raise MirrorOutage(f"injected mirror outage: {kind} write #{self.writes[kind]}")

    def save_round(
        self, stream: str, round_id: str, info: dict[str, str], ranges: list[dict[str, Any]]
    ) -> None:
        self._maybe_fail(self._kind())
        super().save_round(stream, round_id, info, ranges)

    def save_range(self, stream: str, round_id: str, range_id: int, doc: dict[str, Any]) -> None:
        self._maybe_fail(self._kind(doc))
        super().save_range(stream, round_id, range_id, doc)

    def save_watermark(self, stream: str, watermark: str) -> None:
        self._maybe_fail(self._kind())
        super().save_watermark(stream, watermark)
