"""Who may act on the review page: signed session cookies, CSRF tokens, origin checks.

Pure functions and one small class, no I/O, so every rule is easy to test.

* The page is read-only unless an admin token is configured. Every state
  change is a POST that needs an **admin session** (a signed cookie earned by
  entering the token) and a **CSRF token** bound to that session.
* Sessions are stateless: the cookie is ``sid.expires.role.mac`` with an
  HMAC-SHA256 under a key derived from the admin token, so several replicas
  agree without shared state, and rotating the token signs everyone out. The
  token itself never travels in a cookie. Entering the token starts a new
  session id (no session fixation).
* The CSRF token is HMAC(key, sid): a page on another site can neither read
  it nor forge it. The cookie is ``HttpOnly; SameSite=Strict; Secure``, so a
  cross-site request carries no session at all; the Origin (or, failing
  that, Sec-Fetch-Site / Referer) of every POST must be the page's own host.
* With a loopback bind address only loopback ``Host`` names are served, so a
  DNS-rebinding page cannot read the review page through the browser.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

COOKIE = "receipts_ui_session"
SESSION_SECONDS = 8 * 3600
Role = Literal["guest", "admin"]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True, slots=True)
class Session:
    """A verified session: its id, role and expiry (Unix seconds)."""

    sid: str
    role: Role
    expires: int

    @property
    def admin(self) -> bool:
        """True when the holder entered the admin token."""
        return self.role == "admin"


class Sessions:
    """Issues and verifies session cookies and CSRF tokens for one admin token.

    Args:
        admin_token: the configured ``RECEIPTS_UI_ADMIN_TOKEN`` (never stored
            as such: only a derived key and a digest for comparison).
        lifetime_seconds: how long a session cookie is valid (8 h).
    """

    def __init__(self, admin_token: str, *, lifetime_seconds: int = SESSION_SECONDS) -> None:
        self._key = hmac.new(admin_token.encode(), b"receipts-ui session key v1",
                             hashlib.sha256).digest()
        self._token_digest = hashlib.sha256(admin_token.encode()).digest()
        self.lifetime_seconds = lifetime_seconds

    def _mac(self, message: str) -> str:
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str) -> bool:
        """Constant-time comparison of *candidate* with the admin token."""
        digest = hashlib.sha256(candidate.encode("utf-8", "replace")).digest()
        return hmac.compare_digest(digest, self._token_digest)

    def issue(self, role: Role, *, now: float | None = None) -> tuple[Session, str]:
        """A new session with a fresh random id; returns it and its cookie value."""
        sid = base64.urlsafe_b64encode(secrets.token_bytes(18)).decode()
        expires = int(now if now is not None else time.time()) + self.lifetime_seconds
        body = f"{sid}.{expires}.{role}"
        return Session(sid, role, expires), f"{body}.{self._mac(body)}"

    def verify(self, cookie: str | None, *, now: float | None = None) -> Session | None:
        """The session a cookie value proves, or None (missing, forged, expired)."""
        if not cookie or len(cookie) > 200:
            return None
        parts = cookie.split(".")
        if len(parts) != 4:
            return None
        sid, expires_text, role, mac = parts
        if not hmac.compare_digest(mac, self._mac(f"{sid}.{expires_text}.{role}")):
            return None
        if role not in ("guest", "admin") or not expires_text.isdigit():
            return None
        expires = int(expires_text)
        if expires < (now if now is not None else time.time()):
            return None
        return Session(sid, "admin" if role == "admin" else "guest", expires)

    def csrf_token(self, session: Session) -> str:
        """The CSRF token of *session* (goes into every form as a hidden field)."""
        return self._mac(f"csrf.{session.sid}")

    def csrf_matches(self, session: Session, candidate: str | None) -> bool:
        """Constant-time check of a form's CSRF field against *session*."""
        return bool(candidate) and hmac.compare_digest(self.csrf_token(session), candidate or "")


def same_origin(host: str | None, origin: str | None, fetch_site: str | None,
                referer: str | None) -> bool:
    """Whether a POST comes from the page's own origin.

    *host* is the request's ``Host`` header; the ``Origin`` header's host and
    port must equal it (the scheme is not compared: a TLS-terminating proxy
    turns https into http). Without ``Origin``, ``Sec-Fetch-Site`` must say
    ``same-origin`` (or ``none``: typed by the user), or the ``Referer`` must
    be on the same host. A request with none of the three (not a browser) is
    allowed here; it still needs the session cookie and the CSRF token.
    """
    if not host:
        return False
    host = host.lower()
    if origin is not None:
        return origin != "null" and (urlsplit(origin).netloc.lower() == host)
    if fetch_site is not None:
        return fetch_site in ("same-origin", "none")
    if referer is not None:
        return urlsplit(referer).netloc.lower() == host
    return True


def is_loopback(address: str) -> bool:
    """True for a loopback bind address or name (127.0.0.0/8, ::1, localhost)."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str | None, *, loopback_only: bool) -> bool:
    """Whether to serve a request with this ``Host`` header.

    When the server binds to a loopback address only loopback names are
    accepted (``localhost``, ``127.0.0.1``, ``[::1]``, any port): a page on
    another name that rebinds its DNS to 127.0.0.1 gets nothing. Otherwise
    (Kubernetes, behind a Service or an Ingress) every host is served.
    """
    if not loopback_only:
        return True
    if not host_header:
        return False
    netloc = host_header.lower()
    name = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
    name = name.strip("[]")
    return name in LOOPBACK_NAMES or is_loopback(name)
