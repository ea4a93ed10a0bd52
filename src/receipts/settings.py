"""Service settings, read once from the environment (prefix ``RECEIPTS_``).

Every duration is in seconds and says so in its name. Secrets (the database
password inside the DSN, the provider token) are ``SecretStr`` and are never
printed: :func:`receipts.dsn.redact_dsn` is the one way a DSN reaches a log
line or an error (the DSN helpers live in :mod:`receipts.dsn`, without pydantic,
and are re-exported here for existing callers).

Settings are built once at the entry point (:func:`load_settings`) and passed
down; nothing in the package reads the environment on its own.
"""

from __future__ import annotations

import os
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

from receipts import __version__, admission, capacity, flow, retry

# The DSN helpers live in receipts.dsn; the `as` names are re-exported for existing callers.
from receipts.dsn import MASK as MASK
from receipts.dsn import check_dsn as check_dsn
from receipts.dsn import dsn_password as dsn_password
from receipts.dsn import dsn_secrets
from receipts.dsn import redact_dsn as redact_dsn
from receipts.dsn import safe_dsn as safe_dsn
from receipts.dsn import schema_for as schema_for
from receipts.proxy import (
    ProxyChoice,
    ProxyConfigError,
    check_proxy_url,
    choose_proxy,
    is_loopback,
    parse_networks,
)
from receipts.statements import SCHEMA_NAME, SCHEMA_RULE

ENV_PREFIX = "RECEIPTS_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


class SettingsError(ValueError):
    """Settings that cannot run; ``str()`` is one line per problem, naming the variable."""


def package_version() -> str:
    """The running package's version: ``receipts.__version__``.

    The package's own constant, not the installed metadata: the distribution is
    called ``receipts-queue`` (PyPI's ``receipts`` is another project), and a
    source tree that was never installed has no metadata at all. Never raises.
    """
    return __version__


