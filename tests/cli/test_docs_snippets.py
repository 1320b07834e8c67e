"""The docs tell the truth: their code is code the tests run, their commands parse, their error
texts are the errors' real texts, and the operator reference matches the operators.

- Every ```python block in ``docs/*.md`` that starts with ``# snippet: <file>`` must equal that
  file (``docs/snippets/<file>``, else ``<repo>/<file>``, e.g. ``dags/...``). Refresh the blocks
  after editing a file with ``python tests/cli/test_docs_snippets.py --write``.
- Every file in ``docs/snippets/`` is shown in the docs and executed below against real services.
- Every ``$ airflow-keyset ...`` line in a console block parses with the CLI's parser.

Servers: the suite's PostgreSQL and Redis, plus (started here, stopped after) a TLS + password
Redis and a three-node Redis Cluster, both from the system ``redis-server``.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from cli_support import make_events

from airflow_keyset_provider.cli import main

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SNIPPETS = DOCS / "snippets"
SNIPPET_RE = re.compile(r"```python\n# snippet: (?P<path>\S+)\n(?P<body>.*?)```", re.S)
CONSOLE_RE = re.compile(r"```console\n(?P<body>.*?)```", re.S)


# ------------------------------------------------------------------------------------ blocks vs files


def snippet_file(ref: str) -> Path:
    local = SNIPPETS / ref
    return local if local.exists() else REPO / ref


def snippet_blocks() -> list[tuple[Path, str, str]]:
    """(doc, referenced path, block body) for every snippet block of the docs."""
    out = []
    for doc in sorted(DOCS.glob("*.md")):
        for m in SNIPPET_RE.finditer(doc.read_text()):
            out.append((doc, m.group("path"), m.group("body")))
    return out


def sync_blocks() -> list[str]:
    """Rewrite every snippet block from its file; returns the docs changed."""
    changed = []
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text()

        def fill(m: re.Match[str]) -> str:
            body = snippet_file(m.group("path")).read_text()
            return f"```python\n# snippet: {m.group('path')}\n{body.rstrip()}\n```"

        new = SNIPPET_RE.sub(fill, text)
        if new != text:
            doc.write_text(new)
            changed.append(doc.name)
    return changed


def test_every_snippet_block_equals_its_file() -> None:
    blocks = snippet_blocks()
    assert blocks, "no snippet blocks found"
    for doc, ref, body in blocks:
        path = snippet_file(ref)
        assert path.exists(), f"{doc.name}: snippet {ref} does not exist"
        assert body.rstrip() == path.read_text().rstrip(), (
            f"{doc.name}: the block of {ref} differs from the file; run "
            "`python tests/cli/test_docs_snippets.py --write` (after checking the file is right)"
        )


def test_every_snippet_file_is_shown_and_run() -> None:
    shown = {snippet_file(ref).resolve() for _, ref, _ in snippet_blocks()}
    files = {p.resolve() for p in SNIPPETS.glob("*.py")}
    assert files - shown == set(), (
        f"snippet files no doc shows: {sorted(p.name for p in files - shown)}"
    )
    assert {p.name for p in files} == set(RUN_BY_TESTS), (
        "every snippet file needs a test that runs it"
    )
    for ref in {ref for _, ref, _ in snippet_blocks()} - {p.name for p in files}:
        assert ref in RUN_ELSEWHERE, (
            f"{ref} is shown in the docs; which test runs it? (RUN_ELSEWHERE)"
        )


def test_doc_links_point_at_existing_pages_and_anchors() -> None:
    pages = {p.name: p.read_text() for p in DOCS.glob("*.md")}

    def anchors(text: str) -> set[str]:
        out = set()
        for line in text.splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
        return out

    for name, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            page, _, anchor = target.partition("#")
            page = page or name
            if page in ("performance.md", "reliability.md") and page not in pages:
                continue  # written by other maintainers; may land later
            assert page in pages, f"{name}: link to missing page {target}"
            if anchor:
                assert anchor in anchors(pages[page]), f"{name}: link to missing anchor {target}"


PLACEHOLDERS = {"STREAM": "events-nightly", "ROUND": "r1"}


def test_console_commands_of_the_cli_parse() -> None:
    from airflow_keyset_provider.cli import build_parser

    parser = build_parser()
    seen = 0
    for doc in sorted(DOCS.glob("*.md")):
        for m in CONSOLE_RE.finditer(doc.read_text()):
            for line in m.group("body").splitlines():
                if line.startswith("$ airflow-keyset "):
                    argv = shlex.split(line[2:].split(" #")[0])[1:]
                    # placeholders stand for names the parser checks (core/names.py)
                    argv = [PLACEHOLDERS.get(a, a) for a in argv]
                    try:
                        parser.parse_args(argv)
                    except SystemExit as exc:
                        raise AssertionError(f"{doc.name}: `{line}` does not parse") from exc
                    seen += 1
    assert seen >= 10


# ------------------------------------------------------------------------------------ running the snippets

RUN_BY_TESTS = {
    "quickstart_engine.py": "test_quickstart_engine",
    "coupon_processors.py": "test_processor_unit_test_snippet_passes",
    "processor_unit_test.py": "test_processor_unit_test_snippet_passes",
    "replay_dead_letters.py": "test_replay_dead_letters_snippet",
    "chunk_size_probe.py": "test_chunk_size_probe",
    "dag_with_pool.py": "test_dag_with_pool_parses",
    "redis_tls_auth.py": "test_redis_tls_auth_snippet",
    "airflow_redis_connection.py": "test_airflow_redis_connection_snippet",
    "redis_cluster.py": "test_redis_cluster_snippet",
}
# Shown in the docs, run by other test modules.
RUN_ELSEWHERE = {
    "dags/nightly_event_redispatch.py": "tests/airflow/test_example_dags.py",
    "dags/order_timeout_cancel.py": "tests/airflow/test_example_dags.py",
    "dags/cancel_stale_orders.py": "tests/airflow/test_decorator.py and tests/scheduler/test_decorator_scheduler.py",
    "dags/downstream_on_round.py": "tests/airflow/test_downstream_example.py and "
    "tests/scheduler/test_downstream_assets.py",
    "dags/approved_order_cancellation.py": "tests/scheduler/test_approval_scheduler.py",
}


def run_snippet(name: str, env: dict[str, str], *args: str, timeout: float = 180) -> str:
    proc = subprocess.run(
        [sys.executable, str(SNIPPETS / name), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SNIPPETS), **env},
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def snippet_env(pg_schema_url: str, redis_url: str, key_prefix: str) -> dict[str, str]:
    return {
        "KEYSET_SOURCE_URL": pg_schema_url,
        "KEYSET_REDIS_URL": redis_url,
        "KEYSET_KEY_PREFIX": key_prefix,
    }


def make_coupons(url: str) -> None:
    """200 coupons: odd ids ACTIVE, even ids EXPIRED; ids 13 and 15 in the unknown currency XXX."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            c.exec_driver_sql(
                "CREATE TABLE coupons (id bigint PRIMARY KEY, currency text NOT NULL, "
                "status text NOT NULL)"
            )
            c.execute(
                sa.text("INSERT INTO coupons VALUES (:i, :c, :s)"),
                [
                    {
                        "i": i,
                        "c": "XXX" if i in (13, 15) else "EUR",
                        "s": "ACTIVE" if i % 2 else "EXPIRED",
                    }
                    for i in range(1, 201)
                ],
            )
    finally:
        engine.dispose()


