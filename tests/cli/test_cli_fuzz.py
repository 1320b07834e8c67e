"""The CLI's arguments, fuzzed (Hypothesis; issue 28, item 7): whatever the arguments, every
command answers with an exit code of ``EXIT_CODES`` (or argparse's 2), one line on stderr, no
traceback, no secret of the Redis URL and no row value, against a real round in real Redis.

Each example is a command and a list of arguments drawn from names that are valid, names with
a trailing newline, a key separator, a glob or a brace, random text, and each option with a
valid or a junk value. ``replay-dead-letters`` is not fuzzed here (it imports the module named
by ``--processor``; its arguments are checked in tests/cli/test_cli_replay_watch.py), and
``--watch`` always ends with ``--count 1`` (it would refresh until Ctrl-C). Examples per run:
``KEYSET_FUZZ_EXAMPLES`` (default 300: the short mode CI runs, ~10 s here)."""

from __future__ import annotations

import io
import os
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.cli import EXIT_CODES, main

EXAMPLES = int(os.environ.get("KEYSET_FUZZ_EXAMPLES", "300"))
SECRET = "Fuzz3dS3cret"
COMMANDS = ["status", "ranges", "dead-letters", "reset-round", "pause", "resume", "throttle"]
ROW_VALUES = ["e37", "e74"]  # payloads of dead-lettered rows (cli_support.make_events)

names = st.one_of(
    st.sampled_from(["events-nightly", "r1", "r2", "r0", "r1:range:0", "events-nightly\n"]),
    st.sampled_from(["r1\n", "ks\n", "*", "{x}", "a:b", "-x", "--", "", " ", "\x00", "é"]),
    st.text(max_size=12),
)
numbers = st.one_of(
    st.sampled_from(["0", "1", "3", "-1", "nan", "inf", "-inf", "1e400", "0.001", "x", ""]),
    st.integers(-5, 10**12).map(str),
    st.text(max_size=6).filter(lambda s: not s.strip().lstrip("-").replace(".", "").isdigit()),
)
options = st.one_of(
    st.tuples(st.sampled_from(["--round", "--by", "--reason"]), names),
    st.tuples(st.sampled_from(["--range", "--limit", "--count", "--max-rows-per-second"]), numbers),
    st.tuples(st.just("--sample"), st.sampled_from(["0", "0.001", "-1", "nan", "x"])),
    st.tuples(
        st.sampled_from(["--json", "--check", "--yes", "--force", "--off", "--until-closed"])
    ),
    st.tuples(st.just("--key-prefix"), names),
    st.tuples(
        st.just("--watch"), st.sampled_from(["0.001", "-1", "x"]), st.just("--count"), st.just("1")
    ),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# found by the fuzz in a CI run: after `--`, argparse echoed the Redis URL with its password in
# "unrecognized arguments: ..."
@example(command="status", positional=["events-nightly", "--"], opts=[])
@given(
    command=st.sampled_from(COMMANDS),
    positional=st.lists(names, max_size=3),
    opts=st.lists(options, max_size=4),
)
def test_no_argument_gives_a_traceback_a_secret_or_a_row_value(
    sqlite_round: Any, command: str, positional: list[str], opts: list[tuple[str, ...]]
) -> None:
    redis_url = f"{sqlite_round.redis_url.rstrip('/')}?password={SECRET}"
    argv = [command, *positional, *[a for o in opts for a in o]]
    argv += ["--redis-url", redis_url, "--key-prefix", sqlite_round.key_prefix]
    if any(o[0] == "--key-prefix" for o in opts):
        argv = argv[:-2]  # the fuzzed prefix is the one used
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    text = out.getvalue() + err.getvalue()
    assert code in EXIT_CODES or code == 2, (argv, code, text)
    assert "Traceback" not in text and "unexpected " not in err.getvalue(), (argv, text)
    assert SECRET not in text, (argv, text)
    assert not any(v in text for v in ROW_VALUES), (argv, text)
    if code not in (0, 3):
        assert err.getvalue().strip(), (argv, code)
