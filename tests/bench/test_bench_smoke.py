"""The benchmark suite's machinery runs end to end on a tiny table (no assertion on speed).

Runs ``python -m benchmarks`` as a subprocess, as ``make bench`` does, against the test
services, in a throwaway schema that it drops, and checks that the JSON document has every
metric of every group with a numeric ratio (the Airflow overhead is reported n/a by design).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_MEASURED = {"airflow_overhead"}


def _expected_metrics() -> list[str]:
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.metrics import GROUPS
    finally:
        sys.path.remove(str(ROOT))
    return [m for _, names in GROUPS.values() for m in names]


def test_suite_reports_every_metric_with_a_numeric_ratio(pg_url: str, redis_url: str, tmp_path: Path) -> None:
    schema = f"kbench_smoke_{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "benchmarks", "--rows", "20000", "--repeat", "1", "--wb-rows", "500",
           "--schema", schema, "--drop-schema", "--json", "--results-dir", str(tmp_path),
           "--pg-url", pg_url, "--redis-url", redis_url]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(proc.stdout)
    by_name = {m["name"]: m for m in doc["metrics"]}
    assert sorted(by_name) == sorted(_expected_metrics())
    for name, m in by_name.items():
        if name in NOT_MEASURED:
            assert m["met"] is None and m["note"]
            continue
        assert isinstance(m["ratio"], (int, float)) and math.isfinite(m["ratio"]), (name, m)
        assert isinstance(m["met"], bool), (name, m)
        assert not m["note"].startswith("error:"), (name, m["note"])
    assert list(tmp_path.glob("*.json")), "the JSON document was not written to --results-dir"
    assert "| metric" in proc.stderr  # the table, on stderr when --json owns stdout
