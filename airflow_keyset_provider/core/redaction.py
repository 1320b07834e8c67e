"""One redaction for every URL or DSN the provider prints, raises or logs.

Every place that names a Redis or database URL in a message (the CLI, the engine's errors, the
page, the logs) renders it with :func:`redact_url` and never echoes the error a parser raised
about it (:func:`url_error`). What is hidden:

- the userinfo's password (``scheme://user:***@host``; a userinfo without ``:`` is hidden whole,
  some services put a token there);
- every query-string value but those of :data:`SAFE_QUERY_PARAMS` (``?password=``,
  ``?sslpassword=``, ``?token=``... whatever the name);
- everything after a ``#`` (a URL's fragment: in a DSN it is a password with an unencoded ``#``);
- an unparsable URL entirely: ``<unparsable URL, not shown>`` (a parser's own message may quote
  a piece of the password: redis-py's ``Port could not be cast to integer value as 'hunt'`` for
  ``redis://:hunt#er@host``).

The userinfo is taken up to the *last* ``@`` of the URL, so a password with an unencoded ``@``,
``/``, ``?`` or ``#`` is hidden too (at the price of hiding more than the password when an ``@``
stands in the path or the query). ``sqlalchemy.URL`` objects are rendered through the same
function. :func:`scrub` redacts every URL-shaped word of a free text (an exception's message).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote

#: Query parameters whose values are shown (settings, never credentials).
SAFE_QUERY_PARAMS = frozenset(
    {
        "db",
        "sslmode",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "connect_timeout",
        "socket_timeout",
        "socket_connect_timeout",
        "health_check_interval",
        "protocol",
        "charset",
        "decode_responses",
        "client_name",
        "application_name",
        "options",
        "target_session_attrs",
    }
)
HIDDEN = "***"
UNPARSABLE = "<unparsable URL, not shown>"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*\Z")
#: A URL-shaped word in free text (``scheme://`` up to the next blank or quote).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")


def redact_url(url: Any) -> str:
    """``url`` (a string or a ``sqlalchemy.URL``) with its secrets hidden (module docstring)."""
    text = _as_text(url)
    if text is None:
        return UNPARSABLE
    scheme, sep, rest = text.partition("://")
    if not sep or not _SCHEME.match(scheme):
        return UNPARSABLE
    rest, hash_sign, _fragment = _split_fragment(rest)
    userinfo, at, location = rest.rpartition("@")
    shown_user = ""
    if at:
        user, colon, _password = userinfo.partition(":")
        shown_user = f"{user}:{HIDDEN}@" if colon and _plain(user) else f"{HIDDEN}@"
    path, question, query = location.partition("?")
    out = f"{scheme}://{shown_user}{path}"
    if question:
        out += "?" + _redact_query(query)
    return out + (f"#{HIDDEN}" if hash_sign else "")


def _as_text(url: Any) -> str | None:
    if isinstance(url, str):
        return url
    render = getattr(url, "render_as_string", None)  # sqlalchemy.URL
    if callable(render):
        try:
            return str(render(hide_password=True))
        except Exception:
            return None
    return None


def _split_fragment(rest: str) -> tuple[str, str, str]:
    """Everything before the first ``#`` that is not inside the userinfo (``#`` before the last
    ``@`` belongs to a password), the ``#`` and the rest."""
    at = rest.rfind("@")
    hash_at = rest.find("#", at + 1)
    if hash_at < 0:
        return rest, "", ""
    return rest[:hash_at], "#", rest[hash_at + 1 :]


def _plain(user: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_.\-%]{0,128}", user))


def _redact_query(query: str) -> str:
    parts = []
    for piece in query.split("&"):
        name, eq, _value = piece.partition("=")
        if not eq:
            parts.append(piece if _plain(name) else HIDDEN)
        elif unquote(name).lower() in SAFE_QUERY_PARAMS:
            parts.append(piece if _plain(_value) else f"{name}={HIDDEN}")
        else:
            parts.append(f"{name if _plain(name) else HIDDEN}={HIDDEN}")
    return "&".join(parts)


def secrets_of(url: Any) -> list[str]:
    """The secret pieces of ``url`` (password, its pieces around URL delimiters, hidden query
    values, fragment), longest first: what :func:`scrub` removes from a text about ``url``."""
    if isinstance(url, str):
        text = url
    else:
        try:
            text = str(url.render_as_string(hide_password=False))  # sqlalchemy.URL
        except Exception:
            return []
    _scheme, _sep, rest = text.partition("://")
    found: set[str] = set()
    userinfo, at, location = rest.rpartition("@")
    if at:
        _user, colon, password = userinfo.partition(":")
        secret = password if colon else userinfo
        found.update({secret, unquote(secret)})
        found.update(re.split(r"[#/?@:&=]", secret))
    location, hash_sign, fragment = location.partition("#")
    if hash_sign:
        found.add(fragment)
    _path, _q, query = location.partition("?")
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name.lower() not in SAFE_QUERY_PARAMS:
            found.update({value, *re.split(r"[#/?@:&=]", value)})
    return sorted((s for s in found if len(s) >= 3), key=len, reverse=True)


def scrub(text: str, *urls: Any) -> str:
    """``text`` with every URL-shaped word redacted and every secret piece of ``urls`` (the
    URLs the text may be about) replaced by ``***``."""
    out = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    for url in urls:
        for secret in secrets_of(url):
            out = out.replace(secret, HIDDEN)
    return out


def url_error(what: str, url: Any, exc: BaseException) -> str:
    """The message for a URL that could not be used: what it is, the redacted URL, the error's
    type and, for an error that is not about parsing the URL, its text scrubbed of the URL's
    secrets. A parser's message is never echoed (it may quote a piece of the password)."""
    shown = redact_url(url)
    if type(exc).__name__ == "NoSuchModuleError":
        scheme = shown.partition("://")[0] if shown != UNPARSABLE else "?"
        reason = f"no installed SQLAlchemy dialect or driver for {scheme!r}"
    elif isinstance(exc, ValueError) or type(exc).__name__ == "ArgumentError":
        shown = UNPARSABLE  # never echoed: what did not parse may be a piece of the password
        reason = (
            "it could not be parsed (check the port, and percent-encode '@', ':', '/', '?' "
            "and '#' in the user name and the password)"
        )
    else:
        reason = f"{type(exc).__name__}: {scrub(str(exc), url)}"
    return f"{what} {shown} is not usable: {reason}"


__all__ = ["HIDDEN", "UNPARSABLE", "redact_url", "scrub", "secrets_of", "url_error"]
