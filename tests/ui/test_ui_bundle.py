"""The committed bundle (``airflow_keyset_provider/plugins/static/ui/``) is built from the committed
sources (``ui/``), and it registers itself under the names the plugin declares. Needs no Node:
``ui/scripts/source-hash.mjs`` records the sources' SHA-256 next to the bundle at each
``npm run build`` (``make ui``), and this module computes the same hash in Python."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from airflow_keyset_provider.plugins import keyset

REPO = Path(__file__).resolve().parents[2]
UI = REPO / "ui"
BUNDLE_DIR = REPO / "airflow_keyset_provider" / "plugins" / "static" / "ui"
#: What source-hash.mjs hashes besides everything under ui/src (keep the two lists equal).
TOP = ("package.json", "package-lock.json", "vite.config.js", "scripts/source-hash.mjs")


def source_hash(ui: Path = UI) -> str:
    """SHA-256 over ``<relative path>\\0<bytes>\\0`` of each source, in sorted path order."""
    files = sorted(
        [*TOP, *(p.relative_to(ui).as_posix() for p in (ui / "src").rglob("*") if p.is_file())]
    )
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0" + (ui / rel).read_bytes() + b"\0")
    return h.hexdigest()


def test_the_committed_bundle_is_built_from_the_committed_sources() -> None:
    recorded = (BUNDLE_DIR / "SOURCE_SHA256").read_text().strip()
    assert recorded == source_hash(), (
        "ui/ changed since the bundle was built: run `make ui` and commit "
        "airflow_keyset_provider/plugins/static/ui/"
    )
    assert (BUNDLE_DIR / keyset.BUNDLE_FILE).stat().st_size > 5_000
    assert keyset.BUNDLE_URL.endswith(f"?v={recorded[:12]}")


def test_the_hash_sees_a_changed_source(tmp_path: Path) -> None:
    """The check can fail: one changed byte under src/ is another hash."""
    copy = tmp_path / "ui"
    for rel in [
        *TOP,
        *(p.relative_to(UI).as_posix() for p in (UI / "src").rglob("*") if p.is_file()),
    ]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((UI / rel).read_bytes())
    assert source_hash(copy) == source_hash()
    main = copy / "src" / "main.jsx"
    main.write_text(main.read_text() + "\n")
    assert source_hash(copy) != source_hash()


def test_the_bundle_registers_every_react_app_name_the_plugin_declares() -> None:
    """Airflow renders ``globalThis[<app name>]``: each declared app's name is one the bundle
    registers itself under (``APP_NAMES`` in ui/src/main.jsx), and they share one bundle URL."""
    main = (UI / "src" / "main.jsx").read_text()
    names = re.search(r"APP_NAMES = \[(.*?)\]", main, re.S)
    assert names is not None
    in_bundle = tuple(re.findall(r'"([^"]+)"', names.group(1)))
    apps = keyset.KeysetPlugin.react_apps
    assert tuple(a["name"] for a in apps) == in_bundle == keyset.REACT_APP_NAMES
    assert {a["bundle_url"] for a in apps} == {keyset.BUNDLE_URL}
    js = (BUNDLE_DIR / keyset.BUNDLE_FILE).read_text()
    assert all(f"`{n}`" in js or f'"{n}"' in js for n in in_bundle)
