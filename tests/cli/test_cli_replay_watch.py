"""``replay-dead-letters`` takes its source from the round; ``status --watch`` streams plain text.

- A round planned over ``schema.table`` with a ``where`` and ``where_params`` is replayed with no
  ``--table``, ``--key``, ``--columns`` or ``--where``: the CLI reads the round's stored source,
  and the processor gets every column of the table. A flag overrides the stored value, and the
  engine refuses an override that describes another set of rows.
- ``status --watch N --until-closed`` with stdout on a pipe writes one plain block per reading
  (no ANSI escape), flushed: the reader sees it while the round is still open, and the process
  ends by itself once the round closes.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from cli_support import POISON, LiveRound, make_events, poison_processor

from airflow_keyset_provider.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from airflow_keyset_provider.core import KeysetTraversal

REPO = Path(__file__).resolve().parents[2]
TOP = 390  # the round's where: seq <= :top
WAIT_S = 120.0  # bound on any wait for the subprocess; never a timing assertion


@pytest.fixture
def pg_round(
    pg_url: str, pg_schema: str, pg_schema_url: str, redis_url: str, key_prefix: str
) -> Iterator[LiveRound]:
    """Round r1 over ``<schema>.events`` where ``seq <= 390``, every range traversed with the
    poison processor: dead letters in each range."""
    make_events(pg_schema_url)
    t = KeysetTraversal(
        pg_url,
        f"{pg_schema}.events",
        "seq",
        redis_url=redis_url,
        stream="events-nightly",
        key_prefix=key_prefix,
        where="seq <= :top",
        where_params={"top": TOP},
    )
    rnd = t.plan(max_ranges=3, new_stream=True)
    for spec in rnd.ranges:
        t.traverse(
            rnd.round_id,
            spec.range_id,
            poison_processor,
            chunk_size=25,
            item_retry_delay=0.0,
            backoff_base=0.01,
        )
    yield LiveRound(t, rnd.round_id, pg_url, redis_url, key_prefix)
    t.close()


FIXED = """
from airflow_keyset_provider import ChunkResult

def process(chunk):
    # the fix needs the payload column, which the round's own traversal never fetched
    bad = {k: f"row without its payload: {sorted(row)}" for k, row in zip(chunk.keys, chunk.rows)
           if row.get("payload") != f"e{k}"}
    return ChunkResult(failed=bad)
"""


def test_replay_reads_table_key_and_where_from_the_round(
    pg_round: LiveRound, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fixed_dispatch.py").write_text(textwrap.dedent(FIXED))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = pg_round.cli_json("dead-letters", "events-nightly", "r1")
    assert before["dead_total"] == TOP // POISON  # 37, 74, ..., 370

    common = ["replay-dead-letters", "events-nightly", "r1", "--source-url", pg_round.source_url]
    common += ["--processor", "fixed_dispatch:process", "--item-retry-delay", "0"]
    # an override that names other rows is refused by the engine, nothing replayed
    code, _, err = pg_round.cli(*common, "--where", "seq <= 100")
    assert code == EXIT_USAGE and "planned over" in err, err
    assert pg_round.cli_json("dead-letters", "events-nightly", "r1")["dead_total"] == 10

    doc = pg_round.cli_json(*common)  # no --table, --key, --columns, --where
    assert doc["still_dead"] == 0, doc
    assert sorted(r["range_id"] for r in doc["ranges"]) == [0, 1, 2]
    assert pg_round.cli_json("dead-letters", "events-nightly", "r1")["dead_total"] == 0
    ranges = pg_round.cli_json("ranges", "events-nightly", "r1")["ranges"]
    assert sum(r["done"] + r["skipped"] for r in ranges) == TOP


def test_replay_of_an_unknown_round_or_unrecorded_source(pg_round: LiveRound) -> None:
    code, _, err = pg_round.cli(
        "replay-dead-letters", "events-nightly", "r9", "--source-url", pg_round.source_url,
        "--processor", "json:dumps",
    )  # fmt: skip
    assert code == EXIT_NOT_FOUND and "no round 'r9'" in err, err
    store = pg_round.traversal.store
    store.client.hset(store.round_key("r1"), "source", "")
    code, _, err = pg_round.cli(
        "replay-dead-letters", "events-nightly", "r1", "--source-url", pg_round.source_url,
        "--processor", "json:dumps",
    )  # fmt: skip
    assert code == EXIT_USAGE and "give --table and --key" in err, err


def _lines(pipe: IO[str]) -> queue.Queue[str | None]:
    """Lines of ``pipe`` as they arrive (None at EOF), read by a daemon thread."""
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in pipe:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until(q: queue.Queue[str | None], needle: str, seen: list[str]) -> None:
    while True:
        line = q.get(timeout=WAIT_S)  # queue.Empty fails the test: nothing arrived
        assert line is not None, f"output ended before {needle!r}: {''.join(seen)}"
        seen.append(line)
        if needle in line:
            return


def test_watch_on_a_pipe_streams_plain_blocks_until_the_round_closes(
    sqlite_round: LiveRound,
) -> None:
    # a colour terminal type, but stdout is a pipe: the output must still be plain
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color"}
    env.pop("FORCE_COLOR", None)
    cmd = [sys.executable, "-m", "airflow_keyset_provider.cli", "status", "events-nightly"]
    cmd += ["--watch", "0.2", "--until-closed", "--redis-url", sqlite_round.redis_url]
    cmd += ["--key-prefix", sqlite_round.key_prefix]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        q, seen = _lines(proc.stdout), []
        _until(q, "round r1 (-inf, 400] open", seen)  # the first block, the round still open
        _until(q, "--- ", seen)  # and a second reading: a block per interval
        assert proc.poll() is None
        t = sqlite_round.traversal
        for range_id in (2, 3):
            t.traverse("r1", range_id, poison_processor, chunk_size=50, item_retry_delay=0.0)
        t.close_round("r1")
        assert proc.wait(timeout=WAIT_S) == EXIT_OK
        while (line := q.get(timeout=WAIT_S)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen)
    assert "\x1b" not in out, "ANSI escape sequences on a pipe"
    assert out.count("--- ") >= 3 and "(every 0.2 s, Ctrl-C to stop)" in out
    assert out.rstrip().endswith("no open rounds"), out[-500:]
