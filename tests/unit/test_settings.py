"""Settings validation and DSN redaction (pure, no I/O)."""

from __future__ import annotations

import pytest

from receipts.delivery import classify
from receipts.dsn import redact_dsn
from receipts.model import Verdict
from receipts.settings import SettingsError, load_settings


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://app:hunter2@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        ("host=db password=hunter2 user=app", "host=db password=*** user=app"),
        ("host=db password='hu nter2' user=app", "host=db password=*** user=app"),
        ("postgresql://app@db/shop", "postgresql://app@db/shop"),
        ("to postgresql://u:p@h/d failed", "to postgresql://u:***@h/d failed"),
        ("postgresql://alice:p@ss@127.0.0.1:1/x", "postgresql://alice:***@127.0.0.1:1/x"),
        ("host=h password='Sek r1t dbname=x", "host=h password=***"),
        # A missing space: libpq quotes the whole run as a host or user name.
        ("failed to resolve host '127.0.0.1port=1password=S3cretPW': x",
         "failed to resolve host '127.0.0.1port=1password=*** x"),
        ('for user "apppassword=S3cretPW"', 'for user "apppassword=***'),
    ],
)
def test_dsn_passwords_are_masked_in_any_text(text, expected):
    assert redact_dsn(text) == expected


def test_defaults_follow_the_design():
    settings = load_settings(database_url="postgresql://u@h/d")
    assert (settings.lease_seconds, settings.max_attempts, settings.metrics_port) == (60, 5, 9464)
    budget = settings.lease_seconds - settings.lease_margin
    assert settings.delivery_timeout_seconds <= budget


@pytest.mark.parametrize(("lease", "timeout"), [(5, 3), (12, 2), (60, 50), (3600, 3590)])
def test_the_lease_margin_scales_with_the_lease_so_short_leases_work(lease, timeout):
    settings = load_settings(database_url="postgresql://u@h/d", lease_seconds=lease,
                             delivery_timeout_seconds=timeout)
    assert settings.lease_margin == min(10, lease / 4)


@pytest.mark.parametrize(("lease", "timeout"), [(5, 4), (1, 1), (60, 51)])
def test_only_impossible_lease_arithmetic_is_refused(lease, timeout):
    with pytest.raises(SettingsError, match="RECEIPTS_DELIVERY_TIMEOUT_SECONDS"):
        load_settings(database_url="postgresql://u@h/d", lease_seconds=lease,
                      delivery_timeout_seconds=timeout)


def test_a_delivery_timeout_that_does_not_fit_the_lease_is_refused_by_name():
    with pytest.raises(SettingsError, match="RECEIPTS_DELIVERY_TIMEOUT_SECONDS"):
        load_settings(database_url="postgresql://u@h/d", lease_seconds=30,
                      lease_margin_seconds=10, delivery_timeout_seconds=25)


def test_a_rejected_dsn_is_never_echoed():
    with pytest.raises(SettingsError) as info:
        load_settings(database_url="mysql://u:hunter2@h/d")
    assert "hunter2" not in str(info.value)
    assert "RECEIPTS_DATABASE_URL" in str(info.value)


def test_secrets_do_not_show_in_the_settings_repr():
    settings = load_settings(database_url="postgresql://u:hunter2@h/d", provider_token="tok-xyz")
    assert "hunter2" not in repr(settings) and "tok-xyz" not in repr(settings)
    assert settings.safe_dsn == "user=u dbname=d host=h password=***"


@pytest.mark.parametrize(
    ("status", "verdict"),
    [(204, Verdict.DELIVERED), (409, Verdict.RETRY), (418, Verdict.PERMANENT),
     (451, Verdict.PERMANENT), (599, Verdict.RETRY), (100, Verdict.RETRY)],
)
def test_classification_covers_the_whole_status_range(status, verdict):
    import httpx

    assert classify(status, httpx.Headers(), b"").verdict is verdict


def test_a_uri_with_an_unencoded_at_sign_is_refused_without_echoing_it():
    with pytest.raises(SettingsError, match="%40") as info:
        load_settings(database_url="postgresql://alice:p@ss@127.0.0.1/x")
    assert "p@ss" not in str(info.value) and "ss@" not in str(info.value)


def test_the_database_url_is_required():
    import os

    saved = os.environ.pop("RECEIPTS_DATABASE_URL", None)
    try:
        with pytest.raises(SettingsError, match="RECEIPTS_DATABASE_URL: is required"):
            load_settings()
    finally:
        if saved is not None:
            os.environ["RECEIPTS_DATABASE_URL"] = saved


def test_an_empty_provider_token_means_none():
    settings = load_settings(database_url="postgresql://u@h/d", provider_token=" ")
    assert settings.provider_token is None


def test_the_line_break_a_secret_file_keeps_is_not_part_of_a_value():
    # `kubectl create secret --from-file` keeps a file's last line break.
    settings = load_settings(database_url="postgresql://u:pw@h/shop\n",
                             provider_url="http://x/receipts\r\n", provider_token="tok-1\n",
                             ui_admin_token="a" * 20 + "\n")
    assert settings.dsn == "postgresql://u:pw@h/shop"
    assert settings.provider_url == "http://x/receipts"
    assert settings.provider_token is not None
    assert settings.provider_token.get_secret_value() == "tok-1"
    assert settings.ui_admin_token is not None
    assert settings.ui_admin_token.get_secret_value() == "a" * 20


def test_a_token_with_a_control_character_inside_is_refused_without_showing_it():
    with pytest.raises(SettingsError, match="RECEIPTS_PROVIDER_TOKEN: contains a control") as exc:
        load_settings(database_url="postgresql://u@h/d", provider_token="secret-1\nsecret-2")
    assert "secret" not in str(exc.value)


