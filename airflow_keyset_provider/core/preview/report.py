"""What a preview found (``RoundPreview``), as one JSON-serialisable document for XCom, the page
and the CLI. Keys appear as the status model shows them (JSON renderings of the key values, the
round's bounds and cursors); no row's other columns ever do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RangeEstimate:
    """One range the plan would make, ``lo < key <= hi``, and the database's row estimate."""

    range_id: int
    lo: Any
    hi: Any
    estimated_rows: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "range_id": self.range_id,
            "lo": self.lo,
            "hi": self.hi,
            "estimated_rows": self.estimated_rows,
        }


@dataclass(frozen=True)
class SampleRead:
    """The sample: the first ``rows`` keys of range ``range_id`` read as a traversal reads them,
    in ``chunks`` successive chunk queries of ``chunk_size`` rows at most; ``seconds`` the reads
    took together."""

    range_id: int
    rows: int
    seconds: float
    first_key: Any = None
    last_key: Any = None
    chunks: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "range_id": self.range_id,
            "rows": self.rows,
            "chunks": self.chunks,
            "seconds": round(self.seconds, 6),
            "first_key": self.first_key,
            "last_key": self.last_key,
        }


@dataclass(frozen=True)
class ProcessorTrial:
    """The processor's verdict on the sample, its writes rolled back.

    ``ran`` False says why not (``why_not``). Per key, as the round would count them:
    ``applied`` (done: keys the ``ChunkResult`` names neither failed nor skipped), ``not_applied``
    (skipped), ``failed`` (with ``reasons``: reason -> how many keys). ``raised``: the processor
    raised (a dependency failure, a bug): the whole chunk would be retried, no key counted.
    """

    ran: bool
    why_not: str | None = None
    keys: int = 0
    applied: int = 0
    not_applied: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    raised: str | None = None
    seconds: float = 0.0
    rolled_back: bool = False
    timed_keys: int = 0  # the keys ``seconds`` covers (the first chunk's call is a warm-up)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ran": self.ran,
            "why_not": self.why_not,
            "keys": self.keys,
            "applied": self.applied,
            "not_applied": self.not_applied,
            "failed": self.failed,
            "reasons": dict(self.reasons),
            "raised": self.raised,
            "seconds": round(self.seconds, 6),
            "timed_keys": self.timed_keys,
            "rolled_back": self.rolled_back,
        }


@dataclass(frozen=True)
class Eta:
    """How long the round would take: ``estimated_rows`` at ``rows_per_second``, the sample's
    rate per task (``task_rows_per_second``, read + processor + one Redis round trip a chunk)
    times the tasks that can run at once (``workers``, at most one per range), capped by the
    stream's governor budget (``max_rows_per_second``). ``limited_by`` names which of the two set
    the rate; ``seconds`` None when the sample was empty (no rate to go by)."""

    seconds: float | None
    estimated_rows: int
    rows_per_second: float | None
    task_rows_per_second: float | None
    workers: int
    max_rows_per_second: float | None
    limited_by: str

    def as_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        return {
            "seconds": r(self.seconds),
            "estimated_rows": self.estimated_rows,
            "rows_per_second": r(self.rows_per_second),
            "task_rows_per_second": r(self.task_rows_per_second),
            "workers": self.workers,
            "max_rows_per_second": self.max_rows_per_second,
            "limited_by": self.limited_by,
        }


@dataclass(frozen=True)
class RoundPreview:
    """Everything a preview found; ``problems`` lists what a person should look at before
    approving (a full scan, keys the processor failed, a processor that raised, a stream the plan
    would refuse). ``existing_round``: the round id the plan would return unchanged (the stream's
    open chained round, or the round of this request's key), None when the plan would make one."""

    stream: str
    table: str
    key: list[str]
    start_key: Any
    end_key: Any
    existing_round: str | None
    ranges: list[RangeEstimate]
    row_estimate: str
    chunk_size: int
    chunk_plan: dict[str, Any] | None
    sample: SampleRead | None
    processor: ProcessorTrial
    eta: Eta
    problems: list[str]
    notes: list[str]
    previewed_at: str

    @property
    def estimated_rows(self) -> int:
        return sum(r.estimated_rows for r in self.ranges)

    def as_dict(self) -> dict[str, Any]:
        """The preview as JSON-safe values (XCom, the page, ``airflow-keyset preview --json``)."""
        return {
            "kind": "keyset_preview",
            "stream": self.stream,
            "table": self.table,
            "key": list(self.key),
            "start_key": self.start_key,
            "end_key": self.end_key,
            "existing_round": self.existing_round,
            "estimated_rows": self.estimated_rows,
            "row_estimate": self.row_estimate,
            "ranges": [r.as_dict() for r in self.ranges],
            "chunk_size": self.chunk_size,
            "chunk_plan": self.chunk_plan,
            "sample": None if self.sample is None else self.sample.as_dict(),
            "processor": self.processor.as_dict(),
            "eta": self.eta.as_dict(),
            "problems": list(self.problems),
            "notes": list(self.notes),
            "previewed_at": self.previewed_at,
        }
