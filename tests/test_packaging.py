"""The package declares what it imports, keeps one version, and names the extra it misses.

- Every third-party module imported anywhere in ``airflow_keyset_provider/`` (top level, inside
  functions, under ``try``) belongs to an installed distribution that ``[project].dependencies``
  or an extra of ``pyproject.toml`` declares. ``airflow.providers.<name>`` counts as the provider's
  own distribution (``apache-airflow-providers-<name>``), not as ``apache-airflow``.
- ``__version__`` is the only version: pyproject reads it, ``get_provider_info`` reports it.
- A connection whose Airflow provider is missing fails with ``MissingExtraError`` naming the
  ``pip install`` line of its extra (checked in a subprocess where the provider cannot import).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "airflow_keyset_provider"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SELF = canonicalize_name(PYPROJECT["project"]["name"])
# Airflow ships its namespace in several distributions that the `apache-airflow` meta-package
# requires; code importing `airflow.sdk` or `airflow.api_fastapi` depends on `apache-airflow`.
AIRFLOW_CORE = {"apache-airflow-core", "apache-airflow-task-sdk"}


def imported_modules(root: Path) -> dict[str, set[str]]:
    """Absolute module names imported by the package -> the files importing them."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(root.parent)))
    return found


def third_party(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    skip = set(sys.stdlib_module_names) | {"__future__", "airflow_keyset_provider"}
    return {m: files for m, files in modules.items() if m.split(".")[0] not in skip}


@cache
def _owners_of_airflow_packages() -> dict[str, str]:
    """``airflow.x.y`` package -> the installed distribution whose files hold its ``__init__``."""
    owners: dict[str, str] = {}
    for dist in md.distributions():
        for f in dist.files or ():
            parts = f.parts
            if parts and parts[0] == "airflow" and f.name == "__init__.py":
                owners[".".join(parts[:-1])] = canonicalize_name(dist.metadata["Name"])
    return owners


def distribution_of(module: str) -> str:
    """The installed distribution that provides ``module`` (the most specific package for the
    ``airflow`` namespace, which many distributions share)."""
    top = module.split(".")[0]
    if top == "airflow":
        owners = _owners_of_airflow_packages()
        parts = module.split(".")
        for n in range(len(parts), 0, -1):
            owner = owners.get(".".join(parts[:n]))
            if owner:
                return owner
        raise AssertionError(f"no installed distribution provides {module}")
    dists = md.packages_distributions().get(top)
    assert dists, f"no installed distribution provides the import {top!r}"
    return canonicalize_name(dists[0])


def declared() -> dict[str, set[str]]:
    """Declared distribution -> where (``dependencies`` or ``extra:<name>``), self-references of
    the form ``airflow-keyset-provider[a,b]`` left out (their extras are listed on their own)."""
    out: dict[str, set[str]] = {}
    sections = {"dependencies": PYPROJECT["project"]["dependencies"]}
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items():
        sections[f"extra:{extra}"] = reqs
    for where, reqs in sections.items():
        for raw in reqs:
            name = canonicalize_name(Requirement(raw).name)
            if name != SELF:
                out.setdefault(name, set()).add(where)
    return out


def test_every_third_party_import_is_declared() -> None:
    modules = third_party(imported_modules(PACKAGE))
    assert "redis" in modules and "sqlalchemy" in modules, "the import scan found nothing"
    deps = declared()
    missing = []
    for module, files in sorted(modules.items()):
        dist = distribution_of(module)
        if dist in AIRFLOW_CORE:
            dist = "apache-airflow"
        if dist not in deps:
            missing.append(f"{module} (distribution {dist}) imported by {sorted(files)}")
    assert not missing, "imported but declared neither as a dependency nor in an extra:\n" + (
        "\n".join(missing)
    )


def test_the_scan_sees_imports_inside_functions_and_providers_apart(tmp_path: Path) -> None:
    """The checker itself: a lazy import is found, and a provider is not mistaken for Airflow."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f():\n    try:\n        import psycopg2\n    except ImportError:\n        pass\n"
        "    from airflow.providers.sqlite.hooks.sqlite import SqliteHook\n"
    )
    modules = third_party(imported_modules(pkg))
    assert set(modules) == {"psycopg2", "airflow.providers.sqlite.hooks.sqlite"}
    assert distribution_of("psycopg2") == "psycopg2-binary"
    assert distribution_of("airflow.providers.sqlite.hooks.sqlite") == (
        "apache-airflow-providers-sqlite"
    )
    assert distribution_of("airflow.sdk") in AIRFLOW_CORE


def test_test_extra_installs_every_other_extra_it_can() -> None:
    """``[test]`` pulls every runtime extra except ``mysql`` and ``mysql-native`` (mysqlclient needs
    C headers: CI installs ``mysql-native`` through the Makefile's ``EXTRAS``)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    pulled: set[str] = set()
    for raw in extras["test"]:
        req = Requirement(raw)
        if canonicalize_name(req.name) == SELF:
            pulled |= req.extras
    assert pulled == set(extras) - {"test", "mysql", "mysql-native"}


def test_one_version_source() -> None:
    import airflow_keyset_provider
    from airflow_keyset_provider.get_provider_info import get_provider_info

    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "airflow_keyset_provider.__version__"
    version = airflow_keyset_provider.__version__
    assert get_provider_info()["versions"] == [version]
    literal = re.compile(r"""["']\d+\.\d+\.\d+["']""")
    for path in PACKAGE.rglob("*.py"):
        for line in path.read_text().splitlines():
            if literal.search(line) and "__version__ =" not in line:
                # version_added of config options is history, not the current version
                assert "CONFIG_ADDED_IN" in line or "version" not in line.lower(), (
                    f"{path}: a version literal besides __version__: {line.strip()}"
                )


PROBE = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        # the provider's hooks are "not installed": their import fails like a missing
        # distribution's (its metadata stays, so Airflow's provider discovery still runs)
        def find_spec(self, name, path=None, target=None):
            if name == "airflow.providers.sqlite.hooks" or name.startswith("airflow.providers.sqlite.hooks."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    from airflow_keyset_provider.hooks.keyset import KeysetHook
    try:
        KeysetHook(source_conn_id="src").source_url()
    except Exception as exc:
        print(json.dumps({"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "text": str(exc)}))
    else:
        print(json.dumps({"type": None}))
    """
)


def test_a_missing_provider_names_the_extra(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW_CONN_SRC": json.dumps({"conn_type": "sqlite", "host": str(tmp_path / "s.db")}),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["type"] == "MissingExtraError", result
    assert {"ConfigurationError", "ImportError"} <= set(result["mro"])
    assert "pip install 'airflow-keyset-provider[sqlite]'" in result["text"]
    assert "airflow.providers.sqlite.hooks" in result["text"]


def test_the_api_reference_documents_every_public_module() -> None:
    """``docs/api.rst`` (``make docs``) has an ``automodule`` for each module behind a top-level
    name, and for the public packages of docs/compatibility.md."""
    import airflow_keyset_provider as pkg

    text = (REPO / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. automodule:: (\S+)", text, re.M))
    public = {"airflow_keyset_provider", "airflow_keyset_provider.core.writeback"}
    public |= {"airflow_keyset_provider.testing", "airflow_keyset_provider.extras"}
    public |= {"airflow_keyset_provider.hooks.keyset", "airflow_keyset_provider.triggers.keyset"}
    for module in pkg._EXPORTS.values():
        # engine names are documented where core re-exports them
        public.add(
            "airflow_keyset_provider.core" if module.startswith("airflow_keyset_provider.core.")
            else module
        )  # fmt: skip
    assert public <= documented, f"not in docs/api.rst: {sorted(public - documented)}"
    for name in pkg._EXPORTS:
        assert f"``{name}``" in text, f"docs/api.rst does not list the top-level name {name}"