class Settings(BaseSettings):
    """Worker, recovery and CLI settings.

    Built from environment variables ``RECEIPTS_<FIELD>`` (case-insensitive);
    validation errors become :class:`SettingsError` in :func:`load_settings`.
    The lease/timeout rule (delivery timeout ≤ lease − margin) comes from
    docs/design.md §3: a delivery must end, and its ack land, while the lease holds.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="ignore", frozen=True,
        allow_inf_nan=False,  # "nan" and "inf" are refused as what they are
    )

    database_url: SecretStr = Field(
        description="libpq DSN (postgresql://… URI or key=value pairs) of the database that "
                    "holds receipt_jobs (required; secret).",
    )
    database_schema: str | None = Field(
        default=None,
        description="Schema that holds the receipts tables; every statement names it, "
                    "so a leaked SET search_path cannot redirect the worker. Default: "
                    "the first schema of a search_path in the DSN's options, else public "
                    "(an empty value counts as unset).",
    )
    provider_url: str = Field(
        default="",
        description="URL the receipt is POSTed to, http:// or https://; required by the "
                    "worker, empty means not set.",
    )
    provider_token: SecretStr | None = Field(
        default=None, description="Bearer token sent to the provider, if any (secret)."
    )
    provider_proxy: SecretStr | None = Field(
        default=None,
        description="http://[user:password@]host:port of the egress proxy for the provider; "
                    "wins over HTTPS_PROXY/HTTP_PROXY/NO_PROXY (secret: may hold credentials).",
    )
    provider_ca_file: str | None = Field(
        default=None,
        description="PEM bundle of the CA(s) that sign an https provider's certificate "
                    "(a private CA); default: the public CAs.",
    )
    provider_client_cert_file: str | None = Field(
        default=None, description="PEM client certificate for providers that require mTLS.",
    )
    provider_client_key_file: str | None = Field(
        default=None, description="PEM key of the client certificate (if not in the same file).",
    )
    # receipts.transport.TransportName and DEFAULT_TRANSPORT (not imported: aiohttp and
    # httpx would load with the settings); tests/unit/test_defaults.py holds them equal.
    provider_transport: Literal["aiohttp", "httpx"] = Field(
        default="aiohttp",
        description="The HTTP client that carries deliveries: 'aiohttp' (the least CPU per "
                    "delivery) or 'httpx' (httpx's own transport, httpcore); both classify "
                    "every answer and failure alike.",
    )
    concurrency: int = Field(default=32, ge=1, le=10_000,
                             description="Delivery slots per worker process.")
    lease_seconds: float = Field(default=60.0, gt=0, le=86_400,
                                 description="Lease of one attempt: how long a claimed job "
                                             "stays the worker's before recovery may take it "
                                             "back.")
    lease_margin_seconds: float | None = Field(
        default=None, ge=0, le=3_600,
        description="Lease minus this bounds the delivery timeout; default min(10, lease / 4).",
    )
    max_attempts: int = Field(default=5, ge=1, le=1_000,
                              description="Attempts before a job fails.")
    delivery_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3_600,
        description="Deadline of one provider exchange, body included.")
    poll_interval_seconds: float = Field(
        default=1.0, gt=0, le=3_600,
        description="Sleep when the queue looks empty (×0.75–1.25 jitter).")
    claim_batch_max: int = Field(
        default=100, ge=1, le=1_000,
        description="Most jobs one claim takes (never more than free slots).")
    metrics_port: int = Field(default=9464, ge=0, le=65_535,
                              description="Port of /metrics, /healthz and /readyz; 0 disables.")
    log_level: LogLevel = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR.")
    pool_max_size: int = Field(default=2, ge=1, le=100,
                               description="Database connections per process for statements.")
    listen_notify: bool = Field(
        default=True,
        description="One extra connection that LISTENs for wake-ups (and elects the waker).")
    pgbouncer: bool = Field(
        default=False,
        description="Transaction-pooling mode: no prepared statements, LISTEN or startup options.",
    )
    shutdown_grace_seconds: float = Field(
        default=20.0, ge=0, le=3_600,
        description="After SIGTERM, how long in-flight deliveries may finish (at most the "
                    "delivery timeout).")
    retry_base_seconds: float = Field(
        default=retry.BASE_SECONDS, gt=0, le=86_400,
        description="Backoff ceiling of the first retry (full jitter, doubling per attempt).")
    retry_cap_seconds: float = Field(default=retry.CAP_SECONDS, gt=0, le=7 * 86_400,
                                     description="Backoff ceiling of any retry.")
    retry_after_max_seconds: float = Field(
        default=retry.RETRY_AFTER_MAX_SECONDS, ge=0, le=7 * 86_400,
        description="Clamp for a provider's Retry-After (of a job's retry and of a pause).")
    recovery_delay_seconds: float = Field(
        default=5.0, ge=0, le=86_400,
        description="An expired job is due again after this × U(0.5, 1).")
    recovery_batch_size: int = Field(default=100, ge=1, le=100,
                                     description="Rows per recovery statement (≤ 100).")
    retention_days: float = Field(
        default=30.0, ge=0, le=3_650,
        description="Prune done/failed rows older than this; 0 keeps everything.")
    prune_batch_size: int = Field(default=1_000, ge=1, le=10_000,
                                  description="Rows per prune statement.")
    pushgateway_url: str | None = Field(
        default=None, description="Push the sweep's figures to this Prometheus Pushgateway.")
    queue_stats_interval_seconds: float = Field(
        default=15.0, ge=1, le=3_600, description="How often a worker reads the queue gauges.")
    statement_timeout_seconds: float = Field(default=5.0, gt=0, le=3_600,
                                             description="Per-connection statement_timeout.")
    lock_timeout_seconds: float = Field(default=2.0, gt=0, le=3_600,
                                        description="Per-connection lock_timeout.")
    idle_in_transaction_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3_600,
        description="Per-connection idle_in_transaction_session_timeout.")
    auth_pause_seconds: float = Field(
        default=flow.AUTH_PAUSE_SECONDS, gt=0, le=3_600,
        description="First fleet-wide pause after a 401/403 (doubles up to the pause cap).",
    )
    provider_rate_limit_per_second: float = Field(
        default=0.0, ge=0, le=1_000_000,
        description="Fleet-wide provider rate limit (jobs/s); 0 means none.",
    )
    provider_burst: float | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Token bucket capacity (jobs); default one second's worth of the rate.",
    )
    migrate_lock_timeout_seconds: float = Field(
        default=120.0, gt=0, le=86_400,
        description="How long `receipts migrate` waits for a lock (another migrate, DDL).",
    )
    attempt_history: Literal["all", "retries"] = Field(
        default="retries",
        description="Which attempts the job history records: 'retries' skips a delivery "
                    "on the first attempt (the job row says it all), 'all' records every one.",
    )
    admission_control: bool = Field(
        default=False,
        description="Adapt the claim rate to the database's commit latency (AIMD); off by "
                    "default: it slows drains without a steady gain in checkout's p99 "
                    "(docs/design.md §11).",
    )
    synchronous_commit: Literal["on", "off", "local"] = Field(
        default="off",
        description="synchronous_commit of the worker's and recovery's own sessions: 'off' "
                    "lets their claims, acks and sweeps skip the WAL flush checkout waits for "
                    "(a database crash can undo their last fraction of a second, which the "
                    "lease protocol redelivers with the same idempotency key); 'on' or 'local'.",
    )
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        default="auto",
        description="The worker's event loop: 'uvloop' (the extra `uvloop`; less "
                    "CPU per delivery), 'asyncio' (the standard library's), or 'auto': "
                    "uvloop when it is installed, else asyncio.",
    )
    admission_min_rate_per_second: float = Field(
        default=admission.MIN_RATE_PER_SECOND, gt=0, le=1_000_000,
        description="Admission control never claims slower than this (jobs/s per worker).",
    )
    admission_max_rate_per_second: float = Field(
        default=admission.MAX_RATE_PER_SECOND, gt=0, le=10_000_000,
        description="Admission control's ceiling and starting limit (jobs/s per worker).",
    )
    adaptive_concurrency: bool = Field(
        default=False,
        description="Adapt each worker's limit on deliveries in flight to the provider's "
                    "answers (AIMD: x0.85 on a 429, a 5xx, a timeout or rising latency, x0.9 "
                    "for a worker alone; x1.5 per round trip of calm answers until the first "
                    "decrease, then +0.5 shared among the live workers, a third of it for a "
                    "worker alone); a new worker starts at the fleet's mean "
                    "limit, and the KEDA signal stops adding pods the limits cannot use. "
                    "Off: the slots alone bound deliveries, as before (docs/scaling.md).",
    )
    adaptive_concurrency_floor: int = Field(
        default=capacity.FLOOR, ge=1, le=10_000,
        description="Adaptive concurrency never limits a worker below this many "
                    "deliveries in flight.",
    )
    adaptive_concurrency_ceiling: int = Field(
        default=capacity.CEILING, ge=1, le=10_000,
        description="Adaptive concurrency never allows a worker more than this many "
                    "deliveries in flight (nor more than its slots).",
    )
    outage_window_seconds: float = Field(
        default=flow.WINDOW_SECONDS, gt=0, le=3_600,
        description="Outage detection looks at each job's latest answer over this window.",
    )
    outage_min_jobs: int = Field(
        default=flow.MIN_JOBS, ge=1, le=10_000,
        description="Distinct jobs that must have failed before an outage is declared.",
    )
    outage_failure_ratio: float = Field(
        default=flow.FAILURE_RATIO, gt=0, le=1,
        description="Share of the distinct jobs answered in the window that must have failed.",
    )
    outage_pause_seconds: float = Field(
        default=flow.OUTAGE_PAUSE_SECONDS, gt=0, le=3_600,
        description="First fleet-wide pause after an outage."
    )
    pause_max_seconds: float = Field(
        default=flow.PAUSE_MAX_SECONDS, gt=0, le=86_400,
        description="Cap of a pause doubled by failed probes."
    )
    max_in_progress_answers: int = Field(
        default=20, ge=0, le=10_000,
        description="409 'in progress' answers per job that give their attempt back.",
    )
    application_name: str = Field(default="receipts", min_length=1, max_length=63,
                                  description="Prefix of the connections' application_name.")
    ui_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address `receipts ui` binds to (the chart sets 0.0.0.0).",
    )
    ui_port: int = Field(default=8090, ge=1, le=65_535, description="Port of `receipts ui`.")
    ui_admin_token: SecretStr | None = Field(
        default=None,
        description="Enables the review page's actions for whoever enters it; unset: read-only.",
    )
    ui_viewer_token: SecretStr | None = Field(
        default=None,
        description="Readers of the review page sign in with it (the admin token reads too); "
                    "required unless the page binds to localhost or "
                    "RECEIPTS_UI_ANONYMOUS_READ is true.",
    )
    ui_anonymous_read: bool = Field(
        default=False,
        description="Let anyone who reaches a non-localhost review page read it without a "
                    "token (only behind a proxy that authenticates).",
    )
    ui_pool_max_size: int = Field(
        default=4, ge=2, le=20,
        description="Database connections of `receipts ui` (one refreshes the shared summary, "
                    "one runs a bulk action, the rest serve viewers' lists).",
    )
    ui_refresh_seconds: float = Field(
        default=5.0, ge=1, le=300,
        description="How often the review page refreshes itself and its shared summary "
                    "(every viewer shares one reading per interval).",
    )
    ui_user_header: str = Field(
        default="X-Forwarded-User", min_length=1, max_length=100,
        pattern=r"^[A-Za-z0-9-]+$",
        description="Header in which an authenticating proxy (oauth2-proxy, an Ingress with "
                    "external auth) names the signed-in user, for the pause's author, bulk "
                    "actions and the audit log; believed only from "
                    "RECEIPTS_UI_TRUSTED_PROXIES (e.g. X-Auth-Request-User).",
    )
    ui_trusted_proxies: str = Field(
        default="",
        description="Comma-separated addresses or CIDR networks of the authenticating proxy "
                    "whose RECEIPTS_UI_USER_HEADER the review page believes (e.g. "
                    "10.0.0.0/8); empty: the header is ignored and sessions name the actor.",
    )

    @field_validator("ui_trusted_proxies")
    @classmethod
    def _valid_proxies(cls, value: str) -> str:
        parse_networks(value)  # the page's rule, in one place (receipts.proxy)
        return value

    @field_validator("database_url")
    @classmethod
    def _valid_dsn(cls, value: SecretStr) -> SecretStr:
        check_dsn(value.get_secret_value())
        return value

    @field_validator("database_schema", mode="before")
    @classmethod
    def _valid_schema(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str) and not SCHEMA_NAME.match(value):
            raise ValueError(f"{value!r} is not {SCHEMA_RULE}; PostgreSQL folds "
                             "unquoted names to lower case")
        return value

    @field_validator("database_url", "provider_url", mode="before")
    @classmethod
    def _strip_url(cls, value: object) -> object:
        # A value read from a file (a Secret mounted or made with --from-file) often
        # ends in a line break; it is never part of a URL or DSN.
        return value.strip() if isinstance(value, str) else value

    @field_validator("provider_token", "ui_admin_token", "ui_viewer_token", "provider_proxy",
                     mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        # Surrounding white space (the line break a Secret made from a file keeps) is
        # not part of a token; one inside it could never be sent in an HTTP header.
        value = value.strip()
        if not value:
            return None
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ValueError("contains a control character (a line break or tab inside "
                             "the value?); HTTP headers cannot carry it")
        return value

    @field_validator("ui_admin_token", "ui_viewer_token")
    @classmethod
    def _strong_ui_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (a random token, e.g. "
                             "`openssl rand -hex 24`)")
        return value

    @field_validator("provider_url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        if not value.strip():
            return ""
        check_provider_url(value)
        return value

    @field_validator("provider_proxy")
    @classmethod
    def _valid_proxy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            try:
                check_proxy_url(value.get_secret_value(), "proxy")
            except ProxyConfigError as exc:
                raise ValueError(str(exc).removeprefix("proxy: ")) from None
        return value

    @field_validator("provider_ca_file", "provider_client_cert_file",
                     "provider_client_key_file")
    @classmethod
    def _readable_file(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            with open(value, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot read {value!r}: {exc.strerror}") from None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("synchronous_commit", "attempt_history", "event_loop", "provider_transport",
                     mode="before")
    @classmethod
    def _lower_choice(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _timeout_fits_lease(self) -> Settings:
        margin = self.lease_margin
        budget = self.lease_seconds - margin
        if self.delivery_timeout_seconds > budget:
            raise ValueError(
                f"RECEIPTS_DELIVERY_TIMEOUT_SECONDS ({self.delivery_timeout_seconds:g}) must be "
                f"at most RECEIPTS_LEASE_SECONDS - lease margin "
                f"({self.lease_seconds:g} - {margin:g} = {budget:g}), "
                "so a delivery ends and is acked while its lease still holds"
            )
        if self.admission_max_rate_per_second < self.admission_min_rate_per_second:
            raise ValueError(
                "RECEIPTS_ADMISSION_MAX_RATE_PER_SECOND must be at least "
                "RECEIPTS_ADMISSION_MIN_RATE_PER_SECOND"
            )
        if self.adaptive_concurrency_ceiling < self.adaptive_concurrency_floor:
            raise ValueError(
                "RECEIPTS_ADAPTIVE_CONCURRENCY_CEILING must be at least "
                "RECEIPTS_ADAPTIVE_CONCURRENCY_FLOOR"
            )
        if self.retry_cap_seconds < self.retry_base_seconds:
            raise ValueError(
                "RECEIPTS_RETRY_CAP_SECONDS must be at least RECEIPTS_RETRY_BASE_SECONDS"
            )
        if self.database_schema is None and not SCHEMA_NAME.match(self.db_schema):
            raise ValueError(
                f"the DSN's search_path starts with {self.db_schema!r}, which is not "
                f"{SCHEMA_RULE}; set RECEIPTS_DATABASE_SCHEMA to the schema of the receipts "
                "tables"
            )
        return self

    @property
    def lease_margin(self) -> float:
        """Seconds of the lease kept free after the delivery timeout for the ack.

        ``RECEIPTS_LEASE_MARGIN_SECONDS`` when set, else ``min(10, lease / 4)``:
        it scales with short leases (a 5 s lease keeps 1.25 s), so only
        impossible arithmetic is refused.
        """
        if self.lease_margin_seconds is not None:
            return self.lease_margin_seconds
        return min(10.0, self.lease_seconds / 4)

    @property
    def burst(self) -> float:
        """The token bucket's capacity (jobs): the setting, or one second's worth."""
        if self.provider_burst is not None:
            return self.provider_burst
        return max(1.0, self.provider_rate_limit_per_second)

    @property
    def dsn(self) -> str:
        """The database DSN in clear text, for the driver only; never log it."""
        return self.database_url.get_secret_value()

    @property
    def db_schema(self) -> str:
        """The schema every statement names (see :func:`schema_for`)."""
        return self.database_schema or schema_for(self.dsn)

    @property
    def safe_provider_url(self) -> str:
        """The provider URL without userinfo, query or fragment (they may carry tokens)."""
        parts = urlsplit(self.provider_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port else host
        return f"{parts.scheme}://{netloc}{parts.path}"

    @property
    def safe_dsn(self) -> str:
        """The DSN with its password masked (parsed, not pattern-matched), for logs."""
        return safe_dsn(self.dsn)

    @property
    def stop_budget_seconds(self) -> float:
        """Longest a worker takes to stop after SIGTERM, in seconds.

        The sum of the three phases of the drain: waiting for in-flight
        deliveries, at most ``min(shutdown_grace_seconds,
        delivery_timeout_seconds)`` (a delivery cannot outlast its timeout);
        flushing the pending acks, at most ``max(5, min(shutdown_grace_seconds,
        30))``; closing the connection pool, at most 5. The Helm chart derives
        the pod's ``terminationGracePeriodSeconds`` from the same formula (plus
        a margin) and refuses a smaller one, so Kubernetes never kills a worker
        that is still inside its own budget.
        """
        grace = self.shutdown_grace_seconds
        deliveries = min(grace, self.delivery_timeout_seconds)
        ack_flush = max(5.0, min(grace, 30.0))
        pool_close = 5.0
        return deliveries + ack_flush + pool_close

    @property
    def retention_seconds(self) -> float:
        """Retention of done/failed rows in seconds; 0 disables pruning."""
        return self.retention_days * 86_400.0

    def secrets(self) -> list[str]:
        """The literal secrets logs must mask: the DSN password, the provider and UI tokens.

        The password is returned as libpq decodes it and, for a URI, as written
        (percent-encoded), since either spelling may reach a message. Empty
        values are left out; never log the result.
        """
        found = dsn_secrets(self.dsn)
        for token in (self.provider_token, self.ui_admin_token, self.ui_viewer_token):
            if token is not None:
                found.append(token.get_secret_value())
        if self.provider_proxy is not None:
            found += ProxyChoice(self.provider_proxy.get_secret_value()).secrets()
        return [s for s in found if s]

    def provider_proxy_choice(self, environ: Mapping[str, str]) -> ProxyChoice:
        """The egress proxy for the provider (:func:`receipts.proxy.choose_proxy`):
        ``RECEIPTS_PROVIDER_PROXY``, else the standard variables of *environ*.

        Raises :class:`SettingsError` naming the variable when the proxy that
        applies is not usable (the message never holds its credentials).
        """
        setting = self.provider_proxy.get_secret_value() if self.provider_proxy else None
        try:
            return choose_proxy(self.provider_url, setting=setting, environ=environ)
        except ProxyConfigError as exc:
            raise SettingsError(str(exc)) from None


def check_worker_settings(settings: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingsError` unless *settings* can run a worker.

    A worker needs ``RECEIPTS_PROVIDER_URL``: without it there is nowhere to
    deliver, and guessing (a localhost default) would retry every job into
    failure. Other commands (migrate, recover, jobs) do not need it. The
    egress proxy that applies to the provider (``RECEIPTS_PROVIDER_PROXY``, or
    the standard ``*_PROXY`` variables of *environ*, default ``os.environ``)
    must be usable too, so a bad one stops the worker at start.
    """
    if not settings.provider_url:
        raise SettingsError(
            f"{ENV_PREFIX}PROVIDER_URL: is required by the worker and not set "
            "(the receipt provider's http:// or https:// endpoint)"
        )
    settings.provider_proxy_choice(os.environ if environ is None else environ)


