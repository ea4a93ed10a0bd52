"""Which proxy the provider's requests take: curl's and httpx's rule, and never a password shown."""

from __future__ import annotations

import pytest

from receipts.proxy import ProxyConfigError, check_proxy_url, choose_proxy, redact_proxy
from receipts.settings import SettingsError, load_settings

HTTPS = "https://api.provider.example/receipts"
HTTP = "http://10.1.2.3:8080/receipts"


@pytest.mark.parametrize(("url", "environ", "expected"), [
    (HTTPS, {}, None),
    (HTTPS, {"HTTPS_PROXY": "http://p:3128"}, ("http://p:3128", "HTTPS_PROXY")),
    (HTTPS, {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:1"},
     ("http://lower:1", "https_proxy")),
    (HTTPS, {"HTTP_PROXY": "http://p:3128"}, None),  # another scheme's proxy
    (HTTPS, {"ALL_PROXY": "http://all:1"}, ("http://all:1", "ALL_PROXY")),
    (HTTPS, {"https_proxy": "", "HTTPS_PROXY": "http://p:1"}, ("http://p:1", "HTTPS_PROXY")),
    (HTTP, {"HTTP_PROXY": "p:3128"}, ("http://p:3128", "HTTP_PROXY")),  # no scheme: http://
])
def test_the_proxy_variable_of_the_provider_s_scheme_applies_lower_case_first(
        url, environ, expected):
    choice = choose_proxy(url, setting=None, environ=environ)
    assert (choice.url, choice.source) == (expected or (None, None))


@pytest.mark.parametrize(("no_proxy", "bypassed"), [
    ("*", True),
    ("provider.example", True),
    (".provider.example", True),
    ("*.provider.example", True),
    ("api.provider.example:443", True),
    ("api.provider.example:8443", False),
    ("badprovider.example, other.example", False),
    ("example", True),  # a domain matches its subdomains, as in curl
    ("PROVIDER.EXAMPLE", True),
    ("10.0.0.0/8", False),  # an address range does not match a host name
])
def test_no_proxy_entries_match_as_in_curl(no_proxy, bypassed):
    environ = {"HTTPS_PROXY": "http://p:3128", "NO_PROXY": no_proxy}
    choice = choose_proxy(HTTPS, setting=None, environ=environ)
    assert (choice.url is None) is bypassed
    if bypassed:
        assert "NO_PROXY" in choice.describe()


@pytest.mark.parametrize(("no_proxy", "bypassed"), [
    ("10.0.0.0/8", True), ("10.1.2.3", True), ("10.1.2.4", False), ("10.1.2.3:8080", True),
    ("10.1.2.3:80", False), ("192.168.0.0/16", False),
])
def test_no_proxy_matches_addresses_and_ranges(no_proxy, bypassed):
    choice = choose_proxy(HTTP, setting=None,
                          environ={"http_proxy": "http://p:3128", "no_proxy": no_proxy})
    assert (choice.url is None) is bypassed


def test_the_setting_wins_over_every_variable_no_proxy_included():
    environ = {"HTTPS_PROXY": "http://env:1", "NO_PROXY": "*"}
    choice = choose_proxy(HTTPS, setting="http://mine:3128", environ=environ)
    assert (choice.url, choice.source) == ("http://mine:3128", "RECEIPTS_PROVIDER_PROXY")


@pytest.mark.parametrize("bad", ["socks5://p:1080", "https://p:3128", "http://p:bad",
                                 "http://p:99999", "http://:3128", "http://p:3128/path"])
def test_a_proxy_url_that_cannot_be_used_is_refused_naming_the_variable(bad):
    with pytest.raises(ProxyConfigError, match=r"^HTTPS_PROXY: "):
        check_proxy_url(bad, "HTTPS_PROXY")


def test_a_malformed_proxy_for_another_scheme_does_not_matter():
    choice = choose_proxy(HTTPS, setting=None, environ={"HTTP_PROXY": "socks5://x:1"})
    assert choice.url is None


def test_credentials_are_masked_in_every_text_made_for_people():
    url = "http://egress:s3cret%40pw@proxy.example:3128"
    assert redact_proxy(url) == "http://egress:***@proxy.example:3128"
    choice = choose_proxy(HTTPS, setting=None, environ={"HTTPS_PROXY": url})
    assert choice.describe() == "http://egress:***@proxy.example:3128 (HTTPS_PROXY)"
    assert set(choice.secrets()) == {"s3cret%40pw", "s3cret@pw"}
    settings = load_settings(database_url="postgresql://u@h/d", provider_url=HTTPS,
                             provider_proxy=url)
    dumped = f"{settings!r} {settings.model_dump()} {settings.model_dump_json()}"
    assert "s3cret" not in dumped
    assert "s3cret@pw" in settings.secrets()  # handed to the log formatter to mask


def test_a_bad_proxy_setting_is_a_settings_error_without_its_password():
    with pytest.raises(SettingsError) as caught:
        load_settings(database_url="postgresql://u@h/d", provider_url=HTTPS,
                      provider_proxy="http://u:s3cret@proxy:bad")
    assert str(caught.value).startswith("RECEIPTS_PROVIDER_PROXY: ")
    assert "s3cret" not in str(caught.value)
