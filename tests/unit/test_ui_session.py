"""Review-page sessions, CSRF tokens and origin/host checks (pure functions)."""

from __future__ import annotations

from receipts.ui.app import clip, parse_filter
from receipts.ui.session import Sessions, host_allowed, is_loopback, same_origin

TOKEN = "a-long-enough-admin-token"


def test_a_session_cookie_verifies_only_unaltered_and_unexpired() -> None:
    sessions = Sessions(TOKEN, lifetime_seconds=60)
    session, cookie = sessions.issue("admin", now=1_000)
    assert sessions.verify(cookie, now=1_030) == session and session.admin
    assert sessions.verify(cookie, now=1_061) is None  # expired
    sid, expires, _, mac = cookie.split(".")
    assert sessions.verify(f"{sid}.{expires}.admin.{'0' * len(mac)}", now=1_030) is None
    _, guest_cookie = sessions.issue("guest", now=1_000)
    g_sid, g_exp, _, g_mac = guest_cookie.split(".")
    assert sessions.verify(f"{g_sid}.{g_exp}.admin.{g_mac}", now=1_030) is None  # no promotion
    assert sessions.verify(f"{sid}.{int(expires) + 999}.admin.{mac}", now=1_030) is None
    for junk in (None, "", "a.b", "x" * 500):
        assert sessions.verify(junk) is None
    # Another token signs everyone out; the token is never part of the cookie.
    assert Sessions(TOKEN + "2").verify(cookie, now=1_030) is None
    assert TOKEN not in cookie


def test_csrf_tokens_are_bound_to_the_session() -> None:
    sessions = Sessions(TOKEN)
    one, _ = sessions.issue("guest")
    two, _ = sessions.issue("guest")
    assert one.sid != two.sid
    assert sessions.csrf_matches(one, sessions.csrf_token(one))
    assert not sessions.csrf_matches(one, sessions.csrf_token(two))
    assert not sessions.csrf_matches(one, "") and not sessions.csrf_matches(one, None)
    assert sessions.token_matches(TOKEN) and not sessions.token_matches(TOKEN[:-1])


def test_same_origin_compares_the_origin_with_the_host() -> None:
    host = "127.0.0.1:8090"
    assert same_origin(host, "http://127.0.0.1:8090", None, None)
    assert same_origin("review.example.com", "https://review.example.com", None, None)
    assert not same_origin(host, "http://evil.test:8090", None, None)
    assert not same_origin(host, "http://127.0.0.1:9999", None, None)
    assert not same_origin(host, "null", None, None)
    assert same_origin(host, None, "same-origin", None)
    assert not same_origin(host, None, "cross-site", None)
    assert not same_origin(host, None, None, "http://evil.test/page")
    assert same_origin(host, None, None, None)  # not a browser: cookie and CSRF still needed
    assert not same_origin(None, "http://127.0.0.1:8090", None, None)


def test_a_loopback_bind_serves_only_loopback_host_names() -> None:
    for ok in ("127.0.0.1:8090", "localhost:8090", "[::1]:8090", "localhost", "127.0.0.2"):
        assert host_allowed(ok, loopback_only=True), ok
    for bad in ("evil.test:8090", "10.0.0.1", "", None, "127.0.0.1.evil.test"):
        assert not host_allowed(bad, loopback_only=True), bad
    assert host_allowed("review.example.com", loopback_only=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_display_text_is_one_clipped_line_without_control_or_bidi_characters() -> None:
    assert clip("a\nb\tc\r\nd") == "a b c d"
    assert clip("x\x1b[31mred\u202eevil") == "x\ufffd[31mred\ufffdevil"
    assert clip("y" * 300, 10) == "yyyyyyyyyy… (+290 characters)"
    assert clip(None) == ""


def test_filter_input_is_validated() -> None:
    import pytest

    from receipts.ui.app import BadInput

    view = parse_filter({"state": "failed", "status": "422", "q": " ord ",
                         "since": "2026-01-31T09:00"})
    assert view.status == 422 and view.order_contains == "ord"
    assert view.since is not None and view.since.utcoffset() is not None
    assert parse_filter({"state": "running", "expired": "1"}).expired is True
    assert parse_filter({"state": "failed", "expired": "1"}).expired is None
    for bad in ({"state": "nope"}, {"status": "42"}, {"expired": "yes"},
                {"status": "4x2"}, {"reason": "<b>"}, {"since": "yesterday"},
                {"q": "o" * 201}):
        with pytest.raises(BadInput):
            parse_filter(bad)
