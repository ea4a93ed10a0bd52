"""Service settings, read once from the environment (prefix ``RECEIPTS_``).

Every duration is in seconds and says so in its name. Secrets (the database
password inside the DSN, the provider token) are ``SecretStr`` and are never
printed: :func:`redact_dsn` is the one way a DSN reaches a log line or an error.

Settings are built once at the entry point (:func:`load_settings`) and passed
down; nothing in the package reads the environment on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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


def package_version() -> str:
    """The installed ``receipts`` distribution's version (``importlib.metadata``).

    Falls back to ``receipts.__version__`` when the package runs from a source
    tree that was never installed. Never raises.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("receipts")
    except PackageNotFoundError:
        from receipts import __version__

        return __version__


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
        default="",
        description="URL the receipt is POSTed to; required by the worker (see "
                    ":func:`check_worker_settings`), empty means not set.",
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

    @field_validator("database_url")
    @classmethod
    def _valid_dsn(cls, value: SecretStr) -> SecretStr:
        check_dsn(value.get_secret_value())
        return value

    @field_validator("provider_token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("provider_url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        if not value.strip():
            return ""
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

    def secrets(self) -> list[str]:
        """The literal secrets logs must mask: the DSN password, the provider token.

        The password is returned as libpq decodes it and, for a URI, as written
        (percent-encoded), since either spelling may reach a message. Empty
        values are left out; never log the result.
        """
        from psycopg.conninfo import conninfo_to_dict

        found: list[str] = []
        try:
            found.append(str(conninfo_to_dict(self.dsn).get("password") or ""))
            if "://" in self.dsn:
                found.append(urlsplit(self.dsn).password or "")
        except Exception:  # the validator already refused unparsable DSNs
            pass
        if self.provider_token is not None:
            found.append(self.provider_token.get_secret_value())
        return [s for s in found if s]


def check_worker_settings(settings: Settings) -> None:
    """Raise :class:`SettingsError` unless *settings* can run a worker.

    A worker needs ``RECEIPTS_PROVIDER_URL``: without it there is nowhere to
    deliver, and guessing (a localhost default) would retry every job into
    failure. Other commands (migrate, recover, jobs) do not need it.
    """
    if not settings.provider_url:
        raise SettingsError(
            f"{ENV_PREFIX}PROVIDER_URL: is required by the worker and not set "
            "(the receipt provider's http:// or https:// endpoint)"
        )


# Variables Kubernetes injects for a Service named "receipts…" (service links),
# e.g. RECEIPTS_SERVICE_HOST, RECEIPTS_SERVICE_PORT_METRICS,
# RECEIPTS_PORT_9464_TCP_ADDR, and RECEIPTS_PORT=tcp://10.0.0.7:9464 (a bare
# *_PORT only with such a URL as its value, so RECEIPTS_METRIC_PORT=9464, a
# typo, is still reported): not settings, never warned about.
_SERVICE_LINK = re.compile(
    r"^[A-Z0-9_]*_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
    r"|PORT_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)$"
)
_SERVICE_LINK_PORT = re.compile(r"^[A-Z0-9_]*_PORT$")
_SERVICE_URL = re.compile(r"^(tcp|udp|sctp)://", re.I)


def _is_service_link(name: str, value: str) -> bool:
    return bool(_SERVICE_LINK.match(name)) or bool(
        _SERVICE_LINK_PORT.match(name) and _SERVICE_URL.match(value)
    )


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``RECEIPTS_*`` names in *environ* that are no setting, each with a close match.

    Returns ``(name, suggestion)`` pairs sorted by name; *suggestion* is the
    nearest setting's variable (``difflib``) or None. Kubernetes service-link
    variables (``RECEIPTS_SERVICE_HOST``, ``RECEIPTS_PORT_9464_TCP…``) are
    skipped. Matching is case-insensitive, like the settings themselves.
    """
    import difflib

    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    found: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        upper = name.upper()
        if (not upper.startswith(ENV_PREFIX) or upper in known
                or _is_service_link(upper, environ[name])):
            continue
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.75)
        found.append((name, close[0] if close else None))
    return found


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
