"""Waiting until every key at or below a round's end has committed (PostgreSQL).

Guarantee (``wait_for_transactions``): when it returns, every transaction of *this database*
that was open when it was called has ended (committed or aborted), including prepared (two-phase)
transactions, which hold no backend. So a key written by any of them is either visible or never
will be. Sessions of other databases and VACUUM (manual or autovacuum, which never insert rows)
are not waited for, as PostgreSQL's own ``CREATE INDEX CONCURRENTLY`` does not wait for them. The
wait is bounded: on timeout, ``CommitOrderTimeoutError`` names every blocker (pid or prepared
transaction gid, database, user, ``application_name``, state, transaction age; never its query,
which may hold a row's values).

The provider's own workers of *other* streams (their connections are named
``keyset:<stream>:...``, ``naming``) are not waited for when the key takes its values when a row
is written (``sequence_fed``: a sequence or identity feeds its first column) and the worker's
transaction holds no write lock on the source table, its partitions or children, or those
sequences (``pg_locks``; ``nextval`` locks its sequence until the transaction ends, a write its
table). Such a transaction has taken no key yet; one it takes later comes after the bound. A
worker that did write the table, any other session, and every session when the key is not
sequence-fed (a transaction-start ``now()`` is a key taken before the row is written) are waited
for as before.

``settle`` adds an opt-in window: after the first wait, sleep ``settle_seconds`` and wait again
for the transactions open then. A key committed up to ``settle_seconds`` after the bound was read
(by a transaction that began after it) is then still visible when the round is saved. It is a
window, not a guarantee: a key committed later than that is missed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from ..errors import CommitOrderTimeoutError
from . import naming

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blocker:
    """An open transaction that could still commit a key."""

    ident: str  # virtualxid of a backend, or "prepared:<gid>"
    describe: str
    app: str = ""  # the connection's name (``naming``), "" if unknown
    writes_source: bool = True  # holds a write lock on the source (True when it cannot be told)


_OPEN_BACKENDS = sa.text(
    # Every running transaction holds an ExclusiveLock on its own virtual transaction id, whether
    # or not it has an xid yet (nextval() alone may not assign one). pg_locks is cluster-wide:
    # keep this database's sessions, not ours, not VACUUM (pg_stat_progress_vacuum, which lists
    # manual and auto vacuums) nor autovacuum workers.
    # writes: a lock stronger than a read's on one of the watched relations (``:rels``, oids).
    "SELECT l.virtualxid, a.pid, a.datname, a.usename, a.application_name, a.backend_type, a.state, "
    "       extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start)), "
    "       EXISTS (SELECT 1 FROM pg_locks w WHERE w.pid = a.pid AND w.locktype = 'relation' "
    "               AND w.relation = ANY(CAST(:rels AS oid[])) "
    "               AND w.mode NOT IN ('AccessShareLock', 'RowShareLock')) "
    "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted "
    "AND a.pid <> pg_backend_pid() "
    "AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND a.backend_type NOT IN ('autovacuum worker', 'autovacuum launcher') "
    "AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum v)"
)

_OPEN_PREPARED = sa.text(
    # Prepared transactions hold no backend and no virtualxid lock: they live on until
    # COMMIT PREPARED / ROLLBACK PREPARED, possibly holding keys below the bound.
    "SELECT p.gid, p.owner, p.database, extract(epoch FROM now() - p.prepared) "
    "FROM pg_prepared_xacts p WHERE p.database = current_database()"
)


_WATCHED = sa.text(
    # the source, every table that inherits from it (partitions included, at any depth), and the
    # sequences their columns own or their defaults call
    "WITH RECURSIVE t(oid) AS (SELECT CAST(:rel AS regclass)::oid "
    "  UNION SELECT i.inhrelid FROM pg_inherits i JOIN t ON i.inhparent = t.oid) "
    "SELECT oid FROM t "
    "UNION SELECT d.objid FROM pg_depend d JOIN t ON d.refobjid = t.oid "
    "  WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass "
    "  AND d.deptype IN ('a', 'i') "
    "UNION SELECT d.refobjid FROM pg_attrdef ad JOIN t ON ad.adrelid = t.oid "
    "  JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid "
    "  AND d.refclassid = 'pg_class'::regclass"
)


def watched_relations(conn: sa.Connection, rel: str) -> list[int]:
    """Oids whose write lock marks a transaction as writing the source ``rel`` (see _WATCHED)."""
    return [int(r[0]) for r in conn.execute(_WATCHED, {"rel": rel})]


def open_transactions(conn: sa.Connection, rels: list[int] | None = None) -> dict[str, Blocker]:
    """Transactions of this database that could still commit a key, by identity; ``rels``: the
    oids ``watched_relations`` returned (without them every backend counts as writing)."""
    out: dict[str, Blocker] = {}
    rows = conn.execute(_OPEN_BACKENDS, {"rels": rels or []})
    for vxid, pid, db, user, app, btype, state, age, writes in rows:
        out[vxid] = Blocker(
            vxid,
            f"pid {pid} database {db} user {user} application_name {app!r} ({btype}) "
            f"transaction open for {float(age or 0):.1f} s ({state})"
            f"{', writing the source' if writes and rels else ''}, end it with "
            f"SELECT pg_terminate_backend({pid})",
            app or "",
            bool(writes) or not rels,
        )
    for gid, owner, db, age in conn.execute(_OPEN_PREPARED):
        out[f"prepared:{gid}"] = Blocker(
            f"prepared:{gid}",
            f"prepared transaction gid {gid!r} database {db} owner {owner} "
            f"prepared {float(age or 0):.1f} s ago (end it with COMMIT PREPARED "
            f"'{gid}' or ROLLBACK PREPARED '{gid}')",
        )
    return out


def other_streams_reader(own_prefix: str) -> Callable[[Blocker], bool]:
    """``skip`` for ``wait_for_transactions``: a transaction of the provider's worker of another
    stream than the one named ``own_prefix...`` that does not write the source (module doc)."""
    return lambda b: not b.writes_source and naming.is_other_stream(b.app, own_prefix)


def wait_for_transactions(
    conn: sa.Connection,
    timeout: float,
    what: str,
    list_open: Callable[[sa.Connection], dict[str, Blocker]] | None = None,
    skip: Callable[[Blocker], bool] | None = None,
) -> None:
    """Wait until the transactions open now have all ended (see module doc). ``what`` names the
    table in the timeout error; ``list_open`` lists a database's open transactions by identity
    (PostgreSQL's ``open_transactions`` by default; MySQL passes its own); ``skip`` drops, once,
    those open now that cannot hold a key (``other_streams_reader``)."""
    list_open = list_open or open_transactions
    waiting = list_open(conn)
    skipped = [b for b in waiting.values() if skip is not None and skip(b)]
    for b in skipped:
        del waiting[b.ident]
    deadline = time.monotonic() + timeout
    delay = 0.01
    if skipped:
        log.info(
            "%s: not waiting for %d transaction(s) of other streams' workers that do not write "
            "it: %s",
            what,
            len(skipped),
            "; ".join(b.describe for b in skipped),
        )
    if waiting:
        log.info(
            "%s: waiting up to %.0f s for %d open transaction(s) to end before saving the round",
            what,
            timeout,
            len(waiting),
        )
    while waiting:
        still = list_open(conn)
        # the blockers' descriptions are refreshed so the timeout error shows their current state
        waiting = {k: still[k] for k in waiting if k in still}
        if not waiting:
            return
        if time.monotonic() >= deadline:
            who = "; ".join(b.describe for b in waiting.values())
            raise CommitOrderTimeoutError(
                f"{len(waiting)} transaction(s) open when the upper bound of {what!r} was fixed did not "
                f"end within {timeout:.0f} s: {who}. A key they hold could fall inside the round, so no "
                "round was saved. Let them finish (or terminate them), or raise commit_wait_timeout."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def settle(
    conn: sa.Connection,
    timeout: float,
    settle_seconds: float,
    what: str,
    list_open: Callable[[sa.Connection], dict[str, Blocker]] | None = None,
    skip: Callable[[Blocker], bool] | None = None,
) -> None:
    """``wait_for_transactions``; then, with a settle window, sleep it and wait again."""
    wait_for_transactions(conn, timeout, what, list_open, skip)
    if settle_seconds > 0:
        log.info("%s: settle window of %.1f s before saving the round", what, settle_seconds)
        time.sleep(settle_seconds)
        wait_for_transactions(conn, timeout, what, list_open, skip)
