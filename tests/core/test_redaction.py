"""One redaction for every URL the provider prints, raises or logs (issue 28, item 1).

Each URL carries a secret in one position (userinfo password, ``?password=``, a PostgreSQL
``sslpassword``, a password with an unencoded ``#``, a token as the user name, an unparsable
port); each is fed to every path that can print it: the CLI (stdout and stderr, against the
real Redis or a closed port), the engine's errors (Redis, source, target, checkpoint mirror),
the page's error mapping (``plugins/app.py``'s ``_read``) and the log records of all of them.
No secret may come out of any of them."""

from __future__ import annotations

import io
import logging
import socket
import traceback

import pytest
import redis
import sqlalchemy as sa

from airflow_keyset_provider.cli import main
from airflow_keyset_provider.core.errors import ConfigurationError
from airflow_keyset_provider.core.redaction import UNPARSABLE, redact_url, scrub
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror
from airflow_keyset_provider.core.sql.source import make_engine
from airflow_keyset_provider.core.sql.target import make_target_engine
from airflow_keyset_provider.core.store.server import connect_redis

SECRET = "Hunt3rZ"  # every URL below carries it (or a piece of it) somewhere


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_urls(host: str, port: int) -> dict[str, str]:
    return {
        "userinfo": f"redis://bob:{SECRET}@{host}:{port}/15",
        "query": f"redis://{host}:{port}/15?password={SECRET}",
        "query-encoded-name": f"redis://{host}:{port}/15?pass%77ord={SECRET}",
        "token-as-user": f"redis://{SECRET}@{host}:{port}/15",
        "hash-in-password": f"redis://:{SECRET[:4]}#{SECRET[4:]}@{host}:{port}/15",
        "at-in-password": f"redis://bob:{SECRET}@x@{host}:{port}/15",
        "bad-port": f"redis://bob:{SECRET}@{host}:{SECRET}/15",
    }


def sql_urls() -> dict[str, str]:
    return {
        "userinfo": f"postgresql+psycopg2://bob:{SECRET}@127.0.0.1:1/test",
        "sslpassword": f"postgresql+psycopg://bob@127.0.0.1:1/test?sslpassword={SECRET}",
        "hash-in-password": f"postgresql+psycopg2://bob:{SECRET[:4]}#{SECRET[4:]}@127.0.0.1:1/t",
        "unknown-driver": f"nosuchdb+x://bob:{SECRET}@h/db",
        "unparsable": f"not a url {SECRET}",
    }


def _pieces() -> list[str]:
    return [SECRET, SECRET[:4], SECRET[4:]]


def _assert_clean(*texts: str) -> None:
    for text in texts:
        for piece in _pieces():
            assert piece not in text, f"{piece!r} leaked in {text!r}"


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter()
    out = []
    for record in caplog.records:
        out.append(record.getMessage())
        if record.exc_info:
            out.append(formatter.formatException(record.exc_info))
    return "\n".join(out)


@pytest.mark.parametrize("reachable", [True, False], ids=["real-redis", "closed-port"])
@pytest.mark.parametrize("command", [["status"], ["ranges", "s1", "r1"], ["pause", "s1"]])
def test_the_cli_never_prints_a_redis_secret(
    reachable: bool, command: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = 6379 if reachable else _closed_port()
    for position, url in redis_urls("127.0.0.1", port).items():
        out, err = io.StringIO(), io.StringIO()
        code = main(
            [*command, "--redis-url", url, "-v", "--key-prefix", "kstrust"], stdout=out, stderr=err
        )
        _assert_clean(out.getvalue(), err.getvalue())
        assert code != 0 or position in {"query", "query-encoded-name"}, (position, err.getvalue())
        if code:
            assert err.getvalue().startswith("airflow-keyset: "), err.getvalue()
            assert "Traceback" not in err.getvalue()
    _assert_clean(_log_text(caplog))


def test_the_engine_s_errors_never_carry_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    messages = []
    for url in redis_urls("127.0.0.1", _closed_port()).values():
        try:
            client = connect_redis(url)
            client.ping()
        except (ConfigurationError, redis.RedisError) as exc:
            messages.append("".join(traceback.format_exception(exc)))  # with its causes
    for url in sql_urls().values():
        for make in (make_engine, make_target_engine, CheckpointMirror):
            try:
                made = make(url)
                engine = made.engine if isinstance(made, CheckpointMirror) else made
                engine.dispose()
            except ConfigurationError as exc:
                messages.append("".join(traceback.format_exception(exc)))
    assert len(messages) >= 10, messages  # the malformed ones were refused, each with a message
    assert any("could not be parsed" in m for m in messages)
    _assert_clean(*messages, _log_text(caplog))


def test_the_page_s_errors_never_carry_a_secret() -> None:
    pytest.importorskip("airflow.api_fastapi")
    from fastapi import HTTPException

    from airflow_keyset_provider.plugins import app

    for url in [*redis_urls("h", 1).values(), *sql_urls().values()]:
        for exc in (
            ConfigurationError(f"connection is not usable: {url}"),
            redis.ConnectionError(f"Error connecting to {url}"),
        ):

            def fail(*_args: object, _exc: Exception = exc) -> None:
                raise _exc

            with pytest.raises(HTTPException) as raised:
                app._read(fail)
            _assert_clean(str(raised.value.detail))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://bob:pw@h:1/0", "redis://bob:***@h:1/0"),
        ("redis://h:1/0?password=pw&db=2", "redis://h:1/0?password=***&db=2"),
        ("redis://:a#b@h:1/0", "redis://:***@h:1/0"),
        ("redis://h:1/0#frag", "redis://h:1/0#***"),
        ("rediss://tok@h:1", "rediss://***@h:1"),
        ("unix:///tmp/r.sock?password=pw", "unix:///tmp/r.sock?password=***"),
        ("postgresql://u:pw@h/db?sslmode=require", "postgresql://u:***@h/db?sslmode=require"),
        ("h:6379", UNPARSABLE),
        ("", UNPARSABLE),
        (None, UNPARSABLE),
    ],
)
def test_redact_url_hides_each_position(url: object, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_sqlalchemy_url_object_is_redacted_too() -> None:
    url = sa.make_url(f"postgresql://u:{SECRET}@h/db?password={SECRET}")
    assert SECRET not in redact_url(url)
    assert scrub(f"failed: {SECRET}", url) == "failed: ***"
