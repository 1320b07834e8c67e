"""The outcome type of every write-back helper: what happened to each key of the call."""

from __future__ import annotations

from dataclasses import dataclass, field

from airflow_keyset_provider.core.chunk import ChunkResult


@dataclass(frozen=True)
class WriteOutcome:
    """What one write-back call did, key by key. Every input key is in exactly one field.

    - ``applied``: keys whose row the statement changed or inserted, in input order.
    - ``not_applied``: keys whose row it did not touch: the row is missing, the guard did not
      match (another writer changed it first), or the upsert found it already as wanted. The
      write is not retried: running it again would not touch these rows either.
    - ``failed``: ``{key: first line of the database error}`` for keys whose own row made the
      write fail. Nothing was written for them; the other keys are unaffected.
    """

    applied: list = field(default_factory=list)
    not_applied: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)

    def to_chunk_result(self) -> ChunkResult:
        """``failed`` -> ``ChunkResult.failed`` (retried), ``not_applied`` -> ``skipped``."""
        return ChunkResult(failed=dict(self.failed), skipped=list(self.not_applied))
