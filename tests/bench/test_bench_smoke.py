"""The benchmark suite's machinery runs end to end on a tiny table (no assertion on speed).

Runs ``python -m benchmarks`` as a subprocess, as ``make bench`` does, against the test
services (MariaDB included, for the ``mariadb`` group), in a throwaway schema (and MariaDB
database) that it drops, and checks that the JSON document has every
metric of every group with a numeric ratio (every group but those in ``EXCLUDED``, which says
why). Every metric has a target it meets or misses (``met`` true or false), except the informational ones: the Airflow overhead reports its figures
(``met`` is None) and must still carry them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Reported, not judged: a numeric ratio and these numeric details, ``met`` None.
INFORMATIONAL = {"airflow_overhead": ("dag_test_s", "engine_s", "fixed_s", "per_task_s")}
# Groups this test does not run, and why.
EXCLUDED = {
    # one dag.test() of dags/cancel_stale_orders.py costs 15-25 s on this 2-core machine even on
    # 2,000 rows (plan 6-10 s, 16 mapped traverse tasks 6-9 s: Airflow's fixed cost per task),
    # ~50 s for the group with its reset and baselines; the DAG file itself runs end to end under
    # dag.test() in tests/airflow/test_decorator.py.
    "decorator_example": "costs ~50 s even on 2,000 rows (Airflow's fixed cost per task)",
}


def _groups() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The groups this test runs: every group of ``benchmarks.metrics.GROUPS`` not excluded."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.metrics import GROUPS
    finally:
        sys.path.remove(str(ROOT))
    assert set(EXCLUDED) <= set(GROUPS), "EXCLUDED names a group that does not exist"
    return {g: v for g, v in GROUPS.items() if g not in EXCLUDED}


def _expected_metrics() -> list[str]:
    return [m for _, names in _groups().values() for m in names]


def test_suite_reports_every_metric_with_a_numeric_ratio(
    pg_url: str, redis_url: str, mariadb_url: str, tmp_path: Path
) -> None:
    schema = f"kbench_smoke_{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--rows",
        "20000",
        "--repeat",
        "1",
        "--wb-rows",
        "500",
        "--only",
        ",".join(_groups()),
        "--schema",
        schema,
        "--drop-schema",
        "--json",
        "--results-dir",
        str(tmp_path),
        "--pg-url",
        pg_url,
        "--redis-url",
        redis_url,
        "--mariadb-url",
        mariadb_url,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(proc.stdout)
    by_name = {m["name"]: m for m in doc["metrics"]}
    assert sorted(by_name) == sorted(_expected_metrics())
    for name, m in by_name.items():
        assert isinstance(m["ratio"], (int, float)) and math.isfinite(m["ratio"]), (name, m)
        assert not m["note"].startswith("error:"), (name, m["note"])
        if name in INFORMATIONAL:
            assert m["met"] is None and m["note"], (name, m)
            for detail in INFORMATIONAL[name]:
                assert isinstance(m["details"][detail], (int, float)), (name, detail, m["details"])
                assert math.isfinite(m["details"][detail]), (name, detail, m["details"])
            continue
        assert isinstance(m["met"], bool), (name, m)
    assert list(tmp_path.glob("*.json")), "the JSON document was not written to --results-dir"
    assert "| metric" in proc.stderr  # the table, on stderr when --json owns stdout