def check_provider_url(url: str) -> None:
    """Raise ``ValueError`` unless *url* is an ``http://`` or ``https://`` URL with a
    host and, if given, a port from 1 to 65535. The message never echoes *url*
    (it may carry credentials)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise ValueError("has an invalid port (a number from 1 to 65535) or host") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if port == 0:
        raise ValueError("has an invalid port (a number from 1 to 65535)")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url.strip()):
        raise ValueError("contains whitespace or control characters")


def check_ui_settings(settings: Settings) -> None:
    """Raise :class:`SettingsError` unless *settings* can serve the review page safely.

    A page bound beyond localhost (``RECEIPTS_UI_HOST``) shows order ids and
    provider errors to whoever reaches it, so readers need the viewer token
    unless ``RECEIPTS_UI_ANONYMOUS_READ`` says an authenticating proxy stands
    in front; the two tokens must differ (a reader could otherwise act).
    """
    viewer, admin = settings.ui_viewer_token, settings.ui_admin_token
    if (viewer is not None and admin is not None
            and viewer.get_secret_value() == admin.get_secret_value()):
        raise SettingsError(f"{ENV_PREFIX}UI_VIEWER_TOKEN: must differ from "
                            f"{ENV_PREFIX}UI_ADMIN_TOKEN (readers could act)")
    if is_loopback(settings.ui_host) or viewer is not None or settings.ui_anonymous_read:
        return
    raise SettingsError(
        f"{ENV_PREFIX}UI_VIEWER_TOKEN: is required when the review page binds to "
        f"{settings.ui_host} (beyond this machine); set it (readers sign in with it), or set "
        f"{ENV_PREFIX}UI_ANONYMOUS_READ=true only behind a proxy that authenticates")


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
