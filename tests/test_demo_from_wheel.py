"""The release as a user gets it: the built wheel, installed into a fresh virtualenv that has
only Airflow and the project's dependencies (``tests/wheel_support.py``), runs the README's demo
(``scripts/demo.py``: the nightly example DAG under ``airflow dags test`` on SQLite and an
embedded Redis) from a directory that holds the demo and the example DAGs but no package, so
every import of ``airflow_keyset_provider`` (the provider's entry points, the plugin, the
operators in the DAG file) comes from the wheel."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import wheel_support

pytestmark = pytest.mark.wheel

REPO = Path(__file__).resolve().parents[1]

WHICH = r"""
import sys
from pathlib import Path

import airflow_keyset_provider
from airflow_keyset_provider.get_provider_info import get_provider_info

pkg = Path(airflow_keyset_provider.__file__).resolve()
assert pkg.is_relative_to(Path(sys.argv[1]).resolve()), f"imported from {pkg}"
print(get_provider_info()["package-name"], pkg)
"""


def test_the_demo_runs_from_the_installed_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as on a user's machine: no Airflow settings or example settings from other tests (the
    # Airflow tests' conftest sets AIRFLOW_HOME, key prefixes ... for the whole session)
    for name in list(os.environ):
        if name.startswith(("AIRFLOW", "KEYSET_EXAMPLE_")):
            monkeypatch.delenv(name)
    venv = wheel_support.wheel_venv(tmp_path)
    project = tmp_path / "project"
    shutil.copytree(REPO / "dags", project / "dags", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", project / "scripts")
    (project / "tests").mkdir()
    shutil.copy2(REPO / "tests" / "_services.py", project / "tests" / "_services.py")
    which = tmp_path / "which.py"
    which.write_text(WHICH)
    assert "airflow-keyset-provider" in wheel_support.run_in(
        venv, which, str(venv.root), cwd=project
    )
    out = wheel_support.run_in(
        venv,
        project / "scripts" / "demo.py",
        "--events",
        "3000",
        "--ranges",
        "4",
        "--chunk-size",
        "500",
        cwd=project,
    )
    assert "watermark     3000" in out, out
