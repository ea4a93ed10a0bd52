"""Which egress proxy the provider's requests go through, chosen once at start.

The rule is curl's and httpx's, so an operator's usual settings work as
everywhere else:

1. ``RECEIPTS_PROVIDER_PROXY``, when set, is used for the provider whatever
   the environment says (``NO_PROXY`` included): it is this service's own
   setting for this one destination.
2. Otherwise the standard variables of the provider URL's scheme:
   ``https_proxy`` then ``HTTPS_PROXY`` for an ``https`` provider,
   ``http_proxy`` then ``HTTP_PROXY`` for ``http``, then ``all_proxy`` /
   ``ALL_PROXY``; the lower-case spelling wins when both are set, an empty
   value counts as unset.
3. ``no_proxy`` / ``NO_PROXY`` (lower case first) turns an environment proxy
   off for the provider when one of its comma-separated entries matches the
   provider's host: ``*`` (every host); a domain, with or without a leading
   ``.`` or ``*.`` (``example.com`` matches ``example.com`` and
   ``api.example.com``, not ``badexample.com``); an IP address or a CIDR
   range (``10.0.0.0/8``, ``::1``); each optionally with ``:port``, which
   then must equal the provider's port. Matching ignores case.

A proxy URL is ``http://[user:password@]host[:port]``; a value without a
scheme gets ``http://``, as httpx does (port 80 unless given). ``https://``
proxies (TLS to the proxy) and SOCKS are
refused, with the variable named: aiohttp, which carries the requests,
speaks plain HTTP to a proxy (an ``https`` provider's TLS runs end to end
through a ``CONNECT`` tunnel).

Credentials in a proxy URL are sent to the proxy only (``Proxy-Authorization:
Basic``); every text made here for logs and errors masks the password
(:func:`redact_proxy`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

#: The setting that wins over the environment.
SETTING = "RECEIPTS_PROVIDER_PROXY"
MASK = "***"


class ProxyConfigError(ValueError):
    """A proxy URL that cannot be used; the message names the variable, never the password."""


@dataclass(frozen=True, slots=True)
class ProxyChoice:
    """The proxy for the provider, or none, and why.

    Attributes:
        url: the proxy URL with its credentials (for the HTTP client only;
            never log it), or None for a direct connection.
        source: the variable it came from (``RECEIPTS_PROVIDER_PROXY``,
            ``HTTPS_PROXY``, ``https_proxy``, …), or None.
        bypassed_by: the ``NO_PROXY`` entry that turned an environment proxy
            off for the provider, or None.
    """

    url: str | None
    source: str | None = None
    bypassed_by: str | None = None

    @property
    def safe_url(self) -> str | None:
        """:attr:`url` with the password masked, for logs."""
        return redact_proxy(self.url) if self.url else None

    def describe(self) -> str:
        """One line for logs: ``http://u:***@proxy:3128 (HTTPS_PROXY)``, ``none``, or
        ``none (NO_PROXY matches .corp)``."""
        if self.url:
            return f"{self.safe_url} ({self.source})"
        if self.bypassed_by is not None:
            return f"none (NO_PROXY entry {self.bypassed_by!r} matches the provider)"
        return "none"

    def secrets(self) -> list[str]:
        """The proxy password (plain and as written), for log masking; may be empty."""
        return _passwords(self.url)


def redact_proxy(url: str) -> str:
    """*url* with the password of its userinfo replaced by ``***`` (the user kept)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, tail = rest.partition("/")
    userinfo, at, hostport = authority.rpartition("@")
    if not at:
        return url
    user = userinfo.split(":", 1)[0]
    masked = f"{user}:{MASK}" if ":" in userinfo else user
    return f"{scheme}{sep}{masked}@{hostport}{slash}{tail}"


def check_proxy_url(value: str, variable: str) -> str:
    """Return *value* as a usable proxy URL (``http://`` added when no scheme is given).

    Raises :class:`ProxyConfigError` naming *variable* for a scheme other than
    ``http``, no host, or a port that is not a number from 1 to 65535. The
    message never contains the value.
    """
    text = value.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ProxyConfigError(f"{variable}: has an invalid port (a number from 1 to 65535) "
                               "or an invalid host") from None
    if parts.scheme.lower() != "http":
        raise ProxyConfigError(
            f"{variable}: proxy scheme {parts.scheme.lower()!r} is not supported; use an "
            "http:// proxy (https providers are reached through it with CONNECT)")
    if not parts.hostname:
        raise ProxyConfigError(f"{variable}: the proxy URL has no host")
    if port == 0:
        raise ProxyConfigError(f"{variable}: has an invalid port (a number from 1 to 65535)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ProxyConfigError(f"{variable}: a proxy URL is scheme://host:port, without a path")
    return text


def choose_proxy(provider_url: str, *, setting: str | None,
                 environ: Mapping[str, str]) -> ProxyChoice:
    """The proxy for *provider_url* (module doc): *setting* first, then *environ*.

    Args:
        provider_url: the provider's ``http``/``https`` URL.
        setting: ``RECEIPTS_PROVIDER_PROXY`` (None or empty: unset).
        environ: the process environment (read once, at start).

    Raises :class:`ProxyConfigError` (naming the variable) when the proxy that
    applies is not a usable URL; a malformed variable that does not apply to
    the provider is ignored, as curl ignores it.
    """
    if setting and setting.strip():
        return ProxyChoice(check_proxy_url(setting, SETTING), SETTING)
    parts = urlsplit(provider_url)
    scheme = parts.scheme.lower()
    source = value = None
    for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        if environ.get(name, "").strip():
            source, value = name, environ[name]
            break
    if source is None or value is None:
        return ProxyChoice(None)
    for name in ("no_proxy", "NO_PROXY"):
        if name in environ:
            entry = no_proxy_match(environ[name], parts.hostname or "",
                                   parts.port or (443 if scheme == "https" else 80))
            if entry is not None:
                return ProxyChoice(None, bypassed_by=entry)
            break
    return ProxyChoice(check_proxy_url(value, source), source)


def is_loopback(address: str) -> bool:
    """True for a loopback address or name (127.0.0.0/8, ::1, ``localhost``; IPv6 in
    brackets or not): a destination or bind address that never leaves this machine."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def no_proxy_match(no_proxy: str, host: str, port: int) -> str | None:
    """The first entry of the *no_proxy* list that matches *host*:*port*, or None."""
    host = host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return raw.strip()
        name, want_port = _split_port(entry)
        if want_port is not None and want_port != port:
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(name.strip("[]"), strict=False):
                    return raw.strip()
            except ValueError:
                pass
            continue
        domain = name.removeprefix("*").lstrip(".").rstrip(".")
        if domain and (host == domain or host.endswith("." + domain)):
            return raw.strip()
    return None


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` → (host, port); IPv6 only in brackets carries a port."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
        return host, int(port) if port.isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None


def _passwords(url: str | None) -> list[str]:
    if not url:
        return []
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found: list[str] = []
    if parts.password:
        from urllib.parse import unquote

        found = [parts.password, unquote(parts.password)]
    return [p for p in dict.fromkeys(found) if p]


def environment_secrets(environ: Mapping[str, str]) -> list[str]:
    """Passwords inside any standard proxy variable of *environ*, for log masking."""
    found: list[str] = []
    for scheme in ("http", "https", "all"):
        for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY"):
            value = environ.get(name, "").strip()
            if value:
                found += _passwords(value if "://" in value else "http://" + value)
    return found
