"""TLS files for an https provider: a file that holds no PEM data is a settings error."""

from __future__ import annotations

import pytest

from receipts.runtime import make_deliverer
from receipts.settings import SettingsError, load_settings


def _settings(**extra: str):
    return load_settings(database_url="postgresql://app@127.0.0.1:5432/db",
                         provider_url="https://provider.example/receipts", **extra)


def test_a_ca_file_without_certificates_names_its_setting(tmp_path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(SettingsError, match="RECEIPTS_PROVIDER_CA_FILE: no usable PEM"):
        make_deliverer(_settings(provider_ca_file=str(junk)))


def test_a_client_certificate_without_pem_data_names_its_settings(tmp_path) -> None:
    junk = tmp_path / "client.pem"
    junk.write_text("neither certificate nor key\n")
    with pytest.raises(SettingsError, match="RECEIPTS_PROVIDER_CLIENT_CERT_FILE"):
        make_deliverer(_settings(provider_client_cert_file=str(junk)))


def test_a_plain_http_provider_loads_no_tls_files(tmp_path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    settings = load_settings(database_url="postgresql://app@127.0.0.1:5432/db",
                             provider_url="http://provider.example/receipts",
                             provider_ca_file=str(junk))
    make_deliverer(settings)  # http: the CA file is never read
