"""The package as a user installs it: the wheel carries the Lua scripts (package data) and a whole
round runs from it, in a fresh virtualenv, from a directory outside the checkout.

The script below runs with the fresh venv's python (``tests/wheel_support.py``): it checks that
``airflow_keyset_provider`` is imported from that venv, then plans, traverses and closes a round
on SQLite and the test Redis (under the test's key prefix), and prints the totals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import wheel_support

pytestmark = pytest.mark.wheel

SCRIPT = r"""
import json, sys
from pathlib import Path

import sqlalchemy as sa

import airflow_keyset_provider
from airflow_keyset_provider.core import KeysetTraversal

venv, sqlite_url, redis_url, prefix = sys.argv[1:5]
pkg = Path(airflow_keyset_provider.__file__).resolve()
assert pkg.is_relative_to(Path(venv).resolve()), f"imported from {pkg}, not from {venv}"
from airflow_keyset_provider.core.store import scripts
lua = Path(scripts.__file__).parent / "lua" / "advance.lua"
assert lua.is_file(), lua

engine = sa.create_engine(sqlite_url)
with engine.begin() as c:
    c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
    c.execute(sa.text("INSERT INTO events VALUES (:s, :p)"),
              [{"s": k, "p": f"e{k}"} for k in range(1, 251)])
engine.dispose()
t = KeysetTraversal(sqlite_url, table="events", key="seq", redis_url=redis_url,
                    stream="events-nightly", key_prefix=prefix)
rnd = t.plan(max_ranges=4, new_stream=True)
seen = []
for r in rnd.ranges:
    t.traverse(rnd.round_id, r.range_id, lambda chunk: seen.extend(chunk.keys), chunk_size=40)
totals = t.close_round(rnd.round_id)
print(json.dumps({"package": str(pkg), "ranges": len(rnd.ranges), "seen": sorted(seen),
                  "done": totals.done, "skipped": totals.skipped, "dead": totals.dead,
                  "watermark": t.watermark()}))
"""


def test_a_round_runs_from_the_installed_wheel(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    venv = wheel_support.wheel_venv(tmp_path)
    names = wheel_support.wheel_names(venv.wheel)
    assert "airflow_keyset_provider/core/store/lua/advance.lua" in names
    assert "airflow_keyset_provider/core/store/lua/includes/intact.lua" in names
    work = tmp_path / "work"
    work.mkdir()
    script = work / "round.py"
    script.write_text(SCRIPT)
    out = wheel_support.run_in(
        venv,
        script,
        str(venv.root),
        f"sqlite:///{work / 'source.db'}",
        redis_url,
        key_prefix,
        cwd=work,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert Path(result["package"]).is_relative_to(venv.site_packages)
    assert result["ranges"] >= 2
    assert result["seen"] == list(range(1, 251))
    assert (result["done"], result["skipped"], result["dead"]) == (250, 0, 0)
    assert result["watermark"]
