"""Review-page sessions, CSRF tokens and origin/host checks (pure functions)."""

from __future__ import annotations

import pytest

from receipts.proxy import parse_networks
from receipts.ui.display import clip
from receipts.ui.form import parse_filter
from receipts.ui.session import Sessions, UserHeader, host_allowed, is_loopback, same_origin

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

    from receipts.ui.form import BadInput

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


def test_roles_come_from_the_token_typed_and_reading_may_need_one() -> None:
    both = Sessions(TOKEN, "a-long-enough-viewer-token")
    assert both.role_for(TOKEN) == "admin"
    assert both.role_for("a-long-enough-viewer-token") == "viewer"
    assert both.role_for("guess") is None and both.viewer_required and both.actions_enabled
    viewer, _ = both.issue("viewer")
    assert viewer.reader and not viewer.admin
    readers_only = Sessions(None, "a-long-enough-viewer-token")
    assert not readers_only.actions_enabled and readers_only.role_for(TOKEN) is None
    # A cookie of one configuration is worthless under another (the key covers both tokens).
    _, cookie = both.issue("admin")
    assert Sessions(TOKEN).verify(cookie) is None
    import pytest

    with pytest.raises(ValueError):
        Sessions(None, None)


def test_a_revoked_session_is_refused_though_its_signature_holds() -> None:
    sessions = Sessions(TOKEN)
    session, cookie = sessions.issue("admin")
    assert sessions.verify(cookie) == session
    sessions.revoke(session.sid)
    assert sessions.verify(cookie) is None
    other, other_cookie = sessions.issue("admin")
    replica = Sessions(TOKEN)  # another replica learns it from the shared list
    assert replica.verify(other_cookie) == other
    replica.update_revoked({other.sid})
    assert replica.verify(other_cookie) is None
    assert len(session.short_id) == 12 and session.sid.startswith(session.short_id)


def test_wrong_tokens_are_throttled_per_client_within_a_window() -> None:
    from receipts.ui.session import SignInThrottle

    now = [1000.0]
    throttle = SignInThrottle(failures=3, window_seconds=60, max_clients=2,
                              clock=lambda: now[0])
    for _ in range(3):
        assert throttle.retry_after("a") == 0
        throttle.failed("a")
        now[0] += 1
    assert throttle.retry_after("a") == 57  # the oldest failure ages out at 1060
    assert throttle.retry_after("b") == 0  # another client is not held back
    now[0] = 1061
    assert throttle.retry_after("a") == 0
    throttle.failed("a")
    throttle.succeeded("a")
    assert throttle.retry_after("a") == 0
    for client in ("c", "d", "e"):  # memory is bounded: the oldest client is forgotten
        throttle.failed(client)
    assert "c" not in throttle._seen and len(throttle._seen) == 2


def test_a_throttled_address_gets_one_check_a_second_not_a_lock() -> None:
    from receipts.ui.session import SignInThrottle

    now = [1000.0]
    throttle = SignInThrottle(failures=2, window_seconds=60, check_seconds=1.0,
                              clock=lambda: now[0])
    assert throttle.may_check("a") and throttle.may_check("a")  # not throttled: always
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.may_check("a")  # throttled: the first check of this second
    assert not throttle.may_check("a")  # a second one within it is not checked
    now[0] += 1.0
    assert throttle.may_check("a")
    assert throttle.may_check("b")  # another address is not paced


def test_a_trusted_header_names_the_user_only_from_a_configured_proxy() -> None:
    header = UserHeader("X-Forwarded-User", parse_networks("10.0.0.0/8, 127.0.0.2"))
    assert header.user("10.1.2.3", "alice@example.com") == "alice@example.com"
    assert header.user("127.0.0.2", " bob ") == "bob"
    assert header.user("127.0.0.1", "mallory") is None  # not the proxy: a client could send it
    assert header.user("10.1.2.3", None) is None and header.user(None, "x") is None
    assert header.user("10.1.2.3", "eve\u202e\x07" + "e" * 100) == "eve" + "e" * 61
    assert UserHeader("X-Forwarded-User", ()).user("10.1.2.3", "alice") is None
    with pytest.raises(ValueError, match="not an IP address"):
        parse_networks("10.0.0.0/8, proxy.internal")


def test_a_secure_cookie_sticks_over_https_behind_a_proxy_and_on_localhost_only() -> None:
    from receipts.ui.session import keeps_secure_cookie

    assert keeps_secure_cookie("https", None, "review.example.com")
    assert keeps_secure_cookie("http", "https", "review.example.com")
    assert keeps_secure_cookie("http", None, "localhost:8090")
    assert keeps_secure_cookie("http", None, "127.0.0.1:8090")
    assert not keeps_secure_cookie("http", None, "review.example.com")
    assert not keeps_secure_cookie("http", "http", "10.0.0.7:8090")


def test_the_chart_breaks_its_lines_over_gaps_and_describes_itself() -> None:
    from datetime import UTC, datetime, timedelta

    from receipts.ui.chart import Sample, depth_chart, nice_ceiling

    assert [nice_ceiling(v) for v in (0, 1, 3, 10, 11, 2_400, 999_999)] == [
        1, 1, 5, 10, 20, 5_000, 1_000_000]
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    samples = [Sample(now - timedelta(seconds=s), 10, 2, 1) for s in (600, 595, 590)]
    samples += [Sample(now - timedelta(seconds=s), 30, 0, 4) for s in (10, 5, 0)]
    svg = str(depth_chart(samples, now, interval_seconds=5))
    assert svg.count("<polyline") == 6  # a 10-minute gap splits each series in two
    assert "since 11:50 UTC: ready 10 to 30 (highest 30)" in svg and ">50<" in svg
    assert "<script" not in svg and svg.startswith('<svg class="depth"')
    assert "no samples yet" in str(depth_chart([], now))


def test_an_estimate_is_rounded_and_labelled() -> None:
    from receipts.ui.display import rounded

    assert [rounded(v) for v in (42, 10_150, 123_456, 1_234_567)] == [
        "42", "10,000", "120,000", "1.2 million"]
