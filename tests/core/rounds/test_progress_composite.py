"""Progress, rate and ETA of the first round of a stream on a composite key, checked against the
real progress, on real PostgreSQL + Redis (issue 30: the page and the CLI showed ``n/a`` / ``? of
key space`` and ``ETA -``, and a closed round's rate was the average since planning).

- The first range of a stream's first round starts at ``-inf``; it is measured from the round's
  lowest key when planned (``floor``), so the round has a figure, for a ``(created_at, id)`` key as
  for any other: within 0.05 of the rows that reached a terminal state / the rows of the round
  (keys evenly spread over time, so key space and rows agree).
- A single reading has an ETA (the rest at the pace so far) and a rate measured from the round's
  first claim, not from planning: a round planned long before its tasks ran is not reported at a
  fraction of its pace.
- The CLI prints the figure (``NN.N% of key space``), not ``?``.
"""

from __future__ import annotations

import datetime as dt
import io
import time

import sqlalchemy as sa

from airflow_keyset_provider.cli import main
from airflow_keyset_provider.core import KeysetTraversal

ROWS = 2000
T0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)


def _orders(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql(
            "CREATE TABLE orders (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, "
            "status text NOT NULL)"
        )
        c.exec_driver_sql("CREATE UNIQUE INDEX orders_ct_id ON orders (created_at, id)")
        c.execute(
            sa.text("INSERT INTO orders VALUES (:i, :t, 'PENDING')"),
            [{"i": i, "t": T0 + dt.timedelta(seconds=7 * i)} for i in range(1, ROWS + 1)],
        )


def test_the_first_round_on_a_composite_key_has_progress_rate_and_eta(
    pg_engine, pg_schema_url, redis_url, key_prefix
) -> None:
    _orders(pg_engine)
    t = KeysetTraversal(pg_schema_url, "orders", ["created_at", "id"], redis_url=redis_url,
                        stream="orders-nightly", key_prefix=key_prefix)  # fmt: skip
    rnd = t.plan(max_ranges=2, new_stream=True)
    assert rnd.ranges[0].lo is None  # the first range starts at -inf
    time.sleep(1.0)  # planned a while before the tasks run: the rate must not count this wait
    calls = [0]

    def half(chunk):
        calls[0] += 1
        if calls[0] == 5:  # 5 chunks of 100 of range 0's ~1000 rows, then stop
            t.request_stop()

    res = t.traverse(rnd.round_id, 0, half, chunk_size=100)
    assert res.stopped and res.done == 500
    status = t.control.round_status(rnd.round_id)
    real = status.items / ROWS
    assert status.progress is not None, "no progress figure for the first round"
    assert abs(status.progress - real) < 0.05, (status.progress, real)
    hi_t, hi_id = rnd.ranges[0].hi
    with pg_engine.connect() as c:
        in_range0 = c.execute(
            sa.text("SELECT count(*) FROM orders WHERE (created_at, id) <= (:t, :i)"),
            {"t": hi_t, "i": hi_id},
        ).scalar_one()
    r0 = status.ranges[0]
    assert r0.progress is not None and abs(r0.progress - 500 / in_range0) < 0.05
    assert status.rate_basis == "average while processing"
    assert status.eta_s is not None and status.eta_s > 0

    out, err = io.StringIO(), io.StringIO()
    code = main(["status", "orders-nightly", "--redis-url", redis_url, "--key-prefix", key_prefix],
                stdout=out, stderr=err)  # fmt: skip
    assert code == 0, err.getvalue()
    assert f"{status.progress * 100:.1f}% of key space" in out.getvalue(), out.getvalue()
    assert "? of key space" not in out.getvalue()

    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=500)
    t.close_round(rnd.round_id)
    closed = t.control.round_status(rnd.round_id)
    assert closed.progress == 1.0 and closed.items == ROWS
    assert closed.rate_basis == "average while processing"
    t.close()
