"""Who may read and act on the review page: signed session cookies, CSRF tokens,
origin checks, revocation, sign-in throttling.

Pure functions and small classes, no I/O, so every rule is easy to test.

* The page is read-only unless an admin token is configured. Every state
  change is a POST that needs an **admin session** (a signed cookie earned by
  entering the token) and a **CSRF token** bound to that session.
* Reading needs a **viewer session** (the viewer or the admin token) when a
  viewer token is configured; without one, anyone who reaches the page reads
  it (a localhost bind, or an authenticating proxy in front).
* Sessions are signed, not stored: the cookie is ``sid.expires.role.mac``
  with an HMAC-SHA256 under a key derived from both tokens, so several
  replicas agree without shared state, and rotating a token signs everyone
  out. The token itself never travels in a cookie. Entering a token starts a
  new session id (no session fixation). **Signing out revokes** the session
  id: the page records it in the database, and every replica refuses it
  (:meth:`Sessions.revoke`, :meth:`Sessions.update_revoked`) until the
  cookie would have expired anyway.
* **Failed sign-ins are throttled** per client address
  (:class:`SignInThrottle`): after a few wrong tokens the client must wait.
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
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from receipts.proxy import is_loopback as is_loopback  # re-exported: ui.app, tests

COOKIE = "receipts_ui_session"
SESSION_SECONDS = 8 * 3600
Role = Literal["guest", "viewer", "admin"]
ROLES: tuple[Role, ...] = ("guest", "viewer", "admin")
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

    @property
    def reader(self) -> bool:
        """True when the holder entered the viewer or the admin token."""
        return self.role in ("viewer", "admin")

    @property
    def short_id(self) -> str:
        """The first 12 characters of the id: names the session in logs and in
        ``paused_by`` (a session id proves nothing without the signing key)."""
        return self.sid[:12]


def _digest(token: str | None) -> bytes:
    return hashlib.sha256((token or "").encode("utf-8", "replace")).digest()


class Sessions:
    """Issues and verifies session cookies and CSRF tokens for the configured tokens.

    Args:
        admin_token: ``RECEIPTS_UI_ADMIN_TOKEN`` or None (no actions).
        viewer_token: ``RECEIPTS_UI_VIEWER_TOKEN`` or None (reading needs no
            token). Neither is stored as such: only a derived key and digests.
        lifetime_seconds: how long a session cookie is valid (8 h).

    Raises ``ValueError`` when neither token is given (then there are no sessions).
    """

    def __init__(self, admin_token: str | None, viewer_token: str | None = None, *,
                 lifetime_seconds: int = SESSION_SECONDS) -> None:
        if not admin_token and not viewer_token:
            raise ValueError("sessions need an admin or a viewer token")
        secret = _digest(admin_token) + _digest(viewer_token)
        self._key = hmac.new(secret, b"receipts-ui session key v2", hashlib.sha256).digest()
        self._admin_digest = _digest(admin_token) if admin_token else None
        self._viewer_digest = _digest(viewer_token) if viewer_token else None
        self.lifetime_seconds = lifetime_seconds
        self.actions_enabled = admin_token is not None
        self.viewer_required = viewer_token is not None
        self._revoked: set[str] = set()

    def _mac(self, message: str) -> str:
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def role_for(self, candidate: str) -> Role | None:
        """The role a typed token earns (``admin``, ``viewer``), or None.

        Both comparisons always run, in constant time, so the time taken says
        nothing about which token came close.
        """
        digest = _digest(candidate)
        admin = self._admin_digest is not None and hmac.compare_digest(digest,
                                                                        self._admin_digest)
        viewer = self._viewer_digest is not None and hmac.compare_digest(digest,
                                                                          self._viewer_digest)
        return "admin" if admin else "viewer" if viewer else None

    def token_matches(self, candidate: str) -> bool:
        """Constant-time comparison of *candidate* with the admin token."""
        return self.role_for(candidate) == "admin"

    def revoke(self, sid: str) -> None:
        """Refuse *sid* from now on in this process (the caller records it for the others)."""
        self._revoked.add(sid)

    def update_revoked(self, sids: set[str]) -> None:
        """Add the revoked ids every replica recorded (read once per refresh interval)."""
        self._revoked |= sids

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
        if role not in ROLES or not expires_text.isdigit() or sid in self._revoked:
            return None
        expires = int(expires_text)
        if expires < (now if now is not None else time.time()):
            return None
        return Session(sid, ROLES[ROLES.index(role)], expires)

    def csrf_token(self, session: Session) -> str:
        """The CSRF token of *session* (goes into every form as a hidden field)."""
        return self._mac(f"csrf.{session.sid}")

    def csrf_matches(self, session: Session, candidate: str | None) -> bool:
        """Constant-time check of a form's CSRF field against *session*."""
        return bool(candidate) and hmac.compare_digest(self.csrf_token(session), candidate or "")


class SignInThrottle:
    """Failed sign-ins per client: after *failures* wrong tokens within
    *window_seconds* the client must wait until the oldest of them ages out.

    Memory is bounded: at most *max_clients* clients are remembered (the least
    recently failing are forgotten first). A success clears the client.

    Args:
        failures: wrong tokens allowed per window.
        window_seconds: the window, seconds.
        max_clients: clients remembered at most.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, *, failures: int = 5, window_seconds: float = 300.0,
                 max_clients: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.window_seconds = window_seconds
        self.max_clients = max_clients
        self._clock = clock
        self._seen: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, client: str) -> deque[float]:
        times = self._seen.get(client, deque())
        horizon = self._clock() - self.window_seconds
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def retry_after(self, client: str) -> float:
        """Seconds *client* must wait before its next try (0: it may try now)."""
        times = self._recent(client)
        if len(times) < self.failures:
            return 0.0
        return max(0.0, times[-self.failures] + self.window_seconds - self._clock())

    def failed(self, client: str) -> None:
        """Count one wrong token from *client*."""
        times = self._recent(client)
        times.append(self._clock())
        self._seen[client] = times
        self._seen.move_to_end(client)
        while len(self._seen) > self.max_clients:
            self._seen.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """Forget *client*'s failures."""
        self._seen.pop(client, None)


def keeps_secure_cookie(scheme: str, forwarded_proto: str | None, host: str | None) -> bool:
    """Whether a browser will store this page's ``Secure`` session cookie.

    It does over HTTPS (the request's *scheme*, or an ``X-Forwarded-Proto:
    https`` set by a TLS-terminating proxy) and on a loopback name, which
    browsers count as a secure context. Over plain HTTP on any other name the
    cookie is dropped, and every form would fail its CSRF check: the page says
    so instead (the header only chooses a message; it grants nothing).
    """
    if scheme == "https" or (forwarded_proto or "").split(",")[0].strip().lower() == "https":
        return True
    return host_allowed(host, loopback_only=True)


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