@pytest.mark.parametrize("dsn", [
    "postgresql://h1:5432,h2:5433/db?target_session_attrs=read-write",
    "postgresql://u:pw@h1,h2/db?target_session_attrs=primary&connect_timeout=3",
    "host=h1,h2 port=5432,5433 dbname=db target_session_attrs=read-write",
    "postgresql:///db?host=/var/run/postgresql",
])
def test_every_form_libpq_accepts_is_accepted(dsn):
    assert load_settings(database_url=dsn).dsn == dsn


PASSWORDS = ["with space", "qu'o\"te", "at@sign", "per%cent", "ünï©ødé", "a b' c=d", "🔑🔑"]


@pytest.mark.parametrize("password", PASSWORDS)
def test_passwords_of_any_shape_never_show_in_the_safe_dsn(password):
    from urllib.parse import quote

    from psycopg.conninfo import make_conninfo

    for dsn in (f"postgresql://alice:{quote(password, safe='')}@db.example:5432/shop",
                make_conninfo("", host="db.example", user="alice", password=password,
                              dbname="shop")):
        settings = load_settings(database_url=dsn)
        assert password not in settings.safe_dsn
        assert "password=***" in settings.safe_dsn and "db.example" in settings.safe_dsn
        assert password not in repr(settings)


@pytest.mark.parametrize("bad", ["postgresql://u:se cret@h/d x=", "host=h password='unterminated",
                                 "nonsense=1 password=hunter2"])
def test_an_invalid_dsn_is_refused_without_any_part_of_it(bad):
    with pytest.raises(SettingsError) as info:
        load_settings(database_url=bad)
    message = str(info.value)
    assert "RECEIPTS_DATABASE_URL" in message
    assert "hunter2" not in message and "se cret" not in message and "unterminated" not in message


@pytest.mark.parametrize("dsn, key", [
    ("host=127.0.0.1port=1password=hunter2", "host"),
    ("host=h user=apppassword=hunter2", "user"),
    ("host=h dbname=shopsslmode=require password=hunter2", "dbname"),
    ("host=h target_session_attrs=anypassword=hunter2", "target_session_attrs"),
    ("host=nonexist.invalidpassword=hunter2 port=1 application_name=http://x", "host"),
])
def test_a_pair_glued_to_the_one_before_is_refused_at_start(dsn, key):
    """A missing space makes libpq read the next pairs as part of a value, and its errors
    would quote that value, password included."""
    with pytest.raises(SettingsError) as info:
        load_settings(database_url=dsn)
    assert f"{key}=… holding another key=value pair" in str(info.value)
    assert "hunter2" not in str(info.value)
    # "=" stays ordinary in a password and in options, in any quoted value, and in an
    # unquoted one that holds no libpq keyword; "://" inside a value is no URI.
    for dsn in ("host=h password='a=b' options='-c search_path=x'",
                "host=127.0.0.1 port=1 user='CN=app' dbname=d", "host=h dbname='a=b'",
                "host=/tmp/x=y port=1 dbname=d",
                "host=h user=svc dbname=d application_name=http://a@b@c"):
        load_settings(database_url=dsn)


@pytest.mark.parametrize("dsn, key", [
    ("postgresql://u:hunter2@h/d?sslmode=bogus", "sslmode"),
    ("host=h password=hunter2 target_session_attrs=writable", "target_session_attrs"),
])
def test_a_keyword_value_libpq_checks_only_when_connecting_is_refused_at_start(dsn, key):
    with pytest.raises(SettingsError) as info:
        load_settings(database_url=dsn)
    assert f"invalid {key}" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize("dsn, schema", [
    ("postgresql://u@h/d", "public"),
    ("postgresql://u@h/d?options=-c%20search_path%3Dshop,public", "shop"),
    ("host=h options='-c search_path=\"$user\",app'", "app"),
    ("host=h options='-csearch_path=Shop -c statement_timeout=5'", "shop"),
])
def test_the_schema_comes_from_the_dsns_search_path_else_public(dsn, schema):
    assert load_settings(database_url=dsn).db_schema == schema
    assert load_settings(database_url=dsn, database_schema="orders").db_schema == "orders"


def test_the_provider_url_is_logged_without_userinfo_or_query():
    settings = load_settings(database_url="postgresql://u@h/d",
                             provider_url="https://user:s3cr3t@api.example:8443/r?token=abc#x")
    assert settings.safe_provider_url == "https://api.example:8443/r"


@pytest.mark.parametrize("given", ["OFF", " Off", "off"])
def test_choices_take_any_case_like_postgresql_does(given):
    s = load_settings(database_url="postgresql://u@h/db", synchronous_commit=given,
                      attempt_history="ALL")
    assert s.synchronous_commit == "off" and s.attempt_history == "all"


def test_a_synchronous_commit_postgresql_would_not_take_for_a_session_is_refused_by_name():
    with pytest.raises(SettingsError, match="RECEIPTS_SYNCHRONOUS_COMMIT"):
        load_settings(database_url="postgresql://u@h/db", synchronous_commit="maybe")


@pytest.mark.parametrize("field", ["retry_base_seconds", "lease_seconds",
                                   "provider_rate_limit_per_second", "delivery_timeout_seconds"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_refused_as_such(field, value):
    with pytest.raises(SettingsError, match=f"RECEIPTS_{field.upper()}: .*finite"):
        load_settings(database_url="postgresql://u@h/d", **{field: value})
