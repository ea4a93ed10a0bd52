"""Service settings, read once from the environment (prefix ``RECEIPTS_``).

Every duration is in seconds and says so in its name. Secrets (the database
password inside the DSN, the provider token) are ``SecretStr`` and are never
printed: :func:`redact_dsn` is the one way a DSN reaches a log line or an error.

Settings are built once at the entry point (:func:`load_settings`) and passed
down; nothing in the package reads the environment on its own.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "RECEIPTS_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


class SettingsError(ValueError):
    """Settings that cannot run; ``str()`` is one line per problem, naming the variable."""


# URI userinfo: the password runs to the *last* '@' before the path, so an
# unencoded '@' inside a password is masked whole. Key/value: a quoted value
# (even one missing its closing quote) or a bare word.
_DSN_PASSWORD_URI = re.compile(
    r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^/\s]*)@", re.I
)
_DSN_PASSWORD_KV = re.compile(
    r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*(?:'|$)|\S+)", re.I
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
    """Raise ``ValueError`` when *dsn* is not a usable libpq URI or key/value string.

    The message never contains the DSN or its password.
    """
    from psycopg.conninfo import conninfo_to_dict

    if not dsn.strip():
        raise ValueError("is empty")
    if "://" in dsn:
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError("must start with postgresql:// (or be a key=value libpq string)")
        if parts.netloc.count("@") > 1:
            raise ValueError("has an unencoded '@' in its user or password (write it as %40)")
        try:
            _ = parts.port
        except ValueError:
            raise ValueError("has an invalid port") from None
    try:
        conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg.ProgrammingError; message may echo the DSN
        detail = " ".join(str(exc).split())
        raise ValueError(f"is not a valid libpq connection string ({redact_dsn(detail)})") from None


class Settings(BaseSettings):
    """Worker, recovery and CLI settings.

    Built from environment variables ``RECEIPTS_<FIELD>`` (case-insensitive);
    validation errors become :class:`SettingsError` in :func:`load_settings`.
    The lease/timeout rule (delivery timeout ≤ lease − margin) comes from
    docs/design.md §3: a delivery must end, and its ack land, while the lease holds.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="ignore", frozen=True
    )

    database_url: SecretStr = Field(
        description="libpq DSN of the database that holds receipt_jobs (required).",
    )
    provider_url: str = Field(
        default="http://127.0.0.1:8080/receipts",
        description="URL the receipt is POSTed to.",
    )
    provider_token: SecretStr | None = Field(
        default=None, description="Bearer token sent to the provider, if any."
    )
    concurrency: int = Field(default=32, ge=1, le=10_000, description="Delivery slots.")
    lease_seconds: float = Field(default=60.0, gt=0, le=86_400)
    lease_margin_seconds: float = Field(default=10.0, ge=0, le=3_600)
    max_attempts: int = Field(default=5, ge=1, le=1_000)
    delivery_timeout_seconds: float = Field(default=10.0, gt=0, le=3_600)
    poll_interval_seconds: float = Field(default=1.0, gt=0, le=3_600)
    claim_batch_max: int = Field(default=100, ge=1, le=1_000)
    metrics_port: int = Field(default=9464, ge=0, le=65_535, description="0 disables.")
    log_level: LogLevel = "INFO"
    pool_max_size: int = Field(default=2, ge=1, le=100)
    listen_notify: bool = True
    pgbouncer: bool = Field(
        default=False,
        description="Transaction-pooling mode: no prepared statements, LISTEN or startup options.",
    )
    shutdown_grace_seconds: float = Field(default=20.0, ge=0, le=3_600)
    retry_base_seconds: float = Field(default=5.0, gt=0, le=86_400)
    retry_cap_seconds: float = Field(default=900.0, gt=0, le=7 * 86_400)
    retry_after_max_seconds: float = Field(default=3_600.0, ge=0, le=7 * 86_400)
    recovery_delay_seconds: float = Field(default=5.0, ge=0, le=86_400)
    recovery_batch_size: int = Field(default=100, ge=1, le=100)
    retention_days: float = Field(default=30.0, ge=0, le=3_650)
    prune_batch_size: int = Field(default=1_000, ge=1, le=10_000)
    pushgateway_url: str | None = None
    queue_stats_interval_seconds: float = Field(default=15.0, ge=1, le=3_600)
    statement_timeout_seconds: float = Field(default=5.0, gt=0, le=3_600)
    lock_timeout_seconds: float = Field(default=2.0, gt=0, le=3_600)
    idle_in_transaction_timeout_seconds: float = Field(default=10.0, gt=0, le=3_600)
    auth_pause_seconds: float = Field(
        default=30.0, gt=0, le=3_600, description="First claim pause after a 401/403."
    )
    application_name: str = Field(default="receipts", min_length=1, max_length=63)
    ui_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address `receipts ui` binds to (the chart sets 0.0.0.0).",
    )
    ui_port: int = Field(default=8090, ge=1, le=65_535, description="Port of `receipts ui`.")
    ui_admin_token: SecretStr | None = Field(
        default=None,
        description="Enables the review page's actions for whoever enters it; unset: read-only.",
    )

    @field_validator("database_url")
    @classmethod
    def _valid_dsn(cls, value: SecretStr) -> SecretStr:
        check_dsn(value.get_secret_value())
        return value

    @field_validator("provider_token", "ui_admin_token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("ui_admin_token")
    @classmethod
    def _strong_ui_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (a random token, e.g. "
                             "`openssl rand -hex 24`)")
        return value

    @field_validator("provider_url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _timeout_fits_lease(self) -> Settings:
        budget = self.lease_seconds - self.lease_margin_seconds
        if self.delivery_timeout_seconds > budget:
            raise ValueError(
                f"RECEIPTS_DELIVERY_TIMEOUT_SECONDS ({self.delivery_timeout_seconds:g}) must be "
                f"at most RECEIPTS_LEASE_SECONDS - RECEIPTS_LEASE_MARGIN_SECONDS "
                f"({self.lease_seconds:g} - {self.lease_margin_seconds:g} = {budget:g}), "
                "so a delivery ends and is acked while its lease still holds"
            )
        if self.retry_cap_seconds < self.retry_base_seconds:
            raise ValueError(
                "RECEIPTS_RETRY_CAP_SECONDS must be at least RECEIPTS_RETRY_BASE_SECONDS"
            )
        return self

    @property
    def dsn(self) -> str:
        """The database DSN in clear text, for the driver only; never log it."""
        return self.database_url.get_secret_value()

    @property
    def safe_dsn(self) -> str:
        """The DSN with its password masked, for logs and messages."""
        return redact_dsn(self.dsn)

    @property
    def retention_seconds(self) -> float:
        """Retention of done/failed rows in seconds; 0 disables pruning."""
        return self.retention_days * 86_400.0


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item.get("loc", ()) if part != "__root__"]
        name = f"{ENV_PREFIX}{loc[0].upper()}" if loc else "settings"
        message = str(item.get("msg", "invalid"))
        message = message.removeprefix("Value error, ")
        if item.get("type") == "missing":
            message = "is required and not set"
        # Never echo the offending input: it may be a DSN or a token.
        lines.append(f"{name}: {redact_dsn(message)}" if loc else redact_dsn(message))
    return "; ".join(lines)


def load_settings(**overrides: object) -> Settings:
    """Build :class:`Settings` from the environment plus keyword *overrides*.

    Raises:
        SettingsError: one line naming each bad ``RECEIPTS_*`` variable; the
            message never contains the rejected value.
    """
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
