"""Provider metadata: the ``[keyset]`` config section and the UI plugin are declared, valid against
Airflow's own schema, match what the code reads, and show through the real ``airflow`` CLI.

Before, ``get_provider_info()`` declared neither: ``airflow config get-value keyset redis_conn_id``
failed ("section/key [keyset/redis_conn_id] not found in config") and ``airflow config list`` knew
no ``[keyset]`` defaults, although the UI plugin reads both options.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema

from airflow_keyset_provider.get_provider_info import get_provider_info

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_keyset_provider"
PROVIDER = "airflow-keyset-provider"
CLI_TIMEOUT_S = 120
# conf.get("keyset", "opt", ...) / conf.getint(CONFIG_SECTION, "opt", ...) anywhere in the package
CONF_READ = re.compile(
    r"conf\.get\w*\(\s*(?:\"keyset\"|'keyset'|CONFIG_SECTION)\s*,\s*[\"'](\w+)[\"']"
)


def _airflow(*args: str, env: dict[str, str] | None = None) -> str:
    """Run the real ``airflow`` CLI (this venv's) on the throwaway AIRFLOW_HOME of the conftest."""
    airflow_bin = Path(sys.executable).with_name("airflow")
    cmd = [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__KEYSET__")}
    proc = subprocess.run(
        [*cmd, *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"airflow {' '.join(args)}: {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
    return proc.stdout


def _json_of(output: str) -> object:
    """The JSON document in a CLI output (Airflow may print warnings before it)."""
    start = min(i for i in (output.find("["), output.find("{")) if i >= 0)
    return json.loads(output[start:])


def test_provider_info_is_valid_and_declares_what_the_code_reads() -> None:
    info = get_provider_info()
    schema = json.loads((resources.files("airflow") / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)

    assert info["plugins"] == [
        {"name": "keyset", "plugin-class": "airflow_keyset_provider.plugins.keyset.KeysetPlugin"}
    ]
    from airflow_keyset_provider.plugins.keyset import KeysetPlugin

    assert KeysetPlugin.name == "keyset"

    options = info["config"]["keyset"]["options"]
    read = {
        m.group(1) for path in PACKAGE.rglob("*.py") for m in CONF_READ.finditer(path.read_text())
    }
    assert read, "no [keyset] option read found: is the pattern stale?"
    assert set(options) == read, f"declared {sorted(options)}, read by the code {sorted(read)}"
    for name, option in options.items():
        for field in ("description", "type", "example", "default", "version_added"):
            assert option[field], f"[keyset] {name}: empty {field}"
        assert option["version_added"] in info["versions"]

    # The declared defaults are the ones the code falls back to.
    from airflow_keyset_provider.plugins import app

    assert options["redis_conn_id"]["default"] == app.DEFAULT_REDIS_CONN_ID
    assert options["key_prefix"]["default"] == app.DEFAULT_KEY_PREFIX


def test_airflow_cli_shows_the_config_section_and_the_provider() -> None:
    options = get_provider_info()["config"]["keyset"]["options"]

    listing = _airflow(
        "config",
        "list",
        "--section",
        "keyset",
        "--show-values",
        "--include-descriptions",
        "--include-examples",
    )
    assert "[keyset]" in listing, listing
    for name, option in options.items():
        assert f"\n{name} = {option['default']}\n" in listing, listing
        assert f"Example: {name} = {option['example']}" in listing, listing
        assert option["description"] in listing, listing

    assert _airflow("config", "get-value", "keyset", "redis_conn_id").strip() == "redis_default"
    # The option is the one the environment sets, as for any Airflow option.
    overridden = _airflow(
        "config",
        "get-value",
        "keyset",
        "key_prefix",
        env={"AIRFLOW__KEYSET__KEY_PREFIX": "from-env"},
    )
    assert overridden.strip() == "from-env"

    full = _json_of(_airflow("providers", "get", PROVIDER, "--full", "-o", "json"))
    assert isinstance(full, list) and len(full) == 1, full
    provider = full[0]
    assert provider["package-name"] == PROVIDER
    assert provider["plugins"] == get_provider_info()["plugins"]
    assert set(provider["config"]["keyset"]["options"]) == set(options)


def _plugin_import_errors(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Plugin names and plugin import errors as Airflow's own plugins manager sees them."""
    code = (
        "import json; from airflow import plugins_manager as pm; "
        "plugins, errors = pm._get_plugins(); "
        "print(json.dumps([[p.name for p in plugins], errors]))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__CORE__LAZY")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names, errors = json.loads(proc.stdout.strip().splitlines()[-1])
    return names, errors


def test_plugin_loads_once_with_lazy_and_with_eager_provider_discovery() -> None:
    """Scenario: the plugin is both an ``airflow.plugins`` entry point (what loads it by default,
    with lazy provider discovery) and listed in ``get_provider_info`` (what ``airflow providers
    get`` shows, and what eager discovery loads). Loaded both ways, Airflow recorded "Plugin
    'keyset' already registered, skipping" as a plugin import error; now each mode loads it once."""
    for lazy in ("True", "False"):
        names, errors = _plugin_import_errors({"AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": lazy})
        assert names.count("keyset") == 1, (lazy, names)
        assert not [e for e in errors.values() if "keyset" in e], (lazy, errors)
