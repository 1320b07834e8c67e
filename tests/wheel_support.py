"""Build the project's wheel and install it in a fresh virtualenv, to run code against the package
as a user gets it (package data included), not against the checkout.

``wheel_venv(tmp)`` builds the wheel from a copy of the source tree (the checkout gets no
``build/`` or ``*.egg-info``), creates ``tmp/venv`` with ``python -m venv``, installs the wheel
there with ``--no-deps``, and makes the test venv's dependencies importable through a ``.pth``
file that lists the test venv's site-packages directory. A directory named in a ``.pth`` file is
only appended to ``sys.path``: the ``.pth`` files inside it are not processed, so the editable
install's finder (which maps ``airflow_keyset_provider`` to the checkout) stays out, and the
package imported is the wheel's. Run code in it with ``run_in(venv, script, cwd=...)`` from a
directory outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the wheel is built from: the package, its metadata and the files pyproject names.
SOURCE_FILES = ("airflow_keyset_provider", "pyproject.toml", "README.md", "LICENSE")


@dataclass(frozen=True)
class WheelVenv:
    """A fresh virtualenv with the project's wheel installed; ``python`` runs in it."""

    root: Path
    python: Path
    wheel: Path
    site_packages: Path


def build_wheel(out_dir: Path, source: Path = ROOT) -> Path:
    """The project's wheel, built with the test venv's pip (no build isolation, no network) from a
    copy of ``source``'s files in ``out_dir / "src"``; returns the ``.whl`` path."""
    src = out_dir / "src"
    for name in SOURCE_FILES:
        path = source / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    dist = out_dir / "dist"
    pip = [sys.executable, "-m", "pip"]
    _run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        cwd=out_dir,
    )
    (wheel,) = dist.glob("airflow_keyset_provider-*.whl")
    return wheel


def install_venv(wheel: Path, root: Path) -> WheelVenv:
    """A virtualenv at ``root`` (without pip) with ``wheel`` installed by the test venv's pip
    (``--python``, ``--no-deps``) and the test venv's site-packages on its path (a ``.pth``)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    python = root / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd=root.parent)
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=root.parent,
        ).strip()
    )
    (site / "_keyset_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return WheelVenv(root, python, wheel, site)


def wheel_venv(tmp: Path) -> WheelVenv:
    """``build_wheel`` into ``tmp / "wheel"``, then ``install_venv`` at ``tmp / "venv"``."""
    (tmp / "wheel").mkdir(parents=True, exist_ok=True)
    return install_venv(build_wheel(tmp / "wheel"), tmp / "venv")


def run_in(venv: WheelVenv, script: Path, *args: str, cwd: Path) -> str:
    """Run ``script`` with the venv's python in ``cwd``; its stdout (raises with the output when
    the script fails)."""
    return _run([str(venv.python), str(script), *args], cwd=cwd)


def _run(cmd: list[str], *, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc.stdout


def wheel_names(wheel: Path) -> set[str]:
    """The paths of the files inside ``wheel``."""
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())
