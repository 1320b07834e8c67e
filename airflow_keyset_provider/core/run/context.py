"""``RunContext``: everything a range's run and a pull loop need, in one small explicit object.

The facade (``core.traversal.KeysetTraversal``) builds one per ``traverse`` / ``traverse_round``
call and hands it down; nothing in ``core.run`` reaches back into the facade. Its parts are the
engine's rooms: the source (``core.sql``), the cursor store (``core.store``), the checkpoint
mirror and the round operations that restore a round from it (``core.rounds``), the metrics sink,
the call's stop signal and its progress hook, and the target database a processor writes to.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import sqlalchemy as sa

from ..metrics import Metrics, NullMetrics
from ..rounds.control import StreamControl
from ..rounds.mirror import CheckpointMirror
from ..sql.ledger import LEDGER_TABLE
from ..sql.source import SqlSource
from ..store.cursor_store import CursorStore
from .state import ProgressHook


@dataclass(frozen=True)
class RunContext:
    """What one call of ``traverse`` or ``traverse_round`` runs with.

    ``stop`` is the call's stop signal (``KeysetTraversal.request_stop`` sets it): every wait of
    the run (claim, backoff, retry passes, pull polls, the pacer) ends at once when it is set.
    ``progress`` receives the range's committed state (throttled by itself). ``mirror`` is None
    without a checkpoint mirror; ``control`` restores a round Redis lost from it.
    """

    source: SqlSource
    store: CursorStore
    control: StreamControl
    mirror: CheckpointMirror | None = None
    metrics: Metrics = field(default_factory=NullMetrics)
    stop: threading.Event = field(default_factory=threading.Event)
    progress: ProgressHook = field(default_factory=ProgressHook)
    checkpoint_seconds: float = 10.0
    target: sa.Engine | None = None  # the processor's database (``chunk.connection``)
    ledger_table: str = LEDGER_TABLE  # exactly_once: the target's ledger table

    @property
    def stream(self) -> str:
        return self.store.stream

    @property
    def arity(self) -> int:
        """Columns in the key."""
        return self.source.arity

    @property
    def tags(self) -> dict[str, str]:
        """The metrics' tags of this stream."""
        return {"stream": self.store.stream}


__all__ = ["RunContext"]