def test_quickstart_engine(snippet_env: dict[str, str], pg_engine: sa.Engine) -> None:
    make_events(snippet_env["KEYSET_SOURCE_URL"], 400)
    with pg_engine.begin() as c:
        c.exec_driver_sql("UPDATE events SET payload = '' WHERE seq IN (7, 300)")
    out = run_snippet("quickstart_engine.py", snippet_env)
    assert "round r1: (None, 400] in 4 ranges" in out
    assert "closed r1: done 398, skipped 0, dead 2; watermark 400" in out
    with pg_engine.begin() as c:
        c.exec_driver_sql(
            "INSERT INTO events SELECT seq + 400, payload FROM events WHERE seq <= 50"
        )
    out = run_snippet("quickstart_engine.py", snippet_env)
    assert (
        "round r2: (400, 450]" in out
        and "closed r2: done 49, skipped 0, dead 1; watermark 450" in out
    )


def test_processor_unit_test_snippet_passes(
    snippet_env: dict[str, str], pg_engine: sa.Engine
) -> None:
    make_coupons(snippet_env["KEYSET_SOURCE_URL"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(SNIPPETS / "processor_unit_test.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(SNIPPETS),
            "-c",
            os.devnull,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SNIPPETS), **snippet_env},
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    with pg_engine.connect() as c:
        assert dict(
            c.exec_driver_sql("SELECT status, count(*) FROM coupons GROUP BY status").all()
        ) == {"EXPIRED": 198, "ACTIVE": 2}


def test_replay_dead_letters_snippet(
    snippet_env: dict[str, str], pg_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_coupons(snippet_env["KEYSET_SOURCE_URL"])
    monkeypatch.setenv("KEYSET_SOURCE_URL", snippet_env["KEYSET_SOURCE_URL"])
    monkeypatch.syspath_prepend(str(SNIPPETS))
    monkeypatch.delitem(sys.modules, "coupon_processors", raising=False)
    import coupon_processors

    from airflow_keyset_provider.core import KeysetTraversal

    t = KeysetTraversal(
        snippet_env["KEYSET_SOURCE_URL"],
        "coupons",
        "id",
        columns=["currency"],
        stream="coupons-expiry",
        redis_url=snippet_env["KEYSET_REDIS_URL"],
        key_prefix=snippet_env["KEYSET_KEY_PREFIX"],
    )
    try:
        rnd = t.plan(max_ranges=2, new_stream=True)
        for spec in rnd.ranges:
            t.traverse(
                rnd.round_id, spec.range_id, coupon_processors.expire_coupons, item_retry_delay=0.0
            )
        assert sum(r["dead"] for r in t.range_status(rnd.round_id)) == 2
    finally:
        t.close()
        coupon_processors.engine.dispose()
        sys.modules.pop("coupon_processors", None)
    with pg_engine.begin() as c:  # the fix: the currency is corrected at the source
        c.exec_driver_sql("UPDATE coupons SET currency = 'EUR' WHERE currency = 'XXX'")
    out = run_snippet("replay_dead_letters.py", {**snippet_env, "KEYSET_ROUND": "r1"})
    assert (
        "key 13: unknown currency 'XXX' (3 attempts)" in out
        and "key 15: unknown currency 'XXX'" in out
    )
    assert re.search(r"range \d: done \d+, skipped \d+, dead 0", out)
    with pg_engine.connect() as c:
        assert (
            c.exec_driver_sql("SELECT count(*) FROM coupons WHERE status = 'ACTIVE'").scalar() == 0
        )


def test_chunk_size_probe(sqlite_url: str, redis_url: str, tmp_path: Path) -> None:
    make_events(sqlite_url, 3000)
    (tmp_path / "probe_target.py").write_text("def noop(chunk):\n    return None\n")
    out = run_snippet(
        "chunk_size_probe.py",
        {"KEYSET_REDIS_URL": redis_url, "PYTHONPATH": str(tmp_path)},
        sqlite_url,
        "events",
        "seq",
        "probe_target:noop",
        "2000",
    )
    lines = out.strip().splitlines()
    assert lines[0].split() == ["chunk_size", "rows/s", "ms/chunk"]
    assert [int(line.split()[0].replace(",", "")) for line in lines[1:]] == [
        100,
        500,
        1000,
        5000,
        10000,
    ]


def _airflow_env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AIRFLOW_HOME": str(tmp),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp / 'airflow.db'}",
        "PYTHONPATH": str(SNIPPETS),
    }


def test_dag_with_pool_parses(tmp_path: Path) -> None:
    """Parses the DAG in a fresh process (no metadata database needed) and checks its wiring."""
    probe = f"""
import json, runpy
ns = runpy.run_path({str(SNIPPETS / "dag_with_pool.py")!r})
dag = ns["dag"]
t = dag.task_dict["traverse"]
b = dag.task_dict["barrier"]
print(json.dumps({{"tasks": sorted(dag.task_dict), "pool": t.partial_kwargs.get("pool"),
    "per_run": t.partial_kwargs.get("max_active_tis_per_dagrun"), "retries": t.partial_kwargs.get("retries"),
    "processor": t.partial_kwargs.get("processor"), "deferrable": b.deferrable,
    "max_dead": b.max_dead_letters, "upstream": sorted(b.upstream_task_ids)}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=_airflow_env(tmp_path),
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "tasks": ["barrier", "plan", "traverse"],
        "pool": "coupons_db_writers",
        "per_run": 4,
        "retries": 3,
        "processor": "coupon_processors:expire_coupons",
        "deferrable": True,
        "max_dead": 100,
        "upstream": ["traverse"],
    }


# ------------------------------------------------------------------------------------ throwaway Redis servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 29999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if not found:
        pytest.fail(
            "redis-server (with TLS support) is needed for the Redis TLS/Cluster docs tests; "
            "install the Debian package redis-server"
        )
    return found


@dataclass
class TlsRedis:
    url: str  # rediss://:<password>@localhost:<port>/0
    port: int
    password: str
    ca: str


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[TlsRedis]:
    """A redis-server with TLS only (no plain port) and a password; certificate by a throwaway CA."""
    server = _redis_server()
    tmp = Path(tempfile.mkdtemp(prefix="keyset-tls-redis-"))
    ssl = shutil.which("openssl")
    if not ssl:
        pytest.fail("openssl is needed to make the TLS test certificates")

    def sh(*args: str) -> None:
        subprocess.run([ssl, *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    sh(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=keyset-test-ca",
    )
    sh(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    )
    (tmp / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    sh(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )
    port, password = _free_port(), "s3cret"
    proc = subprocess.Popen(
        [
            server,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            "server.crt",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.crt",
            "--tls-auth-clients",
            "no",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
            "--logfile",
            str(tmp / "redis.log"),
        ],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://:{password}@localhost:{port}/0"
    try:
        _wait(
            lambda: redis.Redis.from_url(url, ssl_ca_certs=str(tmp / "ca.crt")).ping(),
            proc,
            tmp / "redis.log",
        )
        yield TlsRedis(url, port, password, str(tmp / "ca.crt"))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[str]:
    """Three cluster-mode masters on loopback, slots split evenly, joined with CLUSTER MEET."""
    server = _redis_server()
    tmp = Path(tempfile.mkdtemp(prefix="keyset-redis-cluster-"))
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    while len(ports) < 3:
        port = _free_cluster_port()
        if port not in ports:
            ports.append(port)
    try:
        for port in ports:
            node = tmp / str(port)
            node.mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        server,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node),
                        "--logfile",
                        str(node / "redis.log"),
                    ],
                    cwd=node,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        clients = [redis.Redis(port=p) for p in ports]
        for c, proc, port in zip(clients, procs, ports, strict=True):
            _wait(c.ping, proc, tmp / str(port) / "redis.log")
        bounds = [0, 5461, 10923, 16384]
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for p in ports[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", p)

        def ready() -> None:
            for c in clients:  # redis-py parses both replies into dicts
                assert c.execute_command("CLUSTER INFO").get("cluster_state") == "ok"
                assert len(c.execute_command("CLUSTER NODES")) == 3

        _wait(ready, procs[0], tmp / str(ports[0]) / "redis.log", timeout=60)
        for c in clients:
            c.close()
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(check: Any, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            err = log.read_text(errors="replace") if log.exists() else "(no log)"
            pytest.fail(f"redis-server exited with {proc.returncode}: {err[-2000:]}")
        try:
            check()
            return
        except (redis.RedisError, AssertionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_redis_tls_auth_snippet(tls_redis: TlsRedis, sqlite_url: str, key_prefix: str) -> None:
    make_events(sqlite_url, 50)
    env = {
        "KEYSET_REDIS_URL": tls_redis.url,
        "KEYSET_REDIS_CA": tls_redis.ca,
        "KEYSET_SOURCE_URL": sqlite_url,
        "KEYSET_KEY_PREFIX": key_prefix,
    }
    assert run_snippet("redis_tls_auth.py", env).strip() == "r1"
    wrong = {**env, "KEYSET_REDIS_URL": tls_redis.url.replace(tls_redis.password, "wrong")}
    proc = subprocess.run(
        [sys.executable, str(SNIPPETS / "redis_tls_auth.py")],
        capture_output=True,
        text=True,
        env={**os.environ, **wrong},
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "AuthenticationError" in proc.stderr
    # the CLI reads the same server with the same URL (the CA as a URL query parameter)
    out, err = io.StringIO(), io.StringIO()
    code = main(
        [
            "status",
            "events-nightly",
            "--json",
            "--key-prefix",
            key_prefix,
            "--redis-url",
            f"{tls_redis.url}?ssl_ca_certs={tls_redis.ca}&ssl_cert_reqs=required",
        ],
        stdout=out,
        stderr=err,
    )
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["open_rounds"] == ["r1"]


def test_airflow_redis_connection_snippet(
    tls_redis: TlsRedis, tmp_path: Path, sqlite_url: str, key_prefix: str
) -> None:
    """The printed connection, pointed at the test server, works for the provider's hook and the CLI."""
    out = run_snippet("airflow_redis_connection.py", {})
    exported = re.fullmatch(r"export AIRFLOW_CONN_KEYSET_REDIS='(.*)'", out.strip())
    assert exported
    conn = json.loads(exported.group(1))
    assert conn["password"] == tls_redis.password and conn["extra"]["ssl"] is True
    conn.update(host="localhost", port=tls_redis.port)
    conn["extra"]["ssl_ca_certs"] = tls_redis.ca
    env = {**_airflow_env(tmp_path), "AIRFLOW_CONN_KEYSET_REDIS": json.dumps(conn)}
    probe = (
        "from airflow_keyset_provider.hooks.keyset import KeysetHook\n"
        "print(KeysetHook(redis_conn_id='keyset_redis').redis_client().ping())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("True"), proc.stderr[-3000:]
    cli = Path(sys.executable).parent / "airflow-keyset"
    proc = subprocess.run(
        [str(cli), "status", "--redis-conn-id", "keyset_redis", "--key-prefix", key_prefix],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0 and "no streams under key prefix" in proc.stdout, proc.stderr[
        -3000:
    ]


def test_redis_cluster_snippet(redis_cluster: str, sqlite_url: str, key_prefix: str) -> None:
    make_events(sqlite_url, 120)
    env = {
        "KEYSET_CLUSTER_URL": redis_cluster,
        "KEYSET_SOURCE_URL": sqlite_url,
        "KEYSET_KEY_PREFIX": key_prefix,
    }
    out = run_snippet("redis_cluster.py", env)
    totals = ast.literal_eval(out.strip())
    assert {"watermark": 120} | totals == {
        "round_id": "r1",
        "start_key": None,
        "end_key": 120,
        "done": 120,
        "skipped": 0,
        "dead": 0,
        "watermark": 120,
    }  # watermark: newer engines
    # the CLI finds the stream with SCAN on every node of the cluster
    buf = io.StringIO()
    assert (
        main(
            [
                "status",
                "--cluster",
                "--redis-url",
                redis_cluster,
                "--key-prefix",
                key_prefix,
                "--json",
            ],
            stdout=buf,
        )
        == 0
    )
    [stream] = json.loads(buf.getvalue())["streams"]
    assert (stream["stream"], stream["watermark"]) == ("events-nightly", 120)


# ------------------------------------------------------------------------------------ operator reference

_SIGNATURES = """
import inspect, json
from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, PreviewRoundOperator, TraverseRangeOperator
out = {}
for cls in (PlanRangesOperator, PreviewRoundOperator, TraverseRangeOperator, BarrierSensor):
    params = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        params[name] = None if p.default is p.empty else repr(p.default)
    out[cls.__name__] = {"params": params, "template_fields": list(cls.template_fields)}
print(json.dumps(out))
"""


def _doc_tables() -> dict[str, list[list[str]]]:
    text = (DOCS / "operators.md").read_text()
    tables: dict[str, list[list[str]]] = {}
    for section in re.split(r"(?m)^## ", text)[1:]:
        title, _, body = section.partition("\n")
        rows = [
            [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in body.splitlines()
            if line.startswith("| `")
        ]
        tables[title.strip()] = rows
    return tables


def test_operator_reference_matches_the_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNATURES],
        capture_output=True,
        text=True,
        env=_airflow_env(tmp_path),
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = json.loads(proc.stdout.strip().splitlines()[-1])
    tables = _doc_tables()
    for cls, info in code.items():
        rows = tables[cls]
        documented = {row[0].strip("`"): row for row in rows}
        assert list(documented) == list(info["params"]), (
            f"{cls}: documented parameters differ from the signature"
        )
        for name, default in info["params"].items():
            cell = documented[name][1]
            if default is None:
                assert cell == "required", f"{cls}.{name} is required, the docs say {cell}"
            elif "default_deferrable" not in cell:
                assert cell == f"`{default}`", (
                    f"{cls}.{name}: default {default}, the docs say {cell}"
                )
            templated = documented[name][2] == "yes"
            assert templated == (name in info["template_fields"]), (
                f"{cls}.{name}: templated is {not templated}"
            )
        assert set(info["template_fields"]) <= set(documented), (
            f"{cls}: undocumented template fields"
        )


# ------------------------------------------------------------------------------------ error texts


def _trouble() -> str:
    return (DOCS / "troubleshooting.md").read_text()


def _raised(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return str(exc)
    raise AssertionError("expected an error")


def _quoted(message: str, *phrases: str) -> None:
    """Each phrase is in the real message and quoted verbatim in troubleshooting.md."""
    doc = _trouble()
    for phrase in phrases:
        assert phrase in message, f"the real message changed: {phrase!r} not in {message!r}"
        assert phrase in doc, f"troubleshooting.md does not quote {phrase!r}"


def _source_segments(path: Path) -> list[str]:
    """Constant text of every (f-)string literal, split at its placeholders."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            out.extend(
                "".join(
                    v.value if isinstance(v, ast.Constant) else "\x00" for v in node.values
                ).split("\x00")
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def _in_source(relpath: str, *phrases: str) -> None:
    """For messages of the Airflow adapters (raised in their own tests): phrase in the code and the doc."""
    segments = _source_segments(REPO / "airflow_keyset_provider" / relpath)
    doc = _trouble()
    for phrase in phrases:
        assert any(phrase in seg for seg in segments), f"{relpath} no longer says {phrase!r}"
        assert phrase in doc, f"troubleshooting.md does not quote {phrase!r}"


def test_troubleshooting_quotes_key_validation_errors(
    pg_schema_url: str, pg_engine: sa.Engine, redis_url: str, key_prefix: str
) -> None:
    from airflow_keyset_provider.core import KeysetTraversal
    from airflow_keyset_provider.core.sql.source import _BYTE_ORDER_COLLATIONS

    # A collation that does not order by code point, if the server can use one (ICU or an OS
    # locale); a server built without ICU and without locales (the embedded one) has none at all.
    with pg_engine.connect() as c:
        candidates = (
            c.execute(
                sa.text(
                    "SELECT collname FROM pg_collation WHERE collencoding IN (-1, pg_char_to_encoding('UTF8')) "
                    "AND NOT collname = ANY(:byte_order) ORDER BY collname = 'en-US-x-icu' DESC, collname"
                ),
                {"byte_order": sorted(_BYTE_ORDER_COLLATIONS | {"default"})},
            )
            .scalars()
            .all()
        )
    other = None
    for name in [*candidates, None]:
        collate = f'COLLATE "{name}"' if name else ""
        try:
            with pg_engine.begin() as c:
                c.exec_driver_sql(
                    "CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL, "
                    "created_at timestamptz, score float8 NOT NULL UNIQUE, "
                    f"name text {collate} NOT NULL UNIQUE)"
                )
        except sa.exc.DBAPIError:  # listed but unusable here (e.g. ICU in a build without ICU)
            continue
        other = name
        break
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE events_copy (seq bigint NOT NULL, payload text)")
        c.exec_driver_sql("CREATE INDEX ON events_copy (seq)")
        c.exec_driver_sql(
            "CREATE TABLE pairs (a bigint NOT NULL, b bigint NOT NULL, PRIMARY KEY (b, a))"
        )
        c.exec_driver_sql(
            "INSERT INTO events SELECT g, 'p', now(), g, 'n' || g FROM generate_series(1, 100) g"
        )

    def plan(table: str, key: Any, **kw: Any) -> str:
        t = KeysetTraversal(
            pg_schema_url, table, key, redis_url=redis_url, stream="errs", key_prefix=key_prefix
        )
        try:
            return _raised(lambda: t.plan(**kw))
        finally:
            t.close()

    _quoted(
        plan("nope", "seq"),
        "does not exist (dialect postgresql). Check the name and schema ('schema.table'), "
        "and that the connection points at the right database.",
    )
    _quoted(  # a misspelt table: the closest names of the catalog
        plan("evnets", "seq"),
        "does not exist (dialect postgresql). Did you mean '",
        "events'? Check the name and schema",
    )
    _quoted(
        plan("events", "nope"),
        "column 'nope' does not exist in '",
        "'; its columns are ['created_at', 'name', 'payload', 'score', 'seq']",
    )
    _quoted(
        plan("events", "created_at"),
        "key column 'created_at' of '",
        "' is nullable: NULL keys have no place in the order and would be skipped. Fix: ALTER TABLE ",
        " ALTER COLUMN created_at SET NOT NULL (after filling NULLs).",
    )
    _quoted(
        plan("events_copy", "seq"),
        "' has no unique index on (seq): no primary key, unique constraint or unique index "
        "covers it, so its uniqueness is not proven and two rows could share a cursor position "
        "and one would be skipped. Fix: CREATE UNIQUE INDEX ON ",
        " (seq), or add the primary key as the last key column, e.g. key=['created_at', 'id'].",
    )
    _quoted(
        plan("pairs", ["a", "b"]),
        "' starts with the key columns (a, b) in that order; every chunk would scan "
        "the table. Fix: CREATE INDEX ON ",
    )
    _quoted(
        plan("events", "score"),
        "' has type double precision, which cannot be a key: floating point: values are not "
        "exact (0.1 + 0.2 <> 0.3) and NaN sorts above every number. Fix: key by an integer or "
        "numeric/decimal column.",
    )
    collation_tail = (
        "which does not order by code point, so cursors compared in Redis would disagree with the "
        "database. Fix: ALTER TABLE "
    )
    if other:
        _quoted(
            plan("events", "name"),
            f"text key column 'name' uses collation '{other}', {collation_tail}",
            ' ALTER COLUMN name TYPE text COLLATE "C" (or page by another key).',
        )
    else:  # every collation here orders by code point: the refusal cannot happen, so check its text
        _in_source("core/sql/dialects/postgresql.py", collation_tail)
    _quoted(
        plan("events", "seq", start_key=50, end_key=10),
        "start_key 50 is above end_key 10: a round is start < key <= end",
    )
    _quoted(
        plan("events", "seq", start_key="x"), "start_key='x' (str) does not fit a int key column"
    )


def test_troubleshooting_quotes_runtime_errors(
    pg_schema_url: str, pg_engine: sa.Engine, pg_url: str, redis_url: str, key_prefix: str
) -> None:
    import threading

    import psycopg2

    from airflow_keyset_provider import ChunkResult, RetryableError
    from airflow_keyset_provider.core import KeysetTraversal

    make_events(pg_schema_url, 100)

    def traversal(**kw: Any) -> KeysetTraversal:
        return KeysetTraversal(
            pg_schema_url,
            "events",
            "seq",
            redis_url=redis_url,
            stream="events-nightly",
            key_prefix=key_prefix,
            **kw,
        )

    # commit order: a session inserts and stays idle in its transaction
    dsn = sa.make_url(pg_url)
    conn = psycopg2.connect(
        host=dsn.host, port=dsn.port, user=dsn.username, password=dsn.password, dbname=dsn.database
    )
    try:
        conn.cursor().execute("SELECT txid_current()")  # opens a transaction and keeps it open
        t = traversal(commit_wait_timeout=0.5)
        _quoted(
            _raised(lambda: t.plan(new_stream=True)),
            " transaction(s) open when the upper bound of '",
            " application_name '",
            " end it with SELECT pg_terminate_backend(",
            ". A key they hold could fall inside the round, so no round was saved. Let them "
            "finish (or terminate them), or raise commit_wait_timeout.",
        )
        t.close()
    finally:
        conn.rollback()
        conn.close()

    t = traversal()
    rnd = t.plan(max_ranges=2, new_stream=True)

    def down(chunk: Any) -> None:
        raise RetryableError("HTTP 503 from dispatch-api")

    _quoted(
        _raised(
            lambda: t.traverse(rnd.round_id, 0, down, max_chunk_attempts=2, backoff_base=0.001)
        ),
        "round r1 range 0: the processor's dependency failed ",
        " times in a row (last: RetryableError: HTTP 503 from dispatch-api); the cursor stays at ",
        ", nothing was skipped. An Airflow retry (or a new traverse) resumes from there.",
    )
    _quoted(
        _raised(lambda: t.traverse(rnd.round_id, 0, lambda chunk: {"failed": {}})),
        "processor returned dict; it must return ChunkResult or None. Nothing of round r1 range 0 was committed.",
    )
    _quoted(
        _raised(
            lambda: t.traverse(rnd.round_id, 0, lambda chunk: ChunkResult(failed={99999: "x"}))
        ),
        "ChunkResult.failed names key 99999, which is not in the chunk",
    )
    for malformed, quoted in (
        (
            ChunkResult(failed=[1]),  # type: ignore[arg-type]
            "ChunkResult.failed is list; expected a mapping {key: reason (str)}, e.g. "
            "ChunkResult(failed={key: 'why'}). Nothing of round r1 range 0 was committed.",
        ),
        (
            ChunkResult(skipped=None),  # type: ignore[arg-type]
            "ChunkResult.skipped is NoneType; expected a list, tuple or set of keys (an empty "
            "tuple for none). Nothing of round r1 range 0 was committed.",
        ),
    ):
        _quoted(_raised(lambda m=malformed: t.traverse(rnd.round_id, 0, lambda chunk: m)), quoted)

    # a live owner holds range 1
    inside, release = threading.Event(), threading.Event()
    holder = traversal()

    def block(chunk: Any) -> None:
        inside.set()
        assert release.wait(60)

    worker = threading.Thread(
        target=holder.traverse, args=(rnd.round_id, 1, block), kwargs={"lease_seconds": 60}
    )
    worker.start()
    try:
        assert inside.wait(30)
        _quoted(
            _raised(
                lambda: t.traverse(
                    rnd.round_id, 1, lambda chunk: None, claim_timeout=0.5, lease_seconds=1
                )
            ),
            "round r1 range 1 is held by live owner ",
            " (lease renewed by heartbeats); gave up after ",
            " s. If that worker is gone, its lease expires by itself; otherwise let it finish.",
        )
        _quoted(
            _raised(
                lambda: t.traverse(
                    rnd.round_id, 1, lambda chunk: None, claim_timeout=0.2, lease_seconds=100
                )
            ),
            "round r1 range 1 is still held by ",
        )
        msg = _raised(lambda: t.close_round(rnd.round_id))
        _quoted(msg, "round r1: 2 range(s) not complete: range 0 at ", "range 1 at ", " (running, ")
    finally:
        release.set()
        worker.join(60)
        holder.close()

    # fencing refusals, straight from the store
    store = t.store
    claim = store.claim(rnd.round_id, 0, "a#1", "", 60_000)
    assert not isinstance(claim, tuple)
    _quoted(
        _raised(
            lambda: store.advance(
                rnd.round_id,
                0,
                "b#2",
                claim.cursor,
                claim.cursor,
                done=0,
                skipped=0,
                lease_ms=1000,
                max_item_attempts=3,
            )
        ),
        " of round r1 (stream 'events-nightly') is now owned by ",
        "; this worker lost its lease and its advance was refused (fencing)",
    )
    store.release(rnd.round_id, 0, "a#1")
    store.claim(rnd.round_id, 0, "c#3", "", 1)
    time.sleep(0.01)  # let the 1 ms lease run out
    _quoted(
        _raised(
            lambda: store.advance(
                rnd.round_id,
                0,
                "c#3",
                claim.cursor,
                claim.cursor,
                done=0,
                skipped=0,
                lease_ms=1000,
                max_item_attempts=3,
            )
        ),
        "the lease on range ",
        " of round r1 (stream 'events-nightly') expired before the advance; refused (fencing)",
    )
    _in_source("core/run/range_run.py", "lease lost; chunk not committed")

    # lost state
    store.client.delete(store.range_key(rnd.round_id, 0))
    _quoted(
        _raised(lambda: t.traverse(rnd.round_id, 0, lambda chunk: None)),
        "range 0 of round r1 (stream 'events-nightly') has no state in Redis; it was lost, not finished. "
        "Re-plan or restore from the checkpoint mirror.",
    )
    store.client.delete(store.round_key(rnd.round_id))
    _quoted(
        _raised(lambda: t.traverse(rnd.round_id, 0, lambda chunk: None)),
        "round r1 of stream 'events-nightly' has no state in Redis (flushed, evicted or restarted without "
        "persistence). Nothing was read as complete. Re-plan the round or restore it from its checkpoint mirror "
        "(see docs/reliability.md).",
    )
    t.close()

    # a traverse with another where than the plan's
    t = traversal()
    rnd2 = t.plan(max_ranges=1, start_key=0, end_key=10)
    other = KeysetTraversal(
        pg_schema_url,
        "events",
        "seq",
        redis_url=redis_url,
        stream="events-nightly",
        key_prefix=key_prefix,
        where="payload <> ''",
    )
    _quoted(
        _raised(lambda: other.traverse(rnd2.round_id, 0, lambda chunk: None)),
        " was planned over {",
        "; traverse it with the same table, key and where",
    )
    other.close()
    t.close()

    unreachable = KeysetTraversal(
        pg_schema_url, "events", "seq", redis_url="redis://127.0.0.1:1/0", stream="x"
    )
    _quoted(
        _raised(unreachable.plan),
        "Redis is unreachable (Error 111 connecting to 127.0.0.1:",
        "); nothing was written. Check the Redis connection (host, port, password, TLS) and that the server is "
        "running.",
    )
    unreachable.close()


def test_troubleshooting_quotes_the_stream_refusals(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """``StreamStateLostError``: no state in Redis and nothing to restore it from; a round open
    when Redis lost it (``core/rounds/durability.py``)."""
    from airflow_keyset_provider.core import KeysetTraversal
    from airflow_keyset_provider.core.rounds.durability import PlannedRound, StreamRecord

    make_events(pg_schema_url, 10)
    t = KeysetTraversal(
        pg_schema_url, "events", "seq", redis_url=redis_url, stream="s", key_prefix=key_prefix
    )
    _quoted(_raised(t.plan), "has no state in Redis (no round counter, no watermark)")
    lost = StreamRecord(source="record", last_round="r1", planned=PlannedRound("r2", "", ""))
    _quoted(
        _raised(lambda: t.plan(record=lost)),
        "was open when Redis lost it",
        "Its committed cursors are gone",
    )
    t.close()


def test_troubleshooting_quotes_the_airflow_adapters() -> None:
    _in_source(
        "sensors/keyset.py",
        " is not complete after ",
        " s. Lagging ranges: ",
        ". The round stays open and the watermark did not move. Inspect the dead letters "
        "(StreamControl.dead_letters), then raise the limit and clear this task, or reset the round to "
        "traverse it again.",
    )
    _in_source(
        "hooks/keyset.py",
        " is not defined. Create it in the Airflow UI (Admin > Connections, type ",
        "; it must be of type ",
    )
    _in_source("core/run/claim.py", " s more; waiting")


if __name__ == "__main__":
    if "--write" in sys.argv:
        print("updated:", ", ".join(sync_blocks()) or "nothing")
    else:
        print(__doc__)


def test_key_types_page_lists_the_validations_own_types() -> None:
    """docs/key-types.md shows, between its markers, exactly what ``key_types.docs_table`` renders
    from the lists the plan's validation reads (regenerate: replace the block with its output)."""
    from airflow_keyset_provider.core.sql import key_types

    page = (DOCS / "key-types.md").read_text()
    begin = "<!-- key-types:begin (generated by key_types.docs_table) -->\n"
    shown = page[page.index(begin) + len(begin) : page.index("<!-- key-types:end -->")]
    assert shown == key_types.docs_table(), "docs/key-types.md differs from key_types.docs_table()"
