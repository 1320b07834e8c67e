"""A durable mirror of a stream's control state, for when Redis loses it.

Redis on many deployments keeps nothing on disk: a restart or FLUSHDB mid-round would otherwise
leave the engine unable to tell "done" from "never started". With a mirror configured the engine
writes, to a SQL table, the round definition at plan time, each range's *committed* cursor with its
counters, pending item retries and dead letters at most every ``checkpoint_seconds`` (and when a
range finishes or stops), the watermark when a round closes, and the fingerprint of the stream's
key when a round is planned (``core/rounds/stream_key.py``: the key the watermark is encoded
with).

Guarantee: a mirrored cursor is never ahead of the cursor Redis committed (it is written after
the commit, from the commit's own result). Restoring therefore moves a range *back* to its last
checkpoint: the keys committed after it are delivered again (at-least-once, at most
``checkpoint_seconds`` worth of chunks per range) and the counters are exact again once they are
re-counted. Nothing is ever restored as complete that the mirror did not record as complete.

Every statement the mirror issues runs with a statement timeout and a lock timeout
(``core/pace/sql_timeouts.py``): ``timeout_seconds`` (30 s by default; a traversal narrows it to
its ``chunk_timeout`` and lease with ``bounded``), so a mirror write that waits on a lock fails
(a range's checkpoint then logs it and goes on) instead of holding the range's loop and lease.

A split the mirror missed (its record failed) is carried by the range's later records: the split
marks the range in Redis (``split_marks``) until the mirror has it, and every write of a marked
range also writes the new range as the split made it, unless the mirror already has a record of
that range. A round restored from the mirror is therefore a partition whatever write failed.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Engine

from ..errors import ConfigurationError
from ..pace.sql_timeouts import bounded_connection
from ..redaction import url_error

_ROUND, _WATERMARK, _KEY = -1, -2, -3

#: A range's mark for a split the mirror has not recorded yet (the SPLIT script writes it when
#: the owner keeps a mirror): ``unmirrored_split:<new range id>`` = ``"<at> <hi before>"``.
SPLIT_MARK = "unmirrored_split:"


def split_marks(doc: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """The splits of this range (a range document as ``snapshot_range`` reads it) that the
    mirror has not recorded: new range id -> ``(lo, hi)`` of the new range as the split made it."""
    out = {}
    for name, value in doc.items():
        if name.startswith(SPLIT_MARK):
            lo, _, hi = str(value).partition(" ")
            out[int(name[len(SPLIT_MARK) :])] = (lo, hi)
    return out


def split_range_doc(parent: dict[str, Any], range_id: int, lo: str, hi: str) -> dict[str, Any]:
    """The range ``range_id`` as the split of ``parent`` created it: pending, unowned, nothing
    committed (a restore from it delivers every key of it again: at-least-once)."""
    zero = {f: "0" for f in ("epoch", "done", "skipped", "dead", "takeovers", "chunks", "retries")}
    return {
        **zero,
        "range_id": str(range_id),
        "lo": lo,
        "hi": hi,
        "cursor": lo,
        "state": "pending",
        "owner": "",
        "lineage": "",
        "lease_until": "0",
        "heartbeat_ms": "0",
        "split_from": str(parent["range_id"]),
        "retry": {},
        "dead_letters": [],
    }


# On MySQL/MariaDB: the stream and round names compare byte for byte (the default collation would
# make streams "A" and "a" one row), and a document may exceed TEXT's 64 KB (dead letters).
_NAME = sa.String(200).with_variant(mysql.VARCHAR(200, collation="utf8mb4_bin"), "mysql", "mariadb")
_ROUND_ID = sa.String(64).with_variant(
    mysql.VARCHAR(64, collation="utf8mb4_bin"), "mysql", "mariadb"
)
_DOC = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


class CheckpointMirror:
    """The table ``keyset_checkpoints`` (created if missing): one row per stream/round/range."""

    def __init__(
        self,
        url: str | sa.URL | Engine,
        table: str = "keyset_checkpoints",
        *,
        timeout_seconds: float = 30.0,
    ) -> None:
        if not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0:
            raise ConfigurationError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        self.timeout_seconds = float(timeout_seconds)
        try:
            self.engine = (
                url if isinstance(url, Engine) else sa.create_engine(url, pool_pre_ping=True)
            )
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
            raise ConfigurationError(
                url_error("checkpoint mirror URL", url, exc)
            ) from None  # the cause may quote the password
        schema, _, name = table.rpartition(".")
        self.table = sa.Table(
            name,
            sa.MetaData(),
            sa.Column("stream", _NAME, primary_key=True),
            sa.Column("round_id", _ROUND_ID, primary_key=True),
            sa.Column("range_id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("doc", _DOC, nullable=False),
            schema=schema or None,
        )
        self._created = False

    def bounded(self, seconds: float | None) -> CheckpointMirror:
        """This mirror (same engine and table) with its statements limited to at most
        ``seconds`` (None: unchanged): what one traversal call uses."""
        if seconds is None or seconds >= self.timeout_seconds:
            return self
        narrowed = copy.copy(self)
        narrowed.timeout_seconds = float(seconds)
        return narrowed

    def _connect(self) -> Any:
        """A connection whose statements and lock waits are limited to ``timeout_seconds``."""
        return bounded_connection(self.engine, self.timeout_seconds)

    def _ensure(self) -> None:
        if not self._created:
            with self._connect() as conn:
                self.table.create(conn, checkfirst=True)
            self._created = True

    def _upsert(self, rows: list[dict[str, Any]]) -> None:
        """Write ``rows`` (insert or replace) in one transaction; with them, for each range
        document that carries split marks (``split_marks``), the new range as the split made it
        unless the mirror already has that range (a later record of it is never replaced)."""
        if not rows:
            return
        self._ensure()
        dialect = self.engine.dialect.name
        stmt: Any
        if dialect == "mysql":  # MySQL 8.0 and MariaDB: INSERT ... ON DUPLICATE KEY UPDATE
            stmt = mysql.insert(self.table)
            stmt = stmt.on_duplicate_key_update(doc=stmt.inserted.doc)
        else:
            insert: Any = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
            if insert is None:
                raise ConfigurationError(
                    f"checkpoint mirror supports PostgreSQL, SQLite and MySQL/MariaDB, not {dialect}"
                )
            stmt = insert(self.table)
            stmt = stmt.on_conflict_do_update(
                index_elements=["stream", "round_id", "range_id"], set_={"doc": stmt.excluded.doc}
            )
        missed = self._missed_splits(rows)
        with self._connect() as conn:
            conn.execute(stmt, rows)
            if missed:  # the new ranges of missed splits, unless the mirror has them already
                keep: Any = (
                    mysql.insert(self.table).prefix_with("IGNORE")
                    if dialect == "mysql"
                    else insert(self.table).on_conflict_do_nothing()
                )
                conn.execute(keep, missed)

    def _missed_splits(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of the new ranges that the splits marked on ``rows``' ranges created, except
        those ``rows`` write themselves."""
        written = {(r["round_id"], r["range_id"]) for r in rows}
        out = []
        for row in rows:
            if row["range_id"] < 0:
                continue
            doc = json.loads(row["doc"])
            for rid, (lo, hi) in split_marks(doc).items():
                if (row["round_id"], rid) not in written:
                    new = split_range_doc(doc, rid, lo, hi)
                    out.append({**row, "range_id": rid, "doc": json.dumps(new)})
        return out

    # ---- writing -----------------------------------------------------------------------------
    def save_round(
        self, stream: str, round_id: str, info: dict[str, str], ranges: list[dict[str, Any]]
    ) -> None:
        rows = [
            {"stream": stream, "round_id": round_id, "range_id": _ROUND, "doc": json.dumps(info)}
        ]
        rows += [
            {
                "stream": stream,
                "round_id": round_id,
                "range_id": int(r["range_id"]),
                "doc": json.dumps(r),
            }
            for r in ranges
        ]
        self._upsert(rows)

    def save_range(self, stream: str, round_id: str, range_id: int, doc: dict[str, Any]) -> None:
        self._upsert(
            [{"stream": stream, "round_id": round_id, "range_id": range_id, "doc": json.dumps(doc)}]
        )

    def save_watermark(self, stream: str, watermark: str) -> None:
        self._upsert(
            [
                {
                    "stream": stream,
                    "round_id": "",
                    "range_id": _WATERMARK,
                    "doc": json.dumps({"watermark": watermark}),
                }
            ]
        )

    def save_key_fingerprint(self, stream: str, fingerprint: str) -> None:
        """The fingerprint of the stream's key (``core/rounds/stream_key.py``)."""
        doc = json.dumps({"key": fingerprint})
        self._upsert([{"stream": stream, "round_id": "", "range_id": _KEY, "doc": doc}])

    # ---- reading -----------------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the mirror's table exists (read only: nothing is created)."""
        if self._created:
            return True
        with self._connect() as conn:
            self._created = sa.inspect(conn).has_table(self.table.name, schema=self.table.schema)
        return self._created

    def load_round(
        self, stream: str, round_id: str
    ) -> tuple[dict[str, str], list[dict[str, Any]]] | None:
        self._ensure()
        t = self.table
        with self._connect() as conn:
            rows = conn.execute(
                sa.select(t.c.range_id, t.c.doc)
                .where(t.c.stream == stream, t.c.round_id == round_id)
                .order_by(t.c.range_id)
            ).all()
        docs = {rid: json.loads(doc) for rid, doc in rows}
        info = docs.pop(_ROUND, None)
        if info is None:
            return None
        return info, [docs[i] for i in sorted(docs)]

    def rounds(self, stream: str) -> list[dict[str, str]]:
        """The mirrored round definitions of a stream."""
        self._ensure()
        t = self.table
        with self._connect() as conn:
            docs = conn.execute(
                sa.select(t.c.doc).where(t.c.stream == stream, t.c.range_id == _ROUND)
            ).scalars()
            return [json.loads(d) for d in docs]

    def round_state(self, stream: str, round_id: str) -> str | None:
        """The state the mirror last recorded for the round (None: it never saw the round)."""
        self._ensure()
        t = self.table
        with self._connect() as conn:
            doc = conn.execute(
                sa.select(t.c.doc).where(
                    t.c.stream == stream, t.c.round_id == round_id, t.c.range_id == _ROUND
                )
            ).scalar()
        return None if doc is None else json.loads(doc).get("state")

    def drop_ranges(self, stream: str, round_id: str, first: int) -> None:
        """Forget the round's ranges numbered ``first`` and up (Redis lost the splits that made
        them: ``core/rounds/regressions.py``)."""
        self._ensure()
        t = self.table
        with self._connect() as conn:
            conn.execute(
                sa.delete(t).where(
                    t.c.stream == stream, t.c.round_id == round_id, t.c.range_id >= first
                )
            )

    def load_watermark(self, stream: str) -> str | None:
        self._ensure()
        t = self.table
        with self._connect() as conn:
            doc = conn.execute(
                sa.select(t.c.doc).where(t.c.stream == stream, t.c.range_id == _WATERMARK)
            ).scalar()
        return None if doc is None else json.loads(doc)["watermark"]

    def load_key_fingerprint(self, stream: str) -> str | None:
        """The stream's mirrored key fingerprint (None: never mirrored)."""
        self._ensure()
        t = self.table
        with self._connect() as conn:
            doc = conn.execute(
                sa.select(t.c.doc).where(t.c.stream == stream, t.c.range_id == _KEY)
            ).scalar()
        return None if doc is None else str(json.loads(doc)["key"])

    def max_round_number(self, stream: str) -> int:
        self._ensure()
        t = self.table
        with self._connect() as conn:
            ids = conn.execute(
                sa.select(t.c.round_id).where(t.c.stream == stream, t.c.range_id == _ROUND)
            ).scalars()
            return max((int(r[1:]) for r in ids if r[1:].isdigit()), default=0)
