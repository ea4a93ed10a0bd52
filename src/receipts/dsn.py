"""Connection strings (libpq DSNs): checked, masked and read without connecting.

The ground floor under :mod:`receipts.settings`, :mod:`receipts.db`,
:mod:`receipts.logs` and :mod:`receipts.migrate`: plain functions over a DSN's
text, needing only psycopg's conninfo parser (libpq's own rules), no
pydantic, so anything that handles a DSN (a log line, an error, the enqueue
API's base install) can use them without the settings model.

A DSN's password reaches a log line or an error only through
:func:`redact_dsn` (free text that may hold a DSN) or :func:`safe_dsn` (a
DSN, parsed); neither ever returns a fragment of the password.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from receipts.statements import DEFAULT_SCHEMA

MASK = "***"


# URI userinfo: the password runs to the *last* '@' before the path, so an
# unencoded '@' inside a password is masked whole. Key/value: a quoted value
# (even one missing its closing quote) or a bare word, after "password="
# wherever it stands, also glued to what precedes it: a DSN missing the space
# between two pairs ("host=h1password=x") reaches libpq as one host name, and
# its errors quote that name whole.
_DSN_PASSWORD_URI = re.compile(
    r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^/\s]*)@", re.I
)
_DSN_PASSWORD_KV = re.compile(
    r"(?P<head>password\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*(?:'|$)|\S+)", re.I
)


def redact_dsn(text: str) -> str:
    """Return *text* with every DSN password replaced by ``***``.

    Handles both URI (``postgresql://user:secret@host/db``) and key/value
    (``host=h password=secret``) forms; text without a password is returned
    unchanged. Use it on anything that might contain a DSN before logging it.
    """
    text = _DSN_PASSWORD_URI.sub(lambda m: m.group("head") + "***@", text)
    return _DSN_PASSWORD_KV.sub(lambda m: m.group("head") + "***", text)


def check_dsn(dsn: str) -> None:
    """Raise ``ValueError`` when libpq would not accept *dsn* (URI or key/value).

    Parsed by psycopg's conninfo (libpq's own parser), so every form libpq
    accepts passes, multi-host failover URIs with ``target_session_attrs``
    included. The message never contains the DSN or any part of it.
    """
    if not dsn.strip():
        raise ValueError("is empty")
    if is_uri(dsn):
        authority = dsn.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        if authority.count("@") > 1:  # libpq would read the rest as a host name
            raise ValueError("has an unencoded '@' in its user or password (write it as %40)")
    try:
        info = conninfo_to_dict(dsn)
    except Exception:  # psycopg.ProgrammingError; its message may quote the DSN
        raise ValueError(
            "is not a valid libpq connection string (postgresql://… URI or key=value pairs)"
        ) from None
    if not is_uri(dsn):
        glued = _glued_pair()
        for key in (*_GLUED_KEYS, *_DSN_CHOICES):
            text = str(info.get(key) or "")
            if glued.search(text) and not re.search(rf"(?:^|\s){key}\s*=\s*'", dsn):
                # "host=h port=1password=x" parses as one value holding the next pairs:
                # a missing space, whose errors would quote the password in the value.
                # A quoted value may hold anything ("user='CN=app'").
                raise ValueError(f"has {key}=… holding another key=value pair (a missing "
                                 "space between two pairs?)")
    for port in str(info.get("port") or "").split(","):
        if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65_536):
            raise ValueError("has an invalid port (a number from 1 to 65535 for each host)")
    for key, allowed in _DSN_CHOICES.items():
        value = info.get(key)
        if value is not None and str(value) not in allowed:
            # libpq would refuse it only when connecting; the value is not a secret.
            raise ValueError(f"has an invalid {key} {str(value)[:40]!r} "
                             f"(one of: {', '.join(allowed)})")


#: Key/value keywords whose unquoted value holding "<libpq keyword>=" swallowed the pairs
#: after it (a missing space); the choice keywords (_DSN_CHOICES) are checked too. Not
#: password or options, where "=" is ordinary.
_GLUED_KEYS = ("host", "hostaddr", "port", "user", "dbname")
#: libpq's keywords when its own list cannot be read (PQconndefaults).
_LIBPQ_KEYWORDS = (
    "service", "user", "password", "passfile", "channel_binding", "connect_timeout", "dbname",
    "host", "hostaddr", "port", "client_encoding", "options", "application_name",
    "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
    "keepalives_count", "tcp_user_timeout", "sslmode", "sslcompression", "sslcert", "sslkey",
    "sslpassword", "sslrootcert", "sslcrl", "sslcrldir", "sslsni", "requirepeer",
    "require_auth", "ssl_min_protocol_version", "ssl_max_protocol_version", "gssencmode",
    "krbsrvname", "gsslib", "gssdelegation", "replication", "target_session_attrs",
    "load_balance_hosts",
)
_glued: re.Pattern[str] | None = None


def _glued_pair() -> re.Pattern[str]:
    """"<a libpq keyword>=" anywhere (libpq's own list, read once)."""
    global _glued
    if _glued is None:
        try:
            from psycopg import pq

            words = {d.keyword.decode() for d in pq.Conninfo.get_defaults()}
        except Exception:  # no libpq to ask: the list above
            words = set(_LIBPQ_KEYWORDS)
        alternatives = "|".join(sorted(map(re.escape, words), key=len, reverse=True))
        _glued = re.compile(rf"(?:{alternatives})\s*=", re.I)
    return _glued


def is_uri(dsn: str) -> bool:
    """Whether libpq reads *dsn* as a URI (``postgresql://`` or ``postgres://``) rather
    than key/value pairs, whatever "://" a value may hold."""
    return dsn.lstrip().lower().startswith(("postgresql://", "postgres://"))


#: Keywords whose values libpq checks only when it connects (libpq's
#: documentation, "Parameter Key Words"): checked here so a typo is bad
#: usage (exit 2) at start, not a connection error later.
_DSN_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby",
                             "prefer-standby"),
    "gssencmode": ("disable", "prefer", "require"),
    "load_balance_hosts": ("disable", "random"),
}


