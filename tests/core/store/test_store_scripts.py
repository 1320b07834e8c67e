"""The Lua scripts as files (``core/store/lua/*.lua``, loaded by ``core/store/scripts.py``): each
file is one script headed by its contract, the fragments it includes are pasted in, and the
defaults the Lua side fills in are the Python side's."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest

from airflow_keyset_provider.core.store import scripts
from airflow_keyset_provider.core.store.layout import RANGE_DEFAULTS

LUA = files("airflow_keyset_provider.core.store") / "lua"
SCRIPT_FILES = sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua"))


def test_every_file_is_a_constant_and_every_constant_a_file() -> None:
    names = {n for n in scripts.__all__ if n.isupper()}
    assert {f.removesuffix(".lua").upper() for f in SCRIPT_FILES} == names


@pytest.mark.parametrize("name", SCRIPT_FILES)
def test_a_script_is_headed_by_its_contract_and_its_includes_are_pasted(name: str) -> None:
    text = getattr(scripts, name.removesuffix(".lua").upper())
    header = re.match(r"\n((?:--.*\n)+)", text)
    assert header, f"{name} does not open with a comment block"
    assert "KEYS" in header.group(1) and "Return" in header.group(1), name
    assert "--!include" not in text
    raw = (LUA / name).read_text()
    for inc in re.findall(r"^--!include (\S+)$", raw, re.MULTILINE):
        code = scripts._fragment(inc)
        assert code and not code.startswith("--"), inc
        assert code in text, f"{name}: {inc} not pasted"


def test_an_include_documents_itself_but_pastes_only_its_code() -> None:
    now = (LUA / "includes" / "now.lua").read_text()
    assert now.startswith("-- now:")
    assert scripts._fragment("now.lua") == (
        "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
    )


def test_a_missing_file_or_include_is_an_error() -> None:
    with pytest.raises(FileNotFoundError):
        scripts.load("no_such_script.lua")


def test_the_lua_defaults_are_the_python_defaults() -> None:
    text = (LUA / "includes" / "fields.lua").read_text()
    table = re.search(r"^local RANGE_DEFAULTS = \{(.*)\}$", text, re.MULTILINE)
    assert table
    lua = dict(re.findall(r"(\w+) = '([^']*)'", table.group(1)))
    assert lua == RANGE_DEFAULTS
