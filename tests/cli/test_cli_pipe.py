"""``airflow-keyset`` as a script or a person meets it through a pipe (a real subprocess, stdout a
pipe), on real Redis and SQLite.

- Tables are printed in full: no cell is cut (``ra…``, ``2,…``) at any width the old 140-column
  default would have cut; ``COLUMNS`` sets the width and is honoured.
- Messages name the Redis they read, with its password redacted (in the userinfo and in the
  query string); a URL that does not parse is never echoed.
- Exit codes are the documented ones: a round lost while its stream is still in Redis exits 4
  (``EXIT_LOST``); a stream with no state at all (a typo, or a Redis that lost every key of it)
  exits 5 (``EXIT_NOT_FOUND``) and says both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cli_support import LiveRound

from airflow_keyset_provider.cli import EXIT_LOST, EXIT_NOT_FOUND, EXIT_OK

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunt3r2-s3cret"


def run(lr: LiveRound, *argv: str, redis_url: str | None = None, **env: str):
    """The CLI in a subprocess, stdout and stderr pipes (not a terminal)."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    if "COLUMNS" not in env:
        full.pop("COLUMNS", None)
    cmd = [sys.executable, "-m", "airflow_keyset_provider.cli", *argv]
    cmd += ["--redis-url", redis_url or lr.redis_url, "--key-prefix", lr.key_prefix]
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


def test_tables_on_a_pipe_are_never_cut(sqlite_round: LiveRound) -> None:
    t = sqlite_round.traversal
    long_owner = "a_dag_with_a_long_name/scheduled__2026-11-30T00:00:00+00:00/traverse/2"
    t.store.client.hset(t.store.range_key("r1", 2), "owner", f"{long_owner}#{'f' * 32}")
    proc = run(sqlite_round, "ranges", "events-nightly", "r1")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    assert "\x1b" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) > 140, "the table fits 140 columns: the test proves nothing"
    dead = sqlite_round.cli_json("dead-letters", "events-nightly", "r1")["dead_letters"]
    proc = run(sqlite_round, "dead-letters", "events-nightly", "r1")
    assert proc.returncode == EXIT_OK and "…" not in proc.stdout
    for d in dead:  # every error in full, on one line with its key
        assert any(str(d["key"]) in ln and d["error"] in ln for ln in proc.stdout.splitlines())

    narrow = run(sqlite_round, "ranges", "events-nightly", "r1", COLUMNS="100")
    assert narrow.returncode == EXIT_OK
    rules = [ln for ln in narrow.stdout.splitlines() if "───" in ln]  # the tables' header rules
    assert rules and max(map(len, rules)) <= 100, narrow.stdout  # COLUMNS is the tables' width


def test_messages_name_the_redis_they_read_without_its_password(
    sqlite_round: LiveRound,
) -> None:
    url = sqlite_round.redis_url
    with_secret = f"{url}{'&' if '?' in url else '?'}password={SECRET}"
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_keyset_provider.cli", "status", "--redis-url", url,
         "--key-prefix", "nosuchprefix"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_OK and f"in Redis {url}" in proc.stdout, proc.stdout
    # a wrong stream name: not found, with the Redis named (its password redacted)
    proc = run(sqlite_round, "ranges", "events-nightlly", "r1", redis_url=with_secret)
    assert proc.returncode in (EXIT_NOT_FOUND, 1), proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert "password=***" in proc.stderr, proc.stderr  # not found, or credentials refused
    proc = run(sqlite_round, "ranges", "events-nightlly", "r1")
    assert proc.returncode == EXIT_NOT_FOUND and "(Redis read: redis://" in proc.stderr
    # a URL that does not parse is never echoed
    proc = run(sqlite_round, "status", redis_url=f"redis://h:{SECRET}#x@127.0.0.1:1/0")
    assert proc.returncode != EXIT_OK and SECRET not in proc.stderr + proc.stdout, proc.stderr


def test_a_lost_round_exits_4_and_a_stream_with_no_state_exits_5(
    sqlite_round: LiveRound,
) -> None:
    store = sqlite_round.traversal.store
    store.client.delete(store.round_key("r1"))  # the stream stays: its round is lost
    proc = run(sqlite_round, "ranges", "events-nightly", "r1")
    assert proc.returncode == EXIT_LOST, proc.stderr
    assert "round state lost" in proc.stderr and "(Redis read: redis://" in proc.stderr
    for key in store.client.scan_iter(f"{sqlite_round.key_prefix}:*"):
        store.client.delete(key)  # every key of the stream: a flushed Redis, or a typo
    proc = run(sqlite_round, "ranges", "events-nightly", "r1")
    assert proc.returncode == EXIT_NOT_FOUND, proc.stderr
    assert "has no state" in proc.stderr and "Redis lost" in proc.stderr