def schema_for(dsn: str) -> str:
    """The schema of the receipts tables when ``RECEIPTS_DATABASE_SCHEMA`` is unset.

    The first schema of a ``search_path`` that the DSN's own ``options`` set
    (``options=-c search_path=shop,public`` → ``shop``; ``"$user"`` is
    skipped), else ``public``. It is decided from the configuration, never
    from a session: a pooled server connection may carry another client's
    ``SET search_path``. Returns a lower-case name; an ``options`` value that
    cannot be parsed gives ``public``.
    """
    try:
        options = conninfo_to_dict(dsn).get("options") or ""
    except Exception:  # check_dsn reports a bad DSN; here it counts as no search_path
        return DEFAULT_SCHEMA
    found = re.search(r"(?:-c\s*|--)search_path\s*=\s*((?:\\\s|[^\s])+)", str(options))
    if not found:
        return DEFAULT_SCHEMA
    for part in found.group(1).replace("\\ ", " ").split(","):
        name = part.strip()
        if name and name != '"$user"' and name != "$user":
            return name[1:-1] if name.startswith('"') and name.endswith('"') else name.lower()
    return DEFAULT_SCHEMA


def safe_dsn(dsn: str) -> str:
    """*dsn* as key=value pairs without its password, for logs and messages.

    Parsed, not pattern-matched: a password with spaces, quotes, ``@`` or
    ``%`` cannot leak a fragment. An unparsable DSN becomes ``<invalid DSN>``.
    """
    try:
        info = conninfo_to_dict(dsn)
    except Exception:
        return "<invalid DSN>"
    if info.pop("password", None) is not None:
        info["password"] = MASK
    return make_conninfo("", **info)


def dsn_password(dsn: str) -> str | None:
    """The password inside *dsn* as libpq reads it (decoded), or None."""
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:
        return None
    return str(password) if password else None


def dsn_secrets(dsn: str) -> list[str]:
    """The spellings of *dsn*'s password that may reach a message, for log masking.

    The password as libpq decodes it and, for a URI, as written
    (percent-encoded); empty ones left out, ``[]`` for a DSN that cannot be
    parsed (the settings refuse those). Never log the result.
    """
    found: list[str] = []
    try:
        found.append(str(conninfo_to_dict(dsn).get("password") or ""))
        if is_uri(dsn):
            found.append(urlsplit(dsn).password or "")
    except Exception:  # psycopg.ProgrammingError, or urlsplit's ValueError
        pass
    return [s for s in found if s]
